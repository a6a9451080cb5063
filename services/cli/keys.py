"""``coordinator keys add | list | revoke``: the gateway's API keys.

A key is shown once, when it is made; the ``gateway_keys`` bucket keeps only its hash
(`services.gateway.keys.key_hash`), its name, its priority and when it was made. A running
gateway watches the bucket, so a key counts (or stops counting, revoked) within a moment,
without a restart. Writing the bucket needs a NATS user that may (``admin``, ``operator``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from schemas.subjects import GATEWAY_KEYS_BUCKET, InvalidId
from services.cli.client import find_nats_url
from services.errors import Conflict, NotFound, Unavailable
from services.gateway.keys import (
    PRIORITIES,
    KeyRecord,
    check_key_name,
    make_record,
    new_key,
    record_decoder,
    record_encoder,
)
from services.runtime.bus import bucket_keys, connect, ensure_bucket

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

_json = msgspec.json.Encoder()
T = TypeVar("T")


def register(sub: Any) -> None:
    """Add ``keys`` and its actions to the ``coordinator`` parser."""
    keys = sub.add_parser(
        "keys",
        help="the HTTP gateway's API keys: add (shown once), list, revoke",
        description="Needs a NATS user that may write the gateway_keys bucket (admin).",
    )
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")

    add = actions.add_parser("add", help="make a key for NAME and print it, once")
    add.add_argument("name", help="who the key is for: letters, digits, '-' or '_'")
    add.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="interactive",
        help="recorded with the key and its tasks' log lines (routing does not use it yet)",
    )
    add.add_argument(
        "--operator",
        action="store_true",
        help="the fleet's operator's key: the dashboard shows it every task's id (another "
        "key sees its own tasks' only), and it may pull, create, copy and remove models",
    )
    add.set_defaults(func=cmd_add)

    listing = actions.add_parser("list", help="the keys: name, priority, when made (never a key)")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_list)

    revoke = actions.add_parser("revoke", help="delete NAME's key: the gateway refuses it at once")
    revoke.add_argument("name")
    revoke.set_defaults(func=cmd_revoke)


def cmd_add(args: argparse.Namespace) -> int:
    if (bad := _bad_name(args.name)) is not None:
        return bad
    key = new_key()
    record = make_record(args.name, key, args.priority, time.time(), operator=args.operator)

    async def go(kv: KeyValue | None, js: JetStreamContext) -> bool:
        assert kv is not None  # made when missing
        try:
            await kv.create(record.name, record_encoder.encode(record))
        except KeyWrongLastSequenceError:
            return False
        return True

    if not _run(go, create=True):
        print(
            f"error {Conflict.code}: a key named {args.name!r} exists; revoke it first "
            "(`coordinator keys revoke NAME`) or choose another name",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(key)
    print(
        f"key {record.name!r} ({record.priority}) added: the line above is the key, shown only "
        "this once; clients send it as `Authorization: Bearer <key>`",
        file=sys.stderr,
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    async def go(kv: KeyValue | None, js: JetStreamContext) -> list[KeyRecord]:
        if kv is None:
            return []
        records = []
        for name in await bucket_keys(js, GATEWAY_KEYS_BUCKET):
            try:
                entry = await kv.get(name)
            except (KeyNotFoundError, KeyDeletedError):
                continue  # revoked
            if entry.value:
                records.append(
                    msgspec.structs.replace(record_decoder.decode(entry.value), name=name)
                )
        return records

    records = _run(go)
    if args.json:
        shown = [
            {
                "name": r.name,
                "priority": r.priority,
                "created_at": r.created_at,
                "operator": r.operator,
            }
            for r in records
        ]
        print(_json.encode(shown).decode())
        return 0
    if not records:
        print("no gateway keys: the gateway requires none on loopback (`coordinator keys add`)")
        return 0
    print(f"{'NAME':<24} {'PRIORITY':<12} {'CREATED':<20} OPERATOR")
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_at))
        print(f"{r.name:<24} {r.priority:<12} {created:<20} {'yes' if r.operator else ''}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    if (bad := _bad_name(args.name)) is not None:
        return bad

    async def go(kv: KeyValue | None, js: JetStreamContext) -> bool:
        if kv is None:
            return False
        try:
            await kv.get(args.name)
        except KeyNotFoundError:
            return False
        await kv.delete(args.name)
        return True

    if not _run(go):
        print(f"error {NotFound.code}: no gateway key is named {args.name!r}", file=sys.stderr)
        return EXIT_FAILED
    print(f"key {args.name!r} revoked: the gateway refuses it from now on")
    return 0


def _bad_name(name: str) -> int | None:
    try:
        check_key_name(name)
    except InvalidId as exc:
        print(f"error {InvalidId.code}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return None


def _run(
    action: Callable[[KeyValue | None, JetStreamContext], Awaitable[T]], *, create: bool = False
) -> T:
    """Run ``action(bucket, js)`` on a fresh connection; the bucket is made when ``create``
    (else ``action`` gets None when it does not exist)."""

    async def go() -> T:
        nc = await connect(find_nats_url(), "coordinator-keys", connect_timeout_s=3.0)
        try:
            js = nc.jetstream()
            if create:
                return await action(await ensure_bucket(js, GATEWAY_KEYS_BUCKET, ttl_s=None), js)
            kv: KeyValue | None = None
            with suppress(BucketNotFoundError, NotFoundError):
                kv = await js.key_value(GATEWAY_KEYS_BUCKET)
            return await action(kv, js)
        except nats.errors.TimeoutError:
            # What a NATS user gets for a subject it may not publish to: no answer.
            raise Unavailable(
                f"NATS did not answer for bucket {GATEWAY_KEYS_BUCKET}: may this NATS user "
                f"write it (admin; or publish to $KV.{GATEWAY_KEYS_BUCKET}.>)?"
            ) from None
        finally:
            await nc.close()

    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)
    return asyncio.run(go())

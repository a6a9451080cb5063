"""What identities cost and how fast a revocation bites.

    .venv/bin/python -m benchmarks.identities [--connects 200] [--revocations 20]

Two nats-servers from the wheel on loopback: one with the configuration of one password user
per role (``deploy render nats``), one with identities (``deploy render nats --jwt``). Then:

- **connect**: ``--connects`` connections one after the other, each connected, flushed
  (the server has checked it) and closed, as the ``client`` user and as an identity: the
  server verifies a JWT's signature and its chain on each connect, where a password user's
  is a string compare;
- **revocation**: ``--revocations`` times, an identity connected, then revoked as
  ``coordinator revoke`` does (the fleet's account JWT re-signed and pushed): the time from
  the push's start to the server closing that connection.

Results: a table, and ``benchmarks/results/identities-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from benchmarks.stack import table, write_result
from devtools.servers import NatsServer
from schemas.subjects import inbox_prefix
from services.cli.identities import Store, push_account
from services.cli.permissions import (
    EXAMPLE_WEB_WORKERS,
    EXAMPLE_WORKERS,
    NATS_ROLES,
    nats_user,
    password_variable,
    render_nats_conf,
    render_server_conf,
)


def _server(tmp: Path, name: str, conf: str, env: dict[str, str] | None = None) -> NatsServer:
    conf = conf.replace("/var/lib/nats", str(tmp / name)).replace(
        "http: 127.0.0.1:8222", "http: 127.0.0.1:0"
    )
    path = tmp / f"{name}.conf"
    path.write_text(conf)
    return NatsServer(str(tmp / name / "jetstream"), config=str(path), env=env).start()


async def _time_connects(count: int, connect: Callable[[], Awaitable[Client]]) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        nc = await connect()
        await nc.flush()
        times.append((time.perf_counter() - started) * 1000)
        await nc.close()
    return times


def _ms(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99, max(ordered)


async def run(connects: int, revocations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ids-") as name:
        tmp = Path(name)
        users = [
            "admin",
            *NATS_ROLES,
            *(nats_user("worker", w) for w in EXAMPLE_WORKERS),
            *(nats_user("web-search", w) for w in EXAMPLE_WEB_WORKERS),
        ]
        plain = _server(
            tmp,
            "passwords",
            render_nats_conf(EXAMPLE_WORKERS, EXAMPLE_WEB_WORKERS),
            {password_variable(user): "pw" for user in users},
        )
        store = Store(tmp / "identities")
        store.create()
        jwt = _server(tmp, "identities", render_server_conf(store.auth()))
        try:
            _, alice = store.invite("client", "alice")
            creds = tmp / "alice.creds"
            creds.write_text(alice)
            by_password = await _time_connects(
                connects,
                lambda: nats.connect(
                    plain.url, user="client", password="pw", inbox_prefix=inbox_prefix("client")
                ),
            )
            by_identity = await _time_connects(
                connects,
                lambda: nats.connect(
                    jwt.url, user_credentials=str(creds), inbox_prefix=inbox_prefix("alice")
                ),
            )
            cut_ms = []
            for i in range(revocations):
                identity, text = store.invite("client", f"r{i}")
                path = tmp / f"{identity}.creds"
                path.write_text(text)
                closed = asyncio.Event()

                async def on_closed(event: asyncio.Event = closed) -> None:
                    event.set()

                await nats.connect(
                    jwt.url,
                    user_credentials=str(path),
                    inbox_prefix=inbox_prefix(identity),
                    allow_reconnect=False,
                    closed_cb=on_closed,
                )
                account = store.revoke(identity)
                started = time.perf_counter()
                await push_account(account, jwt.url, store.admin_creds, None)
                await asyncio.wait_for(closed.wait(), timeout=10)
                cut_ms.append((time.perf_counter() - started) * 1000)
        finally:
            plain.stop()
            jwt.stop()
    rows = [
        ["connect: password user", *_ms(by_password)],
        ["connect: identity (JWT)", *_ms(by_identity)],
        ["revoke: push to cut-off", *_ms(cut_ms)],
    ]
    print(table(["what", "p50 ms", "p99 ms", "max ms"], rows))
    return {
        "connects": connects,
        "revocations": revocations,
        "rows": [dict(zip(("what", "p50_ms", "p99_ms", "max_ms"), r, strict=True)) for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--revocations", type=int, default=20)
    args = parser.parse_args()
    figure = asyncio.run(run(args.connects, args.revocations))
    print(f"written to {write_result('identities', figure)}")


if __name__ == "__main__":
    main()

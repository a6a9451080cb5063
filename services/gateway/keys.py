"""The gateway's API keys, the pure part: making a key, its hash, key names, the key record
kept in the ``gateway_keys`` bucket, reading ``Authorization: Bearer``, the table of known
keys, which API a path belongs to, and whether a gateway may listen open.

No I/O: `services.gateway.access` watches the bucket and guards the routes with this;
``coordinator keys`` (`services.cli.keys`) adds, lists and revokes keys.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from schemas.subjects import check_token
from services.errors import InvalidApiKey

Priority = Literal["interactive", "batch"]
PRIORITIES: Final[tuple[Priority, ...]] = ("interactive", "batch")

# Every key starts so, which makes a leaked one easy to recognise (and to grep for).
KEY_PREFIX: Final = "coord_"
# 32 random bytes: 256 bits, as much as the hash keeps.
KEY_BYTES: Final = 32

# The code of a 401, as OpenAI's API names a missing or wrong key (its SDK raises
# `openai.AuthenticationError` on the status whatever the body says).
INVALID_API_KEY: Final = InvalidApiKey.code

# Answered without a key: Ollama's "is it up" probes, which `coordinator health gateway`, the
# Ollama CLI and Open WebUI's connection check use. They tell the Ollama API version and the
# gateway's, nothing about the fleet.
PUBLIC_PATHS: Final = frozenset({"/", "/api/version"})
# The dashboard's page and its files: the same for everyone, nothing about the fleet in them
# (its data, ``/dashboard/state`` and ``/dashboard/stream``, needs the key).
DASHBOARD_PAGE: Final = "/dashboard"
DASHBOARD_FILES: Final = "/dashboard/static/"

Api = Literal["ollama", "openai", "anthropic", "task"]


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A key as the ``gateway_keys`` bucket keeps it (under its name): never the key itself."""

    name: str
    sha256: str
    """`key_hash` of the key: hex SHA-256."""
    priority: Priority = "interactive"
    """Recorded only, for now: routing does not order tasks by it."""
    created_at: float = 0.0
    """Unix time the key was made."""
    operator: bool = False
    """The fleet's operator's: the dashboard shows it every task's id, where another key sees
    only its own tasks'."""


record_decoder: Final = msgspec.json.Decoder(KeyRecord)
record_encoder: Final = msgspec.json.Encoder()


def new_key() -> str:
    """A fresh random key: `KEY_PREFIX` and 32 random bytes, URL-safe base64 (43 chars)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_hash(key: str) -> str:
    """The hex SHA-256 of ``key``: what is stored and compared, never the key.

    A fast hash is enough here. Slow password hashes (bcrypt, scrypt, argon2) exist to make
    guessing a low-entropy, human-chosen password from a stolen hash expensive; these keys are
    256 random bits, so no amount of guessing finds one from its hash, slow or fast. A fast
    hash lets every request be checked in microseconds and looked up by its hash, with no salt
    to try per stored key. Looking the hash up in a table leaks, through timing, at most
    something about the hash of the guess, which does not help find a key.
    """
    return hashlib.sha256(key.encode()).hexdigest()


def check_key_name(name: str) -> str:
    """``name`` if it is a key name (one subject token: letters, digits, ``-``, ``_``; it is
    the bucket's key), else `schemas.subjects.InvalidId`."""
    return check_token("key name", name)


def make_record(
    name: str, key: str, priority: Priority, now: float, *, operator: bool = False
) -> KeyRecord:
    """The record of a new key ``key`` called ``name`` (checked)."""
    return KeyRecord(
        name=check_key_name(name),
        sha256=key_hash(key),
        priority=priority,
        created_at=now,
        operator=operator,
    )


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case, as
    RFC 7235 has it), or None when the header is absent, another scheme, or empty."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def is_public(path: str) -> bool:
    """Is ``path`` answered without a key (the probes, the dashboard's page and files)?"""
    return path in PUBLIC_PATHS or path == DASHBOARD_PAGE or path.startswith(DASHBOARD_FILES)


def api_of(path: str) -> Api:
    """Which API a path belongs to, so a refusal comes in that API's error shape (the
    dashboard's data and ``/metrics`` use the project's own, as the task API does)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path == "/v1" or path.startswith("/v1/"):
        return "openai"
    if path in {"/route", "/task", DASHBOARD_PAGE, "/metrics"} or path.startswith(
        ("/task/", f"{DASHBOARD_PAGE}/")
    ):
        return "task"
    return "ollama"


def is_loopback(host: str) -> bool:
    """Does listening on ``host`` keep the gateway to this machine? ``localhost`` and loopback
    addresses do; every other name or address (``0.0.0.0``, ``::``, "") is taken to reach a
    network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_refusal(host: str, *, allow_open: bool, keys: int) -> str | None:
    """Why a gateway on ``host`` with ``keys`` keys must not start, or None when it may."""
    if keys or allow_open or is_loopback(host):
        return None
    return (
        f"GATEWAY_HOST={host!r} reaches the network and no gateway key exists: anyone could use "
        "the fleet. Add one (`coordinator keys add NAME`), or set GATEWAY_ALLOW_OPEN=1 to serve "
        "without keys on purpose"
    )


def always_keyed(host: str, *, allow_open: bool) -> bool:
    """Whether keys are required even when none exists: a gateway on the network that was not
    told to be open refuses every request once its last key is revoked (it fails closed);
    on loopback, or told to be open, no key means no check."""
    return not (allow_open or is_loopback(host))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused (401)."""

    message: str


@dataclass
class KeyTable:
    """The keys the gateway knows, by name and by hash; fed from the bucket's watch."""

    always: bool = False
    """Require a key even when none exists (`always_keyed`)."""
    _by_name: dict[str, KeyRecord] = field(default_factory=dict)
    _by_hash: dict[str, KeyRecord] = field(default_factory=dict)

    def put(self, record: KeyRecord) -> None:
        self.remove(record.name)
        self._by_name[record.name] = record
        self._by_hash[record.sha256] = record

    def remove(self, name: str) -> bool:
        """Forget ``name``'s key; whether there was one."""
        old = self._by_name.pop(name, None)
        if old is None:
            return False
        self._by_hash.pop(old.sha256, None)
        return True

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def required(self) -> bool:
        """Does a request need a key now?"""
        return self.always or bool(self._by_name)

    def identify(
        self, authorization: str | None, api_key: str | None = None
    ) -> KeyRecord | Refusal | None:
        """The key an ``Authorization`` header carries, else an ``x-api-key`` header (how
        Anthropic's clients send theirs); None when no key is required (then the headers are
        not looked at); a `Refusal` when one is and it is missing or unknown."""
        if not self.required:
            return None
        if not self._by_name:
            return Refusal(
                "this gateway requires an API key and none exists: an operator adds one "
                "with `coordinator keys add NAME`"
            )
        token = bearer_token(authorization)
        if token is None and authorization is None and api_key:
            token = api_key.strip() or None
        if token is None:
            return Refusal(
                "missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`"
                " (OLLAMA_API_KEY, or the OpenAI or Anthropic client's api_key)"
            )
        record = self._by_hash.get(key_hash(token))
        if record is None:
            return Refusal("invalid API key: it is not one of this gateway's keys, or revoked")
        return record

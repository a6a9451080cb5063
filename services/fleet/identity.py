"""Identities: who a person or a machine is to NATS, by name. Pure.

Every identity is a NATS user of its own (a user JWT signed for the fleet's account, with its
nkey seed: a ``.creds`` file), named once here from its role and the name the operator gave it:
``worker-<name>``, ``web-<name>`` and ``<role>-<name>`` for the services, the bare name for a
person who asks (``client``). The name is the identity everywhere: its inbox
(``_INBOX_<identity>``, the only one it may read), the unit it runs as, what ``coordinator
revoke`` takes. A join token carries one identity to its machine in one line.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Collection
from typing import Final, NamedTuple

import msgspec

from schemas.subjects import (
    INBOX,
    SHARED_CPU,
    WEB,
    InvalidId,
    check_token,
    check_worker_id,
)
from services.errors import ConfigError

# The roles an identity can have (services/cli/permissions.py gives each its permissions), and
# the prefix of each machine role's identities. A person asking (``client``) has none.
ROLE_PREFIXES: Final = {
    "worker": "worker",
    "web-search": "web",
    "router": "router",
    "stats": "stats",
    "reaper": "reaper",
    "gateway": "gateway",
    "jobs": "jobs",
    "operator": "operator",
}
PERSON: Final = "client"
ROLES: Final = (*ROLE_PREFIXES, PERSON)
# Roles with a worker id: the name given is the id (WORKER_ID), the identity its user.
WITH_WORKER_ID: Final = frozenset({"worker", "web-search"})


def identity_name(role: str, name: str) -> str:
    """The identity of ``name`` in ``role``; `ConfigError` for an unknown role or a bad name."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    try:
        if role in WITH_WORKER_ID:
            check_worker_id(name)
        else:
            check_token("name", name)
    except InvalidId as exc:
        raise ConfigError(str(exc)) from None
    if role != PERSON:
        return f"{ROLE_PREFIXES[role]}-{name}"
    if name in (*ROLES, "admin") or any(name.startswith(f"{p}-") for p in ROLE_PREFIXES.values()):
        raise ConfigError(
            f"a person's name {name!r} reads as a role's identity: choose another "
            f"(not a role, nor starting with {', '.join(f'{p}-' for p in ROLE_PREFIXES.values())})"
        )
    return name


def is_operator(identity: str | None) -> bool:
    """Whether an identity is the fleet's operator's (``operator-<name>``; ``operator`` and
    ``admin``, the users of the configuration with passwords)."""
    if identity is None:
        return False
    return identity in ("operator", "admin") or identity.startswith(f"{ROLE_PREFIXES['operator']}-")


def is_gateway(identity: str | None) -> bool:
    """Whether an identity is an HTTP gateway's, which asks for the people its keys name."""
    if identity is None:
        return False
    return identity == "gateway" or identity.startswith(f"{ROLE_PREFIXES['gateway']}-")


def worker_of(identity: str | None) -> tuple[str, str] | None:
    """(role, worker id) of a worker's identity (``worker-<id>``, ``web-<id>``: its
    password user's name too); None for any other."""
    for role in WITH_WORKER_ID:
        prefix = f"{ROLE_PREFIXES[role]}-"
        if identity is not None and identity.startswith(prefix) and len(identity) > len(prefix):
            return role, identity.removeprefix(prefix)
    return None


# The pool each worker role pulls besides its own queues (`schemas.subjects.POOLS`).
_POOL_OF_ROLE: Final = {"worker": SHARED_CPU.name, "web-search": WEB.name}


def may_read_task_events(reader: str | None, routed_to: Collection[str]) -> bool:
    """Whether ``reader`` may read a task's events (`schemas.subjects.LAST_EVENT`) whose
    attempts were routed to ``routed_to`` (workers, pools): a worker one of them was routed
    to, or that pulls the pool it was; the operator; anyone on a bus without identities."""
    if reader is None or is_operator(reader):
        return True
    worker = worker_of(reader)
    if worker is None:
        return False
    role, worker_id = worker
    return worker_id in routed_to or _POOL_OF_ROLE[role] in routed_to


def asker_of(reply: str | None) -> str | None:
    """The identity a request came from, by its reply subject: ``_INBOX_<identity>.…``, the
    inbox only that identity may read (`schemas.subjects.inbox_prefix`); None for a plain
    ``_INBOX.…`` (a fleet without identities) or no reply at all."""
    if not reply or not reply.startswith(f"{INBOX}_"):
        return None
    name = reply[len(INBOX) + 1 :].split(".", 1)[0]
    return name or None


class Owner(NamedTuple):
    """Who asked for a task, or who asks about one: the identity whose inbox the request
    came from and, through a gateway, the key it came in with. Only a gateway speaks for its
    keys; on a bus without identities, whoever asks does (nothing there proves who asks, and
    the gateway's keys still keep its HTTP clients apart)."""

    asker: str | None
    client: str | None = None

    @classmethod
    def of(cls, asker: str | None, client: str | None) -> Owner:
        return cls(asker, client if asker is None or is_gateway(asker) else None)

    @classmethod
    def asking(cls, reply: str | None, client: str | None = None) -> Owner:
        """Who sent a request, from its reply subject and the key a gateway named."""
        return cls.of(asker_of(reply), client)


def may_change_models(asker: str | None) -> bool:
    """Whether a request from ``asker`` may change the machines' models (pull, create, copy,
    remove): the operator only, or a gateway (which passes on only its operator keys'). On a
    bus without identities (None) nothing proves who asks, and whoever may reach the router
    may, as with every other change there."""
    return asker is None or is_operator(asker) or is_gateway(asker)


def may_see(task: Owner, viewer: Owner) -> bool:
    """Whether ``viewer`` may read, follow or cancel a task ``task`` asked for: the operator
    always; for a task that came in with a gateway's key, whoever speaks for that key; else
    the identity that asked. A task asked with neither (a fleet without identities, an open
    gateway) is anyone's."""
    if is_operator(viewer.asker):
        return True
    if task.client is not None:
        return viewer.client == task.client
    return task.asker is None or viewer.asker == task.asker


_JWT_BEGIN: Final = "-----BEGIN NATS USER JWT-----"
_JWT_END: Final = "------END NATS USER JWT------"
_SEED_BEGIN: Final = "-----BEGIN USER NKEY SEED-----"
_SEED_END: Final = "------END USER NKEY SEED------"


def creds_text(jwt: str, seed: str) -> str:
    """A ``.creds`` file (nats-py's ``user_credentials``, the ``nats`` CLI's ``--creds``)."""
    return (
        f"{_JWT_BEGIN}\n{jwt}\n{_JWT_END}\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"{_SEED_BEGIN}\n{seed}\n{_SEED_END}\n"
    )


def _between(text: str, begin: str, end: str) -> str:
    _, found, rest = text.partition(begin)
    body, closed, _ = rest.partition(end)
    if not found or not closed or not body.strip():
        raise ConfigError(f"not a .creds file: no {begin.strip('-')} block")
    return body.strip()


def jwt_of_creds(text: str) -> str:
    return _between(text, _JWT_BEGIN, _JWT_END)


def claims_of(jwt: str) -> dict[str, object]:
    """A JWT's claims as written (not verified: nats-server verifies; this only reads)."""
    parts = jwt.split(".")
    if len(parts) != 3:
        raise ConfigError("not a JWT: expected three dot-separated parts")
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        raise ConfigError("not a JWT: its claims are not base64url JSON") from None
    if not isinstance(claims, dict):
        raise ConfigError("not a JWT: its claims are not an object")
    return claims


def identity_of_creds(text: str) -> str:
    """The identity a ``.creds`` file proves (its JWT's ``name``)."""
    name = claims_of(jwt_of_creds(text)).get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError("the .creds file's JWT names no identity")
    return name


class JoinToken(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a machine (or a person) needs to join the fleet, from ``coordinator invite``."""

    role: str
    name: str
    identity: str
    servers: list[str]
    creds: str
    ca: str | None = None
    """The CA certificate (PEM) when the fleet's NATS speaks TLS."""
    gpu: bool = False


TOKEN_PREFIX: Final = "coordinator-join-1."
_token_json = msgspec.json.Encoder()


def encode_token(token: JoinToken) -> str:
    """One line: the prefix, then the token as base64url JSON."""
    body = base64.urlsafe_b64encode(_token_json.encode(token)).rstrip(b"=").decode()
    return TOKEN_PREFIX + body


def decode_token(text: str) -> JoinToken:
    """The token `encode_token` wrote; `ConfigError` naming what is wrong otherwise."""
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise ConfigError(f"not a join token: it should start with {TOKEN_PREFIX!r}")
    body = text.removeprefix(TOKEN_PREFIX)
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        token = msgspec.json.decode(raw, type=JoinToken)
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise ConfigError(f"not a join token: {exc}") from None
    if token.role not in ROLES or identity_name(token.role, token.name) != token.identity:
        raise ConfigError(f"join token: identity {token.identity!r} does not match its role")
    if identity_of_creds(token.creds) != token.identity:
        raise ConfigError("join token: its credentials are another identity's")
    if not token.servers:
        raise ConfigError("join token: it names no server")
    return token

"""``coordinator invite | revoke | identities``: one NATS identity per person and machine.

The operator's machine keeps the fleet's keys and the list of identities in one directory
(``COORDINATOR_IDENTITIES``, default ``~/.config/coordinator/identities``; mode 0700, its files
0600): whoever holds it can let anyone in. ``deploy render nats --jwt`` makes the keys on first
use and prints the server's configuration; ``invite`` signs a new identity and prints its join
token, changing nothing on the server; ``revoke`` lists the identity's key in the fleet's
account JWT and pushes that to the server (``$SYS.REQ.CLAIMS.UPDATE``), which refuses the key
from then on and cuts its connections at once, without a restart or a reload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import msgspec
import nats.errors

from services.cli.nats_jwt import Keys, jwt_auth
from services.errors import ConfigError, Conflict, NotFound, Unavailable
from services.fleet.identity import (
    ROLES,
    JoinToken,
    claims_of,
    creds_text,
    encode_token,
    identity_name,
    jwt_of_creds,
)
from services.runtime.bus import connect
from services.runtime.settings import NatsAuth, Settings, nats_servers

STORE_VARIABLE: Final = "COORDINATOR_IDENTITIES"
# Where the server answers an account update (its full resolver).
CLAIMS_UPDATE: Final = "$SYS.REQ.CLAIMS.UPDATE"
_OK: Final = 200


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """One identity as the store keeps it: never its seed (only the machine it went to has it)."""

    role: str
    name: str
    public_key: str
    issued_at: int
    revoked_at: int | None = None


class _Keys(msgspec.Struct, frozen=True):
    operator: str
    system: str
    fleet: str
    signing: str


class _Registry(msgspec.Struct, kw_only=True):
    identities: dict[str, Identity] = {}
    # Every key ever revoked, with when: an identity invited again by the same name has a new
    # key, and its old one stays refused.
    revoked: dict[str, int] = {}
    # The newest ``iat`` signed: each JWT gets a later one, so that the server, which keeps the
    # account JWT with the newest ``iat``, never keeps an older one over a revocation.
    last_issued_at: int = 0


def default_store() -> Path:
    given = os.environ.get(STORE_VARIABLE)
    if given:
        return Path(given)
    return Path("~/.config/coordinator/identities").expanduser()


class Store:
    """The operator's directory of keys and identities."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def _keys_file(self) -> Path:
        return self.path / "keys.json"

    @property
    def _registry_file(self) -> Path:
        return self.path / "identities.json"

    @property
    def admin_creds(self) -> Path:
        """The system account's user: what pushes the fleet's account to the server."""
        return self.path / "admin.creds"

    def exists(self) -> bool:
        return self._keys_file.is_file()

    def create(self) -> None:
        """Make the fleet's keys (once: refuses to replace them, which would lock every
        identity out)."""
        if self.exists():
            raise Conflict(f"{self.path} already holds the fleet's keys")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        keys = Keys.new()
        write_private(
            self._keys_file,
            msgspec.json.encode(_Keys(keys.operator, keys.system, keys.fleet, keys.signing)),
        )
        registry = _Registry()
        jwt, seed = keys.system_user(self._issue(registry))
        write_private(self.admin_creds, creds_text(jwt, seed).encode())
        self._save(registry)

    def keys(self) -> Keys:
        if not self.exists():
            raise ConfigError(
                f"no identities at {self.path}: render the server's configuration first "
                f"(`coordinator deploy render nats --jwt`), or set {STORE_VARIABLE}"
            )
        k = msgspec.json.decode(self._keys_file.read_bytes(), type=_Keys)
        return Keys(k.operator, k.system, k.fleet, k.signing)

    def registry(self) -> _Registry:
        if not self._registry_file.is_file():
            return _Registry()
        return msgspec.json.decode(self._registry_file.read_bytes(), type=_Registry)

    def _save(self, registry: _Registry) -> None:
        write_private(self._registry_file, msgspec.json.format(msgspec.json.encode(registry)))

    @staticmethod
    def _issue(registry: _Registry) -> int:
        registry.last_issued_at = max(int(time.time()), registry.last_issued_at + 1)
        return registry.last_issued_at

    def auth(self) -> str:
        """Who is who in a server's configuration, with the accounts as they are now."""
        keys, registry = self.keys(), self.registry()
        auth = jwt_auth(keys, revocations(registry), self._issue(registry))
        self._save(registry)
        return auth

    def invite(self, role: str, name: str) -> tuple[str, str]:
        """A new identity: (its name, its ``.creds``); `Conflict` while one by that name is
        still valid (revoke it first)."""
        identity = identity_name(role, name)
        keys, registry = self.keys(), self.registry()
        known = registry.identities.get(identity)
        if known is not None and known.revoked_at is None:
            raise Conflict(f"{identity} exists: `coordinator revoke {identity}` first")
        issued_at = self._issue(registry)
        creds, public = keys.creds(role, name, identity, issued_at)
        registry.identities[identity] = Identity(
            role=role, name=name, public_key=public, issued_at=issued_at
        )
        self._save(registry)
        return identity, creds

    def revoke(self, identity: str) -> str:
        """Record ``identity`` revoked; the fleet's account JWT to push."""
        keys, registry = self.keys(), self.registry()
        known = registry.identities.get(identity)
        if known is None:
            raise NotFound(f"no identity {identity!r} (`coordinator identities` lists them)")
        issued_at = self._issue(registry)
        if known.revoked_at is None:
            registry.identities[identity] = msgspec.structs.replace(known, revoked_at=issued_at)
            registry.revoked[known.public_key] = issued_at
        self._save(registry)
        return keys.fleet_jwt(revocations(registry), issued_at)


def own_identities(
    store: Store, directory: Path, wanted: Iterable[tuple[str, str]]
) -> dict[str, Path]:
    """A ``.creds`` file in ``directory`` for each (role, name) of ``wanted``, by role: the one
    kept there from before while the store still knows it as valid, else a new identity
    (`ConfigError` if the store holds a valid one by that name whose creds are not here)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    for role, name in wanted:
        identity = identity_name(role, name)
        path = directory / f"{identity}.creds"
        known = store.registry().identities.get(identity)
        if known is not None and known.revoked_at is None:
            if not path.is_file() or _subject(path.read_text()) != known.public_key:
                raise ConfigError(
                    f"{identity} exists but its credentials are not in {directory}: "
                    f"`coordinator revoke {identity}`, then start again"
                )
        else:
            _, creds = store.invite(role, name)
            write_private(path, creds.encode())
        found[role] = path
    return found


def _subject(creds: str) -> object:
    return claims_of(jwt_of_creds(creds)).get("sub")


def revocations(registry: _Registry) -> dict[str, int]:
    """Each revoked key and when: the server refuses its JWTs issued until then."""
    return dict(registry.revoked)


def write_private(path: Path, data: bytes) -> None:
    """Write a secret: created 0600, never readable by others even for a moment, and put in
    place whole (an older file of the same name, however wide its mode, is replaced)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover of a write cut short may have another mode
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


async def push_account(jwt: str, url: str, admin_creds: Path, tls_ca: str | None) -> None:
    """Hand the fleet's account JWT to the server (every node of a cluster learns it from
    the one that answers); `Unavailable` when none takes it."""
    auth = NatsAuth(creds=str(admin_creds), tls_ca=tls_ca)
    nc = await connect(url, "coordinator-revoke", auth=auth)
    try:
        reply = await nc.request(CLAIMS_UPDATE, jwt.encode(), timeout=5)
    except nats.errors.NoRespondersError:
        raise Unavailable(
            f"{url} takes no account update: is it running the configuration from "
            "`coordinator deploy render nats --jwt`?"
        ) from None
    except nats.errors.TimeoutError:
        raise Unavailable(f"{url} did not answer the account update within 5 s") from None
    finally:
        await nc.close()
    answer = json.loads(reply.data)
    data = answer.get("data") or answer.get("error") or {}
    if data.get("code") != _OK:
        raise Unavailable(f"the server refused the account update: {data}")


def register(sub: Any) -> None:
    """Add ``invite``, ``revoke`` and ``identities`` to the ``coordinator`` parser."""
    store_help = f"the fleet's keys and identities (default ${STORE_VARIABLE} or {default_store()})"
    invite = sub.add_parser(
        "invite",
        help="a new identity for a machine or a person: prints its one-line join token",
        description="Signs a new NATS identity with ROLE's permissions and prints a join "
        "token (`coordinator join TOKEN` on the machine). Nothing changes on the server.",
    )
    invite.add_argument("role", choices=ROLES, metavar="ROLE", help=", ".join(ROLES))
    invite.add_argument("name", help="a worker's id, a person's name, a service's instance")
    invite.add_argument("--gpu", action="store_true", help="a worker with a GPU")
    invite.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="the fleet's NATS as the machine reaches it (repeat; default NATS_URL)",
    )
    invite.add_argument("--ca", type=Path, help="the CA the server's certificate (TLS) is from")
    invite.add_argument("--identities", type=Path, default=None, help=store_help)
    invite.set_defaults(func=cmd_invite)

    revoke = sub.add_parser(
        "revoke",
        help="end an identity: refused from now on, its connections cut",
        description="Reads NATS_URL (and NATS_TLS_CA) to reach the server.",
    )
    revoke.add_argument("identity", help="as `coordinator identities` lists it")
    revoke.add_argument("--identities", type=Path, default=None, help=store_help)
    revoke.set_defaults(func=cmd_revoke)

    listing = sub.add_parser("identities", help="list the fleet's identities")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--identities", type=Path, default=None, help=store_help)
    listing.set_defaults(func=cmd_identities)


def _store(args: argparse.Namespace) -> Store:
    return Store(args.identities or default_store())


def cmd_invite(args: argparse.Namespace) -> int:
    if args.gpu and args.role != "worker":
        raise ConfigError("--gpu is for a worker")
    servers = args.server or nats_servers(Settings.from_env().nats_url)
    ca = None
    if args.ca is not None:
        if not args.ca.is_file():
            raise ConfigError(f"--ca {args.ca}: no such file")
        ca = args.ca.read_text()
    store = _store(args)
    identity, creds = store.invite(args.role, args.name)
    token = JoinToken(
        role=args.role,
        name=args.name,
        identity=identity,
        servers=list(servers),
        creds=creds,
        ca=ca,
        gpu=args.gpu,
    )
    print(encode_token(token))
    print(
        f"{identity}: on its machine, `coordinator join <the line above>`. The token is a "
        "secret: whoever holds it is this identity until `coordinator revoke "
        f"{identity}`.",
        file=sys.stderr,
    )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)
    settings = Settings.from_env()
    store = _store(args)
    jwt = store.revoke(args.identity)
    asyncio.run(push_account(jwt, settings.nats_url, store.admin_creds, settings.nats_tls_ca))
    print(f"revoked {args.identity}: refused from now on, its connections cut")
    return 0


def cmd_identities(args: argparse.Namespace) -> int:
    registry = _store(args).registry()
    if args.json:
        print(msgspec.json.encode(registry.identities).decode())
        return 0
    for identity, known in sorted(registry.identities.items()):
        state = "revoked" if known.revoked_at is not None else "valid"
        issued = time.strftime("%Y-%m-%d %H:%M", time.localtime(known.issued_at))
        print(f"{identity:24} {known.role:10} {state:8} issued {issued}")
    return 0

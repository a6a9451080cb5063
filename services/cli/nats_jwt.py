"""NATS's decentralised authentication, written: nkeys, and the operator's, accounts' and
users' JWTs the server trusts. Pure (no I/O): the identity store (`identities`) keeps the keys.

The chain: the operator's key signs its own JWT, which the server's configuration holds, and
the JWTs of two accounts: the system account (its users push account updates to the server,
``$SYS.REQ.CLAIMS.UPDATE``) and the fleet's account, where every stream and every identity
lives. The fleet's signing key signs each identity's user JWT, with the permissions of its
role (`permissions.role_permissions`, the one source). The server keeps no list of users:
one it has never seen connects with a valid JWT, and a revoked one is refused because the
fleet's account JWT lists it (``revocations``: every JWT of that key issued up to then).

The JWT format is nats-io/jwt's (v2): a base64url JSON header and claims, signed with the
issuer's ed25519 nkey; ``jti`` is the base32 SHA-512/256 of the claims.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import nkeys

from services.cli.permissions import (
    NATS_STORE_DIR,
    RESPONSES_EXPIRE_S,
    Permissions,
    role_permissions,
)
from services.fleet.identity import WITH_WORKER_ID, creds_text

OPERATOR: Final = nkeys.PREFIX_BYTE_OPERATOR
ACCOUNT: Final = nkeys.PREFIX_BYTE_ACCOUNT
USER: Final = nkeys.PREFIX_BYTE_USER
SYSTEM_ACCOUNT_NAME: Final = "SYS"
FLEET_ACCOUNT_NAME: Final = "FLEET"
# The resolver keeps the accounts' JWTs (a revocation pushed later included) beside JetStream.
RESOLVER_DIR: Final = f"{NATS_STORE_DIR}/jwt"
_HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMIT: Final = -1
_NS_PER_S: Final = 1_000_000_000


def new_seed(prefix: int) -> str:
    """A fresh nkey seed (``S…``) for an operator, an account or a user."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), prefix)
    return seed.decode()


def public_key(seed: str) -> str:
    kp = nkeys.from_seed(bytearray(seed.encode()))
    key: bytes = kp.public_key
    return key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_jwt(claims: Mapping[str, Any], signer_seed: str, issued_at: int) -> str:
    """Sign ``claims`` (``sub``, ``name``, ``nats``) with ``signer_seed`` as nats-io/jwt does."""
    signer = nkeys.from_seed(bytearray(signer_seed.encode()))
    body: dict[str, Any] = {**claims, "iat": issued_at, "iss": signer.public_key.decode()}
    body["jti"] = (
        base64.b32encode(hashlib.new("sha512_256", _json(body).encode()).digest())
        .decode()
        .rstrip("=")
    )
    signed = f"{_b64(_json(_HEADER).encode())}.{_b64(_json(body).encode())}"
    signature: bytes = signer.sign(signed.encode())
    return f"{signed}.{_b64(signature)}"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class Keys:
    """The fleet's keys: the operator's, the two accounts' and the fleet's signing key."""

    operator: str
    system: str
    fleet: str
    signing: str

    @classmethod
    def new(cls) -> Keys:
        return cls(new_seed(OPERATOR), new_seed(ACCOUNT), new_seed(ACCOUNT), new_seed(ACCOUNT))

    def operator_jwt(self, issued_at: int) -> str:
        claims = {
            "sub": public_key(self.operator),
            "name": "coordinator",
            "nats": {"type": "operator", "version": 2, "system_account": public_key(self.system)},
        }
        return encode_jwt(claims, self.operator, issued_at)

    def system_jwt(self, issued_at: int) -> str:
        return self._account_jwt(self.system, SYSTEM_ACCOUNT_NAME, {}, issued_at, jetstream=False)

    def fleet_jwt(self, revocations: Mapping[str, int], issued_at: int) -> str:
        """The fleet's account: JetStream on, users signed by its signing key, and every
        revoked identity's key with the time it was revoked."""
        return self._account_jwt(self.fleet, FLEET_ACCOUNT_NAME, revocations, issued_at)

    def _account_jwt(
        self,
        seed: str,
        name: str,
        revocations: Mapping[str, int],
        issued_at: int,
        *,
        jetstream: bool = True,
    ) -> str:
        limits: dict[str, Any] = {
            key: _NO_LIMIT
            for key in ("subs", "data", "payload", "imports", "exports", "conn", "leaf")
        }
        limits["wildcards"] = True
        if jetstream:  # unlimited; JetStream's own limits are the server's
            limits.update({k: _NO_LIMIT for k in ("mem_storage", "disk_storage")})
            limits.update({k: _NO_LIMIT for k in ("streams", "consumer")})
        nats: dict[str, Any] = {"type": "account", "version": 2, "limits": limits}
        if jetstream:
            nats["signing_keys"] = [public_key(self.signing)]
        if revocations:
            nats["revocations"] = dict(revocations)
        return encode_jwt(
            {"sub": public_key(seed), "name": name, "nats": nats}, self.operator, issued_at
        )

    def system_user(self, issued_at: int) -> tuple[str, str]:
        """A system account user (JWT, seed): what pushes the fleet's account JWT."""
        seed = new_seed(USER)
        claims = {
            "sub": public_key(seed),
            "name": "coordinator-admin",
            "nats": {"type": "user", "version": 2, **_unlimited()},
        }
        return encode_jwt(claims, self.system, issued_at), seed

    def user(self, role: str, name: str, identity: str, seed: str, issued_at: int) -> str:
        """An identity's user JWT: its role's permissions, with its own inbox."""
        worker_id = name if role in WITH_WORKER_ID else None
        perms = role_permissions(role, worker_id, user=identity)
        claims = {
            "sub": public_key(seed),
            "name": identity,
            "nats": {
                "type": "user",
                "version": 2,
                "issuer_account": public_key(self.fleet),
                "tags": [f"role:{role}"],
                **_jwt_permissions(perms),
                **_unlimited(),
            },
        }
        return encode_jwt(claims, self.signing, issued_at)

    def creds(self, role: str, name: str, identity: str, issued_at: int) -> tuple[str, str]:
        """A fresh identity: (its ``.creds`` text, its public key)."""
        seed = new_seed(USER)
        jwt = self.user(role, name, identity, seed, issued_at)
        return creds_text(jwt, seed), public_key(seed)


def _unlimited() -> dict[str, int]:
    return {"subs": _NO_LIMIT, "data": _NO_LIMIT, "payload": _NO_LIMIT}


def _jwt_permissions(perms: Permissions) -> dict[str, Any]:
    """The user JWT's ``pub``, ``sub`` and ``resp`` from a role's permissions."""
    pub: dict[str, list[str]] = {"allow": list(dict.fromkeys(perms.publish))}
    if perms.publish_deny:
        pub["deny"] = list(perms.publish_deny)
    out: dict[str, Any] = {"pub": pub, "sub": {"allow": list(dict.fromkeys(perms.subscribe))}}
    if perms.responses:
        # How long a service may answer a request (`permissions.RESPONSES_EXPIRE`), in ns.
        out["resp"] = {"max": perms.responses, "ttl": RESPONSES_EXPIRE_S * _NS_PER_S}
    return out


def jwt_auth(keys: Keys, revocations: Mapping[str, int], issued_at: int) -> str:
    """Who is who with decentralised authentication: a server's (every node's alike)."""
    system, fleet = public_key(keys.system), public_key(keys.fleet)
    return (
        "# Who is who: NATS's decentralised JWT authentication (docs/identities.md). The\n"
        "# operator's JWT vouches for the system account and the fleet's; each identity is a\n"
        "# user JWT that the fleet's signing key signed (`coordinator invite`). Nothing here\n"
        "# names an identity: adding one changes nothing on the server, and a revocation is\n"
        "# pushed into the resolver (`coordinator revoke`), which keeps it across restarts\n"
        "# (and on a cluster hands it to every node).\n"
        f"operator: {keys.operator_jwt(issued_at)}\n"
        f"system_account: {system}\n"
        "resolver {\n"
        "  type: full\n"
        f'  dir: "{RESOLVER_DIR}"\n'
        "  allow_delete: false\n"
        '  interval: "2m"\n'
        '  timeout: "5s"\n'
        "}\n"
        "# The accounts as of this rendering; a newer JWT pushed since (a revocation) wins.\n"
        "resolver_preload {\n"
        f"  {system}: {keys.system_jwt(issued_at)}\n"
        f"  {fleet}: {keys.fleet_jwt(revocations, issued_at)}\n"
        "}\n"
    )

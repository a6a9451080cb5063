"""Identities, their JWTs and join tokens (services/fleet/identity.py, services/cli/nats_jwt.py,
the store of services/cli/identities.py): names, signatures, what the server is told."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import msgspec
import nacl.exceptions
import nacl.signing
import pytest

from schemas.subjects import InvalidId, task_of_readable_event
from services.cli.identities import Store
from services.cli.nats_jwt import Keys, public_key
from services.cli.permissions import render_server_conf, role_permissions
from services.errors import ConfigError, Conflict, NotFound
from services.fleet.identity import (
    JoinToken,
    Owner,
    asker_of,
    claims_of,
    creds_text,
    decode_token,
    encode_token,
    identity_name,
    identity_of_creds,
    is_operator,
    jwt_of_creds,
    may_read_task_events,
    may_see,
)


def test_an_identity_is_named_from_its_role_and_name() -> None:
    assert identity_name("worker", "gpu1") == "worker-gpu1"
    assert identity_name("web-search", "s1") == "web-s1"
    assert identity_name("router", "a") == "router-a"
    assert identity_name("operator", "ann") == "operator-ann"
    assert identity_name("client", "alice") == "alice"
    assert is_operator("operator-ann") and is_operator("operator")
    assert not is_operator("alice") and not is_operator("operators")


@pytest.mark.parametrize(
    ("role", "name", "says"),
    [
        ("client", "router", "reads as a role"),
        ("client", "worker-gpu1", "reads as a role"),
        ("client", "a.b", "name"),
        ("worker", "shared", "worker id"),  # a pool's name, a queue of its own
        ("worker", "a b", "worker id"),
        ("king", "x", "unknown role"),
    ],
)
def test_a_name_that_could_pass_for_another_is_refused(role: str, name: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        identity_name(role, name)


def verify(jwt: str) -> dict[str, object]:
    """The JWT's claims, once its signature checks with the key its ``iss`` names."""
    head, body, sig = jwt.split(".")
    claims = claims_of(jwt)
    # A public nkey: base32 of a prefix byte, the ed25519 key and a CRC-16.
    raw = base64.b32decode(str(claims["iss"]) + "=" * (-len(str(claims["iss"])) % 8))[1:-2]
    signature = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    nacl.signing.VerifyKey(raw).verify(f"{head}.{body}".encode(), signature)  # raises if not
    return claims


def test_a_users_jwt_is_signed_by_the_fleets_signing_key_with_its_roles_permissions() -> None:
    keys = Keys.new()
    creds, public = keys.creds("worker", "gpu1", "worker-gpu1", issued_at=1_000)
    assert identity_of_creds(creds) == "worker-gpu1"
    claims = verify(jwt_of_creds(creds))
    assert claims["sub"] == public and claims["iss"] == public_key(keys.signing)
    assert claims["iat"] == 1_000
    head, _, sig = jwt_of_creds(creds).split(".")
    claims_json = msgspec.json.encode({**claims, "name": "operator-x"})
    tampered = base64.urlsafe_b64encode(claims_json).rstrip(b"=").decode()
    with pytest.raises(nacl.exceptions.BadSignatureError):
        verify(f"{head}.{tampered}.{sig}")
    nats = claims["nats"]
    assert isinstance(nats, dict)
    assert nats["issuer_account"] == public_key(keys.fleet)
    perms = role_permissions("worker", "gpu1", user="worker-gpu1")
    assert nats["pub"]["allow"] == list(dict.fromkeys(perms.publish))
    assert nats["sub"]["allow"] == ["_INBOX_worker-gpu1.>", "coordinator.cancel.*"]
    assert (
        "deny" not in nats["pub"] and perms.publish_deny == []
    )  # a worker is denied nothing: allowed little
    # The fleet's account trusts that key, and lists revoked keys with when.
    fleet = verify(keys.fleet_jwt({public: 2_000}, issued_at=2_000))
    assert fleet["iss"] == public_key(keys.operator)
    assert isinstance(fleet["nats"], dict)
    assert fleet["nats"]["signing_keys"] == [public_key(keys.signing)]
    assert fleet["nats"]["revocations"] == {public: 2_000}
    assert fleet["nats"]["limits"]["disk_storage"] == -1  # JetStream on


def test_a_join_token_is_one_line_and_carries_one_identity() -> None:
    keys = Keys.new()
    creds, _ = keys.creds("worker", "gpu1", "worker-gpu1", issued_at=1)
    token = JoinToken(
        role="worker",
        name="gpu1",
        identity="worker-gpu1",
        servers=["nats://fleet:4222"],
        creds=creds,
        gpu=True,
    )
    line = encode_token(token)
    assert "\n" not in line and " " not in line
    assert decode_token(f"  {line}\n") == token


def test_a_token_whose_parts_disagree_is_refused() -> None:
    keys = Keys.new()
    alice, _ = keys.creds("client", "alice", "alice", issued_at=1)
    # Names a worker, carries a person's credentials.
    forged = JoinToken(
        role="worker", name="gpu1", identity="worker-gpu1", servers=["nats://f:4222"], creds=alice
    )
    with pytest.raises(ConfigError, match="another identity's"):
        decode_token(encode_token(forged))
    mismatched = msgspec.structs.replace(forged, identity="alice")
    with pytest.raises(ConfigError, match="does not match its role"):
        decode_token(encode_token(mismatched))
    with pytest.raises(ConfigError, match="not a join token"):
        decode_token("coordinator-join-1.!!!")
    with pytest.raises(ConfigError, match="should start with"):
        decode_token("eyJhbGciOi")
    with pytest.raises(ConfigError, match="no BEGIN NATS USER JWT block"):
        identity_of_creds("nothing here")
    with pytest.raises(ConfigError, match="names no identity"):
        jwt = keys.fleet_jwt({}, 1).split(".")
        unnamed = base64.urlsafe_b64encode(b'{"sub":"U"}').rstrip(b"=").decode()
        identity_of_creds(creds_text(f"{jwt[0]}.{unnamed}.{jwt[2]}", "SU"))


def test_the_store_keeps_its_secrets_private_and_signs_later_each_time(tmp_path: Path) -> None:
    store = Store(tmp_path / "ids")
    store.create()
    with pytest.raises(Conflict):
        store.create()  # new keys would lock every identity out
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
    for path in store.path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    first = store.registry().last_issued_at
    identity, creds = store.invite("client", "alice")
    assert identity == "alice"
    account = verify(store.revoke("alice"))
    # Everything signed in the same second still gets a later ``iat``: the server keeps the
    # newest account JWT, and must keep this revocation over the configuration's preload.
    assert int(str(claims_of(jwt_of_creds(creds))["iat"])) > first
    assert int(str(account["iat"])) > int(str(claims_of(jwt_of_creds(creds))["iat"]))
    conf = render_server_conf(store.auth())
    assert "alice" not in conf  # the server's configuration names no identity
    with pytest.raises(NotFound):
        store.revoke("bob")
    again, _ = store.invite("client", "alice")  # a revoked name can be invited again
    assert again == "alice"
    # ...with a new key; the old one stays revoked in every account pushed later.
    old_key = claims_of(jwt_of_creds(creds))["sub"]
    store.invite("client", "bob")
    later = verify(store.revoke("bob"))
    assert isinstance(later["nats"], dict)
    assert old_key in later["nats"]["revocations"]
    assert len(later["nats"]["revocations"]) == 2
    with pytest.raises(Conflict, match="revoke alice"):
        store.invite("client", "alice")


def test_who_asked_is_read_from_the_inbox_a_request_replies_to() -> None:
    assert asker_of("_INBOX_alice.abc.1") == "alice"
    assert asker_of("_INBOX_worker-gpu1.x") == "worker-gpu1"
    assert asker_of("_INBOX.abc.1") is None  # a fleet without identities
    assert asker_of("") is None and asker_of(None) is None
    assert asker_of("somewhere.else") is None
    # A key a gateway names counts; one anybody else names does not.
    assert Owner.asking("_INBOX_gateway-a.1", "key-a") == Owner("gateway-a", "key-a")
    assert Owner.asking("_INBOX_bob.1", "key-a") == Owner("bob", None)
    assert Owner.asking("_INBOX.1", "key-a") == Owner(None, "key-a")  # nobody proves otherwise


@pytest.mark.parametrize(
    ("task", "viewer", "sees"),
    [
        (Owner("alice"), Owner("alice"), True),
        (Owner("alice"), Owner("bob"), False),
        (Owner("alice"), Owner(None), False),  # a reply to the shared inbox reads nothing
        (Owner("alice"), Owner("operator-ann"), True),
        (Owner("alice"), Owner("admin"), True),
        (Owner("alice"), Owner("worker-gpu1"), False),
        (Owner(None), Owner("bob"), True),  # asked without identities: anyone's
        (Owner("gateway", "key-a"), Owner("gateway-2", "key-a"), True),  # any gateway, same key
        (Owner("gateway", "key-a"), Owner("gateway", "key-b"), False),
        (Owner("gateway", "key-a"), Owner("gateway", None), False),
        (Owner("gateway", None), Owner("gateway", None), True),  # an open gateway's
        (Owner("gateway", "key-a"), Owner("key-a"), False),  # a person named like the key
        # A bus without identities: the gateway's keys still keep its clients apart.
        (Owner(None, "key-a"), Owner(None, "key-b"), False),
        (Owner(None, "key-a"), Owner(None, None), False),
        (Owner(None, "key-a"), Owner(None, "key-a"), True),
    ],
)
def test_a_task_is_seen_by_who_asked_and_the_operator_only(
    task: Owner, viewer: Owner, sees: bool
) -> None:
    assert may_see(task, viewer) is sees


@pytest.mark.parametrize(
    ("subject", "task_id"),
    [
        ("events.task.t1.routed", "t1"),
        ("events.task.t1.failed", "t1"),
        ("events.task.t1.*.completed", "t1"),
        ("events.task.t1.cpu1.started", "t1"),
        ("events.task.t1.*.failed", "t1"),
    ],
)
def test_a_worker_reads_the_events_of_one_named_task(subject: str, task_id: str) -> None:
    assert task_of_readable_event(subject) == task_id


@pytest.mark.parametrize(
    "subject",
    [
        "events.task.*.*.completed",  # every task's last answer
        "events.task.>",
        "events.task.t1.submitted",  # the prompt
        "events.task.t1.*.submitted",
        "events.task.t1.>.completed",
        "events.task.t1.routed.x",
        "events.stats.alias.set",
        "events.task.t1",
    ],
)
def test_no_other_subject_is_read_for_a_worker(subject: str) -> None:
    with pytest.raises(InvalidId):
        task_of_readable_event(subject)


@pytest.mark.parametrize(
    ("reader", "routed_to", "may"),
    [
        ("worker-cpu1", {"cpu1"}, True),
        ("worker-cpu1", {"gpu1", "cpu1"}, True),  # moved off it: it still learns so
        ("worker-cpu1", {"gpu1"}, False),
        ("worker-cpu1", {"shared"}, True),  # the shared CPU pool, which every worker pulls
        ("worker-cpu1", {"web"}, False),
        ("web-s1", {"web"}, True),
        ("web-s1", {"shared"}, False),
        ("web-s1", {"s1"}, True),
        ("alice", {"cpu1"}, False),
        ("router-a", {"cpu1"}, False),  # it reads the log itself
        ("operator-ann", set(), True),
        (None, set(), True),  # a bus without identities
        ("worker-", {""}, False),
    ],
)
def test_a_tasks_events_are_read_for_the_workers_it_was_routed_to(
    reader: str | None, routed_to: set[str], may: bool
) -> None:
    assert may_read_task_events(reader, routed_to) is may

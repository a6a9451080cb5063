"""The gateway's API keys, the pure part: keys, hashes, names, the Authorization header, the
key table, and when a gateway may listen open."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from schemas.events import TaskSubmitted, task_event_decoder
from schemas.route import RouteRequest
from schemas.subjects import InvalidId
from services.errors import ConfigError
from services.gateway.keys import (
    KEY_PREFIX,
    KeyRecord,
    KeyTable,
    Refusal,
    always_keyed,
    api_of,
    bearer_token,
    check_key_name,
    is_loopback,
    is_public,
    key_hash,
    make_record,
    new_key,
    open_refusal,
    record_decoder,
    record_encoder,
)
from services.gateway.settings import GatewaySettings


def test_a_new_key_is_prefixed_random_and_long() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert key.startswith(KEY_PREFIX)
        assert len(key) == len(KEY_PREFIX) + 43  # 32 bytes, URL-safe base64 without padding
        assert bearer_token(f"Bearer {key}") == key  # nothing in it breaks the header


def test_the_hash_is_sha256_hex_and_the_record_never_holds_the_key() -> None:
    key = new_key()
    assert key_hash(key) == hashlib.sha256(key.encode()).hexdigest()
    record = make_record("alice", key, "batch", 1700000000.0)
    stored = record_encoder.encode(record)
    assert key.encode() not in stored
    assert record_decoder.decode(stored) == record
    assert (record.name, record.priority, record.created_at) == ("alice", "batch", 1700000000.0)


@pytest.mark.parametrize("name", ["alice", "bob-laptop", "ci_1", "A" * 128])
def test_good_names(name: str) -> None:
    assert check_key_name(name) == name


@pytest.mark.parametrize("name", ["", "a.b", "a b", "a*", ">", "alice\n", "ü", "A" * 129])
def test_bad_names_are_refused_naming_what_is_allowed(name: str) -> None:
    with pytest.raises(InvalidId) as error:
        check_key_name(name)
    assert "letters, digits" in str(error.value)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic YWxhZGRpbjpvcGVu", None),
        ("Bearer a b", None),
        ("abc", None),
    ],
)
def test_the_authorization_header(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/api/chat", "ollama"),
        ("/", "ollama"),
        ("/nope", "ollama"),
        ("/v1/chat/completions", "openai"),
        ("/v1", "openai"),
        ("/v10", "ollama"),
        ("/route", "task"),
        ("/task/t-1", "task"),
        ("/dashboard", "task"),
        ("/dashboard/stream", "task"),
        ("/metrics", "task"),
        ("/dashboards", "ollama"),
    ],
)
def test_each_path_answers_in_its_apis_shape(path: str, api: str) -> None:
    assert api_of(path) == api


@pytest.mark.parametrize(
    ("path", "public"),
    [
        ("/", True),
        ("/api/version", True),
        ("/dashboard", True),
        ("/dashboard/static/dashboard.js", True),
        ("/dashboard/state", False),
        ("/dashboard/stream", False),
        ("/dashboard/", False),
        ("/dashboard/staticx", False),
        ("/metrics", False),
        ("/api/tags", False),
    ],
)
def test_only_the_probes_and_the_dashboards_page_and_files_need_no_key(
    path: str, public: bool
) -> None:
    """The page and its files are the same for everyone; the fleet's data needs the key."""
    assert is_public(path) is public


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("gateway.lan", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_network_address_without_keys_must_be_opened_on_purpose() -> None:
    why = open_refusal("0.0.0.0", allow_open=False, keys=0)
    assert why is not None and "GATEWAY_ALLOW_OPEN" in why and "coordinator keys add" in why
    assert open_refusal("0.0.0.0", allow_open=True, keys=0) is None
    assert open_refusal("0.0.0.0", allow_open=False, keys=1) is None
    assert open_refusal("127.0.0.1", allow_open=False, keys=0) is None
    assert always_keyed("0.0.0.0", allow_open=False)
    assert not always_keyed("0.0.0.0", allow_open=True)
    assert not always_keyed("127.0.0.1", allow_open=False)


def test_no_key_needed_until_one_exists_on_loopback() -> None:
    table = KeyTable()
    assert not table.required
    assert table.identify(None) is None
    assert table.identify("Bearer whatever") is None


def test_the_table_identifies_known_keys_and_refuses_the_rest() -> None:
    table = KeyTable()
    alice, bob = new_key(), new_key()
    table.put(make_record("alice", alice, "interactive", 1.0))
    table.put(make_record("bob", bob, "batch", 2.0))
    assert table.required and len(table) == 2
    found = table.identify(f"Bearer {bob}")
    assert isinstance(found, KeyRecord) and (found.name, found.priority) == ("bob", "batch")
    missing = table.identify(None)
    assert isinstance(missing, Refusal) and "missing API key" in missing.message
    wrong = table.identify(f"Bearer {new_key()}")
    assert isinstance(wrong, Refusal) and "invalid API key" in wrong.message
    assert alice not in wrong.message

    table.remove("bob")
    assert isinstance(table.identify(f"Bearer {bob}"), Refusal)
    assert isinstance(table.identify(f"Bearer {alice}"), KeyRecord)
    table.remove("alice")
    assert not table.required
    assert table.identify(f"Bearer {alice}") is None


def test_a_replaced_record_forgets_the_old_hash() -> None:
    table = KeyTable()
    old, new = new_key(), new_key()
    table.put(make_record("alice", old, "interactive", 1.0))
    table.put(make_record("alice", new, "interactive", 2.0))
    assert len(table) == 1
    assert isinstance(table.identify(f"Bearer {old}"), Refusal)
    assert isinstance(table.identify(f"Bearer {new}"), KeyRecord)


def test_a_gateway_on_the_network_fails_closed_when_its_last_key_goes() -> None:
    table = KeyTable(always=True)
    refused = table.identify("Bearer anything")
    assert isinstance(refused, Refusal) and "coordinator keys add" in refused.message


def test_client_is_optional_on_the_wire_and_old_events_decode() -> None:
    request = RouteRequest(prompt="p", model="m")
    assert request.client is None
    assert b"client" not in msgspec.json.encode(request)
    assert msgspec.json.decode(b'{"prompt":"p","model":"m","client":"alice"}', type=RouteRequest)
    old = b'{"type":"submitted","at":1,"task_id":"t","model":"m","prompt":"p","timeout_s":1}'
    event = task_event_decoder.decode(old)
    assert isinstance(event, TaskSubmitted) and event.client is None


def test_the_timeouts_are_settings_checked_at_start() -> None:
    settings = GatewaySettings.from_env({})
    assert (
        settings.gateway_header_timeout_s,
        settings.gateway_body_timeout_s,
        settings.gateway_keepalive_timeout_s,
        settings.gateway_allow_open,
    ) == (10.0, 60.0, 75.0, False)
    assert GatewaySettings.from_env({"GATEWAY_ALLOW_OPEN": "1"}).gateway_allow_open
    assert (settings.gateway_events_lookback_s, settings.worker_ttl_s) == (3600.0, 3.0)
    for variable in (
        "GATEWAY_HEADER_TIMEOUT_S",
        "GATEWAY_BODY_TIMEOUT_S",
        "WORKER_TTL_S",
    ):
        with pytest.raises(ConfigError) as error:
            GatewaySettings.from_env({variable: "0"})
        assert variable in error.value.message
    with pytest.raises(ConfigError) as lookback:
        GatewaySettings.from_env({"GATEWAY_EVENTS_LOOKBACK_S": "-1"})
    assert "GATEWAY_EVENTS_LOOKBACK_S" in lookback.value.message

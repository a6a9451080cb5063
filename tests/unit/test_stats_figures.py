"""Routing figures for the KV bucket, and aliases: pure parts of the stats."""

from __future__ import annotations

import re

import pytest

from schemas.stats import FigureView, RoutingFigure
from services.errors import BadRequest
from services.fleet.aliases import check_alias, resolve
from services.stats.figures import escape_part, kv_key, routing_figure, unescape_part

# What a NATS KV key may hold.
VALID_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")

NAMES = [
    "qwen2.5:7b",
    "hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M",
    "LFM2.5-1.2B-JP",
    "gemma3:1b",
    "a_b",
    "_",
    "",
    "モデル",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_escapes_to_one_valid_token_and_back(name: str) -> None:
    token = escape_part(name)

    assert VALID_KEY.match(token)
    assert "." not in token
    assert unescape_part(token) == name


def test_a_key_has_three_tokens_and_distinct_figures_get_distinct_keys() -> None:
    key = kv_key("qwen2.5:7b", "code", "mac")

    assert key == "qwen2_2E5_3A7b.code.mac"
    assert len(key.split(".")) == 3
    keys = {kv_key(m, d, w) for m in NAMES for d in ("code", "") for w in ("mac", "a_b")}
    assert len(keys) == len(NAMES) * 4


def figure(**changes: object) -> FigureView:
    values: dict[str, object] = {
        "model": "qwen2.5:7b",
        "domain": "code",
        "worker": "mac",
        "count": 20,
        "failures": 3,
        "p50_ms": 900.0,
        "p95_ms": 2000.0,
        "load_ms_p50": 40.0,
        "cold_load_ms_p50": 3500.0,
        "warm_p50_ms": 860.0,
        "tokens_per_s": 55.5,
        "quality_mean": 0.8,
        "quality_count": 4,
        "recent_count": 20,
        "recent_failures": 5,
        "last_at": 1000.0,
    }
    values.update(changes)
    return FigureView(**values)  # type: ignore[arg-type]


def test_the_routing_figure_carries_typical_duration_and_recent_failure_rate() -> None:
    assert routing_figure(figure(), now=1234.0) == RoutingFigure(
        model="qwen2.5:7b",
        domain="code",
        worker="mac",
        count=20,
        failures=3,
        recent_count=20,
        recent_failure_rate=0.25,
        typical_ms=900.0,
        p95_ms=2000.0,
        load_ms_p50=40.0,
        tokens_per_s=55.5,
        quality_mean=0.8,
        quality_count=4,
        last_at=1000.0,
        updated_at=1234.0,
        warm_ms=860.0,
        cold_load_ms=3500.0,
    )


def test_a_figure_with_only_failures_has_no_typical_duration() -> None:
    routing = routing_figure(
        figure(count=2, failures=2, p50_ms=None, recent_count=2, recent_failures=2), now=0.0
    )

    assert (routing.typical_ms, routing.recent_failure_rate) == (None, 1.0)


def test_an_alias_chain_is_followed_to_its_end() -> None:
    aliases = {"hf.co/elyza/x:Q4": "elyza-jp-8b", "elyza-jp-8b": "elyza:8b"}

    assert resolve(aliases, "hf.co/elyza/x:Q4") == "elyza:8b"
    assert resolve(aliases, "elyza:8b") == "elyza:8b"
    assert resolve(aliases, "other") == "other"


def test_a_cycle_in_the_log_resolves_instead_of_looping() -> None:
    assert resolve({"a": "b", "b": "a"}, "a") == "a"


@pytest.mark.parametrize(
    ("alias", "canonical", "words"),
    [
        ("a", "a", "itself"),
        ("b", "a", "cycle"),
        ("c", "a", "cycle"),  # c -> a -> b -> c
        ("", "a", "empty"),
    ],
)
def test_an_alias_that_would_loop_or_name_nothing_is_refused(
    alias: str, canonical: str, words: str
) -> None:
    aliases = {"a": "b", "b": "c"}

    with pytest.raises(BadRequest) as refused:
        check_alias(aliases, alias, canonical)

    assert words in refused.value.message


def test_a_new_alias_or_a_new_target_is_accepted() -> None:
    check_alias({"a": "b"}, "x", "b")
    check_alias({"a": "b"}, "a", "z")

"""The stats projection's pure rules: which events were applied (positions checked by digest),
which failures park an event, which times a table holds."""

from __future__ import annotations

import math

import pytest

from schemas.stats import LATEST_S
from services.errors import Unavailable, Unstorable
from services.stats.rows import timestamp
from services.stats.tracking import (
    DIGEST_BYTES,
    UNEXPLAINED_TRIES,
    Positions,
    event_digest,
    parked_error,
    parks,
    sort_positions,
)

A, B, C, D = (event_digest("events.x", body) for body in (b"a", b"b", b"c", b"d"))


def test_a_digest_names_the_event_by_its_subject_and_its_bytes() -> None:
    digest = event_digest("events.task.t.submitted", b'{"type":"submitted"}')

    assert len(digest) == DIGEST_BYTES
    assert digest == event_digest("events.task.t.submitted", b'{"type":"submitted"}')
    assert digest != event_digest("events.task.t.submitted", b'{"type":"submitted" }')
    # The same body from another recorder is another event.
    assert digest != event_digest("events.task.t.w.submitted", b'{"type":"submitted"}')


def test_positions_not_tracked_before_are_fresh() -> None:
    positions = sort_positions([(1, A), (2, B)], written={1, 2}, tracked={})

    assert positions == Positions((True, True), replaced_from=None)


def test_a_redelivered_event_is_a_duplicate() -> None:
    positions = sort_positions([(4, A), (5, B)], written={5}, tracked={4: A})

    assert positions == Positions((False, True), replaced_from=None)


def test_another_event_at_a_tracked_position_means_the_log_was_replaced_from_there() -> None:
    # 3 and 4 are the events applied there; 5 is not: the log holds others from 5 on, and
    # what is tracked from there (6 too, the same bytes or not) is set aside.
    positions = sort_positions(
        [(3, A), (4, B), (5, C), (6, D), (7, A)], written={7}, tracked={3: A, 4: B, 5: D, 6: D}
    )

    assert positions == Positions((False, False, True, True, True), replaced_from=5)


def test_the_lowest_position_holding_another_event_is_where_the_log_was_replaced() -> None:
    positions = sort_positions([(8, A), (9, B)], written=(), tracked={8: B, 9: A})

    assert positions.replaced_from == 8
    assert positions.fresh == (True, True)


def test_a_row_without_a_digest_is_taken_for_another_event() -> None:
    # Filled in at start wherever the stream held the event; still empty: the stream did not.
    positions = sort_positions([(2, A)], written=(), tracked={2: None})

    assert positions == Positions((True,), replaced_from=2)


def test_a_position_twice_in_a_batch_is_applied_once() -> None:
    positions = sort_positions([(1, A), (1, A), (2, B)], written={1, 2}, tracked={})

    assert positions.fresh == (True, False, True)


@pytest.mark.parametrize(
    ("error", "tries", "parked"),
    [
        (Unavailable("PostgreSQL unreachable"), 1, False),
        (Unavailable("PostgreSQL unreachable"), 1000, False),
        (Unstorable("time 1e+308 is out of range"), 1, True),
        (RuntimeError("a bug"), 1, False),
        (RuntimeError("a bug"), UNEXPLAINED_TRIES - 1, False),
        (RuntimeError("a bug"), UNEXPLAINED_TRIES, True),
        (KeyError("model"), UNEXPLAINED_TRIES + 5, True),
    ],
)
def test_an_event_is_parked_when_its_failure_is_its_own_or_keeps_coming(
    error: Exception, tries: int, parked: bool
) -> None:
    assert parks(error, tries) is parked


def test_a_parked_event_says_what_went_wrong() -> None:
    assert parked_error(Unstorable("time 1e+308 is out of range")) == "time 1e+308 is out of range"
    assert parked_error(OverflowError("date value out of range")) == (
        "OverflowError: date value out of range"
    )


@pytest.mark.parametrize("at", [1e308, 2.0**63, -1e18, 1.7e12, math.inf, -math.inf, math.nan])
def test_a_time_no_column_holds_is_unstorable_not_an_overflow(at: float) -> None:
    with pytest.raises(Unstorable, match="out of range"):
        timestamp(at)


@pytest.mark.parametrize(
    ("at", "iso"),
    [
        (0.0, "1970-01-01T00:00:00+00:00"),
        (-62_135_596_800.0, "0001-01-01T00:00:00+00:00"),
        (LATEST_S, "9999-12-31T23:59:59+00:00"),
        (math.nextafter(LATEST_S + 1, 0), "9999-12-31T23:59:59.999969+00:00"),
    ],
)
def test_every_time_a_column_holds_is_stored(at: float, iso: str) -> None:
    assert timestamp(at).isoformat() == iso

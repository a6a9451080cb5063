"""The stats requests' pure checks: the times and numbers a request may hold, refused with
``bad_request`` naming the field and the range."""

from __future__ import annotations

import math
from typing import Any

import pytest

from schemas.stats import EARLIEST_S, LATEST_S, ExcludeRequest, time_problem
from services.errors import BadRequest
from services.stats.requests import check_exclusion, check_fields


@pytest.mark.parametrize("at", [EARLIEST_S, 1_700_000_000.5, LATEST_S])
def test_a_request_may_name_any_time_from_1970_to_9999(at: float) -> None:
    assert time_problem("since", at) is None


@pytest.mark.parametrize(
    ("at", "says"),
    [
        (-1.0, "not -1"),
        (1e308, "not 1e+308"),
        (math.inf, "not inf"),
        (math.nan, "not nan"),
        (1.7e12, "not 1700000000000 (that looks like milliseconds: times are epoch seconds, "),
        (1.7e15, "(that looks like microseconds"),
        (1.7e18, "(that looks like nanoseconds"),
        (1e40, "not 1e+40"),
    ],
)
def test_a_time_out_of_range_is_refused_naming_the_field_and_the_range(
    at: float, says: str
) -> None:
    problem = time_problem("until", at)

    assert problem is not None
    assert problem.startswith(
        "until must be a time from 1970-01-01 to 9999-12-31 (epoch seconds 0 to 253402300799)"
    )
    assert says in problem


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"since": 1e308}, "since must be a time from 1970-01-01"),
        ({"since": 1.7e12}, "looks like milliseconds"),
        ({"since": 1.0, "until": 2.0**63}, "until must be a time from 1970-01-01"),
        ({"since": 10.0, "until": 10.0}, "until must be later than since"),
        ({"since": math.nan}, "since must be a time from 1970-01-01"),
    ],
)
def test_an_exclusion_out_of_range_is_a_bad_request(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_exclusion(ExcludeRequest(worker="mac", reason="r", **fields))

    assert says in refused.value.message
    assert refused.value.code == "bad_request"


def test_a_number_that_is_not_finite_is_refused_in_any_request() -> None:
    with pytest.raises(BadRequest, match="until must be a finite number"):
        check_fields(ExcludeRequest(worker="mac", since=1.0, until=math.inf, reason="r"))

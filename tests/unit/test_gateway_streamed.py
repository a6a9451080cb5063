"""What a stream writes of a task's answer across its attempts (`services.gateway.streamed`):
the client ends with the completed attempt's whole answer, or with an error naming the task."""

from __future__ import annotations

import pytest

from schemas.route import RouteReply, StreamChunk, ToolCall
from services.gateway.common import ApiError
from services.gateway.streamed import Sent

TASK = "t-1"


def piece(
    seq: int,
    text: str = "",
    attempt: int | None = 1,
    *,
    thinking: str = "",
    calls: list[ToolCall] | None = None,
) -> StreamChunk:
    return StreamChunk(
        task_id=TASK,
        seq=seq,
        response=text,
        thinking=thinking,
        tool_calls=calls,
        attempt=attempt,
    )


def done(text: str, thinking: str | None = None, calls: list[ToolCall] | None = None) -> RouteReply:
    return RouteReply(
        task_id=TASK,
        status="done",
        queue="q",
        worker="w",
        response=text,
        thinking=thinking,
        tool_calls=calls,
    )


def written(sent: Sent, *chunks: StreamChunk) -> str:
    """The text the client gets of ``chunks``."""
    out = [sent.add(c) for c in chunks]
    return "".join(c.response for c in out if c is not None)


def test_the_routers_first_chunk_and_one_attempts_pieces_go_as_they_come() -> None:
    sent = Sent(TASK)
    first = piece(0, attempt=None)
    assert sent.add(first) is first
    assert written(sent, piece(1, "Hel"), piece(2, "lo")) == "Hello"
    assert sent.rest(done("Hello")) is None


def test_the_final_replys_rest_is_written_whenever_it_continues_the_stream() -> None:
    """Pieces that had not arrived when the router's final reply did (the two travel apart)
    come with it: never a stream that ends short of the answer."""
    sent = Sent(TASK)
    written(sent, piece(1, "Hel"))
    rest = sent.rest(done("Hello!", thinking="hm"))
    assert rest is not None and (rest.response, rest.thinking, rest.seq) == ("lo!", "hm", -1)


def test_after_a_missed_piece_the_rest_comes_with_the_final_reply() -> None:
    sent = Sent(TASK)
    assert written(sent, piece(1, "a"), piece(3, "c"), piece(4, "d")) == "a"
    rest = sent.rest(done("abcd"))
    assert rest is not None and rest.response == "bcd"


def test_a_newer_attempt_that_answers_alike_continues_where_the_stream_stopped() -> None:
    """A worker killed mid-answer: its task runs again elsewhere and starts over."""
    sent = Sent(TASK)
    assert written(sent, piece(1, "The ans"), piece(2, "wer is")) == "The answer is"
    again = [piece(1, "The ", 2), piece(2, "answer", 2), piece(3, " is 4", 2), piece(4, "2.", 2)]
    assert written(sent, *again) == " 42."
    assert written(sent, piece(3, " late", 1)) == ""  # the lost worker's last piece: dropped
    assert sent.rest(done("The answer is 42.")) is None


def test_a_newer_attempt_behind_the_stream_when_it_completes_writes_only_the_rest() -> None:
    sent = Sent(TASK)
    written(sent, piece(1, "The answer"))
    assert written(sent, piece(1, "The", 2)) == ""
    rest = sent.rest(done("The answer is 42"))
    assert rest is not None and rest.response == " is 42"


def test_a_first_attempt_that_wrote_nothing_leaves_the_next_one_to_stream() -> None:
    sent = Sent(TASK)
    sent.add(piece(0, attempt=None))
    assert written(sent, piece(1, "4", 2), piece(2, "2", 2)) == "42"


def test_a_newer_attempt_that_says_something_else_ends_the_stream_naming_the_task() -> None:
    sent = Sent(TASK)
    written(sent, piece(1, "The answer is 4"))
    assert written(sent, piece(1, "The", 2)) == ""
    with pytest.raises(ApiError) as raised:
        sent.add(piece(2, " result", 2))
    assert raised.value.code == "stream_diverged"
    assert f"task {TASK} was run again" in raised.value.message
    assert f"GET /task/{TASK}" in raised.value.message


def test_a_final_answer_that_does_not_continue_the_stream_is_an_error_not_a_rest() -> None:
    for final in ("The answer is 7", "The", ""):
        sent = Sent(TASK)
        written(sent, piece(1, "The answer is 4"))
        with pytest.raises(ApiError, match="does not continue what this stream already sent"):
            sent.rest(done(final))


def test_thinking_and_tool_calls_are_merged_field_by_field() -> None:
    weather = ToolCall(name="get_weather", arguments={"city": "Paris"}, id="call_a")
    sent = Sent(TASK)
    sent.add(piece(1, thinking="Let me"))
    sent.add(piece(2, calls=[weather]))
    # Attempt 2's call has another id (the server's): the same call all the same.
    again = ToolCall(name="get_weather", arguments={"city": "Paris"}, id="call_b")
    assert sent.add(piece(1, thinking="Let", attempt=2)) is None
    fresh = sent.add(piece(2, thinking=" me think", attempt=2))
    assert fresh is not None and (fresh.thinking, fresh.tool_calls) == (" think", None)
    assert sent.add(piece(3, calls=[again], attempt=2)) is None  # caught up: nothing new
    time = ToolCall(name="get_time", arguments={}, index=1)
    rest = sent.rest(done("", thinking="Let me think", calls=[again, time]))
    assert rest is not None and rest.tool_calls == [time]


def test_a_tool_call_the_stream_wrote_and_the_answer_lacks_is_an_error() -> None:
    sent = Sent(TASK)
    sent.add(piece(1, calls=[ToolCall(name="get_weather", arguments={"city": "Paris"})]))
    with pytest.raises(ApiError, match="stream already sent"):
        sent.rest(done("", calls=[ToolCall(name="get_time", arguments={})]))


def test_a_failed_reply_has_no_rest() -> None:
    sent = Sent(TASK)
    written(sent, piece(1, "x"))
    failed = RouteReply(task_id=TASK, status="failed", queue="q", worker="w", error="e")
    assert sent.rest(failed) is None

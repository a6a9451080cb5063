"""Anthropic's Messages API mapped to route requests and written back, as Ollama's own layer
does it: the pure parts of the gateway's ``/v1/messages``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.measures import Tokens
from schemas.route import RouteReply, StreamChunk, ToolCall
from services.gateway.anthropic_answers import AnthropicShape
from services.gateway.anthropic_api import anthropic_count_tokens, anthropic_messages
from services.gateway.common import ApiError

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


def ask(**body: Any) -> Any:
    fields = {"model": "m", "max_tokens": 50, **body}
    return anthropic_messages(msgspec.json.encode(fields), timeout_s=None).route


def refused(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as error:
        ask(**body)
    return error.value


def test_a_users_tool_results_come_before_the_rest_of_its_turn() -> None:
    route = ask(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"c": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and now?"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                ],
            },
        ],
    )

    turns = [(m.role, m.content, m.tool_name, m.tool_call_id) for m in route.messages]
    assert turns == [
        ("system", "Be brief.", None, None),
        ("user", "weather?", None, None),
        ("assistant", "", None, None),
        ("tool", "sunny", "get_weather", "t1"),
        ("user", "and now?", None, None),
    ]
    call = route.messages[2].tool_calls[0]
    assert (call.name, call.arguments, call.id) == ("get_weather", {"c": 1}, "t1")


@pytest.mark.parametrize(
    ("choice", "tools", "option"),
    [
        ({"type": "auto"}, True, None),
        ({"type": "none"}, False, None),
        ({"type": "any"}, True, "required"),
        (
            {"type": "tool", "name": "get_weather"},
            True,
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_tool_choice_travels_as_the_openai_apis_does(
    choice: dict[str, Any], tools: bool, option: Any
) -> None:
    route = ask(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice)

    assert (route.tools is not None) == tools
    assert route.options.get("tool_choice") == option


@pytest.mark.parametrize(
    ("thinking", "effort", "think"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, None, True),
        ({"type": "adaptive"}, None, True),
        ({"type": "disabled"}, "high", False),
        (None, "xhigh", "high"),
        (None, None, None),
    ],
)
def test_thinking_and_effort_are_ollamas_think(
    thinking: dict[str, Any] | None, effort: str | None, think: bool | str | None
) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if thinking is not None:
        body["thinking"] = thinking
    if effort is not None:
        body["output_config"] = {"effort": effort}

    assert ask(**body).think == think


def test_what_the_fleet_cannot_honour_is_refused_by_name() -> None:
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (refused(messages=hi, max_tokens=None), "max_tokens"),
        (refused(messages=[{"role": "tool", "content": "x"}]), "'tool'"),
        (refused(messages=hi, tools=[{"type": "bash_20250124", "name": "bash"}]), "bash_20250124"),
        (refused(messages=hi, tools=[WEATHER], tool_choice={"type": "tool", "name": "x"}), "'x'"),
        (refused(messages=hi, mcp_servers=[{"url": "u"}]), "mcp_servers"),
        (refused(messages=[{"role": "user", "content": [{"type": "document"}]}]), "document"),
        (
            refused(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/tiff",
                                    "data": "",
                                },
                            }
                        ],
                    }
                ]
            ),
            "image/tiff",
        ),
    ]
    for error, needle in cases:
        assert error.status == 400 and needle in error.message, error.message


def test_count_tokens_is_a_quarter_of_the_characters() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
    assert anthropic_count_tokens(msgspec.json.encode(body)) == {"input_tokens": 101}


def events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The Server-Sent Events of ``data``, as (name, payload)."""
    found = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            found.append((name.removeprefix("event: "), msgspec.json.decode(payload[6:])))
    return found


def test_a_stream_opens_and_closes_each_block_in_order_with_its_index() -> None:
    shape = AnthropicShape(model="m")
    call = ToolCall(name="get_weather", arguments={"city": "Paris"})
    written = b"".join(
        piece
        for piece in (
            shape.piece(StreamChunk(task_id="t", seq=0)),
            shape.piece(StreamChunk(task_id="t", seq=1, thinking="hmm")),
            shape.piece(StreamChunk(task_id="t", seq=2, response="It is")),
            shape.piece(StreamChunk(task_id="t", seq=3, response=" sunny.")),
            shape.piece(StreamChunk(task_id="t", seq=4, tool_calls=[call])),
        )
        if piece is not None
    )
    reply = RouteReply(
        task_id="t",
        status="done",
        queue="q",
        worker="w",
        response="It is sunny.",
        thinking="hmm",
        tool_calls=[call],
        tokens=Tokens(prompt=12, eval=5),
        done_reason="stop",
    )
    written += shape.end(reply)

    said = [(name, payload.get("index")) for name, payload in events(written)]
    assert said == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    delta = events(written)[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 12, "output_tokens": 5}
    tool_json = events(written)[9][1]["delta"]
    assert tool_json == {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}
    assert events(written)[0][1]["message"]["id"] == "msg_t"


def test_a_whole_answer_at_the_token_limit_stops_for_max_tokens() -> None:
    reply = RouteReply(
        task_id="t", status="done", queue="q", worker="w", response="long", done_reason="length"
    )
    body = msgspec.json.decode(AnthropicShape(model="m").whole(reply))

    assert body["stop_reason"] == "max_tokens"
    assert body["content"] == [{"type": "text", "text": "long"}]
    assert body["usage"] == {"input_tokens": 0, "output_tokens": 0}

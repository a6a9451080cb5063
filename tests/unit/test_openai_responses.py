"""OpenAI's Responses API mapped to route requests and written back, stateless, as Ollama's
own layer does it: the pure parts of the gateway's ``/v1/responses``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.measures import Tokens
from schemas.route import RouteReply, StreamChunk, ToolCall
from services.gateway.common import ApiError
from services.gateway.openai_responses_answers import ResponsesShape
from services.gateway.openai_responses_api import openai_responses


def ask(**body: Any) -> Any:
    return openai_responses(msgspec.json.encode({"model": "m", **body}), timeout_s=None)


def test_items_become_turns_calls_joining_one_assistant_turn() -> None:
    route = ask(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "a", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c2", "output": "B"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "A"}],
            },
        ],
        reasoning={"effort": "minimal"},
        max_output_tokens=9,
        tool_choice="required",
    ).route

    turns = [(m.role, m.content, m.tool_name, m.tool_call_id) for m in route.messages]
    assert turns == [
        ("system", "Be brief.", None, None),
        ("system", "Use tools.", None, None),
        ("user", "weather?", None, None),
        ("assistant", "", None, None),
        ("tool", "B", "b", "c2"),
        ("tool", "A", "a", "c1"),
    ]
    calls = [(c.name, c.arguments, c.id, c.index) for c in route.messages[3].tool_calls]
    assert calls == [("a", {"x": 1}, "c1", 0), ("b", "not json", "c2", 1)]
    assert route.think == "low"
    assert route.options == {"num_predict": 9, "tool_choice": "required"}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"type": "computer_call_output"}]}, "computer_call_output"),
        ({"tools": [{"type": "file_search"}]}, "file_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ],
)
def test_what_the_fleet_cannot_do_is_refused_by_name(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError) as refused:
        ask(**{"input": "hi", **fields})
    assert refused.value.status == 400 and needle in refused.value.message


def test_store_false_is_what_the_gateway_does_anyway() -> None:
    assert ask(input="hi", store=False).route.prompt == "hi"


def test_a_namespaces_members_are_function_tools_named_under_it() -> None:
    member = {"type": "function", "name": "close", "parameters": {"type": "object"}}
    route = ask(
        input="hi",
        tools=[{"type": "namespace", "name": "agents", "tools": [member]}, {**member, "name": "x"}],
    ).route

    assert [tool["function"]["name"] for tool in route.tools] == ["agents.close", "x"]


def events(data: bytes) -> list[dict[str, Any]]:
    found = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            decoded: dict[str, Any] = msgspec.json.decode(payload.removeprefix("data: "))
            assert decoded["type"] == name.removeprefix("event: ")
            found.append(decoded)
    return found


def test_a_stream_writes_each_item_whole_in_order_numbering_every_event() -> None:
    shape = ResponsesShape(model="m", echo={"instructions": "Be brief."})
    call = ToolCall(name="get_weather", arguments={"city": "Paris"})
    chunks = [
        StreamChunk(task_id="t", seq=1, thinking="hm"),
        StreamChunk(task_id="t", seq=2, response="Let me "),
        StreamChunk(task_id="t", seq=3, response="look."),
        StreamChunk(task_id="t", seq=4, tool_calls=[call]),
    ]
    written = b"".join(piece for piece in map(shape.piece, chunks) if piece is not None)
    reply = RouteReply(
        task_id="t",
        status="done",
        queue="q",
        worker="w",
        response="Let me look.",
        thinking="hm",
        tool_calls=[call],
        tokens=Tokens(prompt=3, eval=4),
    )
    said = events(written + shape.end(reply))

    assert [e["sequence_number"] for e in said] == list(range(len(said)))
    assert [(e["type"], e.get("output_index")) for e in said] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.reasoning_summary_text.delta", 0),
        ("response.reasoning_summary_text.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    done = said[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message", "function_call"]
    assert done["output"][1]["content"][0]["text"] == "Let me look."
    assert done["output"][2]["arguments"] == '{"city":"Paris"}'
    assert done["usage"]["total_tokens"] == 7 and done["instructions"] == "Be brief."


def test_an_answer_cut_at_the_token_limit_is_incomplete() -> None:
    reply = RouteReply(
        task_id="t", status="done", queue="q", worker="w", response="lo", done_reason="length"
    )
    body = msgspec.json.decode(ResponsesShape(model="m").whole(reply))

    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "lo"

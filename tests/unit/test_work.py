"""`Work`: what a client asked for travels whole, from the route request to the ``submitted``
event, to every attempt's task message; and the flat shapes from before it are still read."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import TaskRouted, TaskSubmitted, any_event_decoder, task_event_decoder
from schemas.route import ChatMessage, RouteRequest, ToolCall
from schemas.tasks import TaskMessage, task_decoder
from schemas.work import ModelChange, Work
from services.fleet.dispatch import routed_event, task_message
from services.fleet.policy import Decision
from services.router.decide import Plan, submission
from services.router.records import submitted_event

PNG = "iVBORw0KGgo="
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ROUTING = {"model", "worker", "wait", "timeout_s", "task_id", "client"}

# Everything a client may ask the backend for, none of it at its default (not a request that
# makes sense: the schema does not judge that, the router does).
EVERYTHING = Work(
    prompt="User: weather?",
    task_type="embedding",
    domain="code",
    options={"temperature": 0.2, "stop": ["\n"]},
    stream=True,
    messages=[
        ChatMessage(role="user", content="weather?", images=[PNG]),
        ChatMessage(role="assistant", tool_calls=[ToolCall(name="get_weather", id="c1")]),
        ChatMessage(role="tool", content="sunny", tool_name="get_weather", tool_call_id="c1"),
    ],
    think="high",
    images=[PNG],
    tools=TOOLS,
    format={"type": "object"},
    keep_alive="5m",
    suffix="end",
    input=["a"],
    truncate=False,
    dimensions=64,
    normalize=False,
    change=ModelChange(op="create", source="qwen3:8b", system="Answer in Japanese."),
)


def test_no_work_field_is_at_its_default_in_the_sample() -> None:
    """So the round trips below would notice any field left behind."""
    default = Work(prompt="")
    for name in Work.__struct_fields__:
        assert getattr(EVERYTHING, name) != getattr(default, name), name


def test_a_route_request_is_work_plus_routing_and_keeps_its_flat_shape() -> None:
    assert set(RouteRequest.__struct_fields__) == set(Work.__struct_fields__) | ROUTING
    body = msgspec.json.encode({**msgspec.to_builtins(EVERYTHING), "model": "m", "wait": True})
    request = msgspec.json.decode(body, type=RouteRequest)
    assert request.work == EVERYTHING
    assert type(request.work) is Work  # nested without the routing fields
    assert "work" not in msgspec.json.decode(msgspec.json.encode(request))
    with pytest.raises(msgspec.ValidationError, match="unknown field `work`"):
        msgspec.json.decode(b'{"model":"m","prompt":"p","work":{"prompt":"p"}}', type=RouteRequest)


def test_the_router_nests_the_whole_work_in_the_event_and_the_message() -> None:
    request = RouteRequest(model="m", wait=True, **msgspec.structs.asdict(EVERYTHING))
    task = submission(
        "t-1",
        request,
        Plan(Decision("mac", "gpu", "tasks.gpu.mac", "r")),
        asked_model="m",
        now=1.0,
        default_timeout_s=30.0,
        reply_to="_INBOX.1",
    )
    event = task_event_decoder.decode(msgspec.json.encode(submitted_event(task)))
    message = task_decoder.decode(
        msgspec.json.encode(task_message(submitted_event(task), 1, routed_seq=7))
    )
    assert isinstance(event, TaskSubmitted)
    assert event.work == message.work == EVERYTHING
    assert b'"model":"m"' not in msgspec.json.encode(event.work)


# What routers and reapers wrote before `Work`: the work's fields at the top level.
OLD_TASK_MESSAGE = b"""{
  "task_id": "t-1", "attempt": 2, "model": "qwen3:8b", "prompt": "User: weather?",
  "task_type": "inference", "domain": "code", "options": {"temperature": 0.2},
  "timeout_s": 60.0, "stream": true, "submitted_at": 1700000000.5,
  "messages": [{"role": "user", "content": "weather?", "images": ["iVBORw0KGgo="]}],
  "think": true, "images": ["iVBORw0KGgo="],
  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
  "format": "json", "keep_alive": 300, "suffix": "end", "routed_seq": 41
}"""

OLD_SUBMITTED = b"""{
  "type": "submitted", "at": 1700000000, "task_id": "t-1", "model": "qwen3:8b",
  "prompt": "a\\nb", "task_type": "embedding", "domain": "embedding",
  "requested_model": "qwen3", "timeout_s": 60, "input": ["a", "b"], "truncate": false,
  "dimensions": 64, "normalize": false, "keep_alive": "1m", "client": "alice"
}"""


def test_an_old_task_message_is_read_with_its_fields_as_its_work() -> None:
    message = task_decoder.decode(OLD_TASK_MESSAGE)
    assert (message.task_id, message.attempt, message.model) == ("t-1", 2, "qwen3:8b")
    assert (message.timeout_s, message.submitted_at, message.routed_seq) == (60.0, 1.7e9 + 0.5, 41)
    assert message.work == Work(
        prompt="User: weather?",
        domain="code",
        options={"temperature": 0.2},
        stream=True,
        messages=[ChatMessage(role="user", content="weather?", images=[PNG])],
        think=True,
        images=[PNG],
        tools=TOOLS,
        format="json",
        keep_alive=300,
        suffix="end",
    )


def test_an_old_submitted_event_is_read_with_its_fields_as_its_work() -> None:
    for decoder in (task_event_decoder, any_event_decoder):
        event = decoder.decode(OLD_SUBMITTED)
        assert isinstance(event, TaskSubmitted)
        assert (event.task_id, event.model, event.requested_model) == ("t-1", "qwen3:8b", "qwen3")
        assert (event.at, event.timeout_s, event.client) == (1.7e9, 60.0, "alice")
        assert event.work == Work(
            prompt="a\nb",
            task_type="embedding",
            domain="embedding",
            input=["a", "b"],
            truncate=False,
            dimensions=64,
            normalize=False,
            keep_alive="1m",
        )


def test_other_events_and_bad_messages_decode_as_before() -> None:
    routed = b'{"type":"routed","at":1,"task_id":"t","attempt":1,"worker":"w","queue":"q"}'
    assert isinstance(task_event_decoder.decode(routed), TaskRouted)
    for bad in (
        b"not json",
        b'{"type":"routed","at":1,"task_id":"t"}',  # a field missing, not work
        b'{"type":"submitted","at":1,"task_id":"t","model":"m","timeout_s":1}',  # no prompt
        b'{"type":"submitted","at":1,"task_id":"t","model":"m","timeout_s":1,"work":{}}',
    ):
        with pytest.raises(msgspec.DecodeError):
            task_event_decoder.decode(bad)
    with pytest.raises(msgspec.ValidationError, match=r"`prompt` - at `\$\.work`"):
        task_decoder.decode(
            b'{"task_id":"t","attempt":1,"model":"m","timeout_s":1,"submitted_at":0,"work":{}}'
        )
    with pytest.raises(msgspec.ValidationError, match=r"\$\.attempt"):
        task_decoder.decode(b'{"task_id":"t","attempt":"x","model":"m","prompt":"p"}')


def test_a_message_of_todays_shape_round_trips() -> None:
    message = TaskMessage(
        task_id="t", attempt=3, model="m", timeout_s=1.0, submitted_at=0.0, work=EVERYTHING
    )
    assert task_decoder.decode(msgspec.json.encode(message)) == message


def test_a_moved_attempt_goes_out_with_the_whole_work_as_submitted() -> None:
    submitted = TaskSubmitted(
        at=5.0, task_id="t-1", model="m", timeout_s=60.0, client="alice", work=EVERYTHING
    )
    elsewhere = Decision("cpu2", "cpu", "tasks.cpu.cpu2", "least loaded")
    routed = routed_event(submitted, 3, elsewhere, reason="moved", domain="code", at=9.0)
    message = task_message(submitted, 3, routed_seq=41)
    assert (routed.attempt, routed.worker, routed.queue, routed.model) == (
        3,
        "cpu2",
        "tasks.cpu.cpu2",
        "m",
    )
    assert (message.attempt, message.routed_seq, message.submitted_at) == (3, 41, 5.0)
    assert message.work == EVERYTHING

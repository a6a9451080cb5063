"""Bad inputs at every decoder: bodies that are not UTF-8, not JSON, nested too deep, counted
over a cap, compressed wrongly. Each is a coded refusal naming what is wrong, never an
exception of another kind (which an endpoint would answer with ``internal``, the gateway with
a 500)."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.js.errors import ServiceUnavailableError

from schemas.queries import TaskQuery
from schemas.route import (
    MAX_IMAGES,
    MAX_INPUTS,
    MAX_MESSAGES,
    MAX_NESTING,
    MAX_OPTIONS,
    MAX_QUERY_ITEMS,
    MAX_STOP,
    MAX_TIMEOUT_S,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    RouteRequest,
    nested_deeper_than,
    request_problem,
)
from schemas.stats import AliasRequest, BaselinesQuery, StatsQuery
from schemas.subjects import InvalidId
from services.errors import BadRequest, TooLarge, from_code
from services.gateway import openai_api
from services.gateway.common import ApiError, keep_alive_ns, model_named, shown
from services.gateway.conversation import arguments_of
from services.gateway.ollama_api import ollama_chat, ollama_embed, ollama_generate
from services.gateway.openai_api import openai_chat
from services.gateway.responses import GATEWAY_DECODED, SERVER_DECODED, content_coding, decompress
from services.gateway.task_api import task_route
from services.router.requests import admit, parse_cancel_request, parse_route_request
from services.runtime.endpoints import (
    MAX_ERROR_HEADER_CHARS,
    MAX_ERROR_MESSAGE_CHARS,
    _failure,
    decode_body,
    respond_error,
)
from services.stats.requests import decode_request, parse_task_query

IMAGE = "aGVsbG8="


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def body(**fields: Any) -> bytes:
    return msgspec.json.encode({"prompt": "hi", "model": "m", **fields})


# -- decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"task_id": "\xff"}', "task query is not valid UTF-8 (at byte 13: invalid start byte)"),
        (b'{"task_id": "\xed\xa0\x80"}', "not valid UTF-8 (at byte 13"),
        (b'{"task_id": "\\ud800"}', "not valid JSON"),
        # Typed fields refuse the first level of the wrong kind, without going deeper.
        (b"[" * 100_000 + b"]" * 100_000, "Expected `object`, got `array`"),
        (b'{"task_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "Expected `str`, got `array`"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
        (b"[]", "invalid task query: Expected `object`, got `array`"),
        (b'{"task_id": 1}', "Expected `str`, got `int` - at `$.task_id`"),
    ],
)
def test_an_undecodable_body_is_a_bad_request_naming_why(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decode_body(raw, TaskQuery, "task query")
    assert words in refused.value.message


class Loose(msgspec.Struct):
    """A request whose unknown fields are skipped, as the gateway's are."""

    model: str = ""


def test_a_field_skipped_as_unknown_may_still_be_too_deep_to_skip() -> None:
    raw = b'{"model": "m", "x": ' + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"}"
    with pytest.raises(BadRequest, match="chat request nests objects and arrays more than 64"):
        decode_body(raw, Loose, "chat request")
    assert decode_body(b'{"x": ' + msgspec.json.encode(nested(100)) + b"}", Loose, "").model == ""


def test_nesting_is_counted_in_objects_and_arrays_and_structs() -> None:
    assert not nested_deeper_than(nested(MAX_NESTING - 1), MAX_NESTING)  # and the 0 inside
    assert nested_deeper_than(nested(MAX_NESTING + 1), MAX_NESTING)
    request = RouteRequest(prompt="p", model="m", options={"a": nested(MAX_NESTING - 2)})
    assert not nested_deeper_than(request, MAX_NESTING)  # request, options, 62 lists
    deeper = RouteRequest(prompt="p", model="m", options={"a": nested(MAX_NESTING - 1)})
    assert nested_deeper_than(deeper, MAX_NESTING)
    assert not nested_deeper_than("[[[[", 1) and not nested_deeper_than({}, 1)


def test_a_body_nested_deeper_than_the_cap_but_not_the_interpreter_is_refused() -> None:
    # The request, its format, then the lists: 64 levels, then 65.
    ok = body(format={"a": nested(MAX_NESTING - 2)})
    assert parse_route_request(ok, 1000).format is not None
    with pytest.raises(BadRequest, match="route request nests objects and arrays more than 64"):
        parse_route_request(body(format={"a": nested(MAX_NESTING - 1)}), 1000)
    with pytest.raises(BadRequest, match="more than 64 levels"):
        parse_route_request(body(options={"a": nested(900)}), 1000)
    deepest = b'{"prompt": "hi", "model": "m", "options": {"a": ' + b"[" * 50_000
    with pytest.raises(BadRequest, match="more than 64 levels"):
        parse_route_request(deepest + b"]" * 50_000 + b"}}", 1000)


def test_every_router_and_stats_decoder_refuses_invalid_utf8() -> None:
    bad = b'{"prompt": "\xc3", "model": "m"}'
    for parse in (
        lambda: parse_route_request(bad, 1000),
        lambda: parse_cancel_request(b'{"task_id": "\xc3"}'),
        lambda: parse_task_query(b'{"task_id": "\xc3"}'),
        lambda: decode_request(b'{"model": "\xc3"}', StatsQuery, "stats query"),
    ):
        with pytest.raises(BadRequest, match="not valid UTF-8"):
            parse()


# -- the caps ---------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f"}}
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("field", "at_cap", "over_cap", "words"),
    [
        (
            "options",
            {f"k{i}": 0 for i in range(MAX_OPTIONS)},
            {f"k{i}": 0 for i in range(MAX_OPTIONS + 1)},
            "options has 257 keys, over the limit of 256",
        ),
        (
            "messages",
            [USER] * MAX_MESSAGES,
            [USER] * (MAX_MESSAGES + 1),
            "messages has 1025 messages, over the limit of 1024",
        ),
        ("tools", [TOOL] * MAX_TOOLS, [TOOL] * (MAX_TOOLS + 1), "tools has 129 tools, over"),
        ("images", [IMAGE] * MAX_IMAGES, [IMAGE] * (MAX_IMAGES + 1), "has 65 images, over"),
        (
            "options",
            {"stop": ["x"] * MAX_STOP},
            {"stop": ["x"] * (MAX_STOP + 1)},
            "options.stop has 17 stop sequences, over the limit of 16",
        ),
        ("options", {"stop": "x"}, {"stop": [1]}, "options.stop must be a string or a list"),
    ],
)
def test_a_count_over_its_cap_is_refused_naming_the_field_and_the_cap(
    field: str, at_cap: Any, over_cap: Any, words: str
) -> None:
    parse_route_request(body(**{field: at_cap}), 10**6)
    with pytest.raises(BadRequest) as refused:
        parse_route_request(body(**{field: over_cap}), 10**6)
    assert words in refused.value.message


def test_images_count_over_the_whole_request_and_tool_calls_per_message() -> None:
    with_images = {"role": "user", "content": "look", "images": [IMAGE] * (MAX_IMAGES // 2)}
    many = body(images=[IMAGE], messages=[with_images, with_images])
    with pytest.raises(BadRequest, match=r"images \(over the request and its messages\) has 65"):
        parse_route_request(many, 10**6)
    calls = [{"name": "f"}] * (MAX_TOOL_CALLS + 1)
    turn = {"role": "assistant", "tool_calls": calls}
    with pytest.raises(BadRequest, match=r"messages\[1\].tool_calls has 129 calls"):
        parse_route_request(body(messages=[USER, turn]), 10**6)


def test_embedding_inputs_are_capped() -> None:
    inputs = ["a"] * (MAX_INPUTS + 1)
    with pytest.raises(BadRequest, match="input has 2049 texts, over the limit of 2048"):
        parse_route_request(body(prompt="", task_type="embedding", input=inputs), 10**6)
    assert request_problem(RouteRequest(prompt="", model="m", input=["a"] * MAX_INPUTS)) is None


def test_a_timeout_is_at_most_a_day() -> None:
    assert parse_route_request(body(timeout_s=MAX_TIMEOUT_S), 1000).timeout_s == MAX_TIMEOUT_S
    for timeout_s in (MAX_TIMEOUT_S + 1, 1e308):
        with pytest.raises(BadRequest, match=r"up to 86400 \(a day\), got"):
            parse_route_request(body(timeout_s=timeout_s), 1000)


def test_a_request_that_grows_once_decoded_is_too_large_before_anything_is_sent() -> None:
    # "1e9" is 1000000000.0 once decoded and encoded again: four times the bytes.
    raw = b'{"prompt": "hi", "model": "m", "options": {"a": [' + b",".join([b"1e9"] * 30_000)
    raw += b"]}}"
    with pytest.raises(TooLarge, match="over the NATS server's max_payload of 200000"):
        admit(raw, max_prompt_chars=1000, max_payload=200_000, resolve=str)


def test_the_stats_decoders_refuse_nul_long_lists_and_ids_that_name_no_task() -> None:
    with pytest.raises(BadRequest, match="alias must not hold NUL"):
        decode_request(b'{"alias": "a\\u0000", "canonical": "b"}', AliasRequest, "alias")
    models = msgspec.json.encode({"models": ["m"] * (MAX_QUERY_ITEMS + 1)})
    with pytest.raises(BadRequest, match="models has 257 entries, over the limit of 256"):
        decode_request(models, BaselinesQuery, "baselines query")
    with pytest.raises(BadRequest, match="invalid task_id"):
        parse_task_query(b'{"task_id": "a.b"}')
    assert parse_task_query(b'{"task_id": "t-1"}').task_id == "t-1"


# -- the endpoint wrapper ---------------------------------------------------------------------


class _Request:
    """What `respond_error` uses of nats.micro's Request."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bytes]] = []

    async def respond_error(self, code: str, description: str, data: bytes = b"") -> None:
        self.sent.append((code, description, data))


async def test_an_error_reply_is_cut_and_its_header_has_no_control_characters() -> None:
    fake = _Request()
    await respond_error(fake, "bad_request", "line\none\x00" + "x" * 10_000)  # type: ignore[arg-type]
    [(code, header, data)] = fake.sent
    message = msgspec.json.decode(data)["error"]["message"]
    assert code == "bad_request" and len(message) == MAX_ERROR_MESSAGE_CHARS
    assert len(header) == MAX_ERROR_HEADER_CHARS and header.startswith("line one ")


def test_an_id_error_keeps_its_code_and_anything_unexpected_is_internal() -> None:
    assert _failure(InvalidId("task id", "a.b")) == ("invalid_id", str(InvalidId("task id", "a.b")))
    assert _failure(BadRequest("no")) == ("bad_request", "no")
    code, message = _failure(KeyError("x" * 1000))
    assert code == "internal" and message.startswith("KeyError: ") and len(message) == 200


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        ServiceUnavailableError(),
    ],
)
def test_the_bus_failing_a_handler_is_unavailable_so_the_client_asks_again(
    exc: Exception,
) -> None:
    code, message = _failure(exc)
    assert code == "unavailable", message
    assert from_code(code, message).retryable
    assert type(exc).__name__ in message and "ask again" in message


# -- the gateway ------------------------------------------------------------------------------


def refusal(parse: Any, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse(raw, timeout_s=None)
    return refused.value


@pytest.mark.parametrize(
    ("parse", "free"),
    [
        (ollama_chat, "options"),
        (ollama_generate, "format"),
        (ollama_embed, "input"),
        (openai_chat, "tool_choice"),
    ],
)
def test_the_gateway_refuses_undecodable_bodies_with_a_400(parse: Any, free: str) -> None:
    """``free`` is a field of any JSON the API takes (msgspec decodes it whole)."""
    deep = msgspec.json.encode({free: {"a": nested(100)}})
    for raw, words in (
        (b'{"model": "\xff"}', "not valid UTF-8"),
        (b'{"model": "m", "options": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}", "64 levels"),
        (b'{"model": "m", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "64 levels"),
        (deep, "64 levels"),
        (b'["model"]', "Expected `object`"),
        (b'{"model": 3}', "Expected `str`"),
    ):
        error = refusal(parse, raw)
        assert (error.status, error.code) == (400, "bad_request") and words in error.message


def test_the_gateway_refuses_counts_over_their_caps_before_routing() -> None:
    options = {f"k{i}": 0 for i in range(100_000)}
    chat = {"model": "m", "messages": [USER], "options": options}
    error = refusal(ollama_chat, msgspec.json.encode(chat))
    assert error.status == 400 and "options has 100000 keys, over the limit of 256" in error.message
    inputs = {"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}
    assert "input has 2049 texts" in refusal(ollama_embed, msgspec.json.encode(inputs)).message
    stop = {"model": "m", "messages": [USER], "stop": ["x"] * (MAX_STOP + 1)}
    assert "options.stop has 17" in refusal(openai_chat, msgspec.json.encode(stop)).message
    with pytest.raises(ApiError, match="options has 257 keys"):
        task_route(body(options={f"k{i}": 0 for i in range(MAX_OPTIONS + 1)}))


def test_a_conversation_over_the_cap_is_refused_before_it_is_worked_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tool results each looking up their call: the count is checked before any message is.
    call = {"id": "c", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "assistant", "tool_calls": [call] * 100}] * 2000
    turns += [{"role": "tool", "tool_call_id": "c", "content": "1"}] * 2000

    def worked_through(*args: object) -> None:
        raise AssertionError("a message was converted before the count was checked")

    monkeypatch.setattr(openai_api, "_chat_message", worked_through)
    error = refusal(openai_chat, msgspec.json.encode({"model": "m", "messages": turns}))
    assert "messages has 4000 messages, over the limit of 1024" in error.message


def test_a_tool_result_takes_the_name_of_the_last_call_with_its_id() -> None:
    def turn(*names: str) -> dict[str, Any]:
        calls = [{"id": "c", "function": {"name": n, "arguments": "{}"}} for n in names]
        return {"role": "assistant", "tool_calls": calls}

    result = {"role": "tool", "tool_call_id": "c", "content": "1"}
    messages = [USER, turn("old"), result, turn("first", "second"), result]
    ask = openai_chat(msgspec.json.encode({"model": "m", "messages": messages}), timeout_s=None)
    assert ask.route.messages is not None
    assert [m.tool_name for m in ask.route.messages if m.role == "tool"] == ["old", "first"]


def test_deep_tool_arguments_stay_text_or_are_refused_as_routed() -> None:
    assert arguments_of("[" * 5000 + "]" * 5000) == "[" * 5000 + "]" * 5000
    deep = msgspec.json.encode({"a": nested(80)}).decode()
    call = {"id": "c", "function": {"name": "f", "arguments": deep}}
    messages = [USER, {"role": "assistant", "tool_calls": [call]}]
    error = refusal(openai_chat, msgspec.json.encode({"model": "m", "messages": messages}))
    assert "the request as routed nests objects and arrays more than 64" in error.message


def test_what_the_gateway_quotes_of_a_body_is_short() -> None:
    assert model_named(b"[" * 100_000) == "" and model_named(b'{"model": "\xff"}') == ""
    assert len(shown("x" * 10_000)) == 80 and shown(nested(5000)).startswith("<a list nested")
    assert keep_alive_ns(1e308) == keep_alive_ns(float("inf")) == keep_alive_ns(-1) == 2**63 - 1
    assert keep_alive_ns(10**300) == 2**63 - 1 and keep_alive_ns(300) == 300 * 10**9
    for unfit in (10**400, float("nan")):
        with pytest.raises(ApiError, match="invalid keep_alive"):
            keep_alive_ns(unfit)
    with pytest.raises(ApiError) as refused:
        keep_alive_ns(["x"] * 100_000)
    assert len(refused.value.message) < 200


# -- content encodings ------------------------------------------------------------------------

JSON_BODY = b'{"model": "m"}'


def test_a_content_coding_is_one_the_server_or_the_gateway_inflates() -> None:
    assert content_coding("", SERVER_DECODED) is None
    assert content_coding(" Identity ", GATEWAY_DECODED) is None
    assert content_coding("GZIP", SERVER_DECODED) == "gzip"
    assert content_coding("br", SERVER_DECODED) == "br"  # aiohttp inflated (or refused) it
    for header, decodable in (("br", GATEWAY_DECODED), ("gzip, gzip", SERVER_DECODED)):
        with pytest.raises(ApiError) as refused:
            content_coding(header, decodable)
        assert (refused.value.status, refused.value.code) == (415, "unsupported")
        assert "deflate, gzip" in refused.value.message


def test_decompress_inflates_gzip_and_both_deflates() -> None:
    raw = zlib.compressobj(wbits=-15)
    assert decompress(gzip.compress(JSON_BODY), "x-gzip", 100) == JSON_BODY
    assert decompress(zlib.compress(JSON_BODY), "deflate", 100) == JSON_BODY
    assert decompress(raw.compress(JSON_BODY) + raw.flush(), "deflate", 100) == JSON_BODY


@pytest.mark.parametrize(
    ("data", "status", "words"),
    [
        (JSON_BODY, 400, "not gzip data, as its Content-Encoding header says"),
        (gzip.compress(JSON_BODY, mtime=0)[:-8], 400, "cut short"),
        (gzip.compress(JSON_BODY, mtime=0) + b"more", 400, "more after its end"),
        (b"", 400, "cut short"),
        (gzip.compress(b" " * 10_000_000), 413, "over the gateway's limit of 100 bytes"),
    ],
)
def test_decompress_refuses_what_is_not_what_its_header_says(
    data: bytes, status: int, words: str
) -> None:
    with pytest.raises(ApiError) as refused:
        decompress(data, "gzip", 100)
    assert refused.value.status == status and words in refused.value.message

from __future__ import annotations

import pytest

from services.errors import BadRequest, PromptTooLarge
from services.router.requests import parse_route_request
from services.runtime.request import new_task_id


def test_a_minimal_request_gets_defaults() -> None:
    request = parse_route_request(b'{"prompt": "hi", "model": "m"}', 100)
    assert (request.task_type, request.wait, request.stream, request.worker) == (
        "inference",
        False,
        False,
        None,
    )


@pytest.mark.parametrize(
    ("body", "error", "words"),
    [
        (b"", BadRequest, "not valid JSON"),
        (b"[1, 2]", BadRequest, "Expected `object`"),
        (b'{"model": "m"}', BadRequest, "missing required field `prompt`"),
        (b'{"prompt": "hi", "model": 3}', BadRequest, "$.model"),
        (b'{"prompt": "hi", "model": "m", "timeout_s": 0}', BadRequest, "timeout_s"),
        (b'{"prompt": "hi", "model": " "}', BadRequest, "model must not be empty"),
        (b'{"prompt": "hi", "model": "m", "domain": "a b"}', BadRequest, "invalid domain"),
        (b'{"prompt": "hello", "model": "m"}', PromptTooLarge, "5 characters of text, over"),
        (
            b'{"prompt": "h", "model": "m", "messages": [{"role": "user", "content": "hello"}]}',
            PromptTooLarge,
            "5 characters of text, over the limit of 4",
        ),
        (b'{"prompt": "", "model": "m", "task_type": "embedding"}', BadRequest, "needs input"),
        (
            b'{"prompt": "", "model": "m", "task_type": "embedding", "input": []}',
            BadRequest,
            "input",
        ),
        (b'{"prompt": "hi", "model": "m", "input": ["a"]}', BadRequest, "embedding requests"),
        (
            b'{"prompt": "", "model": "m", "task_type": "embedding", "input": ["abc", "de"]}',
            PromptTooLarge,
            "6 characters",  # the inputs joined, as statistics show them
        ),
        (b'{"prompt": "hi", "model": "m", "images": ["%%%"]}', BadRequest, "images[0] is not"),
        (
            b'{"prompt": "hi", "model": "m", "messages": [{"role": "user", "images": ["x"]}]}',
            BadRequest,
            "messages[0].images[0] is not base64 data",
        ),
        (b'{"prompt": "hi", "model": "m", "tools": [{"type": "x"}]}', BadRequest, "tools[0]"),
        (
            b'{"prompt": "hi", "model": "m", "tools": [{"function": {"name": ""}}]}',
            BadRequest,
            "function.name",
        ),
        (b'{"prompt": "hi", "model": "m", "format": "yaml"}', BadRequest, "format"),
        (b'{"prompt": "hi", "model": "m", "dimensions": 0}', BadRequest, "dimensions"),
    ],
)
def test_refusals_say_what_is_wrong(body: bytes, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("$", r"\$").replace("[", r"\[")):
        parse_route_request(body, 4 if b"hello" in body or b"abc" in body else 100)


def test_an_embedding_request_keeps_its_inputs_and_shows_them_as_its_prompt() -> None:
    request = parse_route_request(
        b'{"prompt": "", "model": "m", "task_type": "embedding", "input": ["a", "b"]}', 100
    )
    assert (request.input, request.prompt, request.normalize) == (["a", "b"], "a\nb", True)


def test_tools_images_and_format_are_carried_as_given() -> None:
    body = (
        b'{"prompt": "hi", "model": "m", "images": ["aGk="], "format": {"type": "object"},'
        b' "keep_alive": "5m", "options": {"num_ctx": 4096, "mirostat": 2},'
        b' "tools": [{"type": "function", "function": {"name": "get_weather"}}]}'
    )
    request = parse_route_request(body, 100)
    assert request.images == ["aGk="]
    assert request.format == {"type": "object"}
    assert request.keep_alive == "5m"
    assert request.options == {"num_ctx": 4096, "mirostat": 2}
    assert request.tools == [{"type": "function", "function": {"name": "get_weather"}}]


def test_task_ids_are_unique_and_subject_safe() -> None:
    ids = {new_task_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all("." not in i and " " not in i for i in ids)

from __future__ import annotations

import pytest

from services.router.service import new_task_id, parse_route_request
from services.runtime.errors import BadRequest, PromptTooLarge


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
        (b'{"prompt": "hello", "model": "m"}', PromptTooLarge, "5 characters, over the limit of 4"),
    ],
)
def test_refusals_say_what_is_wrong(body: bytes, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("$", r"\$").replace("`", "`")):
        parse_route_request(body, 4 if b"hello" in body else 100)


def test_task_ids_are_unique_and_subject_safe() -> None:
    ids = {new_task_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all("." not in i and " " not in i for i in ids)

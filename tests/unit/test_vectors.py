"""Embedding vectors on the wire: float32 bytes, base64 in JSON."""

from __future__ import annotations

import base64
import struct

import msgspec
import pytest

from schemas.route import RouteReply
from schemas.vectors import dimensions, pack, to_floats, unpack


def test_a_vector_survives_the_wire_at_float32_precision() -> None:
    vector = [0.010071029, -0.5, 1e-8, 0.1, 0.0, -3.4028234663852886e38]
    reply = RouteReply(task_id="t", status="done", queue="q", worker="w", embeddings=[pack(vector)])
    back = msgspec.json.decode(msgspec.json.encode(reply), type=RouteReply)
    assert back.embeddings is not None
    assert to_floats(back.embeddings[0]) == [0.010071029, -0.5, 1e-8, 0.1, 0.0, -3.4028235e38]
    assert dimensions(back.embeddings[0]) == 6


def test_the_bytes_are_what_openai_calls_base64_embeddings() -> None:
    """OpenAI's ``encoding_format: "base64"``: little-endian float32, base64-encoded."""
    data = pack([1.0, -2.5])
    assert base64.b64encode(data) == base64.b64encode(struct.pack("<2f", 1.0, -2.5))
    assert unpack(data) == [1.0, -2.5]


def test_a_truncated_vector_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack(b"\x00\x00\x80")

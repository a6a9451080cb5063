"""Embedding vectors on the wire: little-endian float32, one ``bytes`` value per vector.

msgspec writes ``bytes`` as base64 in JSON, so a 768-dimension vector costs about 4 KB instead
of the 15 KB its decimal text would, which keeps a batch inside one NATS message. The bytes are
exactly what OpenAI's ``encoding_format: "base64"`` returns. float32 is what model servers
compute in, so nothing is lost; `to_floats` gives the shortest decimal that reads back as the
same float32 (what Ollama's JSON shows).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

_FLOAT32 = struct.Struct("<f")


def pack(vector: Sequence[float]) -> bytes:
    """One vector as little-endian float32 bytes."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def unpack(data: bytes) -> list[float]:
    """The float32 values of `pack`'s bytes, as Python floats (exact float32 values)."""
    if len(data) % 4:
        raise ValueError(f"a packed vector has a multiple of 4 bytes, not {len(data)}")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _shortest(value: float) -> float:
    exact = _FLOAT32.pack(value)
    for digits in (6, 7, 8):
        short = float(f"{value:.{digits}g}")
        if _FLOAT32.pack(short) == exact:
            return short
    return float(f"{value:.9g}")  # nine digits always read back as the same float32


def to_floats(data: bytes) -> list[float]:
    """The vector as the shortest decimals that read back as the same float32 values (about
    1 ms per 768 values)."""
    return [_shortest(value) for value in unpack(data)]


def dimensions(data: bytes) -> int:
    return len(data) // 4

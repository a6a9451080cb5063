"""An instant Ollama stand-in for the benchmarks: the API's shapes, as little work as possible.

    .venv/bin/python -m benchmarks.standin --port P [--pieces 2]

``devtools/fakes/ollama.py`` is faithful (every endpoint, knobs, a thread per connection, JSON
built per line) and costs about as much CPU per generation as the service under test, which
would hide the figure being measured; this one answers only what a worker calls on its hot
path (``/api/tags``, ``/api/ps`` with every model loaded, streamed ``/api/generate`` and
``/api/chat``) on one asyncio loop, with bytes prepared once. Each answer is ``--pieces``
NDJSON lines of text and the final line with the figures, sent in one write as chunked
transfer encoding, as Ollama streams them.

``total_duration`` is the stand-in's real time on the request (from its last byte read to the
answer's write), in nanoseconds: the backend's own time in the overhead figure.

Standard library only; loopback unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Sequence
from typing import Final

MODELS: Final = ("qwen2.5:0.5b", "gemma3:1b")
_HEAD_END: Final = b"\r\n\r\n"
_MAX_HEAD: Final = 64 * 1024


def _chunked(line: bytes) -> bytes:
    return f"{len(line):X}\r\n".encode() + line + b"\r\n"


def _json_reply(status: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


_TAGS: Final = _json_reply(
    "200 OK",
    json.dumps(
        {"models": [{"name": m, "model": m, "size": 1, "digest": "0" * 64} for m in MODELS]}
    ).encode(),
)
# Every model loaded, as Ollama lists them once they have run: a worker reads this after a
# task of a model it did not know was loaded (answered 404, it would read it after every one).
_PS: Final = _json_reply(
    "200 OK",
    json.dumps(
        {
            "models": [
                {
                    "name": m,
                    "model": m,
                    "size": 400_000_000,
                    "digest": "0" * 64,
                    "expires_at": "2099-01-01T00:00:00Z",
                    "size_vram": 0,
                }
                for m in MODELS
            ]
        }
    ).encode(),
)
_NOT_FOUND: Final = _json_reply("404 Not Found", b'{"error":"not found"}')
_STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class Answers:
    """The bytes of one streamed answer, prepared once; only the final line is made per call."""

    def __init__(self, pieces: int) -> None:
        words = [f"word{i} " for i in range(pieces)] or [""]
        self.eval_count = len(words)
        self.generate = b"".join(
            _chunked(
                json.dumps({"model": MODELS[0], "response": w, "done": False}).encode() + b"\n"
            )
            for w in words
        )
        self.chat = b"".join(
            _chunked(
                json.dumps(
                    {
                        "model": MODELS[0],
                        "message": {"role": "assistant", "content": w},
                        "done": False,
                    }
                ).encode()
                + b"\n"
            )
            for w in words
        )

    def final(self, chat: bool, took_ns: int) -> bytes:
        text = '"message":{"role":"assistant","content":""}' if chat else '"response":""'
        line = (
            f'{{"model":"{MODELS[0]}",{text},"done":true,"done_reason":"stop",'
            f'"total_duration":{took_ns},"load_duration":0,"prompt_eval_count":8,'
            f'"prompt_eval_duration":0,"eval_count":{self.eval_count},"eval_duration":0}}\n'
        ).encode()
        return _chunked(line) + b"0\r\n\r\n"


class _Http(asyncio.Protocol):
    """HTTP/1.1 with keep-alive; requests on one connection are answered in order."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(_HEAD_END)
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    self._close()
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self._answer(head.split(" ", 2))

    def _answer(self, request_line: list[str]) -> None:
        started = time.perf_counter_ns()
        assert self.transport is not None
        method, path = [*request_line, "", ""][:2]
        if method == "GET" and path == "/api/tags":
            self.transport.write(_TAGS)
        elif method == "GET" and path == "/api/ps":
            self.transport.write(_PS)
        elif method == "POST" and path in ("/api/generate", "/api/chat"):
            chat = path == "/api/chat"
            body = self.answers.chat if chat else self.answers.generate
            # The figures' line last, timed as late as it can be.
            took = time.perf_counter_ns() - started
            self.transport.write(_STREAM_HEAD + body + self.answers.final(chat, took))
        elif method == "GET" and path == "/":
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 17\r\n\r\n"
                b"Ollama is running"
            )
        else:
            self.transport.write(_NOT_FOUND)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(host: str, port: int, pieces: int) -> None:
    """Serve until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    answers = Answers(pieces)
    server = await loop.create_server(lambda: _Http(answers), host, port)
    bound = server.sockets[0].getsockname()
    print(f"instant ollama stand-in listening on http://{bound[0]}:{bound[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.standin", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pieces", type=int, default=2, help="text lines before the final one")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.pieces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

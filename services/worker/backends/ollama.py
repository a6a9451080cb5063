"""Ollama over HTTP: ``/api/tags`` for the models, streamed ``/api/generate`` for the work
(``/api/chat`` for a task that carries a conversation).

Streaming is used even though the answer is returned whole: each chunk is a sign of life
(the worker turns it into ``in_progress()``), and the first chunk gives time to first token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from schemas.events import Durations, Tokens
from schemas.route import ChatMessage
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable
from services.worker.backends import Generation, OnChunk, Progress, drain
from services.worker.backends.http1 import Http1ConnectTimeout, Http1Error, LinePool, usable_for

NS_PER_MS = 1_000_000


class _Tag(msgspec.Struct):
    name: str


class _Tags(msgspec.Struct):
    models: list[_Tag] = []


class _Message(msgspec.Struct):
    content: str = ""
    thinking: str | None = None


class _Chunk(msgspec.Struct):
    """One NDJSON line of ``/api/generate`` (or ``/api/chat``, whose text is in ``message``);
    the last one (``done``) carries the figures."""

    response: str = ""
    thinking: str | None = None
    message: _Message | None = None
    done: bool = False
    error: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


_tags_decoder = msgspec.json.Decoder(_Tags)
_chunk_decoder = msgspec.json.Decoder(_Chunk)
_body_encoder = msgspec.json.Encoder()


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


class OllamaBackend:
    """A client for one Ollama server."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self._base_url = base_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._client = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=httpx.Timeout(30.0, connect=connect_timeout_s),
        )
        # Generations go over the small HTTP/1.1 client where it applies (see http1.py).
        self._lines = (
            LinePool(self._base_url, connect_timeout_s=connect_timeout_s)
            if usable_for(self._base_url)
            else None
        )

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._lines is not None:
            await self._lines.aclose()

    async def list_models(self) -> list[str]:
        try:
            reply = await self._client.get("/api/tags")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        if reply.status_code != 200:
            raise BackendError(
                f"Ollama at {self._base_url} answered /api/tags with HTTP {reply.status_code}"
            )
        try:
            return [m.name for m in _tags_decoder.decode(reply.content).models]
        except msgspec.DecodeError as exc:
            raise BackendError(
                f"Ollama at {self._base_url}: malformed /api/tags reply: {exc}"
            ) from exc

    async def generate(
        self,
        model: str,
        prompt: str,
        *,
        options: dict[str, Any] | None,
        timeout_s: float,
        progress: Progress | None = None,
        on_chunk: OnChunk | None = None,
        messages: list[ChatMessage] | None = None,
        think: bool | str | None = None,
    ) -> Generation:
        body: dict[str, Any] = {"model": model, "stream": True}
        if messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in messages]
            path = "/api/chat"
        else:
            body["prompt"] = prompt
            path = "/api/generate"
        if options:
            body["options"] = options
        if think is not None:
            body["think"] = think
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(path, body, started, progress, on_chunk)
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except (httpx.TimeoutException, Http1ConnectTimeout) as exc:
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {_describe(exc)}") from exc
        except (httpx.HTTPError, Http1Error) as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc

    async def _stream(
        self,
        path: str,
        body: dict[str, Any],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        if self._lines is not None:
            encoded = _body_encoder.encode(body)
            async with self._lines.post(path, encoded, "application/x-ndjson") as fast:
                if fast.status != 200:
                    text = (await fast.read()).decode(errors="replace")
                    raise BackendError(f"Ollama answered HTTP {fast.status}: {_error_text(text)}")
                return await self._read(fast.lines(), started, progress, on_chunk)
        timeout = httpx.Timeout(None, connect=self._connect_timeout_s)
        async with self._client.stream("POST", path, json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                raise BackendError(f"Ollama answered HTTP {reply.status_code}: {_error_text(text)}")
            return await self._read(reply.aiter_lines(), started, progress, on_chunk)

    async def _read(
        self,
        lines: AsyncIterator[str] | AsyncIterator[bytes],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        """Gather the streamed lines into the generation, up to the final (``done``) one."""
        response: list[str] = []
        thinking: list[str] = []
        first_token_ms: float | None = None
        async for line in lines:
            if not line.strip():
                continue
            try:
                chunk = _chunk_decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise BackendError(f"Ollama sent a malformed line: {line[:200]!r}") from exc
            if chunk.error:
                raise BackendError(f"Ollama reported an error: {chunk.error}")
            text, think = chunk.response, chunk.thinking or ""
            if chunk.message is not None:
                text, think = chunk.message.content, chunk.message.thinking or ""
            if (text or think) and first_token_ms is None:
                first_token_ms = (time.perf_counter() - started) * 1000
            if text:
                response.append(text)
            if think:
                thinking.append(think)
            if on_chunk is not None and (text or think):
                await on_chunk(text, think)
            if progress is not None:
                await progress()
            if chunk.done:
                wall_ms = (time.perf_counter() - started) * 1000
                await drain(lines)  # to the body's end: the connection is kept
                return Generation(
                    response="".join(response),
                    thinking="".join(thinking) or None,
                    durations=Durations(
                        total_ms=_ms(chunk.total_duration) or wall_ms,
                        load_ms=_ms(chunk.load_duration),
                        prompt_eval_ms=_ms(chunk.prompt_eval_duration),
                        eval_ms=_ms(chunk.eval_duration),
                    ),
                    tokens=Tokens(prompt=chunk.prompt_eval_count, eval=chunk.eval_count),
                    first_token_ms=first_token_ms,
                )
        raise BackendError("Ollama closed the stream before the final chunk")


def _error_text(text: str) -> str:
    try:
        decoded = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text[:300]
    if isinstance(decoded, dict) and "error" in decoded:
        return str(decoded["error"])
    return text[:300]


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

"""Ollama over HTTP: ``/api/tags`` for the models, streamed ``/api/generate`` for the work.

Streaming is used even though the answer is returned whole: each chunk is a sign of life
(the worker turns it into ``in_progress()``), and the first chunk gives time to first token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import msgspec

from schemas.events import Durations, Tokens
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable
from services.worker.backends import Generation, OnChunk, Progress

NS_PER_MS = 1_000_000


class _Tag(msgspec.Struct):
    name: str


class _Tags(msgspec.Struct):
    models: list[_Tag] = []


class _Chunk(msgspec.Struct):
    """One NDJSON line of ``/api/generate``; the last one (``done``) carries the figures."""

    response: str = ""
    thinking: str | None = None
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

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()

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
    ) -> Generation:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True}
        if options:
            body["options"] = options
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(body, started, progress, on_chunk)
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except httpx.TimeoutException as exc:
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc

    async def _stream(
        self,
        body: dict[str, Any],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        response: list[str] = []
        thinking: list[str] = []
        first_token_ms: float | None = None
        timeout = httpx.Timeout(None, connect=self._connect_timeout_s)
        async with self._client.stream(
            "POST", "/api/generate", json=body, timeout=timeout
        ) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                raise BackendError(f"Ollama answered HTTP {reply.status_code}: {_error_text(text)}")
            async for line in reply.aiter_lines():
                if not line.strip():
                    continue
                try:
                    chunk = _chunk_decoder.decode(line)
                except msgspec.DecodeError as exc:
                    raise BackendError(f"Ollama sent a malformed line: {line[:200]!r}") from exc
                if chunk.error:
                    raise BackendError(f"Ollama reported an error: {chunk.error}")
                if (chunk.response or chunk.thinking) and first_token_ms is None:
                    first_token_ms = (time.perf_counter() - started) * 1000
                if chunk.response:
                    response.append(chunk.response)
                if chunk.thinking:
                    thinking.append(chunk.thinking)
                if on_chunk is not None and (chunk.response or chunk.thinking):
                    await on_chunk(chunk.response, chunk.thinking or "")
                if progress is not None:
                    await progress()
                if chunk.done:
                    wall_ms = (time.perf_counter() - started) * 1000
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

"""OpenAI-compatible servers: llama.cpp's server, vLLM, LM Studio, Ollama's ``/v1``.

``/v1/models`` lists the models; streamed ``/v1/chat/completions`` does the work. Servers
differ in what they report beyond the text: ``usage`` (asked for with
``stream_options.include_usage``) gives token counts, llama.cpp adds ``timings`` with prompt
and generation times, and thinking arrives as ``reasoning_content`` (llama.cpp, vLLM) or
``reasoning`` (Ollama). Whatever is missing stays ``None`` rather than being guessed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import msgspec

from schemas.events import Durations, Tokens
from schemas.route import ChatMessage
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable
from services.worker.backends import Generation, OnChunk, Progress, drain

# Ollama's option names mapped to OpenAI's request fields.
_OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "max_tokens": "max_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model] = []


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Timings(msgspec.Struct):
    """llama.cpp's server reports these with the last chunk."""

    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None


class _ErrorDetail(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    timings: _Timings | None = None
    error: _ErrorDetail | None = None


_models_decoder = msgspec.json.Decoder(_Models)
_chunk_decoder = msgspec.json.Decoder(_Chunk)


class OpenAIBackend:
    """A client for one OpenAI-compatible server; ``base_url`` ends in ``/v1``."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, connect_timeout_s: float = 5.0
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self._base_url,
            headers=headers,
            timeout=httpx.Timeout(30.0, connect=connect_timeout_s),
        )

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()

    async def list_models(self) -> list[str]:
        try:
            reply = await self._client.get("/models")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"{self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        if reply.status_code != 200:
            raise BackendError(f"{self._base_url}/models answered HTTP {reply.status_code}")
        try:
            return [m.id for m in _models_decoder.decode(reply.content).data]
        except msgspec.DecodeError as exc:
            raise BackendError(f"{self._base_url}/models: malformed reply: {exc}") from exc

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
        conversation = (
            [{"role": m.role, "content": m.content} for m in messages]
            if messages
            else [{"role": "user", "content": prompt}]
        )
        body: dict[str, Any] = {
            "model": model,
            "messages": conversation,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for name, value in (options or {}).items():
            if name in _OPTION_FIELDS:
                body[_OPTION_FIELDS[name]] = value
        if isinstance(think, str):
            body["reasoning_effort"] = think  # how OpenAI's API (and Ollama's /v1) say it
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(body, started, progress, on_chunk)
        except TimeoutError as exc:
            raise BackendTimeout(
                f"{self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except httpx.TimeoutException as exc:
            raise BackendTimeout(f"{self._base_url} timed out: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"{self._base_url} cannot be reached: {_describe(exc)}"
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
        usage: _Usage | None = None
        timings: _Timings | None = None
        finished = False
        timeout = httpx.Timeout(None, connect=self._connect_timeout_s)
        async with self._client.stream(
            "POST", "/chat/completions", json=body, timeout=timeout
        ) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                raise BackendError(
                    f"{self._base_url} answered HTTP {reply.status_code}: {text[:300]}"
                )
            lines = reply.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    await drain(lines)  # to the body's end: the connection is kept
                    break
                try:
                    chunk = _chunk_decoder.decode(data)
                except msgspec.DecodeError as exc:
                    raise BackendError(f"malformed stream line: {data[:200]!r}") from exc
                if chunk.error is not None:
                    raise BackendError(f"{self._base_url} reported an error: {chunk.error.message}")
                usage = chunk.usage or usage
                timings = chunk.timings or timings
                for choice in chunk.choices:
                    delta = choice.delta
                    think = delta.reasoning_content or delta.reasoning
                    if (delta.content or think) and first_token_ms is None:
                        first_token_ms = (time.perf_counter() - started) * 1000
                    if delta.content:
                        response.append(delta.content)
                    if think:
                        thinking.append(think)
                    if on_chunk is not None and (delta.content or think):
                        await on_chunk(delta.content or "", think or "")
                if progress is not None:
                    await progress()
        if not finished:
            raise BackendError(f"{self._base_url} closed the stream before [DONE]")
        return Generation(
            response="".join(response),
            thinking="".join(thinking) or None,
            durations=Durations(
                total_ms=(time.perf_counter() - started) * 1000,
                prompt_eval_ms=timings.prompt_ms if timings else None,
                eval_ms=timings.predicted_ms if timings else None,
            ),
            tokens=Tokens(
                prompt=(usage.prompt_tokens if usage else None)
                or (timings.prompt_n if timings else None),
                eval=(usage.completion_tokens if usage else None)
                or (timings.predicted_n if timings else None),
            ),
            first_token_ms=first_token_ms,
        )


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

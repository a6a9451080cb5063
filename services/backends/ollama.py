"""Ollama over HTTP: ``/api/tags`` and ``/api/show`` for the models (``/api/ps``: those
loaded), streamed ``/api/generate`` for the work (``/api/chat`` for a task that carries a
conversation or tools), ``/api/embed`` for vectors, and ``/api/pull``, ``/api/create``,
``/api/copy`` and ``/api/delete`` for a change to its models. The request bodies are built by
`ollama_request` (`ollama_models` for the changes) and the answers read by `ollama_reply`
(all pure); this module is the HTTP client.

Streaming is used even though the answer is returned whole: each chunk is a sign of life
(the worker turns it into ``in_progress()``), and the first chunk gives time to first token.

Every call goes over the backends' one HTTP client (`services.backends.http`). A generation
read to its end gives its connection back to the pool (`drain`); one given up (an error, a
cancel, a timeout) closes it, which is what stops Ollama generating.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import structlog

from schemas.events import Durations
from schemas.models import ModelFacts
from schemas.work import ModelChange, Work
from services.backends import (
    Embedding,
    Generation,
    OnChunk,
    OnModelProgress,
    Progress,
    answer_error,
    drain,
)
from services.backends.http import HttpClient, describe, lines
from services.backends.ollama_models import change_request, progress_line, succeeded
from services.backends.ollama_reply import (
    StreamedAnswer,
    Tag,
    decode_line,
    decode_show,
    decode_tags,
    embedding_of,
    error_text,
    facts_of,
    legacy_vector,
    model_names,
    running_sizes,
)
from services.backends.ollama_request import embed_body, generate_body, legacy_embed_body
from services.errors import (
    BackendError,
    BackendServerError,
    BackendTimeout,
    BackendUnavailable,
)

# A model's ``/api/show`` reads its files, no more; past this the facts wait for a restart.
SHOW_TIMEOUT_S = 30.0
# The model list's read deadline.
TAGS_TIMEOUT_S = 30.0
_JSON = {"Content-Type": "application/json"}
_NDJSON = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}

log = structlog.get_logger("worker")

_body_encoder = msgspec.json.Encoder()


class OllamaBackend:
    """A client for one Ollama server."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self._client = HttpClient(base_url, connect_timeout_s=connect_timeout_s)
        self._base_url = self._client.base_url

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, path: str) -> tuple[int, bytes]:
        timeout = self._client.timeout(TAGS_TIMEOUT_S)
        async with self._client.sent("GET", path, deadlines=timeout) as reply:
            return reply.status, await reply.read()

    async def list_models(self) -> list[str]:
        try:
            status, content = await self._get("/api/tags")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {describe(exc)}"
            ) from exc
        if status != 200:
            raise answer_error(
                status, f"Ollama at {self._base_url} answered /api/tags with HTTP {status}"
            )
        return model_names(content, self._base_url)

    async def resident_models(self) -> dict[str, int]:
        """``/api/ps``: the models loaded now, each with the memory it takes (their runners
        keep them until ``keep_alive`` runs out, or another model needs the memory)."""
        try:
            status, content = await self._get("/api/ps")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {describe(exc)}"
            ) from exc
        if status != 200:
            raise answer_error(
                status, f"Ollama at {self._base_url} answered /api/ps with HTTP {status}"
            )
        return running_sizes(content, self._base_url)

    async def generate(
        self,
        model: str,
        work: Work,
        *,
        timeout_s: float,
        progress: Progress | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Generation:
        """See `Backend.generate`. Tools exist only in ``/api/chat``, so a task with tools
        but no conversation goes there as one user message (with its images); ``suffix``
        exists only in ``/api/generate`` and goes only there."""
        path, body = generate_body(model, work)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(path, body, started, progress, on_chunk)
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {describe(exc)}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {describe(exc)}"
            ) from exc

    async def _stream(
        self,
        path: str,
        body: dict[str, Any],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        encoded = _body_encoder.encode(body)
        async with self._client.sent("POST", path, body=encoded, headers=_NDJSON) as reply:
            if reply.status != 200:
                text = (await reply.read()).decode(errors="replace")
                raise answer_error(
                    reply.status, f"Ollama answered HTTP {reply.status}: {error_text(text)}"
                )
            read = lines(reply)
            generation = await self._read(read, started, progress, on_chunk)
            if not reply.content.at_eof():
                await drain(read)  # to the body's end: the connection is kept
        return generation

    async def _read(
        self,
        lines: AsyncIterator[bytes],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        """Gather the streamed lines into the generation, up to the final (``done``) one.

        Ollama sends each tool call whole, in a chunk of its own; ``on_chunk`` sees them as
        they come, numbered through the whole generation."""
        answer = StreamedAnswer()
        async for line in lines:
            if not line.strip():
                continue
            chunk = decode_line(line)
            text, think, calls = answer.add(chunk)
            if (text or think or calls) and answer.first_token_ms is None:
                answer.first_token_ms = (time.perf_counter() - started) * 1000
            if on_chunk is not None and (text or think or calls):
                await on_chunk(text, think, calls or None)
            if progress is not None:
                await progress()
            if chunk.done:
                return answer.generation(chunk, (time.perf_counter() - started) * 1000)
        raise BackendServerError("Ollama closed the stream before the final chunk")

    async def embed(self, model: str, work: Work, *, timeout_s: float) -> Embedding:
        """``POST /api/embed`` with every input at once (unit-length vectors). ``normalize``
        false uses the older ``POST /api/embeddings``, whose vectors are the model's own: one
        call per input, no figures beyond the wall time, and no ``truncate`` or
        ``dimensions`` (it has neither)."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                if not work.normalize:
                    return await self._embed_legacy(model, work, started)
                return embedding_of(
                    await self._post("/api/embed", embed_body(model, work)),
                    len(work.input or ()),
                    self._base_url,
                    (time.perf_counter() - started) * 1000,
                )
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {describe(exc)}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not embed with {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {describe(exc)}"
            ) from exc
        except msgspec.DecodeError as exc:
            raise BackendError(f"Ollama at {self._base_url}: malformed embed reply: {exc}") from exc

    async def _embed_legacy(self, model: str, work: Work, started: float) -> Embedding:
        vectors: list[bytes] = []
        for text in work.input or ():
            body = legacy_embed_body(model, text, work)
            vectors.append(legacy_vector(await self._post("/api/embeddings", body)))
        return Embedding(
            vectors=vectors, durations=Durations(total_ms=(time.perf_counter() - started) * 1000)
        )

    async def _post(
        self, path: str, body: dict[str, Any], *, read_timeout_s: float | None = None
    ) -> bytes:
        """One JSON POST; by default without a read deadline of its own (the caller's
        applies). An answer other than 200 is a `BackendError` with Ollama's message."""
        async with self._client.sent(
            "POST",
            path,
            body=_body_encoder.encode(body),
            headers=_JSON,
            deadlines=self._client.timeout(read_timeout_s),
        ) as reply:
            content = await reply.read()
            if reply.status != 200:
                text = content.decode(errors="replace")
                raise answer_error(
                    reply.status, f"Ollama answered HTTP {reply.status}: {error_text(text)}"
                )
            return content

    async def change_model(
        self, model: str, change: ModelChange, *, timeout_s: float, on_progress: OnModelProgress
    ) -> None:
        """See `Backend.change_model`: pull and create stream their progress (to Ollama's
        ``success`` line), copy and delete answer an empty 200."""
        request = change_request(model, change)
        what = f"{change.op} {model} on Ollama at {self._base_url}"
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._client.sent(
                    request.method,
                    request.path,
                    body=_body_encoder.encode(request.body),
                    headers=_NDJSON if request.streams else _JSON,
                ) as reply,
            ):
                if reply.status != 200:
                    text = (await reply.read()).decode(errors="replace")
                    raise answer_error(reply.status, f"{what}: {error_text(text)}")
                if not request.streams:
                    return
                async for line in lines(reply):
                    if not line.strip():
                        continue
                    progress = progress_line(line)
                    await on_progress(progress)
                    if succeeded(progress):
                        return
        except TimeoutError as exc:
            raise BackendTimeout(f"{what}: not done within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {describe(exc)}"
            ) from exc
        raise BackendError(f"{what}: the stream ended before Ollama said success")

    async def model_facts(self, served: list[str]) -> dict[str, ModelFacts]:
        """Digest, size, details and date from ``/api/tags`` (one call); capabilities and the
        context length (``model_info["<architecture>.context_length"]``) from one
        ``/api/show`` per model. An Ollama too old to list capabilities leaves them at
        `ModelFacts`'s default; a model whose show fails is left out (and logged), so the
        worker registers the defaults for it rather than failing its start."""
        tags: dict[str, Tag] = {}
        try:
            status, content = await self._get("/api/tags")
            if status == 200:
                tags = decode_tags(content)
            else:
                log.warning("model list refused for model facts", status=status)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning("model list unreadable for model facts", error=describe(exc))
        facts: dict[str, ModelFacts] = {}
        for name in served:
            try:
                show = decode_show(
                    await self._post("/api/show", {"model": name}, read_timeout_s=SHOW_TIMEOUT_S)
                )
            except (BackendError, aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
                message = exc.message if isinstance(exc, BackendError) else describe(exc)
                log.warning("model facts unavailable", model=name, error=message)
                continue
            facts[name] = facts_of(name, tags.get(name), show)
        return facts

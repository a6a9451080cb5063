"""Ollama over HTTP: ``/api/tags`` and ``/api/show`` for the models, streamed
``/api/generate`` for the work (``/api/chat`` for a task that carries a conversation or
tools), ``/api/embed`` for vectors.

Streaming is used even though the answer is returned whole: each chunk is a sign of life
(the worker turns it into ``in_progress()``), and the first chunk gives time to first token.
The project's wire types follow Ollama's, so requests go nearly as they came: every option,
``keep_alive``, ``think``, ``format``, images and tools as given.

Every call goes over one aiohttp session (kept-alive connections, TLS, and a proxy from the
environment as httpx would take it): a streamed call costs its client about 0.14 ms of CPU
here, against httpx's 0.56 ms and the hand-written HTTP/1.1 client's 0.07 ms that it replaced
(``benchmarks/README.md``, "The backends' HTTP client"). A
generation read to its end gives its connection back to the pool (`drain`); one given up
(an error, a cancel, a timeout) closes it, which is what stops Ollama generating.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp.helpers import get_env_proxy_for_url
from aiohttp.http_exceptions import LineTooLong
from yarl import URL

from schemas.events import Durations, Tokens
from schemas.models import ModelDetails, ModelFacts
from schemas.route import ChatMessage, DoneReason, OutputFormat, ToolCall
from schemas.vectors import pack
from services.backends import Embedding, Generation, OnChunk, Progress, drain
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable

NS_PER_MS = 1_000_000
# A model's ``/api/show`` reads its files, no more; past this the facts wait for a restart.
SHOW_TIMEOUT_S = 30.0
# The model list's read deadline.
TAGS_TIMEOUT_S = 30.0
# The longest NDJSON line read (an older Ollama's final ``/api/generate`` line carries the
# whole context as token ids).
MAX_LINE = 64 << 20
_JSON = {"Content-Type": "application/json"}
_NDJSON = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}

log = structlog.get_logger("worker")


class _Tag(msgspec.Struct):
    name: str
    digest: str = ""
    size: int = 0
    modified_at: str | None = None
    details: ModelDetails | None = None


class _Tags(msgspec.Struct):
    models: list[_Tag] = []


class _Show(msgspec.Struct):
    """``/api/show``: an Ollama before 0.6.4 or so sends no ``capabilities``."""

    capabilities: list[str] | None = None
    model_info: dict[str, Any] | None = None
    details: ModelDetails | None = None
    modified_at: str | None = None


class _Function(msgspec.Struct):
    name: str = ""
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class _ToolCall(msgspec.Struct):
    function: _Function = msgspec.field(default_factory=_Function)
    id: str | None = None  # newer Ollama versions number their calls


class _Message(msgspec.Struct):
    content: str = ""
    thinking: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Chunk(msgspec.Struct):
    """One NDJSON line of ``/api/generate`` (or ``/api/chat``, whose text is in ``message``);
    the last one (``done``) carries the figures."""

    response: str = ""
    thinking: str | None = None
    message: _Message | None = None
    done: bool = False
    done_reason: str | None = None
    error: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class _Embedded(msgspec.Struct):
    """``/api/embed``'s answer."""

    embeddings: list[list[float]] | None = None  # null for no input (Go's nil slice)
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None


class _LegacyEmbedded(msgspec.Struct):
    """``/api/embeddings``'s answer: one vector, no figures."""

    embedding: list[float] | None = None


_tags_decoder = msgspec.json.Decoder(_Tags)
_show_decoder = msgspec.json.Decoder(_Show)
_chunk_decoder = msgspec.json.Decoder(_Chunk)
_embedded_decoder = msgspec.json.Decoder(_Embedded)
_legacy_decoder = msgspec.json.Decoder(_LegacyEmbedded)
_body_encoder = msgspec.json.Encoder()

# Ollama's ``done_reason`` words that are `DoneReason`s (it also says ``load`` and ``unload``
# for requests that only load or unload a model).
_DONE_REASONS: dict[str, DoneReason] = {"stop": "stop", "length": "length"}


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


class OllamaBackend:
    """A client for one Ollama server."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self._base_url = base_url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None  # made in the loop, on first use
        # A proxy from the environment (HTTP(S)_PROXY, NO_PROXY), as httpx takes it, read
        # here once: aiohttp's ``trust_env`` reads it, and ``~/.netrc``, on every request
        # (0.35 ms of CPU each here).
        try:
            self._proxy: tuple[URL | None, aiohttp.BasicAuth | None] = get_env_proxy_for_url(
                URL(self._base_url)
            )
        except LookupError:
            self._proxy = (None, None)

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout(None), proxy=self._proxy[0], proxy_auth=self._proxy[1]
            )
        return self._session

    def _timeout(self, read_timeout_s: float | None) -> aiohttp.ClientTimeout:
        """No overall deadline (the caller's `asyncio.timeout` is it): one for the
        connection, and ``read_timeout_s`` between two reads."""
        return aiohttp.ClientTimeout(
            total=None, connect=self._connect_timeout_s, sock_read=read_timeout_s
        )

    async def _get(self, path: str) -> tuple[int, bytes]:
        async with self._http().get(
            self._base_url + path, timeout=self._timeout(TAGS_TIMEOUT_S)
        ) as reply:
            return reply.status, await reply.read()

    async def list_models(self) -> list[str]:
        try:
            status, content = await self._get("/api/tags")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        if status != 200:
            raise BackendError(f"Ollama at {self._base_url} answered /api/tags with HTTP {status}")
        try:
            return [m.name for m in _tags_decoder.decode(content).models]
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
        images: list[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
        format: OutputFormat | None = None,
        keep_alive: float | str | None = None,
        suffix: str | None = None,
    ) -> Generation:
        """See `Backend.generate`. Tools exist only in ``/api/chat``, so a task with tools
        but no conversation goes there as one user message (with its images); ``suffix``
        exists only in ``/api/generate`` and goes only there."""
        body: dict[str, Any] = {"model": model, "stream": True}
        if messages or tools:
            conversation = messages or [
                ChatMessage(role="user", content=prompt, images=images or None)
            ]
            body["messages"] = [_message(m) for m in conversation]
            if tools:
                body["tools"] = tools
            path = "/api/chat"
        else:
            body["prompt"] = prompt
            if images:
                body["images"] = images
            if suffix:
                body["suffix"] = suffix
            path = "/api/generate"
        if options:
            body["options"] = options
        if think is not None:
            body["think"] = think
        if format is not None:
            body["format"] = format
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(path, body, started, progress, on_chunk)
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {_describe(exc)}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
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
        reply = await self._send(path, _body_encoder.encode(body))
        try:
            if reply.status != 200:
                text = (await reply.read()).decode(errors="replace")
                raise BackendError(f"Ollama answered HTTP {reply.status}: {_error_text(text)}")
            generation = await self._read(_lines(reply), started, progress, on_chunk)
        except BaseException:
            reply.close()  # given up midway (a cancel among others): Ollama stops generating
            raise
        reply.release()  # read to its end: the connection goes back to the pool
        return generation

    async def _send(self, path: str, body: bytes) -> aiohttp.ClientResponse:
        """The answer to a streamed POST, its body still to read; sent once more on a new
        connection when a kept-alive one turns out closed before any answer came (the
        server closed it while idle: nothing was done, so sending again is safe)."""
        post = self._http().post
        url = self._base_url + path
        try:
            return await post(url, data=body, headers=_NDJSON)
        except aiohttp.ClientConnectorError:
            raise  # no connection at all: nothing to retry
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return await post(url, data=body, headers=_NDJSON)

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
        response: list[str] = []
        thinking: list[str] = []
        tool_calls: list[ToolCall] = []
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
            calls: list[ToolCall] = []
            if chunk.message is not None:
                text, think = chunk.message.content, chunk.message.thinking or ""
                for call in chunk.message.tool_calls or ():
                    calls.append(
                        ToolCall(
                            name=call.function.name,
                            arguments=call.function.arguments,
                            id=call.id,
                            index=len(tool_calls) + len(calls),
                        )
                    )
                tool_calls.extend(calls)
            if (text or think or calls) and first_token_ms is None:
                first_token_ms = (time.perf_counter() - started) * 1000
            if text:
                response.append(text)
            if think:
                thinking.append(think)
            if on_chunk is not None and (text or think or calls):
                await on_chunk(text, think, calls or None)
            if progress is not None:
                await progress()
            if chunk.done:
                wall_ms = (time.perf_counter() - started) * 1000
                await drain(lines)  # to the body's end: the connection is kept
                done_reason = _DONE_REASONS.get(chunk.done_reason or "")
                if done_reason == "stop" and tool_calls:
                    done_reason = "tool_calls"  # Ollama says "stop"; OpenAI's word for it
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
                    tool_calls=tool_calls or None,
                    done_reason=done_reason,
                )
        raise BackendError("Ollama closed the stream before the final chunk")

    async def embed(
        self,
        model: str,
        inputs: list[str],
        *,
        timeout_s: float,
        truncate: bool | None = None,
        dimensions: int | None = None,
        keep_alive: float | str | None = None,
        options: dict[str, Any] | None = None,
        normalize: bool = True,
    ) -> Embedding:
        """``POST /api/embed`` with every input at once (unit-length vectors). ``normalize``
        false uses the older ``POST /api/embeddings``, whose vectors are the model's own: one
        call per input, no figures beyond the wall time, and no ``truncate`` or
        ``dimensions`` (it has neither)."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                if not normalize:
                    return await self._embed_legacy(model, inputs, keep_alive, options, started)
                body: dict[str, Any] = {"model": model, "input": inputs}
                if truncate is not None:
                    body["truncate"] = truncate
                if dimensions is not None:
                    body["dimensions"] = dimensions
                if keep_alive is not None:
                    body["keep_alive"] = keep_alive
                if options:
                    body["options"] = options
                answer = _embedded_decoder.decode(await self._post("/api/embed", body))
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise BackendTimeout(f"Ollama at {self._base_url} timed out: {_describe(exc)}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(
                f"Ollama at {self._base_url} did not embed with {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(
                f"Ollama at {self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        except msgspec.DecodeError as exc:
            raise BackendError(f"Ollama at {self._base_url}: malformed embed reply: {exc}") from exc
        embeddings = answer.embeddings or []
        if len(embeddings) != len(inputs):
            raise BackendError(
                f"Ollama at {self._base_url} gave {len(embeddings)} vectors "
                f"for {len(inputs)} inputs"
            )
        return Embedding(
            vectors=[pack(vector) for vector in embeddings],
            durations=Durations(
                total_ms=_ms(answer.total_duration) or (time.perf_counter() - started) * 1000,
                load_ms=_ms(answer.load_duration),
                prompt_eval_ms=_ms(answer.prompt_eval_duration),
            ),
            tokens=Tokens(prompt=answer.prompt_eval_count),
        )

    async def _embed_legacy(
        self,
        model: str,
        inputs: list[str],
        keep_alive: float | str | None,
        options: dict[str, Any] | None,
        started: float,
    ) -> Embedding:
        vectors: list[bytes] = []
        for text in inputs:
            body: dict[str, Any] = {"model": model, "prompt": text}
            if keep_alive is not None:
                body["keep_alive"] = keep_alive
            if options:
                body["options"] = options
            vectors.append(
                pack(
                    _legacy_decoder.decode(await self._post("/api/embeddings", body)).embedding
                    or []
                )
            )
        return Embedding(
            vectors=vectors, durations=Durations(total_ms=(time.perf_counter() - started) * 1000)
        )

    async def _post(
        self, path: str, body: dict[str, Any], *, read_timeout_s: float | None = None
    ) -> bytes:
        """One JSON POST; by default without a read deadline of its own (the caller's
        applies). An answer other than 200 is a `BackendError` with Ollama's message."""
        async with self._http().post(
            self._base_url + path,
            data=_body_encoder.encode(body),
            headers=_JSON,
            timeout=self._timeout(read_timeout_s),
        ) as reply:
            content = await reply.read()
            if reply.status != 200:
                text = content.decode(errors="replace")
                raise BackendError(f"Ollama answered HTTP {reply.status}: {_error_text(text)}")
            return content

    async def model_facts(self, served: list[str]) -> dict[str, ModelFacts]:
        """Digest, size, details and date from ``/api/tags`` (one call); capabilities and the
        context length (``model_info["<architecture>.context_length"]``) from one
        ``/api/show`` per model. An Ollama too old to list capabilities leaves them at
        `ModelFacts`'s default; a model whose show fails is left out (and logged), so the
        worker registers the defaults for it rather than failing its start."""
        tags: dict[str, _Tag] = {}
        try:
            status, content = await self._get("/api/tags")
            if status == 200:
                tags = {t.name: t for t in _tags_decoder.decode(content).models}
            else:
                log.warning("model list refused for model facts", status=status)
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning("model list unreadable for model facts", error=_describe(exc))
        facts: dict[str, ModelFacts] = {}
        for name in served:
            try:
                show = _show_decoder.decode(
                    await self._post("/api/show", {"model": name}, read_timeout_s=SHOW_TIMEOUT_S)
                )
            except (BackendError, aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
                message = exc.message if isinstance(exc, BackendError) else _describe(exc)
                log.warning("model facts unavailable", model=name, error=message)
                continue
            tag = tags.get(name)
            fields: dict[str, Any] = {}
            if show.capabilities is not None:
                fields["capabilities"] = list(show.capabilities)
            details = (tag.details if tag else None) or show.details
            if details is not None:
                fields["details"] = details
            facts[name] = ModelFacts(
                name=name,
                digest=tag.digest if tag else "",
                size=tag.size if tag else 0,
                context_length=_context_length(show.model_info),
                modified_at=(tag.modified_at if tag else None) or show.modified_at,
                **fields,
            )
        return facts


async def _lines(reply: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines (each with its line end), the last one even if unterminated."""
    try:
        while line := await reply.content.readline(max_line_length=MAX_LINE):
            yield line
    except LineTooLong as exc:
        raise BackendError(f"Ollama sent a line over {MAX_LINE} bytes") from exc


def _message(message: ChatMessage) -> dict[str, Any]:
    """A turn in ``/api/chat``'s shape: tool calls as ``{"function": {"name", "arguments"}}``
    with the arguments an object (text from an OpenAI client that is a JSON object is
    decoded; other text goes as it came, for Ollama to refuse in its words). Call ids go as
    ``id`` and ``tool_call_id`` when the client gave them: newer Ollama versions read them,
    older ones ignore fields they do not know."""
    shaped: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        shaped["images"] = message.images
    if message.tool_calls:
        shaped["tool_calls"] = [_call(call) for call in message.tool_calls]
    if message.tool_name:
        shaped["tool_name"] = message.tool_name
    if message.tool_call_id:
        shaped["tool_call_id"] = message.tool_call_id
    return shaped


def _call(call: ToolCall) -> dict[str, Any]:
    shaped: dict[str, Any] = {
        "function": {"name": call.name, "arguments": _arguments(call.arguments)}
    }
    if call.id:
        shaped["id"] = call.id
    return shaped


def _arguments(arguments: dict[str, Any] | str) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


def _context_length(model_info: dict[str, Any] | None) -> int | None:
    if not model_info:
        return None
    value = model_info.get(f"{model_info.get('general.architecture')}.context_length")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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

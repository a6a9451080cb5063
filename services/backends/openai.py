"""OpenAI-compatible servers: llama.cpp's server, vLLM, LM Studio, Ollama's ``/v1``.

``/v1/models`` lists the models; streamed ``/v1/chat/completions`` does the work and
``/v1/embeddings`` makes vectors. Servers differ in what they report beyond the text:
``usage`` (asked for with ``stream_options.include_usage``) gives token counts, llama.cpp adds
``timings`` with prompt and generation times, and thinking arrives as ``reasoning_content``
(llama.cpp, vLLM) or ``reasoning`` (Ollama). Whatever is missing stays ``None`` rather than
being guessed.

Tasks arrive in Ollama's terms (the project's wire types follow Ollama), so this module
translates: options to request fields, base64 images to ``image_url`` content parts, tool
calls to OpenAI's ``function`` objects with arguments as JSON text, ``format`` to
``response_format``. ``keep_alive`` has no counterpart (these servers keep their model loaded
for as long as they run) and is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec
import structlog

from schemas.events import Durations, Tokens
from schemas.models import COMPLETION, EMBEDDING, THINKING, TOOLS, VISION, ModelDetails, ModelFacts
from schemas.route import ChatMessage, DoneReason, OutputFormat, ToolCall
from schemas.vectors import pack
from services.backends import Embedding, Generation, OnChunk, Progress, drain
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable

log = structlog.get_logger("worker")

# Ollama's option names mapped to request fields. The first group is OpenAI's own; the rest
# are the sampling fields llama.cpp's server takes under Ollama's very names (its
# ``/completion`` parameters, accepted by its chat API too), and LM Studio and vLLM take
# most of them; vLLM calls the repeat penalty ``repetition_penalty``, so both names go. A
# server ignores fields it does not know (llama.cpp, vLLM, Ollama do). Options fixed when a
# server loads its model (``num_ctx``, ``num_gpu``, ``num_thread``, ...) have no request
# field and are dropped.
_OPTION_FIELDS: dict[str, tuple[str, ...]] = {
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "seed": ("seed",),
    "stop": ("stop",),
    "num_predict": ("max_tokens",),
    "max_tokens": ("max_tokens",),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "top_k": ("top_k",),
    "min_p": ("min_p",),
    "typical_p": ("typical_p",),
    "repeat_penalty": ("repeat_penalty", "repetition_penalty"),
    "repeat_last_n": ("repeat_last_n",),
    "mirostat": ("mirostat",),
    "mirostat_tau": ("mirostat_tau",),
    "mirostat_eta": ("mirostat_eta",),
    "num_keep": ("n_keep",),
    # Not Ollama's: OpenAI's own choice among the tools ("auto", "none", "required", or one
    # function), for a caller that has it (Ollama ignores an option it does not know).
    "tool_choice": ("tool_choice",),
}

# ``finish_reason`` as `DoneReason`; ``function_call`` is the older name of ``tool_calls``.
_DONE_REASONS: dict[str, DoneReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
}

# What a chat template says when its model reasons apart from its answer (Qwen3's switch,
# DeepSeek-R1's tags, the field llama.cpp and vLLM return the reasoning in).
_THINKING_MARKERS = ("<think>", "enable_thinking", "reasoning_content")


class _Meta(msgspec.Struct):
    """What llama.cpp's server adds to each ``/v1/models`` entry."""

    n_ctx_train: int | None = None
    n_params: int | None = None
    size: int | None = None
    ftype: str | None = None


class _Model(msgspec.Struct):
    id: str
    meta: _Meta | None = None


class _Models(msgspec.Struct):
    data: list[_Model] = []


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


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


class _Vector(msgspec.Struct):
    index: int = 0
    embedding: list[float] | str = []


class _Embeddings(msgspec.Struct):
    data: list[_Vector] | None = None  # Ollama's /v1 sends null for no vectors
    usage: _Usage | None = None


class _TemplateCaps(msgspec.Struct):
    supports_tools: bool = False
    supports_reasoning_effort: bool = False


class _Modalities(msgspec.Struct):
    vision: bool = False


class _Props(msgspec.Struct):
    """llama.cpp's ``GET /props`` (the parts read here)."""

    chat_template: str = ""
    chat_template_caps: _TemplateCaps | None = None
    modalities: _Modalities | None = None


_models_decoder = msgspec.json.Decoder(_Models)
_chunk_decoder = msgspec.json.Decoder(_Chunk)
_embeddings_decoder = msgspec.json.Decoder(_Embeddings)
_props_decoder = msgspec.json.Decoder(_Props)


@dataclass
class _PartialCall:
    """One streamed tool call being put together from its deltas."""

    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    whole: dict[str, Any] | None = None  # a server that sends the arguments as an object


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
        return [m.id for m in await self._models()]

    async def _models(self) -> list[_Model]:
        try:
            async with self._sent(self._client.build_request("GET", "/models")) as reply:
                await reply.aread()
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"{self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        if reply.status_code != 200:
            raise BackendError(f"{self._base_url}/models answered HTTP {reply.status_code}")
        try:
            return _models_decoder.decode(reply.content).data
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
        images: list[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
        format: OutputFormat | None = None,
        keep_alive: float | str | None = None,
        suffix: str | None = None,
    ) -> Generation:
        """See `Backend.generate`. ``keep_alive`` is dropped (no such notion here); a
        ``suffix`` is refused: a chat API has no fill-in-the-middle, and `model_facts` never
        reports ``insert`` for these servers, so the router sends none here."""
        if suffix:
            raise BackendError(
                f"{self._base_url}: fill-in-the-middle (suffix) is not available through an "
                "OpenAI-compatible chat API"
            )
        conversation = (
            _conversation(messages)
            if messages
            else [_message(ChatMessage(role="user", content=prompt, images=images or None))]
        )
        body: dict[str, Any] = {
            "model": model,
            "messages": conversation,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for name, value in (options or {}).items():
            for target in _OPTION_FIELDS.get(name, ()):
                body[target] = value
        if isinstance(think, str):
            body["reasoning_effort"] = think  # how OpenAI's API (and Ollama's /v1) say it
        if tools:
            body["tools"] = tools
        if format is not None:
            body["response_format"] = _response_format(format)
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
        calls: dict[int, _PartialCall] = {}
        finished_calls: list[ToolCall] | None = None
        first_token_ms: float | None = None
        usage: _Usage | None = None
        timings: _Timings | None = None
        finish_reason: str | None = None
        finished = False
        timeout = httpx.Timeout(None, connect=self._connect_timeout_s)
        request = self._client.build_request(
            "POST", "/chat/completions", json=body, timeout=timeout
        )
        async with self._sent(request) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                raise BackendError(
                    f"{self._base_url} answered HTTP {reply.status_code}: {_error_text(text)}"
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
                    if delta.tool_calls:
                        _gather(calls, delta.tool_calls)
                    if (delta.content or think or delta.tool_calls) and first_token_ms is None:
                        first_token_ms = (time.perf_counter() - started) * 1000
                    if delta.content:
                        response.append(delta.content)
                    if think:
                        thinking.append(think)
                    if on_chunk is not None and (delta.content or think):
                        await on_chunk(delta.content or "", think or "")
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
                        if calls and finished_calls is None:
                            # The calls are whole once the server says why it stopped.
                            finished_calls = _assemble(calls)
                            if on_chunk is not None:
                                await on_chunk("", "", finished_calls)
                if progress is not None:
                    await progress()
        if not finished:
            raise BackendError(f"{self._base_url} closed the stream before [DONE]")
        if calls and finished_calls is None:  # a server that sent no finish_reason
            finished_calls = _assemble(calls)
            if on_chunk is not None:
                await on_chunk("", "", finished_calls)
        done_reason = _DONE_REASONS.get(finish_reason or "")
        if done_reason == "stop" and finished_calls:
            done_reason = "tool_calls"
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
            tool_calls=finished_calls,
            done_reason=done_reason,
        )

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
        """One ``POST /embeddings`` for all the inputs, vectors put back in input order.

        ``normalize`` false makes the same call: these servers have one embeddings API, and
        whether its vectors are unit length is the server's setting (llama.cpp's
        ``--embd-normalize``), not the request's. ``truncate``, ``keep_alive`` and
        ``options`` have no field in OpenAI's request and are dropped: an input over the
        model's context is cut or refused as the server does it."""
        body: dict[str, Any] = {"model": model, "input": inputs, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        started = time.perf_counter()
        try:
            request = self._client.build_request(
                "POST", "/embeddings", json=body, timeout=timeout_s
            )
            async with self._sent(request) as reply:
                await reply.aread()
        except httpx.TimeoutException as exc:
            raise BackendTimeout(
                f"{self._base_url} did not embed with {model} within {timeout_s:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"{self._base_url} cannot be reached: {_describe(exc)}"
            ) from exc
        if reply.status_code != 200:
            raise BackendError(
                f"{self._base_url} answered HTTP {reply.status_code}: {_error_text(reply.text)}"
            )
        try:
            answer = _embeddings_decoder.decode(reply.content)
        except msgspec.DecodeError as exc:
            raise BackendError(f"{self._base_url}/embeddings: malformed reply: {exc}") from exc
        data = answer.data or []
        if len(data) != len(inputs):
            raise BackendError(
                f"{self._base_url}/embeddings gave {len(data)} vectors for {len(inputs)} inputs"
            )
        vectors = [_packed(v.embedding) for v in sorted(data, key=lambda v: v.index)]
        return Embedding(
            vectors=vectors,
            durations=Durations(total_ms=(time.perf_counter() - started) * 1000),
            tokens=Tokens(prompt=answer.usage.prompt_tokens if answer.usage else None),
        )

    @asynccontextmanager
    async def _sent(self, request: httpx.Request) -> AsyncIterator[httpx.Response]:
        """The answer to ``request``, its body still to read; sent once more on a new
        connection when a kept-alive one turns out closed before any answer came.

        llama.cpp's server closes the connection after each streamed answer without saying
        so (no ``Connection: close``); a request sent right after can go out on it before
        its close is seen, and fail with no answer at all. Nothing was done then, so sending
        again is safe; the second failure is the server's."""
        try:
            reply = await self._client.send(request, stream=True)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            reply = await self._client.send(request, stream=True)
        try:
            yield reply
        finally:
            await reply.aclose()

    async def model_facts(self, served: list[str]) -> dict[str, ModelFacts]:
        """What can be learnt of the served models; ``/v1/models`` itself says nothing of
        capabilities.

        The rule: every model gets ``completion``. A server that answers llama.cpp's
        ``GET /props`` (beside ``/v1``) adds what its model can do: ``tools`` when the chat
        template takes tools (``chat_template_caps.supports_tools``; without it llama.cpp
        ignores the tools and the model answers in text), ``vision`` from
        ``modalities.vision``, ``thinking`` when the template takes a reasoning effort or
        speaks of reasoning (``<think>``, ``enable_thinking``, ``reasoning_content``), and
        ``embedding`` when a one-word ``/embeddings`` call succeeds (llama.cpp serves vectors
        only when started with ``--embeddings``, and says so nowhere else; such a server
        still chats). That probe is made only on a llama.cpp server with one model (loaded
        with the server), where it costs a few milliseconds: elsewhere (Ollama's ``/v1``,
        llama.cpp's router of several models) it could load a model. llama.cpp's model
        entries also give the size, the parameter count, the quantization and the trained
        context length."""
        try:
            listed = {m.id: m for m in await self._models()}
        except BackendError as exc:
            log.warning("model list unreadable for model facts", error=exc.message)
            listed = {}
        props = await self._props()
        facts: dict[str, ModelFacts] = {}
        for name in served:
            capabilities = [COMPLETION]
            if props is not None:
                if props.chat_template_caps is not None and props.chat_template_caps.supports_tools:
                    capabilities.append(TOOLS)
                if props.modalities is not None and props.modalities.vision:
                    capabilities.append(VISION)
                if _thinks(props):
                    capabilities.append(THINKING)
                if len(served) == 1 and await self._embeds(name):
                    capabilities.append(EMBEDDING)
            meta = listed[name].meta if name in listed else None
            facts[name] = ModelFacts(
                name=name,
                capabilities=capabilities,
                size=(meta.size or 0) if meta else 0,
                details=ModelDetails(
                    format="gguf",
                    parameter_size=_human_number(meta.n_params) if meta.n_params else "",
                    quantization_level=meta.ftype or "",
                )
                if meta
                else ModelDetails(),
                context_length=meta.n_ctx_train if meta else None,
            )
        return facts

    async def _props(self) -> _Props | None:
        """llama.cpp's ``/props``, or None from a server without it (or that is not llama.cpp:
        a reply without ``chat_template_caps`` and ``modalities``)."""
        parts = urlsplit(self._base_url)
        root = urlunsplit(parts._replace(path=parts.path.removesuffix("/v1")))
        try:
            async with self._sent(self._client.build_request("GET", f"{root}/props")) as reply:
                await reply.aread()
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        try:
            props = _props_decoder.decode(reply.content)
        except msgspec.DecodeError:
            return None
        if props.chat_template_caps is None and props.modalities is None:
            return None
        return props

    async def _embeds(self, model: str) -> bool:
        try:
            await self.embed(model, ["a"], timeout_s=10.0)
        except BackendError:
            return False
        return True


def _thinks(props: _Props) -> bool:
    caps = props.chat_template_caps
    return (caps is not None and caps.supports_reasoning_effort) or any(
        marker in props.chat_template for marker in _THINKING_MARKERS
    )


def _gather(calls: dict[int, _PartialCall], deltas: list[_ToolCallDelta]) -> None:
    """Add one chunk's tool-call deltas to the calls being put together, by ``index``. The
    id and name come whole in a call's first delta (later repeats are ignored), the arguments
    in fragments to join."""
    for position, delta in enumerate(deltas):
        call = calls.setdefault(
            delta.index if delta.index is not None else position, _PartialCall()
        )
        if delta.id and call.id is None:
            call.id = delta.id
        if delta.function is None:
            continue
        if delta.function.name and not call.name:
            call.name = delta.function.name
        arguments = delta.function.arguments
        if isinstance(arguments, dict):
            call.whole = arguments
        elif arguments:
            call.arguments.append(arguments)


def _assemble(calls: dict[int, _PartialCall]) -> list[ToolCall]:
    """The finished calls in index order; arguments that are a JSON object become a dict,
    any other text stays as it came (OpenAI's API does not promise JSON)."""
    finished: list[ToolCall] = []
    for index in sorted(calls):
        call = calls[index]
        arguments: dict[str, Any] | str
        if call.whole is not None:
            arguments = call.whole
        else:
            text = "".join(call.arguments)
            try:
                decoded = json.loads(text) if text.strip() else {}
            except ValueError:
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else text
        finished.append(ToolCall(name=call.name, arguments=arguments, id=call.id, index=index))
    return finished


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in OpenAI's shape. A tool turn without a call id (a conversation in
    Ollama's terms, which has none) answers the earliest unanswered call of its tool in the
    assistant turn before it, or else the earliest unanswered call: OpenAI-compatible servers
    want every tool turn tied to a call of the assistant turn before it."""
    shaped: list[dict[str, Any]] = []
    waiting: list[tuple[str, str]] = []  # (call id, tool name) not answered yet
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            waiting = [(_call_id(c), c.name) for c in message.tool_calls]
        elif message.role == "tool":
            call_id = message.tool_call_id
            if call_id is None:
                named = [w for w in waiting if w[1] == message.tool_name]
                if named or waiting:
                    call_id = (named or waiting)[0][0]
            waiting = [w for w in waiting if w[0] != call_id]
            shaped.append(_tool_message(message, call_id))
            continue
        shaped.append(_message(message))
    return shaped


def _message(message: ChatMessage) -> dict[str, Any]:
    shaped: dict[str, Any] = {"role": message.role}
    if message.images:
        shaped["content"] = [
            {"type": "text", "text": message.content},
            *(
                {"type": "image_url", "image_url": {"url": _data_url(image)}}
                for image in message.images
            ),
        ]
    else:
        shaped["content"] = message.content
    if message.tool_calls:
        shaped["tool_calls"] = [
            {
                "id": _call_id(call),
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call in message.tool_calls
        ]
    return shaped


def _tool_message(message: ChatMessage, call_id: str | None) -> dict[str, Any]:
    shaped: dict[str, Any] = {"role": "tool", "content": message.content}
    if call_id is not None:
        shaped["tool_call_id"] = call_id
    if message.tool_name:
        shaped["name"] = message.tool_name  # templates that name the tool read it
    return shaped


def _call_id(call: ToolCall) -> str:
    return call.id or f"call_{call.index}"


def _data_url(image: str) -> str:
    return f"data:{_mime_type(image)};base64,{image}"


def _mime_type(image: str) -> str:
    """The image type of base64 data, from its first bytes; PNG when they say nothing known
    (servers decode the bytes themselves, the type is a label)."""
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4))
    except (binascii.Error, ValueError):
        return "image/png"
    if head.startswith(b"\x89PNG"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


def _response_format(format: OutputFormat) -> dict[str, Any]:
    """Ollama's ``format`` as ``response_format``: "json" is any JSON object, a schema is
    OpenAI's strict ``json_schema`` (llama.cpp turns it into a grammar)."""
    if format == "json":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": format, "strict": True},
    }


def _packed(embedding: list[float] | str) -> bytes:
    """A vector as `schemas.vectors` bytes; a server that sends base64 anyway sent exactly
    those bytes (little-endian float32)."""
    if isinstance(embedding, str):
        return base64.b64decode(embedding)
    return pack(embedding)


def _human_number(count: int) -> str:
    """A parameter count as Ollama writes it (``135M``, ``494.03M``, ``3.2B``)."""
    for scale, unit, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if count >= scale:
            number = count / scale
            return f"{number:.0f}{unit}" if number.is_integer() else f"{number:.{digits}f}{unit}"
    return str(count)


def _error_text(text: str) -> str:
    """The message of an error body, in OpenAI's shape (``{"error": {"message"}}``) or
    Ollama's (``{"error": "..."}``); else the start of the body."""
    try:
        decoded = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text[:300]
    if isinstance(decoded, dict):
        error = decoded.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message
        if isinstance(error, str):
            return error
    return text[:300]


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

"""OpenAI-compatible servers: llama.cpp's server, vLLM, LM Studio, Ollama's ``/v1``.

``/v1/models`` lists the models; streamed ``/v1/chat/completions`` does the work and
``/v1/embeddings`` makes vectors. Tasks arrive in Ollama's terms (the project's wire types
follow Ollama), so the request bodies are translated (`openai_request`), and what the servers
answer is read by `openai_reply`; both are pure. This module is the HTTP client: it sends,
reads the stream, times it, and maps the transport's failures to the project's backend errors,
over the backends' one HTTP client (`services.backends.http`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import msgspec
import structlog

from schemas.models import EMBEDDING, ModelFacts
from schemas.work import ModelChange, Work
from services.backends import (
    Embedding,
    Generation,
    OnChunk,
    OnModelProgress,
    Progress,
    answer_error,
    drain,
    embedding_work,
)
from services.backends.http import HttpClient, describe, lines
from services.backends.openai_reply import (
    ChatStream,
    ModelEntry,
    ServerProps,
    decode_chunk,
    decode_models,
    decode_props,
    embedding_of,
    error_text,
    facts_of,
    template_capabilities,
)
from services.backends.openai_request import chat_body, embeddings_body
from services.errors import (
    BackendError,
    BackendServerError,
    BackendTimeout,
    BackendUnavailable,
)

log = structlog.get_logger("worker")

# The model list's and llama.cpp's ``/props``' deadline.
QUERY_TIMEOUT_S = 30.0
_JSON = {"Content-Type": "application/json"}
_body_encoder = msgspec.json.Encoder()


class OpenAIBackend:
    """A client for one OpenAI-compatible server; ``base_url`` ends in ``/v1``."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, connect_timeout_s: float = 5.0
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = HttpClient(base_url, connect_timeout_s=connect_timeout_s, headers=headers)
        self._base_url = self._client.base_url

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()

    def _unreachable(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(f"{self._base_url} cannot be reached: {describe(exc)}")

    async def list_models(self) -> list[str]:
        return [m.id for m in await self._models()]

    async def resident_models(self) -> None:
        """Nothing: the OpenAI-compatible API has no list of the models in memory. llama.cpp's
        server and vLLM hold the one model they were started with for as long as they run,
        so counting no cold load is right for them; LM Studio and Ollama's ``/v1`` load on
        demand, and a list of served models would claim what nobody knows. So the worker
        reports nothing, and routing counts no cold load for it."""
        return None

    async def _models(self) -> list[ModelEntry]:
        deadlines = self._client.timeout(None, total_s=QUERY_TIMEOUT_S)
        try:
            async with self._client.sent("GET", "/models", deadlines=deadlines) as reply:
                status, content = reply.status, await reply.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unreachable(exc) from exc
        if status != 200:
            raise answer_error(status, f"{self._base_url}/models answered HTTP {status}")
        return decode_models(content, self._base_url)

    async def generate(
        self,
        model: str,
        work: Work,
        *,
        timeout_s: float,
        progress: Progress | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Generation:
        """See `Backend.generate`. ``keep_alive`` is dropped (no such notion here); a
        ``suffix`` is refused: a chat API has no fill-in-the-middle, and `model_facts` never
        reports ``insert`` for these servers, so the router sends none here."""
        if work.suffix:
            raise BackendError(
                f"{self._base_url}: fill-in-the-middle (suffix) is not available through an "
                "OpenAI-compatible chat API"
            )
        body = chat_body(model, work)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._stream(body, started, progress, on_chunk)
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise BackendTimeout(f"{self._base_url} timed out: {describe(exc)}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(
                f"{self._base_url} did not finish {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise self._unreachable(exc) from exc

    async def _stream(
        self,
        body: dict[str, Any],
        started: float,
        progress: Progress | None,
        on_chunk: OnChunk | None,
    ) -> Generation:
        stream = ChatStream()
        finished = False
        encoded = _body_encoder.encode(body)
        async with self._client.sent(
            "POST", "/chat/completions", body=encoded, headers=_JSON
        ) as reply:
            if reply.status != 200:
                text = (await reply.read()).decode(errors="replace")
                raise answer_error(
                    reply.status,
                    f"{self._base_url} answered HTTP {reply.status}: {error_text(text)}",
                )
            read = lines(reply)
            async for raw in read:
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip().decode()
                if data == "[DONE]":
                    finished = True
                    if not reply.content.at_eof():
                        await drain(read)  # to the body's end: the connection is kept
                    break
                chunk = decode_chunk(data, self._base_url)
                stream.note(chunk)
                for choice in chunk.choices:
                    text, think, said, calls = stream.add(choice)
                    if said and stream.first_token_ms is None:
                        stream.first_token_ms = (time.perf_counter() - started) * 1000
                    if on_chunk is not None and (text or think):
                        await on_chunk(text, think)
                    if calls is not None and on_chunk is not None:
                        await on_chunk("", "", calls)
                if progress is not None:
                    await progress()
        if not finished:
            raise BackendServerError(f"{self._base_url} closed the stream before [DONE]")
        calls = stream.finish()  # a server that sent no finish_reason
        if calls is not None and on_chunk is not None:
            await on_chunk("", "", calls)
        return stream.generation((time.perf_counter() - started) * 1000)

    async def embed(self, model: str, work: Work, *, timeout_s: float) -> Embedding:
        """One ``POST /embeddings`` for all the inputs, vectors put back in input order.

        ``normalize`` false makes the same call: these servers have one embeddings API, and
        whether its vectors are unit length is the server's setting (llama.cpp's
        ``--embd-normalize``), not the request's. ``truncate``, ``keep_alive`` and
        ``options`` have no field in OpenAI's request and are dropped: an input over the
        model's context is cut or refused as the server does it."""
        body = embeddings_body(model, work)
        started = time.perf_counter()
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._client.sent(
                    "POST", "/embeddings", body=_body_encoder.encode(body), headers=_JSON
                ) as reply,
            ):
                status, content = reply.status, await reply.read()
        except TimeoutError as exc:  # aiohttp's own deadlines included
            raise BackendTimeout(
                f"{self._base_url} did not embed with {model} within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise self._unreachable(exc) from exc
        if status != 200:
            text = content.decode(errors="replace")
            raise answer_error(
                status, f"{self._base_url} answered HTTP {status}: {error_text(text)}"
            )
        return embedding_of(
            content,
            len(work.input or ()),
            self._base_url,
            (time.perf_counter() - started) * 1000,
        )

    async def change_model(
        self, model: str, change: ModelChange, *, timeout_s: float, on_progress: OnModelProgress
    ) -> None:
        """An OpenAI-compatible server has no API to change its models."""
        raise BackendError(
            f"cannot {change.op} {model}: the OpenAI-compatible server at {self._base_url} "
            "has no API to change its models (change them on that machine)"
        )

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
            capabilities = template_capabilities(props)
            if props is not None and len(served) == 1 and await self._embeds(name):
                capabilities.append(EMBEDDING)
            facts[name] = facts_of(name, capabilities, listed.get(name))
        return facts

    async def _props(self) -> ServerProps | None:
        """llama.cpp's ``/props``, or None from a server without it (or that is not llama.cpp:
        a reply without ``chat_template_caps`` and ``modalities``)."""
        parts = urlsplit(self._base_url)
        root = urlunsplit(parts._replace(path=parts.path.removesuffix("/v1")))
        deadlines = self._client.timeout(None, total_s=QUERY_TIMEOUT_S)
        try:
            async with self._client.sent("GET", f"{root}/props", deadlines=deadlines) as reply:
                status, content = reply.status, await reply.read()
        except (aiohttp.ClientError, TimeoutError):
            return None
        if status != 200:
            return None
        return decode_props(content)

    async def _embeds(self, model: str) -> bool:
        try:
            await self.embed(model, embedding_work(["a"]), timeout_s=10.0)
        except BackendError:
            return False
        return True

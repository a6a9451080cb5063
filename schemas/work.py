"""`Work`: what a client asked the backend for, declared once.

The route request is a `Work` plus how to route it (`schemas.route.RouteRequest`); the
``submitted`` event and every attempt's task message nest the `Work` the router took from
it (``work``), and a worker hands that one value to its backend. A task the reaper moves is
queued again with the ``submitted`` event's `Work`, so it runs exactly as asked: nothing is
copied field by field, so nothing can be left out.

Before `Work`, the task message and the ``submitted`` event held these fields at their top
level. Both are still read (`BothShapes`): task messages queued by an older router, and
``submitted`` events in the event log, which is kept for ever (the statistics replay it).
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec

from schemas.base import Wire

TaskType = Literal["inference", "web_search", "embedding", "model_change"]

ChatRole = Literal["system", "user", "assistant", "tool"]

# Ollama's ``format``: "json" for any JSON value, or a JSON schema the answer must follow.
# OpenAI's ``response_format`` maps onto it (json_object -> "json", json_schema -> its schema).
OutputFormat = Literal["json"] | dict[str, Any]


class ToolCall(Wire, frozen=True, kw_only=True):
    """A model's request to call one of the tools it was given.

    ``arguments`` is a JSON object as Ollama has it; a server whose arguments text is not a
    JSON object (OpenAI's API allows that) leaves the text as it came. ``id`` is OpenAI's
    call id (Ollama has none; the gateway makes one from the task id and ``index``)."""

    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)
    id: str | None = None
    index: int = 0


class ChatMessage(Wire, frozen=True, kw_only=True):
    """One turn of a conversation, as Ollama's ``/api/chat`` and OpenAI's chat API take it."""

    role: ChatRole
    content: str = ""
    images: list[str] | None = None
    """Base64 image data (no ``data:`` prefix), as Ollama takes it; a model needs ``vision``."""
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls to tools."""
    tool_name: str | None = None
    """A ``tool`` turn: the name of the tool whose result ``content`` is (Ollama's field)."""
    tool_call_id: str | None = None
    """A ``tool`` turn: the call it answers (OpenAI's field)."""


ModelOp = Literal["pull", "create", "copy", "delete"]


class ModelChange(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A change to the models of one machine (a ``model_change`` task), carried out by its
    worker through its backend's own API: Ollama's ``/api/pull``, ``/api/create``,
    ``/api/copy`` and ``/api/delete``. The name changed is the task's model: the model
    pulled, created, copied to, or removed. The fields of ``create`` are Ollama's."""

    op: ModelOp
    source: str | None = None
    """The model copied (``copy``), or built upon (``create``'s ``from``)."""
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[ChatMessage] | None = None
    license: str | list[str] | None = None
    quantize: str | None = None
    insecure: bool = False
    """``pull``: allow a registry without TLS."""
    size: int | None = None
    """``pull``: the bytes the model takes on disk where the fleet already has it; a machine
    with less free space refuses before it starts (None: not known, not checked)."""


class Work(Wire, frozen=True, kw_only=True):
    """Everything a client asked the backend for, carried unchanged from the route request
    to the ``submitted`` event, to every attempt's task message and to the backend call."""

    prompt: str
    """The text to answer. With ``messages`` it holds the same conversation as text
    (`services.gateway.conversation.chat_prompt`), which statistics and the judge use; an
    embedding task's inputs joined."""
    task_type: TaskType = "inference"
    domain: str | None = None
    """What the prompt is about, for routing and statistics (None: classified from it)."""
    options: dict[str, Any] | None = None
    """Ollama's options, passed whole."""
    stream: bool = False
    """The answer's pieces go to the client as they are generated (every attempt's)."""
    messages: list[ChatMessage] | None = None
    """A conversation: workers send it to their backend's chat API."""
    think: bool | str | None = None
    """Ollama's ``think`` (true, false, or "high" / "medium" / "low"); None: the model's default."""
    images: list[str] | None = None
    """Base64 images for a prompt without ``messages`` (Ollama's ``/api/generate``)."""
    tools: list[dict[str, Any]] | None = None
    """Tool definitions in the chat APIs' shape (``{"type": "function", "function": {...}}``);
    the model may answer with `ToolCall`s instead of text. Needs ``tools``."""
    format: OutputFormat | None = None
    keep_alive: float | str | None = None
    """Ollama's ``keep_alive`` (seconds, or a duration such as "5m"), passed to the backend."""
    suffix: str | None = None
    """Text after the insertion point (fill-in-the-middle); needs ``insert``."""
    input: list[str] | None = None
    """An ``embedding`` task's texts: one vector each, in order (``prompt`` holds them too,
    joined, for statistics). One task however many."""
    truncate: bool | None = None
    """Embedding: cut an input over the model's context instead of failing (Ollama's default)."""
    dimensions: int | None = None
    """Embedding: the length to cut each vector to, for models that allow it."""
    normalize: bool = True
    """Embedding: unit-length vectors (``/api/embed``, ``/v1/embeddings``); false for Ollama's
    older ``/api/embeddings``, whose vectors are the model's own."""
    change: ModelChange | None = None
    """A ``model_change`` task's change (and only such a task's)."""


def work_only(work: Work) -> Work:
    """``work`` as a plain `Work`: a subclass's own fields (a route request's routing) left
    out, so that what is nested on the wire is the work and nothing else."""
    if type(work) is Work:
        return work
    return Work(**{name: getattr(work, name) for name in Work.__struct_fields__})


T = TypeVar("T")


class BothShapes(Generic[T]):
    """A JSON decoder of a type that nests `Work` as ``work`` (or a union holding one) that
    reads the older, flat shape too: the work's fields at the top level, no ``work``.

    Today's shape decodes in one pass. Only a message that fails to decode for want of
    ``work`` is read again, with its own top-level fields as its work (unknown fields are
    ignored both ways, so each part takes what is its own). A ``.decode`` that raises
    `msgspec.DecodeError` (or its `msgspec.ValidationError`) as `msgspec.json.Decoder` does."""

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError:
            flat = msgspec.json.decode(data)
            if not isinstance(flat, dict) or "work" in flat or "prompt" not in flat:
                raise
            return self._decoder.decode(_encoder.encode({**flat, "work": flat}))


_encoder = msgspec.json.Encoder()

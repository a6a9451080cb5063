"""A change to an Ollama server's models: the request of each (``/api/pull``, ``/api/create``,
``/api/copy``, ``/api/delete``, with Ollama's field names) and the progress lines that pull
and create stream back. Pure: no I/O (`services.backends.ollama.OllamaBackend.change_model`
sends them)."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from schemas.route import ModelProgress
from schemas.work import ModelChange
from services.errors import BackendError


class ChangeRequest(msgspec.Struct, frozen=True):
    method: str
    path: str
    body: dict[str, Any]
    streams: bool
    """Answered with NDJSON progress lines (pull, create); else an empty 200."""


def change_request(model: str, change: ModelChange) -> ChangeRequest:
    """The call that makes ``change`` to ``model`` (the name pulled, created, copied to, or
    removed), as Ollama's API takes it (``model``, not the older ``name``)."""
    match change.op:
        case "pull":
            body: dict[str, Any] = {"model": model, "stream": True}
            if change.insecure:
                body["insecure"] = True
            return ChangeRequest("POST", "/api/pull", body, streams=True)
        case "create":
            body = {"model": model, "stream": True}
            fields = {
                "from": change.source,
                "system": change.system,
                "template": change.template,
                "parameters": change.parameters,
                "messages": None
                if change.messages is None
                else [msgspec.to_builtins(m) for m in change.messages],
                "license": change.license,
                "quantize": change.quantize,
            }
            body.update({k: v for k, v in fields.items() if v is not None})
            return ChangeRequest("POST", "/api/create", body, streams=True)
        case "copy":
            if not change.source:
                raise BackendError("a copy needs the model it copies (source)")
            body = {"source": change.source, "destination": model}
            return ChangeRequest("POST", "/api/copy", body, streams=False)
        case "delete":
            return ChangeRequest("DELETE", "/api/delete", {"model": model}, streams=False)


class _Line(msgspec.Struct, frozen=True):
    status: str = ""
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
    error: str | None = None


_line_decoder: Final = msgspec.json.Decoder(_Line)


def progress_line(line: bytes) -> ModelProgress:
    """One progress line; an ``{"error": ...}`` line (the pull or create failed: a name the
    registry does not have, a registry that went away, a disk that filled) or a line that is
    no progress is a `BackendError` (a change is for one machine: nowhere else to try)."""
    try:
        decoded = _line_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise BackendError(f"Ollama sent a malformed progress line: {line[:200]!r}") from exc
    if decoded.error:
        raise BackendError(f"Ollama reported an error: {decoded.error}")
    return ModelProgress(
        status=decoded.status,
        digest=decoded.digest,
        total=decoded.total,
        completed=decoded.completed,
    )


def succeeded(progress: ModelProgress) -> bool:
    """Is this Ollama's last line of a change that went through?"""
    return progress.status == "success"

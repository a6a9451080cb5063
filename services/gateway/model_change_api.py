"""Ollama's model changes through the gateway (``/api/pull``, ``/api/create``, ``/api/copy``,
``DELETE /api/delete``), the pure part: each body read as Ollama reads it, the machines a
change goes to, and the progress of several machines written as one Ollama stream.

Which machines: those the ``X-Coordinator-Machines`` header names (worker ids, comma-separated);
else, for a pull, every live machine of the tiers that serve the model now (a pull there
brings it, or updates it, as ``ollama pull`` does), and for a removal, a copy or a create, the
machines that have the model (its source, its ``from``). None: Ollama's 404, saying to name
them. The changes themselves are ``model_change`` tasks, one per machine
(`services.gateway.model_changes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from schemas.queries import WorkerView
from schemas.route import ModelProgress
from schemas.work import ChatMessage, ModelChange
from services.errors import BadRequest, NoWorker
from services.fleet.model_matrix import holds
from services.gateway.common import ApiError, decode, require_model
from services.gateway.fleet import resolve, served_models

MACHINES_HEADER: Final = "X-Coordinator-Machines"


class _Pull(msgspec.Struct):
    model: str | None = None
    name: str | None = None
    insecure: bool | None = None
    stream: bool | None = None


class _Create(msgspec.Struct):
    model: str | None = None
    name: str | None = None
    from_: str | None = msgspec.field(default=None, name="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[ChatMessage] | None = None
    quantize: str | None = None
    stream: bool | None = None


class _Copy(msgspec.Struct):
    source: str = ""
    destination: str = ""


class _Delete(msgspec.Struct):
    model: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Asked:
    """A model change as a client asked it: the model it names (pulled, created, copied to,
    removed), the change, and whether progress streams (pull and create; Ollama's default)."""

    model: str
    change: ModelChange
    stream: bool = False


def pull_request(body: bytes) -> Asked:
    req = decode(body, _Pull, "pull")
    model = req.model or req.name or ""
    require_model(model)
    change = ModelChange(op="pull", insecure=bool(req.insecure))
    return Asked(model, change, stream=req.stream is not False)


def create_request(body: bytes) -> Asked:
    """``/api/create`` as Ollama 0.5 and later take it; a model made from files (a GGUF, an
    adapter) would need them carried to each machine: refused by name."""
    req = decode(body, _Create, "create")
    model = req.model or req.name or ""
    require_model(model)
    if req.files or req.adapters:
        raise ApiError(
            400,
            BadRequest.code,
            "files and adapters are not carried to the fleet's machines: create from a model "
            "they have ('from'; pull it onto them first)",
        )
    if not req.from_:
        raise ApiError(400, BadRequest.code, "neither 'from' or 'files' was specified")
    change = ModelChange(
        op="create",
        source=req.from_,
        system=req.system,
        template=req.template,
        parameters=req.parameters,
        messages=req.messages,
        license=req.license,
        quantize=req.quantize,
    )
    return Asked(model, change, stream=req.stream is not False)


def copy_request(body: bytes) -> Asked:
    req = decode(body, _Copy, "copy")
    for name, value in (("source", req.source), ("destination", req.destination)):
        if not value.strip():
            raise ApiError(400, BadRequest.code, f'{name} "{value}" is invalid')
    return Asked(req.destination, ModelChange(op="copy", source=req.source))


def delete_request(body: bytes) -> Asked:
    req = decode(body, _Delete, "delete")
    model = req.model or req.name or ""
    if not model.strip():
        raise ApiError(400, BadRequest.code, f'name "{model}" is invalid')
    return Asked(model, ModelChange(op="delete"))


def named_machines(header: str | None) -> list[str] | None:
    """The worker ids the header names, in order, once each; None when it is absent."""
    if header is None:
        return None
    named = list(dict.fromkeys(part.strip() for part in header.split(",") if part.strip()))
    if not named:
        raise ApiError(400, BadRequest.code, f"{MACHINES_HEADER} names no worker")
    return named


def machines_for(
    asked: Asked,
    named: list[str] | None,
    workers: Sequence[WorkerView],
    aliases: Mapping[str, str],
) -> tuple[str, list[str]]:
    """The model the change names (an alias followed for a pull, a removal's name as served)
    and the machines it goes to (see the module's docstring)."""
    inference = [w for w in workers if w.tier != "web"]
    served = served_models(inference)
    op = asked.change.op
    model = asked.model
    if op in ("pull", "delete"):
        model = resolve(model, served, aliases)
    if named is not None:
        return model, named
    if op == "pull":
        tiers = {w.tier for w in inference if holds(w, model)}
        chosen = [w.worker_id for w in inference if w.tier in tiers]
    else:
        wanted = model if op == "delete" else asked.change.source or model
        chosen = [w.worker_id for w in inference if holds(w, wanted)]
    if not chosen:
        where = model if op in ("pull", "delete") else asked.change.source
        raise ApiError(
            404,
            NoWorker.code,
            f"model '{where}' not found on any live machine, so none is chosen for this "
            f"{op}: name the machines with the {MACHINES_HEADER} header (worker ids, "
            "comma-separated)",
        )
    return model, sorted(chosen)


@dataclass
class MergedProgress:
    """Several machines' progress as one Ollama stream: a layer's bytes summed over the
    machines that pull it (one bar per layer, as ``ollama pull`` draws it), each other status
    once, and ``success`` only at the end, once every machine is done."""

    _layers: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    _said: set[str] = field(default_factory=set)

    def add(self, worker: str, step: ModelProgress) -> dict[str, Any] | None:
        """The line to write for ``worker``'s ``step``, or None."""
        if step.digest is not None and step.total:
            layer = self._layers.setdefault(step.digest, {})
            layer[worker] = (step.completed or 0, step.total)
            completed = sum(c for c, _ in layer.values())
            line: dict[str, Any] = {
                "status": step.status,
                "digest": step.digest,
                "total": sum(t for _, t in layer.values()),
            }
            if completed:
                line["completed"] = completed  # Ollama leaves a 0 out
            return line
        if step.status == "success" or step.status in self._said:
            return None
        self._said.add(step.status)
        return {"status": step.status}


def failed_line(failures: Mapping[str, ApiError]) -> dict[str, Any]:
    """Ollama's mid-stream error line for the machines that failed."""
    return {"error": "; ".join(f"{w}: {e.message}" for w, e in sorted(failures.items()))}

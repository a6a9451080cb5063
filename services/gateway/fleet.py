"""The fleet as model listings: ``/api/tags``, ``/api/ps``, ``/api/show``, ``/v1/models`` and
``/v1/models/{id}``, from what ``coordinator.workers`` says (each live worker's models, and the
facts its backend reported about them: capabilities, digest, size, details).

A model several workers serve is one entry: its capabilities are the union of what the live
workers' copies can do (the router sends a request to a copy that can); digest, size, details
and context length are those of the copy most workers share (a tie goes to the copy of the
first worker by id). A worker that reported no facts counts as a copy that does
``completion``, with nothing else known. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import msgspec

from schemas.models import (
    COMPLETION,
    DEFAULT_CAPABILITIES,
    EMBEDDING,
    INSERT,
    THINKING,
    TOOLS,
    VISION,
    ModelDetails,
    ModelFacts,
    resolve_name,
)
from schemas.queries import WorkerView
from services.errors import Unavailable
from services.gateway.common import KEEP_ALIVE_S, ApiError, encoder, iso_now, refusal_status

# The order Ollama lists capabilities in; any other a backend names comes after, sorted.
_CAPABILITY_ORDER: Final = (COMPLETION, EMBEDDING, TOOLS, INSERT, VISION, THINKING)


@dataclass(frozen=True, slots=True)
class Served:
    """One model as the fleet serves it."""

    name: str
    workers: list[WorkerView]
    """The live inference workers serving it, by worker id."""
    facts: ModelFacts | None
    """The copy most workers share; None when no worker reported facts about it."""
    capabilities: list[str]

    @property
    def worker_ids(self) -> list[str]:
        return [w.worker_id for w in self.workers]

    @property
    def last_heartbeat(self) -> float:
        return max(w.last_heartbeat for w in self.workers)

    @property
    def modified_at(self) -> str:
        """When the backend last changed the model, else when a worker last checked in."""
        if self.facts is not None and self.facts.modified_at:
            return self.facts.modified_at
        return iso_now(self.last_heartbeat)

    @property
    def modified_unix(self) -> int:
        if self.facts is not None and self.facts.modified_at:
            try:
                return int(datetime.fromisoformat(self.facts.modified_at).timestamp())
            except ValueError:
                pass  # a stamp Python cannot read: the heartbeat instead
        return int(self.last_heartbeat)

    @property
    def details(self) -> dict[str, Any]:
        """Ollama's ``details``, every field present (the wire type leaves defaults out)."""
        details = self.facts.details if self.facts is not None else ModelDetails()
        return msgspec.structs.asdict(details)

    def listing(self) -> dict[str, Any]:
        """The fields ``/api/tags`` and ``/api/ps`` share (``workers`` is not Ollama's)."""
        return {
            "name": self.name,
            "model": self.name,
            "size": self.facts.size if self.facts else 0,
            "digest": self.facts.digest if self.facts else "",
            "details": self.details,
        }


def _ordered(capabilities: set[str]) -> list[str]:
    known = [c for c in _CAPABILITY_ORDER if c in capabilities]
    return known + sorted(capabilities - set(_CAPABILITY_ORDER))


def _served(name: str, workers: list[WorkerView]) -> Served:
    copies: dict[str, list[tuple[str, ModelFacts]]] = {}
    capabilities: set[str] = set()
    for worker in sorted(workers, key=lambda w: w.worker_id):
        facts = next((f for f in worker.facts if f.name == name), None)
        if facts is None:
            capabilities.update(DEFAULT_CAPABILITIES)
            continue
        capabilities.update(facts.capabilities)
        copies.setdefault(facts.digest, []).append((worker.worker_id, facts))
    # The copy most workers share; on a tie, the one whose first worker sorts first.
    shared = min(copies.values(), key=lambda held: (-len(held), held[0][0]), default=None)
    return Served(
        name=name,
        workers=sorted(workers, key=lambda w: w.worker_id),
        facts=shared[0][1] if shared else None,
        capabilities=_ordered(capabilities),
    )


def served_models(workers: Sequence[WorkerView]) -> dict[str, Served]:
    """Each model live inference workers serve (web-search ones left out: they take no
    inference tasks), sorted by name."""
    serving: dict[str, list[WorkerView]] = {}
    for worker in workers:
        if worker.tier == "web":
            continue
        for model in worker.models:
            serving.setdefault(model, []).append(worker)
    return {name: _served(name, held) for name, held in sorted(serving.items())}


def resolve(asked: str, served: Mapping[str, object], aliases: Mapping[str, str]) -> str:
    """The served name a request for ``asked`` means, as the router resolves it: a bare name is
    its ``:latest`` (and a ``:latest`` the bare name a server may list), each variant through
    the aliases; ``asked`` itself when none is served."""
    return resolve_name(asked, served.__contains__, lambda name: aliases.get(name, name))


def serving(
    asked: str,
    workers: Sequence[WorkerView],
    aliases: Mapping[str, str] | None = None,
    *,
    settling: bool = False,
) -> Served:
    """The model ``asked`` names (`resolve`), else the error: 404 in Ollama's words while some
    inference worker is live, 503 when none is (`refusal_status`'s rule for ``no_worker``),
    and 503 ``unavailable`` while the router's view is ``settling`` (`settling_refusal`)."""
    served = served_models(workers)
    found = served.get(resolve(asked, served, aliases or {}))
    if found is not None:
        return found
    if settling:
        raise settling_refusal(asked)
    if not any(w.tier != "web" for w in workers):
        raise ApiError(
            refusal_status("no_worker", fleet_has_workers=False),
            "no_worker",
            f"model '{asked}' is not served: no inference worker is live",
        )
    message = f"model '{asked}' not found"
    raise ApiError(refusal_status("no_worker", fleet_has_workers=True), "no_worker", message)


def settling_refusal(asked: str) -> ApiError:
    """A model not found while the router reads the registry again after a reconnect to NATS
    (``coordinator.workers``' ``settling``): its workers may be live, not yet read, so the
    answer is a retryable 503 (``unavailable``, with ``Retry-After``), never a 404."""
    return ApiError(
        refusal_status(Unavailable.code, fleet_has_workers=True),
        Unavailable.code,
        f"model '{asked}' is not listed yet: the router is reading the worker registry again "
        "after a reconnect to NATS; retry shortly",
    )


# -- Ollama's listings --------------------------------------------------------------------------


def ollama_tags(workers: Sequence[WorkerView]) -> bytes:
    """``GET /api/tags``: the union of the live workers' models, with their facts;
    ``workers`` (not in Ollama's shape) names who serves each."""
    models = [
        {
            **model.listing(),
            "modified_at": model.modified_at,
            "capabilities": model.capabilities,
            "workers": model.worker_ids,
        }
        for model in served_models(workers).values()
    ]
    return encoder.encode({"models": models})


def ollama_ps(workers: Sequence[WorkerView]) -> bytes:
    """``GET /api/ps``: the models live workers are running a task of, as of their last
    heartbeat; ``expires_at`` is that heartbeat plus Ollama's default keep-alive."""
    served = served_models(workers)
    running: dict[str, list[WorkerView]] = {}
    for worker in workers:
        if worker.state == "busy" and worker.current_model:
            running.setdefault(worker.current_model, []).append(worker)
    models = []
    for name, busy in sorted(running.items()):
        model = served.get(name) or _served(name, busy)
        models.append(
            {
                **model.listing(),
                "expires_at": iso_now(max(w.last_heartbeat for w in busy) + KEEP_ALIVE_S),
                "size_vram": 0,
                "context_length": (model.facts.context_length if model.facts else None) or 0,
                "workers": sorted(w.worker_id for w in busy),
            }
        )
    return encoder.encode({"models": models})


def ollama_show(asked: str, model: Served) -> bytes:
    """``POST /api/show`` for a served model: its capabilities and details, and ``model_info``
    with what ``ollama show`` reads (``general.architecture``, the family's
    ``context_length``). The fleet has no template, parameters or license to show; the
    modelfile names who serves it; ``workers`` is not in Ollama's shape."""
    family = model.details["family"]
    info: dict[str, Any] = {"general.architecture": family}
    context = model.facts.context_length if model.facts else None
    if family and context:
        info[f"{family}.context_length"] = context
    modelfile = (
        "# Modelfile generated by the Coordinator gateway: the fleet serves this model from\n"
        f"# {', '.join(model.worker_ids)}\n"
        f"FROM {asked}\n"
    )
    return encoder.encode(
        {
            "modelfile": modelfile,
            "parameters": "",
            "template": "",
            "details": model.details,
            "model_info": info,
            "capabilities": model.capabilities,
            "modified_at": model.modified_at,
            "workers": model.worker_ids,
        }
    )


# -- OpenAI's listings --------------------------------------------------------------------------


def owned_by(name: str) -> str:
    """The namespace Ollama's ``/v1`` names as a model's owner (``library`` for plain names)."""
    parts = name.split("/")
    return parts[-2] if len(parts) > 1 else "library"


def _openai_model(model_id: str, model: Served) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": model.modified_unix,
        "owned_by": owned_by(model_id),
    }


def openai_models(workers: Sequence[WorkerView]) -> bytes:
    """``GET /v1/models``: the same union as ``/api/tags``."""
    data = [_openai_model(name, model) for name, model in served_models(workers).items()]
    return encoder.encode({"object": "list", "data": data})


def openai_model(
    asked: str,
    workers: Sequence[WorkerView],
    aliases: Mapping[str, str],
    *,
    settling: bool = False,
) -> bytes:
    """``GET /v1/models/{id}``: the model as asked, or OpenAI's 404 (``model_not_found``);
    503 while the router's view is ``settling`` (`settling_refusal`)."""
    served = served_models(workers)
    found = served.get(resolve(asked, served, aliases))
    if found is None:
        if settling:
            raise settling_refusal(asked)
        raise ApiError(404, "model_not_found", f"model '{asked}' not found")
    return encoder.encode(_openai_model(asked, found))


Listing = Callable[[list[WorkerView]], bytes]

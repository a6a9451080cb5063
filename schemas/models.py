"""What a model can do and how it is named: facts workers read from their backend and
register, and the rules every service applies to them.

Capabilities are Ollama's words (``/api/show``): ``completion`` (generates text), ``tools``
(can answer with tool calls), ``vision`` (reads images), ``embedding`` (makes vectors),
``thinking`` (reasons apart from its answer), ``insert`` (fills in between a prompt and a
suffix). A request needs some of them (`needs_of`); the router sends it only to a worker
whose copy of the model has them all (`lacks`, `can_serve`; lesson 12). The one module of
these rules and the names' (`resolve_name`): every service applies them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

import msgspec

from schemas.base import Wire
from schemas.work import Work

COMPLETION: Final = "completion"
TOOLS: Final = "tools"
VISION: Final = "vision"
EMBEDDING: Final = "embedding"
THINKING: Final = "thinking"
INSERT: Final = "insert"
# What a model is taken to do when its backend says nothing more (a worker that predates
# capabilities registered its models after a sanity generation).
DEFAULT_CAPABILITIES: Final = (COMPLETION,)

LATEST: Final = "latest"


class ModelDetails(Wire, frozen=True, kw_only=True):
    """Ollama's ``details`` of a model (``/api/tags``, ``/api/show``)."""

    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelFacts(Wire, frozen=True, kw_only=True):
    """One model as a worker's backend describes it; registered with the worker."""

    name: str
    """The canonical name (aliases applied), as in `WorkerRecord.models`."""
    capabilities: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_CAPABILITIES))
    digest: str = ""
    size: int = 0
    """Bytes on disk."""
    details: ModelDetails = msgspec.field(default_factory=ModelDetails)
    context_length: int | None = None
    modified_at: str | None = None
    """When the backend last changed the model (RFC 3339), as its model list says."""


def facts_in(facts: Iterable[ModelFacts], model: str) -> ModelFacts:
    """``model``'s entry among a worker's ``facts``; `ModelFacts`'s defaults (completion only)
    when the worker gave none (it predates capabilities, or its backend could not say)."""
    return next((f for f in facts if f.name == model), None) or ModelFacts(name=model)


def has_tag(name: str) -> bool:
    """Does an Ollama name carry a tag (``model:tag``)? A colon before the last ``/`` is a
    host's port (``localhost:5000/library/model``), not a tag."""
    return ":" in name.rsplit("/", 1)[-1]


def name_variants(name: str) -> tuple[str, ...]:
    """The names one model may be listed under, as Ollama resolves them: a bare name means its
    ``:latest`` tag (``nomic-embed-text`` is ``nomic-embed-text:latest``), and the other way
    round for servers that list bare names (an OpenAI-compatible one). ``name`` comes first."""
    if not has_tag(name):
        return (name, f"{name}:{LATEST}")
    if name.endswith(f":{LATEST}"):
        return (name, name[: -len(LATEST) - 1])
    return (name,)


def resolve_name(
    asked: str, known: Callable[[str], bool], canonical: Callable[[str], str] = str
) -> str:
    """The name a request for ``asked`` is served as: each of its `name_variants` through the
    aliases (``canonical``), each result's variants in turn, the first that ``known``
    accepts; else ``asked``'s canonical name. The router and the gateway both resolve so."""
    for variant in name_variants(asked):
        for name in name_variants(canonical(variant)):
            if known(name):
                return name
    return canonical(asked)


def needed_capabilities(
    *,
    task_type: str,
    tools: bool = False,
    images: bool = False,
    think: bool | str | None = None,
    suffix: bool = False,
) -> tuple[str, ...]:
    """What a request needs of a model, in the order a refusal names them (Ollama's order).

    ``think`` needs ``thinking`` when it asks for thinking (true or a level); false or None
    is the model's default, which any model can give."""
    if task_type == "embedding":
        return (EMBEDDING,)
    needs = [COMPLETION]
    if tools:
        needs.append(TOOLS)
    if suffix:
        needs.append(INSERT)
    if images:
        needs.append(VISION)
    if think is not None and think is not False:
        needs.append(THINKING)
    return tuple(needs)


def needs_of(work: Work) -> tuple[str, ...]:
    """The model capabilities a request (or its task) needs: the router and the reaper route
    it only to a worker whose copy of the model has them all."""
    return needed_capabilities(
        task_type=work.task_type,
        tools=bool(work.tools),
        images=bool(work.images) or any(m.images for m in work.messages or ()),
        think=work.think,
        suffix=bool(work.suffix),
    )


def missing(needed: Iterable[str], capabilities: Iterable[str]) -> list[str]:
    """The needed capabilities that ``capabilities`` lacks, in ``needed``'s order."""
    have = set(capabilities)
    return [c for c in needed if c not in have]


def does_not_support(model: str, lacking: Iterable[str]) -> str:
    """Ollama's words for a request a model cannot take: ``llama3.2:1b does not support
    tools``, ``"llama3.2:1b" does not support thinking`` (its thinking check quotes the name);
    several capabilities are joined with newlines, as Go's ``errors.Join`` writes them."""
    lacking = list(lacking)
    if lacking == [THINKING]:
        return f'"{model}" does not support thinking'
    return f"{model} does not support " + "\n".join(lacking)


class Serving(Protocol):
    """A worker as the capability rules see it (`schemas.workers.WorkerRecord`)."""

    @property
    def models(self) -> Sequence[str]: ...

    def facts_of(self, model: str) -> ModelFacts: ...


def lacks(worker: Serving, model: str, needs: Sequence[str]) -> list[str]:
    """What ``worker``'s copy of ``model`` lacks of ``needs`` (lesson 12: a request goes only
    to a copy that can do all of it, never to one that would drop the tools or images)."""
    return missing(needs, worker.facts_of(model).capabilities)


def can_serve(worker: Serving, model: str, needs: Sequence[str]) -> bool:
    """Does ``worker`` serve ``model`` with every capability in ``needs``?"""
    return model in worker.models and not lacks(worker, model, needs)

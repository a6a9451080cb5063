"""The web-search worker: one task at a time from the shared ``tasks.web`` queue.

Every web worker binds the one durable pull consumer ``web`` on ``tasks.web``; the task loop
(`services.runtime.taskloop`) holds one message at a time and finishes it (outcome stored,
message acknowledged) before pulling the next, so each worker runs one task at a time while
any number of them share the queue. This is the web-search kind; a task ends:

- ``done`` with the model's answer, its sources and who did the work;
- ``done`` with the plain list of results and a ``note`` when the summary failed or ran out
  of time (the search is what was asked for; the summary is a convenience);
- ``failed`` with the reason when SearXNG failed (refused, timed out, 429, 5xx, not JSON, no
  results), when its client cancelled it, or when the worker that began it was lost
  (`services.fleet.takeover`).

Web-search tasks are never run twice (docs/design.md, lesson 8): their failures surface.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable
from contextlib import suppress
from typing import TypeVar

import msgspec
import structlog
from nats.aio.client import Client

from schemas.events import Durations, TaskCompleted, TaskFailed, Tokens
from schemas.work import Work
from schemas.workers import Capability
from services import __version__
from services.backends import Backend, Generation
from services.backends.choose import make_backend
from services.errors import BackendError, BackendTimeout, SearchError, WorkerStopping
from services.runtime.bus import connect
from services.runtime.consumers import WEB_POOL, Queue
from services.runtime.lifecycle import close_bus, stop_within
from services.runtime.settings import WebSearchSettings
from services.runtime.taskkind import Attempt, KindDefaults, LoopSettings, loop_settings
from services.runtime.taskloop import TaskLoop
from services.web_search.searxng import SearxngClient
from services.web_search.summary import (
    fallback_note,
    fallback_response,
    is_served,
    summary_budget,
    summary_model,
    summary_prompt,
)

log = structlog.get_logger("web_search")

T = TypeVar("T")

# Once a stop's grace period is over, how long the current task gets to record what it has
# (the failure of an unfinished search, or the results without their summary).
WRAP_UP_S = 5.0


class WebSearch(KindDefaults):
    """The web-search kind: SearXNG's results, summarised by a model when it can. Its
    dependencies were checked (and logged) at start; its clients are the caller's to close."""

    def __init__(
        self, settings: WebSearchSettings, searxng: SearxngClient, backend: Backend
    ) -> None:
        self.settings = settings
        self.searxng = searxng
        self.backend = backend
        self.backend_kind = settings.summary_backend
        self.supports: list[Capability] = ["web_search"]

    @property
    def address(self) -> str:
        return self.backend.address

    @property
    def models(self) -> list[str]:
        return [self.settings.ollama_model]

    def queues(self) -> list[Queue]:
        return [WEB_POOL]

    async def check_dependencies(self, nc: Client) -> None:
        """The start banner: version, then each dependency OK or what is wrong with it.

        Only NATS is required to start (without it the worker cannot register). SearXNG or the
        summary backend being down is logged loudly and the worker starts anyway: tasks then
        fail (no SearXNG) or fall back to plain results (no summary), each saying why.
        """
        s = self.settings
        log.info(
            "coordinator web-search starting",
            version=__version__,
            worker_id=s.worker_id,
            host=s.worker_host,
            pid=os.getpid(),
        )
        log.info("NATS OK", url=s.nats_url, server_version=str(nc.connected_server_version))
        try:
            await self.searxng.check(timeout_s=s.search_timeout_s)
        except SearchError as exc:
            log.warning(
                "SearXNG NOT OK: web-search tasks will fail until it answers",
                url=self.searxng.address,
                error=f"{exc.code}: {exc.message}",
            )
        else:
            log.info("SearXNG OK", url=self.searxng.address)
        problem = await self._backend_problem()
        if problem:
            log.warning(
                "backend NOT OK: answers will be plain result lists until it is",
                backend=s.summary_backend,
                url=self.backend.address,
                model=s.ollama_model,
                error=problem,
            )
        else:
            log.info(
                "backend OK",
                backend=s.summary_backend,
                url=self.backend.address,
                model=s.ollama_model,
            )

    async def _backend_problem(self) -> str | None:
        try:
            served = await self.backend.list_models()
        except BackendError as exc:
            return f"{exc.code}: {exc.message}"
        if not is_served(self.settings.ollama_model, served):
            return (
                f"OLLAMA_MODEL '{self.settings.ollama_model}' is not served "
                f"(serves: {', '.join(served) or 'none'})"
            )
        return None

    async def run(self, attempt: Attempt) -> TaskCompleted | TaskFailed:
        """Search, then summarise; a failed summary falls back to the plain results."""
        s = self.settings
        task = attempt.task
        began = time.perf_counter()
        try:
            sources = await _unless_cut(
                attempt.cut,
                self.searxng.search(
                    task.work.prompt,
                    limit=s.searxng_results,
                    timeout_s=min(s.search_timeout_s, task.timeout_s),
                    categories=s.searxng_categories,
                    language=s.searxng_language,
                ),
                self.stopping("the search"),
            )
        except (SearchError, WorkerStopping) as exc:
            return TaskFailed(
                at=time.time(),
                task_id=task.task_id,
                attempt=task.attempt,
                worker=s.worker_id,
                code=exc.code,
                reason=exc.message,
                retryable=False,  # web-search tasks are never run twice
                durations=Durations(total_ms=_ms_since(began)),
            )
        model = summary_model(task.model, s.ollama_model)
        budget = summary_budget(
            task_timeout_s=task.timeout_s,
            elapsed_s=time.perf_counter() - began,
            summary_timeout_s=s.summary_timeout_s,
        )
        generation: Generation | None = None
        note: str | None = None
        if budget == 0:
            note = fallback_note(
                BackendTimeout.code,
                f"no time left for a summary within the task's timeout of {task.timeout_s:g} s",
            )
        else:
            try:
                generation = await _unless_cut(
                    attempt.cut,
                    self.backend.generate(
                        model,
                        Work(
                            prompt=summary_prompt(task.work.prompt, sources),
                            options=task.work.options,
                        ),
                        timeout_s=budget,
                        progress=attempt.progress,
                    ),
                    self.stopping("the summary"),
                )
                if not generation.response.strip():
                    raise BackendError(f"{model} returned an empty answer")
            except (BackendError, WorkerStopping) as exc:
                generation = None
                note = fallback_note(exc.code, exc.message)
        total_ms = _ms_since(began)
        if generation is None:
            response, thinking = fallback_response(sources), None
            durations, tokens = Durations(total_ms=total_ms), Tokens()
        else:
            response, thinking = generation.response.strip(), generation.thinking
            durations = msgspec.structs.replace(
                generation.durations, total_ms=total_ms, first_token_ms=generation.first_token_ms
            )
            tokens = generation.tokens
        return TaskCompleted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=s.worker_id,
            model=model,
            response=response,
            thinking=thinking,
            durations=durations,
            tokens=tokens,
            host=s.worker_host,
            sources=sources,
            note=note,
        )

    def stopping(self, step: str) -> WorkerStopping:
        return WorkerStopping(
            f"web worker '{self.settings.worker_id}' on host {self.settings.worker_host} "
            f"was stopped and its grace period (STOP_GRACE_S={self.settings.stop_grace_s:g})"
            f" ran out during {step}"
        )


async def _unless_cut(cut_event: asyncio.Event, step_work: Awaitable[T], why: WorkerStopping) -> T:
    """Await ``step_work``; if the stop's grace runs out first (``cut_event``), cancel it
    and raise ``why``."""
    work = asyncio.ensure_future(step_work)
    cut = asyncio.create_task(cut_event.wait())
    try:
        await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise why
    finally:
        cut.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work


def web_loop_settings(settings: WebSearchSettings) -> LoopSettings:
    """The task loop's part: never run twice, and at a stop a task records what it has."""
    return loop_settings(settings, wrap_up_s=WRAP_UP_S, runs_twice=False)


def _ms_since(began: float) -> float:
    return (time.perf_counter() - began) * 1000


async def run(settings: WebSearchSettings, stop: asyncio.Event) -> None:
    """Run one web-search worker until ``stop`` is set."""
    nc = await connect(
        settings.nats_url,
        f"coordinator-web-search-{settings.worker_id}",
        auth=settings.nats_auth(),
    )
    searxng = SearxngClient(
        settings.searxng_url, connect_timeout_s=settings.backend_connect_timeout_s
    )
    backend = make_backend(
        settings.summary_backend,
        ollama_host=settings.ollama_host,
        openai_base_url=settings.openai_base_url,
        openai_api_key=settings.openai_api_key,
        connect_timeout_s=settings.backend_connect_timeout_s,
    )
    kind = WebSearch(settings, searxng, backend)
    try:
        await kind.check_dependencies(nc)
        await TaskLoop(nc, kind, web_loop_settings(settings)).run(stop)
    finally:
        await stop_within("close the SearXNG client", searxng.aclose())
        await stop_within("close the backend's connections", backend.aclose())
        await close_bus(nc)

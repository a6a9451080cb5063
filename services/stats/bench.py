"""``coordinator bench``: the nightly benchmark (lesson 2: it is how a duplicate worker shows).

A cron-friendly job that needs only NATS. It asks ``coordinator.workers`` who is live and
sends every prompt of the set (built in, or ``--prompts FILE``) to every live worker serving
each model (``--models`` narrows them; default: every model a live worker serves), through
``coordinator.route`` with ``wait`` and the worker designated, so each worker is measured on
its own. Workers run side by side, each its prompts one at a time, as they would anyway.

As results arrive it prints ``done 9005ms LFM2.5-1.2B-JP (ai-core) [code-fib]`` or ``error -
gemma3:1b (esxi) timed out [code-fib]``; at the end a table per model and worker, and a
warning for each worker that ran a model at twice its own baseline or worse (`baseline.py`:
the median of its earlier clean runs, which the stats service keeps from earlier runs' bench
events, exclusions left out). Durations are the backend's own (from the task's ``completed``
event), not the time spent queueing.

The run is recorded as events: ``events.bench.<run_id>.started``, one ``.result`` per prompt
and worker, ``.finished``. Exit status: 0 when every prompt was done at normal speed, 1 when
one failed or the run could not start, 3 when all were done but some worker was slow.

The pure parts are beside it: ``bench_prompts`` (the prompt set, a prompt file's text read)
and ``bench_report`` (results, exit status, the table and warnings).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import nats.js.errors
from nats.aio.client import Client

from schemas import message_ids
from schemas.events import (
    AnyEvent,
    BenchFinished,
    BenchResult,
    BenchStarted,
    TaskCompleted,
    task_event_decoder,
)
from schemas.models import COMPLETION, facts_in
from schemas.queries import WorkersReply
from schemas.route import RouteReply, RouteRequest, failure_of
from schemas.stats import BaselinesQuery, BaselinesReply
from schemas.subjects import ROUTE, STATS_BASELINES, WORKERS, task_event
from services.errors import ConfigError, CoordinatorError, NoWorker
from services.runtime.bus import publish_event
from services.runtime.outcomes import last_on
from services.runtime.request import call
from services.stats.baseline import PromptBaseline, Sample, compare
from services.stats.bench_prompts import BenchPrompt, parse_prompts
from services.stats.bench_report import BenchReport, Result, failed_result, progress_line

# Extra time a request waits beyond the task's own timeout: queueing and event delivery.
REQUEST_MARGIN_S: Final = 60.0

_encoder = msgspec.json.Encoder()


def load_prompts(path: Path) -> list[BenchPrompt]:
    """Prompts from the file ``path`` (the forms `bench_prompts.parse_prompts` reads).

    Raises `ConfigError` naming what is wrong, an unreadable file included.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: {exc.strerror or exc}") from None
    return parse_prompts(path, text)


def new_run_id() -> str:
    return f"bench-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"


class Bench:
    """One benchmark run over the live fleet."""

    def __init__(
        self,
        nc: Client,
        *,
        timeout_s: float = 300.0,
        say: Callable[[str], None] = print,
        run_id: str | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.timeout_s = timeout_s
        self.say = say
        self.report = BenchReport(run_id=run_id or new_run_id())
        self._index = 0

    async def run(self, prompts: list[BenchPrompt], models: list[str] | None) -> BenchReport:
        """Run every prompt on every (model, worker), record and compare; see the module doc."""
        plan, missing = await self._plan(models)
        all_models = sorted({m for m, _ in plan} | set(missing))
        baselines = await self._baselines(all_models)
        workers = sorted({w for _, w in plan})
        await self._record(
            BenchStarted(
                at=time.time(),
                run_id=self.report.run_id,
                models=all_models,
                workers=workers,
                prompts=len(prompts),
            )
        )
        for model in missing:
            for prompt in prompts:
                await self._result(
                    Result(
                        model,
                        "",
                        prompt,
                        ok=False,
                        error="no live worker serves it",
                        error_code=NoWorker.code,
                    )
                )
        by_worker: dict[str, list[str]] = {}
        for model, worker in plan:
            by_worker.setdefault(worker, []).append(model)
        await asyncio.gather(
            *(self._run_worker(worker, ms, prompts) for worker, ms in sorted(by_worker.items()))
        )
        samples = [
            Sample(r.model, r.worker, r.prompt.key, r.total_ms)
            for r in self.report.results
            if r.ok and r.total_ms is not None
        ]
        self.report.comparisons = compare(samples, baselines)
        await self._record(
            BenchFinished(
                at=time.time(),
                run_id=self.report.run_id,
                ok=len(self.report.results) - self.report.failed,
                failed=self.report.failed,
                slow=[f"{c.model} ({c.worker})" for c in self.report.slow],
            )
        )
        return self.report

    async def _plan(self, models: list[str] | None) -> tuple[list[tuple[str, str]], list[str]]:
        """``[(model, worker)]`` to run, and the requested models no live worker serves."""
        reply = msgspec.json.decode(await call(self.nc, WORKERS, b"{}", 10.0), type=WorkersReply)
        # Generation prompts: models that cannot generate (embedding-only ones) are left out.
        served = sorted(
            {
                (m, w.worker_id)
                for w in reply.workers
                for m in w.models
                if COMPLETION in facts_in(w.facts, m).capabilities
            }
        )
        if models is None:
            if not served:
                raise NoWorker("no live workers: nothing to benchmark")
            return served, []
        plan = [(m, w) for m, w in served if m in models]
        missing = sorted(set(models) - {m for m, _ in plan})
        return plan, missing

    async def _baselines(self, models: list[str]) -> dict[tuple[str, str, str], PromptBaseline]:
        if not models:
            return {}
        query = BaselinesQuery(models=models, exclude_run=self.report.run_id)
        try:
            body = await call(self.nc, STATS_BASELINES, _encoder.encode(query), 30.0)
        except CoordinatorError as exc:
            message = exc.message
            self.report.notes.append(f"no baselines (the stats service: {message})")
            return {}
        reply = msgspec.json.decode(body, type=BaselinesReply)
        return {
            (b.model, b.worker, b.prompt_key): PromptBaseline(b.median_ms, b.runs)
            for b in reply.baselines
        }

    async def _run_worker(self, worker: str, models: list[str], prompts: list[BenchPrompt]) -> None:
        for model in models:
            for prompt in prompts:
                await self._result(await self._ask(model, worker, prompt))

    async def _ask(self, model: str, worker: str, prompt: BenchPrompt) -> Result:
        request = RouteRequest(
            prompt=prompt.prompt,
            model=model,
            worker=worker,
            domain=prompt.domain,
            wait=True,
            timeout_s=self.timeout_s,
        )
        started = time.perf_counter()
        try:
            body = await call(
                self.nc, ROUTE, _encoder.encode(request), self.timeout_s + REQUEST_MARGIN_S
            )
        except CoordinatorError as exc:
            return failed_result(model, worker, prompt, exc)
        wall_ms = (time.perf_counter() - started) * 1000
        reply = msgspec.json.decode(body, type=RouteReply)
        if reply.status != "done":
            failure = failure_of(reply)
            return Result(
                model,
                worker,
                prompt,
                ok=False,
                task_id=reply.task_id,
                error=failure.summary,
                error_code=failure.code,
            )
        total_ms, load_ms = await self._durations(reply.task_id, worker, wall_ms)
        return Result(
            model,
            worker,
            prompt,
            ok=True,
            total_ms=total_ms,
            load_ms=load_ms,
            task_id=reply.task_id,
        )

    async def _durations(
        self, task_id: str, worker: str, wall_ms: float
    ) -> tuple[float, float | None]:
        """The backend's own durations from the ``completed`` event of the worker the task
        was sent to (its own subject: no other worker's can stand in for it)."""
        try:
            # By subject (a direct get): the jobs' user reads only these events, no prompt.
            stored = await last_on(self.js, task_event(task_id, "completed", worker))
            if stored is None:
                raise nats.js.errors.NotFoundError
            event = task_event_decoder.decode(stored)
        except (nats.js.errors.Error, msgspec.DecodeError) as exc:
            self.report.notes.append(f"task {task_id}: wall-clock time used ({exc!r})")
            return wall_ms, None
        if not isinstance(event, TaskCompleted):
            return wall_ms, None
        return event.durations.total_ms, event.durations.load_ms

    async def _result(self, result: Result) -> None:
        self.report.results.append(result)
        self.say(progress_line(result))
        index = self._index
        self._index += 1
        await self._record(
            BenchResult(
                at=time.time(),
                run_id=self.report.run_id,
                index=index,
                model=result.model,
                worker=result.worker,
                domain=result.prompt.domain,
                prompt_key=result.prompt.key,
                prompt_name=result.prompt.name,
                ok=result.ok,
                task_id=result.task_id,
                total_ms=result.total_ms,
                load_ms=result.load_ms,
                error=result.error,
            )
        )

    async def _record(self, event: AnyEvent) -> None:
        index = getattr(event, "index", "")
        msg_id = message_ids.bench_event(self.report.run_id, type(event).__name__, index)
        try:
            await publish_event(self.js, event, msg_id=msg_id)
        except Exception as exc:
            self.report.notes.append(f"could not record a bench event: {exc!r}")

"""``coordinator judge``: score done, unscored tasks with an LLM judge (lessons 9 and 3).

A cron-friendly job. It reads the tasks to judge from the stats read model (PostgreSQL,
``PG_DSN``) and records each verdict as a `QualityScored` event, which the stats projection
turns into the figures' quality columns. The judge model runs on a judge host called
directly, not through routing (lesson 9): the primary (``JUDGE_OLLAMA_HOST``) when it answers
and serves ``JUDGE_MODEL``, else the fallback (``JUDGE_FALLBACK_HOST``); when neither does the
job stops before judging anything (`JudgeUnavailable`). A host that stops answering in the
middle of a run (`BackendUnavailable`, `BackendTimeout`) is replaced by the other one; when
there is none left the run ends, keeping what it recorded. ``BATCH_LIMIT`` caps the verdicts
per run, for slow hosts.

Never the same task twice, even when two runs overlap or a run is repeated: a verdict is
published on the task's own subject ``events.quality.<task_id>.scored`` with
``Nats-Expected-Last-Subject-Sequence: 0``, so the stream stores it only if no verdict for the
task exists (the loser's publish is refused and counted as ``already scored``); before asking
the judge, the job also looks for a verdict in the stream, which covers the time the
projection takes to catch up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from schemas import message_ids
from schemas.events import QualityScored
from schemas.route import MAX_TIMEOUT_S
from schemas.subjects import EVENTS_STREAM, quality_event
from schemas.work import Work
from services.backends.ollama import OllamaBackend
from services.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
    JudgeUnavailable,
    Unavailable,
)
from services.fleet.domains import classify_domain
from services.runtime.bus import is_wrong_last_sequence, publish_event
from services.runtime.outcomes import last_on
from services.runtime.settings import Settings
from services.stats.projection import TaskState
from services.stats.store import Store
from services.stats.verdict import judge_prompt, parse_verdict

log = structlog.get_logger("judge")

# Kept with a verdict so a malformed one can be read later; enough for any sane verdict.
MAX_TEXT_CHARS: Final = 2000
# Verdicts per run at most: a run is a cron job's worth, and the limit goes into a query.
MAX_BATCH_LIMIT: Final = 10_000
# The stream refuses a publish whose expected last subject sequence does not match.


class JudgeSettings(Settings, frozen=True, kw_only=True):
    """``coordinator judge``: flags override these environment variables."""

    pg_dsn: str
    judge_ollama_host: str = "http://localhost:11434"
    judge_fallback_host: str | None = None
    judge_model: str
    batch_limit: int = 20
    judge_timeout_s: float = 300.0
    judge_connect_timeout_s: float = 5.0

    def check(self) -> None:
        if not 1 <= self.batch_limit <= MAX_BATCH_LIMIT:
            raise ConfigError(
                f"BATCH_LIMIT={self.batch_limit} must be at least 1 and at most {MAX_BATCH_LIMIT}"
            )
        for name in ("judge_timeout_s", "judge_connect_timeout_s"):
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:  # NaN included
                raise ConfigError(
                    f"{name.upper()} must be a positive number of seconds, at most "
                    f"{MAX_TIMEOUT_S:.0f} (a day)"
                )


@dataclass
class JudgeReport:
    """What a run did, for its summary line and exit status."""

    host: str | None = None
    scored: int = 0
    malformed: int = 0
    already_scored: int = 0
    errors: list[str] = field(default_factory=list)
    stopped: str | None = None
    """Why the run ended early (the judge hosts stopped answering), or None."""

    @property
    def judged(self) -> int:
        return self.scored + self.malformed

    @property
    def ok(self) -> bool:
        return not self.errors and self.stopped is None


BackendFactory = Callable[[str, float], OllamaBackend]


def ollama_backend(host: str, connect_timeout_s: float) -> OllamaBackend:
    return OllamaBackend(host, connect_timeout_s=connect_timeout_s)


class Judge:
    """One run of the judge over the read model's unscored tasks."""

    def __init__(
        self,
        js: JetStreamContext,
        store: Store,
        settings: JudgeSettings,
        *,
        say: Callable[[str], None] = print,
        backend_factory: BackendFactory = ollama_backend,
    ) -> None:
        self.js = js
        self.store = store
        self.settings = settings
        self.say = say
        self.backend_factory = backend_factory
        self._backend: OllamaBackend | None = None
        self._tried: set[str] = set()

    @property
    def hosts(self) -> list[str]:
        """Primary first, then the fallback when there is one."""
        hosts = [self.settings.judge_ollama_host]
        fallback = self.settings.judge_fallback_host
        if fallback and fallback != hosts[0]:
            hosts.append(fallback)
        return hosts

    async def run(self) -> JudgeReport:
        """Judge up to ``batch_limit`` tasks; raises `JudgeUnavailable` before any when no
        judge host answers."""
        report = JudgeReport()
        limit = self.settings.batch_limit
        # Some candidates may turn out scored already (projection lag, an overlapping run).
        candidates = await self.store.unscored_tasks(limit * 2 + 10)
        if not candidates:
            return report
        try:
            backend = await self._next_backend()
            report.host = backend.address
            for task in candidates:
                if report.judged >= limit:
                    break
                if await self._scored_in_stream(task.task_id):
                    report.already_scored += 1
                    continue
                await self._judge(task, report)
        except JudgeUnavailable as exc:
            if report.host is None:
                raise
            report.stopped = exc.message
        finally:
            if self._backend is not None:
                await self._backend.aclose()
        return report

    async def _next_backend(self) -> OllamaBackend:
        """The first host not tried yet that answers and serves the judge model."""
        problems = []
        for host in self.hosts:
            if host in self._tried:
                continue
            self._tried.add(host)
            backend = self.backend_factory(host, self.settings.judge_connect_timeout_s)
            try:
                models = await backend.list_models()
            except BackendError as exc:
                problems.append(f"{host}: {exc.message}")
                await backend.aclose()
                continue
            if not _serves(models, self.settings.judge_model):
                problems.append(f"{host} does not serve {self.settings.judge_model}")
                await backend.aclose()
                continue
            if self._backend is not None:
                await self._backend.aclose()
            self._backend = backend
            return backend
        if not problems:
            raise JudgeUnavailable("no other judge host to try (set JUDGE_FALLBACK_HOST)")
        raise JudgeUnavailable("no judge host answers: " + "; ".join(problems))

    async def _judge(self, task: TaskState, report: JudgeReport) -> None:
        domain = task.domain or classify_domain(task.prompt)
        rubric, prompt = judge_prompt(task.prompt, task.response or "", domain)
        while True:
            assert self._backend is not None
            backend = self._backend
            try:
                generation = await backend.generate(
                    self.settings.judge_model,
                    Work(prompt=prompt, options={"temperature": 0}),
                    timeout_s=self.settings.judge_timeout_s,
                )
                break
            except (BackendUnavailable, BackendTimeout) as exc:
                log.warning("judge host stopped answering", host=backend.address, error=exc.message)
                self.say(f"judge host {backend.address} stopped answering: {exc.message}")
                report.host = (await self._next_backend()).address
            except BackendError as exc:
                report.errors.append(f"{task.task_id}: {exc.message}")
                self.say(f"error {task.task_id}: {exc.message}")
                return
        verdict = parse_verdict(generation.response)
        event = QualityScored(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            verdict="scored" if verdict.ok else "malformed",
            score=verdict.score,
            rubric=rubric,
            judge_model=self.settings.judge_model,
            judge_host=backend.address,
            text=generation.response[:MAX_TEXT_CHARS],
            reason=verdict.malformed or "",
        )
        if not await self._record(event):
            report.already_scored += 1
            self.say(f"already scored {task.task_id} (by another run)")
            return
        where = f"{task.model} ({task.worker or '-'}) [{rubric}]"
        if verdict.score is not None:
            report.scored += 1
            self.say(f"scored {verdict.score:.2f} {task.task_id} {where}")
        else:
            report.malformed += 1
            self.say(f"malformed {task.task_id} {where}: {verdict.malformed}")

    async def _scored_in_stream(self, task_id: str) -> bool:
        try:
            # By subject (a direct get): the jobs' user reads only these events, no prompt.
            return await last_on(self.js, quality_event(task_id, "scored")) is not None
        except Exception as exc:
            raise Unavailable(f"cannot read {EVENTS_STREAM}: {exc!r}") from exc

    async def _record(self, event: QualityScored) -> bool:
        """Store the verdict unless the task has one; False when it had."""
        try:
            ack = await publish_event(
                self.js,
                event,
                msg_id=message_ids.quality(event.task_id),
                headers={"Nats-Expected-Last-Subject-Sequence": "0"},
            )
        except nats.js.errors.APIError as exc:
            if is_wrong_last_sequence(exc):
                return False
            raise Unavailable(f"could not record the verdict: {exc}") from exc
        except Exception as exc:
            raise Unavailable(f"could not record the verdict: {exc!r}") from exc
        return not getattr(ack, "duplicate", False)


def _serves(models: list[str], wanted: str) -> bool:
    """Whether ``wanted`` is among ``models``, Ollama's way (no tag means ``latest``)."""

    def normal(name: str) -> str:
        name = name.strip().lower()
        return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"

    return normal(wanted) in {normal(m) for m in models}


def summary(report: JudgeReport, model: str) -> str:
    """The run's one summary line."""
    host = report.host or "-"
    line = (
        f"judge: {report.judged} judged ({report.scored} scored, {report.malformed} malformed), "
        f"{report.already_scored} already scored, {len(report.errors)} errors; "
        f"{model} at {host}"
    )
    if report.stopped:
        line += f"; stopped early: {report.stopped}"
    return line

"""The stats service's query and operator endpoints (bodies in ``schemas/stats.py``).

``coordinator.task``, ``coordinator.stats``, ``coordinator.stats.exclude`` / ``.include`` /
``.exclusions``, ``coordinator.stats.alias.add`` / ``.alias.remove``,
``coordinator.stats.aliases``, ``coordinator.stats.rebuild``, ``coordinator.stats.baselines``
and ``coordinator.stats.parked``.
Operator decisions (exclusions, aliases) are published as events and the reply comes once they
are projected, so a ``coordinator stats`` right after shows their effect.

Every instance of the service answers them, standing by or not: they read PostgreSQL, or
record an event that the projecting instance applies; only the figures and the rebuild
(`PROJECTING_ONLY`) need the projecting instance itself, and the service passes those on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import structlog
from nats.js import JetStreamContext

from schemas import message_ids
from schemas.events import (
    AliasRemoved,
    AliasSet,
    AnyEvent,
    ExclusionAdded,
    ExclusionWithdrawn,
    encoder,
    kind_of,
)
from schemas.stats import (
    AliasesReply,
    AliasRemoveRequest,
    AliasRequest,
    AliasView,
    Baseline,
    BaselinesQuery,
    BaselinesReply,
    ExcludeRequest,
    ExclusionsQuery,
    ExclusionsReply,
    ExclusionView,
    IncludeRequest,
    ParkedQuery,
    ParkedReply,
    RebuildReply,
    RebuildRequest,
    StatsQuery,
    StatsReply,
)
from schemas.subjects import (
    ALIAS_ADD,
    ALIAS_REMOVE,
    ALIASES,
    EVENTS_STREAM,
    STATS,
    STATS_BASELINES,
    STATS_EXCLUDE,
    STATS_EXCLUSIONS,
    STATS_INCLUDE,
    STATS_PARKED,
    STATS_REBUILD,
    TASK,
    task_events,
)
from services.errors import Conflict, NotFound, RebuildBusy, Unavailable
from services.fleet.aliases import check_alias
from services.fleet.identity import Owner, may_see
from services.runtime.bus import publish_event
from services.runtime.endpoints import Handler, reply_subject
from services.stats.projection import to_view
from services.stats.publisher import FigurePublisher
from services.stats.rebuild import rebuild
from services.stats.requests import check_exclusion, decode_request, new_id, parse_task_query
from services.stats.store import Store
from services.stats.tracking import event_digest

log = structlog.get_logger("stats")

# How long an operator request waits for its event to be projected before replying anyway.
PROJECTED_WAIT_S: Final = 5.0

T = TypeVar("T")

# The endpoints whose answer needs the instance that projects: the figures (it first brings
# up to date the figure rows its own batches touched) and the rebuild (it pauses the
# projection in that process, and brings the routing figures' bucket in line after).
PROJECTING_ONLY: Final = frozenset({"stats", "rebuild"})


class StatsEndpoints:
    """The handlers, each ``body -> reply``; a `CoordinatorError` is the error reply.

    ``pause`` is the live projection's batch lock, which a rebuild holds while it catches up
    and swaps the tables in.
    """

    def __init__(
        self,
        js: JetStreamContext,
        store: Store,
        publisher: FigurePublisher,
        pause: asyncio.Lock,
    ) -> None:
        self.js = js
        self.store = store
        self.publisher = publisher
        self._pause = pause
        self._rebuilding = False

    def routes(self) -> list[tuple[str, str, Handler]]:
        """(endpoint name, subject, handler) of every endpoint."""
        return [
            ("task", TASK, self.handle_task),
            ("stats", STATS, self.handle_stats),
            ("exclude", STATS_EXCLUDE, self.handle_exclude),
            ("include", STATS_INCLUDE, self.handle_include),
            ("exclusions", STATS_EXCLUSIONS, self.handle_exclusions),
            ("alias-add", ALIAS_ADD, self.handle_alias_add),
            ("alias-remove", ALIAS_REMOVE, self.handle_alias_remove),
            ("aliases", ALIASES, self.handle_aliases),
            ("rebuild", STATS_REBUILD, self.handle_rebuild),
            ("baselines", STATS_BASELINES, self.handle_baselines),
            ("parked", STATS_PARKED, self.handle_parked),
        ]

    async def handle_task(self, body: bytes) -> bytes:
        """``coordinator.task``: the task as projected, read-your-writes: when the stream holds
        a later event of the task than the projection has applied (the end its client has
        just been told), the answer waits for it (at most `PROJECTED_WAIT_S`)."""
        query = parse_task_query(body)
        last = await self._last_event(query.task_id)
        if last is not None:
            await self._when_projected(lambda: self._applied(*last), what="task event")
        state = await self.store.task_state(query.task_id)
        viewer = Owner.asking(reply_subject.get(), query.client)
        if state is None or not may_see(Owner.of(state.asker, state.client), viewer):
            # Another's task is answered as one nobody has: no hint that it exists.
            raise NotFound(f"no task '{query.task_id}' (it may not be projected yet)")
        return encoder.encode(to_view(state))

    async def handle_stats(self, body: bytes) -> bytes:
        """``coordinator.stats``: the figures, exclusions left out, aliases applied."""
        query = decode_request(body, StatsQuery, "stats query")
        await self.publisher.refresh_stale()  # what is projected shows, not what was a second ago
        figures = await self.store.figures(query)
        active = len(await self.store.exclusions())
        return encoder.encode(StatsReply(figures=figures, active_exclusions=active))

    async def handle_exclude(self, body: bytes) -> bytes:
        """``coordinator.stats.exclude``: record an exclusion (an event), reply with it."""
        request = decode_request(body, ExcludeRequest, "exclusion")
        check_exclusion(request)
        event = ExclusionAdded(
            at=time.time(),
            exclusion_id=new_id("x"),
            worker=request.worker,
            model=request.model,
            since=request.since,
            until=request.until,
            reason=request.reason.strip(),
        )
        await self._publish(event, msg_id=event.exclusion_id)

        async def projected() -> ExclusionView | None:
            return await self.store.exclusion(event.exclusion_id)

        view = await self._when_projected(projected)
        return encoder.encode(
            view
            or ExclusionView(
                exclusion_id=event.exclusion_id,
                worker=event.worker,
                model=event.model,
                since=event.since,
                until=event.until,
                reason=event.reason,
                added_at=event.at,
            )
        )

    async def handle_include(self, body: bytes) -> bytes:
        """``coordinator.stats.include``: withdraw an exclusion (an event)."""
        request = decode_request(body, IncludeRequest, "include request")
        existing = await self.store.exclusion(request.exclusion_id)
        if existing is None:
            raise NotFound(f"no exclusion '{request.exclusion_id}'")
        if existing.withdrawn_at is not None:
            raise Conflict(f"exclusion '{request.exclusion_id}' is already withdrawn")
        event = ExclusionWithdrawn(
            at=time.time(), exclusion_id=request.exclusion_id, reason=request.reason
        )
        await self._publish(event, msg_id=message_ids.exclusion_withdrawn(request.exclusion_id))

        async def projected() -> ExclusionView | None:
            view = await self.store.exclusion(request.exclusion_id)
            return view if view is not None and view.withdrawn_at is not None else None

        view = await self._when_projected(projected)
        return encoder.encode(view or existing)

    async def handle_exclusions(self, body: bytes) -> bytes:
        """``coordinator.stats.exclusions``: active exclusions (all with ``withdrawn``)."""
        query = decode_request(body, ExclusionsQuery, "exclusions query")
        exclusions = await self.store.exclusions(withdrawn=query.withdrawn)
        return encoder.encode(ExclusionsReply(exclusions=exclusions))

    async def handle_alias_add(self, body: bytes) -> bytes:
        """``coordinator.stats.alias.add``: one statistics key for two names (an event)."""
        request = decode_request(body, AliasRequest, "alias request")
        alias, canonical = request.alias.strip(), request.canonical.strip()
        check_alias(await self.store.alias_map(), alias, canonical)
        await self._publish(AliasSet(at=time.time(), alias=alias, canonical=canonical))

        async def projected() -> AliasView | None:
            views = {view.alias: view for view in await self.store.aliases()}
            return views.get(alias)

        view = await self._when_projected(projected)
        return encoder.encode(
            view or AliasView(alias=alias, canonical=canonical, set_at=time.time())
        )

    async def handle_alias_remove(self, body: bytes) -> bytes:
        """``coordinator.stats.alias.remove``: the name keys its own statistics again."""
        request = decode_request(body, AliasRemoveRequest, "alias request")
        views = {view.alias: view for view in await self.store.aliases()}
        existing = views.get(request.alias)
        if existing is None:
            raise NotFound(f"'{request.alias}' is not an alias")
        await self._publish(AliasRemoved(at=time.time(), alias=request.alias))

        async def projected() -> bool | None:
            return True if request.alias not in await self.store.alias_map() else None

        await self._when_projected(projected)
        return encoder.encode(existing)

    async def handle_aliases(self, body: bytes) -> bytes:
        """``coordinator.stats.aliases``: every alias and where it leads."""
        return encoder.encode(AliasesReply(aliases=await self.store.aliases()))

    async def handle_rebuild(self, body: bytes) -> bytes:
        """``coordinator.stats.rebuild``: replay the log into fresh tables, swap them in."""
        decode_request(body, RebuildRequest, "rebuild request")
        if self._rebuilding:
            raise RebuildBusy("a rebuild is already running; wait for it to finish")
        self._rebuilding = True
        try:
            result = await rebuild(self.js, self.store.dsn, pause=self._pause)
        finally:
            self._rebuilding = False
        self.publisher.resync()
        return encoder.encode(
            RebuildReply(
                events=result.events,
                last_seq=result.last_seq,
                seconds=result.seconds,
                events_per_s=result.events_per_s,
                figures=result.figures,
                parked=result.parked,
            )
        )

    async def handle_baselines(self, body: bytes) -> bytes:
        """``coordinator.stats.baselines``: each worker's earlier clean bench results."""
        query = decode_request(body, BaselinesQuery, "baselines query")
        baselines = [
            Baseline(model=model, worker=worker, prompt_key=key, median_ms=median, runs=runs)
            for model in query.models
            for worker, key, median, runs in await self.store.baselines(
                model, exclude_run=query.exclude_run
            )
        ]
        return encoder.encode(BaselinesReply(baselines=baselines))

    async def handle_parked(self, body: bytes) -> bytes:
        """``coordinator.stats.parked``: the events the projection could not apply, newest
        first, and how many there are."""
        decode_request(body, ParkedQuery, "parked query")
        parked, total = await self.store.parked()
        return encoder.encode(ParkedReply(parked=parked, total=total))

    async def _publish(self, event: AnyEvent, msg_id: str | None = None) -> None:
        try:
            await publish_event(self.js, event, msg_id=msg_id)
        except Exception as exc:
            raise Unavailable(f"could not record the {kind_of(event)} event: {exc!r}") from exc

    async def _when_projected(
        self, probe: Callable[[], Awaitable[T | None]], what: str = "operator event"
    ) -> T | None:
        """``probe()`` once it returns something, or None after `PROJECTED_WAIT_S`."""
        deadline = time.monotonic() + PROJECTED_WAIT_S
        while time.monotonic() < deadline:
            result = await probe()
            if result is not None:
                return result
            await asyncio.sleep(0.05)
        log.warning("not projected in time; replying anyway", waited_for=what)
        return None

    async def _last_event(self, task_id: str) -> tuple[int, bytes] | None:
        """The stream position and digest of the task's latest event (None: the stream has
        none, or cannot say now: the projection's answer stands)."""
        try:
            stored = await self.js.get_last_msg(EVENTS_STREAM, task_events(task_id), direct=True)
        except Exception:
            return None
        if stored.seq is None or stored.subject is None:
            return None
        return stored.seq, event_digest(stored.subject, stored.data or b"")

    async def _applied(self, seq: int, digest: bytes) -> bool | None:
        return True if await self.store.applied(seq, digest) else None

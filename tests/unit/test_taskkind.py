"""A worker kind declares only what differs from `KindDefaults`; the rest is the defaults'."""

from __future__ import annotations

import asyncio

from schemas.events import TaskCompleted, TaskFailed
from schemas.tasks import TaskMessage
from schemas.work import Work
from schemas.workers import Capability
from services.runtime.consumers import WEB_POOL, Queue
from services.runtime.taskkind import Attempt, Kind, KindDefaults


class Echo(KindDefaults):
    """A kind with only its own: what it does, where it pulls, how it runs a task."""

    backend_kind = "echo"
    address = "echo://"

    def __init__(self) -> None:
        self.supports: list[Capability] = ["web_search"]
        self.models = ["echo"]

    def queues(self) -> list[Queue]:
        return [WEB_POOL]

    async def run(self, attempt: Attempt) -> TaskCompleted | TaskFailed:
        raise NotImplementedError


async def test_a_kind_gets_the_defaults_for_what_it_leaves_out() -> None:
    kind: Kind = Echo()  # mypy holds the protocol: nothing is missing
    message = TaskMessage(
        task_id="t", attempt=1, model="echo", timeout_s=1, submitted_at=0, work=Work(prompt="p")
    )
    assert kind.facts == []
    assert kind.serves(message)
    await kind.prepare(asyncio.Event())
    await kind.close()

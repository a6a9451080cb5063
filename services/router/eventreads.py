"""The ``coordinator.event.last`` endpoint: a task's last event on one subject, for a worker
that may not read the event log itself.

A worker with an identity holds no direct get on ``EVENTS``: the server's permissions cannot
keep one to a single task (a ``*`` in the task's place of the subject reads every task's last
event, every answer included). It asks the router, which reads the event for it, only for a
task one of whose attempts was routed to that worker or to a pool it pulls
(`services.fleet.identity.may_read_task_events`); any other task is answered as one that
does not exist.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from schemas.events import encoder
from schemas.queries import LastEvent, LastEventQuery
from schemas.subjects import InvalidId, task_of_readable_event
from services.errors import BadRequest, NotFound
from services.fleet.identity import asker_of, may_read_task_events
from services.runtime.endpoints import decode_body, reply_subject
from services.runtime.outcomes import last_stored, routings


async def last_event(js: JetStreamContext, body: bytes) -> bytes:
    """The task's last event on the asked subject; `NotFound` when there is none, or the
    task is not the asker's to read."""
    query = decode_body(body, LastEventQuery, "last event query")
    try:
        task_id = task_of_readable_event(query.subject)
    except InvalidId:
        raise BadRequest(
            f"{query.subject!r} is not a task event a worker reads: events.task.<task id>."
            "routed|failed, or events.task.<task id>.<worker or *>.started|completed|failed"
        ) from None
    routed_to = {routed.worker for routed in await routings(js, task_id)}
    stored = None
    if may_read_task_events(asker_of(reply_subject.get()), routed_to):
        stored = await last_stored(js, query.subject)
    if stored is None:
        raise NotFound(f"no event on {query.subject}")
    return encoder.encode(LastEvent(subject=stored.subject, seq=stored.seq, data=stored.data))

"""One message from a JetStream pull consumer, with less machinery than nats.py's ``fetch``.

A worker pulls after every task, and nats.py 2.16's ``fetch(1)`` waits through ``next_msg``,
which makes two tasks and a uuid per wait. `pull_one` sends the same pull request on the
subscription's own inbox and waits on its queue under ``asyncio.timeout``. It uses nats.py's
internals (``_sub._pending_queue``, ``_nms``, ``_deliver``) as pinned in pyproject.
"""

from __future__ import annotations

import asyncio
from typing import Final

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

# A no-wait pull is answered at once; this only bounds a lost answer.
NO_WAIT_BOUND_S: Final = 2.0
# A waiting pull expires on the server, which says so (408); this bounds a lost expiry.
EXPIRY_GRACE_S: Final = 1.0
_NO_WAIT: Final = b'{"batch":1,"no_wait":true}'
# 404 no messages, 408 the request expired, 409 the request was cut short (a leadership
# change, too many pulls waiting, the consumer deleted): nothing this time.
_NOTHING: Final = ("404", "408", "409")
_HEARTBEAT: Final = "100"


async def pull_one(source: JetStreamContext.PullSubscription, wait_s: float) -> Msg | None:
    """The consumer's next message, waiting up to ``wait_s`` for one (0: only if one is there
    now, a ``no_wait`` pull); None when none came. A message a timed-out earlier pull was
    sent late comes first. A status that is not "nothing now" raises `nats.js.errors.APIError`.
    """
    sub = source._sub
    queue = sub._pending_queue
    while not queue.empty():
        msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            return msg
    if wait_s <= 0:
        request, bound_s = _NO_WAIT, NO_WAIT_BOUND_S
    else:
        expires_ns = max(int(wait_s * 1_000_000_000) - 100_000, 1_000_000)
        request, bound_s = b'{"batch":1,"expires":%d}' % expires_ns, wait_s + EXPIRY_GRACE_S
    await source._nc.publish(source._nms, request, reply=source._deliver)
    try:
        async with asyncio.timeout(bound_s):
            while True:
                msg = await queue.get()
                sub._pending_size -= len(msg.data)
                status = JetStreamContext.is_status_msg(msg)
                if not status:
                    return msg
                if status == _HEARTBEAT:
                    continue
                if status in _NOTHING:
                    return None
                raise nats.js.errors.APIError.from_msg(msg)
    except TimeoutError:
        return None


def holds_delivery(source: JetStreamContext.PullSubscription) -> bool:
    """Has a message (an answer to an earlier pull that came late) arrived and not been taken?"""
    queue = source._sub._pending_queue
    return any(not JetStreamContext.is_status_msg(msg) for msg in list(queue._queue))  # type: ignore[attr-defined]

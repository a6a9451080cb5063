"""Which events the projection has handled: applied ones, by position in ``EVENTS`` checked by
content, and parked ones. Pure.

A tracking row holds an event's stream position and a digest of the event (its subject and
bytes, `event_digest`). A position alone does not name an event: ``EVENTS`` recreated (a new
cluster, a lost volume) numbers its events from 1 again, and a copy restored from an older
backup numbers its new events where the lost ones were. Nor does the stream's ``created``
time name the log: a restore gives the stream a new one although it holds the same events at
the same positions (and on a cluster the replicas of a restored stream do not even agree on
it; nats-server 2.9 and 2.15 alike), so keying by it would apply a restored log twice.

So the rule (`sort_positions`): an event whose position is tracked with the same digest was
applied before (a redelivery, or a restored copy of the same log) and changes nothing; a
tracked position with another digest means the log now holds other events than the ones
applied there: from the lowest such position on, the tracking rows are set aside (kept, with
when and from where, in ``replaced_tracking``) and the events are applied as new ones. What
the set-aside events did to the tables stays until a rebuild, which counts only what the log
holds; ``coordinator doctor`` says so.

An event that cannot be applied is parked (`parks`): recorded, with its tracking row, instead
of being tried for ever. What tells it from a failure that passes is the error's kind, decided
where it arises: `Unavailable` (PostgreSQL or the bus away, a timeout, any server error but a
data one) passes, and the event is tried again for as long as it takes; `Unstorable` (a value
no column holds, a check it breaks: SQLSTATE classes 22 and 23, or a time out of range found
before PostgreSQL is asked) is the event's own, and the same event would hit it again. A
failure neither explains (a bug) is tried a few times, then parked: it may be the event's,
and tried for ever it would come back every few seconds and never end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from services.errors import CoordinatorError, Unavailable, Unstorable

DIGEST_BYTES: Final = 16
# How many times an event whose applying fails in a way nothing explains is tried.
UNEXPLAINED_TRIES: Final = 3


def event_digest(subject: str, data: bytes) -> bytes:
    """What identifies an event at its position: a digest of its subject and its bytes (the
    subject too: the same body from another recorder is another event). A backup restored
    keeps both, so a restored log's events have the digests they had."""
    hashed = hashlib.blake2b(digest_size=DIGEST_BYTES)
    hashed.update(subject.encode())
    hashed.update(b"\n")
    hashed.update(data)
    return hashed.digest()


@dataclass(frozen=True)
class Positions:
    """What to do with each event of a batch."""

    fresh: tuple[bool, ...]
    """Per event, in batch order: apply it (True) or not (a duplicate)."""
    replaced_from: int | None = None
    """The lowest position where the log holds another event than the one applied: tracking
    rows from there on are set aside (those the batch has just written excepted). None: the
    log is the one the tracking rows were written from."""


def sort_positions(
    incoming: Sequence[tuple[int, bytes]],
    written: Collection[int],
    tracked: Mapping[int, bytes | None],
) -> Positions:
    """Sort a batch's events ``(position, digest)``, in stream order, into fresh ones and
    duplicates.

    ``written``: the positions whose tracking rows the batch could write (none was there);
    ``tracked``: the digest already tracked at each other position of the batch (None for a
    row written before digests were kept, and not filled in since: its event was no longer in
    the log then, so the log holds another one there now). A position twice in the batch is
    applied once, the first time.
    """
    replaced_from: int | None = None
    for seq, digest in incoming:
        if seq in written:
            continue
        if tracked.get(seq) != digest and (replaced_from is None or seq < replaced_from):
            replaced_from = seq
    seen: set[int] = set()
    fresh: list[bool] = []
    for seq, _ in incoming:
        first = seq not in seen
        seen.add(seq)
        renewed = replaced_from is not None and seq >= replaced_from
        fresh.append(first and (seq in written or renewed))
    return Positions(tuple(fresh), replaced_from)


def parks(error: Exception, tries: int) -> bool:
    """Whether an event whose applying raised ``error``, on its ``tries``-th try, is parked
    rather than tried again: `Unavailable` never, `Unstorable` at once, anything else from
    its `UNEXPLAINED_TRIES`-th try on."""
    if isinstance(error, Unavailable):
        return False
    return isinstance(error, Unstorable) or tries >= UNEXPLAINED_TRIES


def parked_error(error: Exception) -> str:
    """What a parked event's record says went wrong."""
    if isinstance(error, CoordinatorError):
        return error.message
    return f"{type(error).__name__}: {error}"

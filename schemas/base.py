"""Base Struct types shared by every wire type."""

from __future__ import annotations

import msgspec


class Wire(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A message on the bus.

    Unknown fields are ignored (the msgspec default) so an older reader keeps working when a
    newer writer adds a field; new fields always get a default.
    """


class Event(Wire, frozen=True, kw_only=True, tag_field="type"):
    """An event in the ``EVENTS`` stream; ``tag_field`` lets events form tagged unions."""

    at: float
    """Wall-clock time of the fact, seconds since the epoch."""

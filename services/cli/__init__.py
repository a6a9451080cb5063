"""The ``coordinator`` command."""

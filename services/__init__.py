"""Coordinator's services: router, worker, stats (and the runtime they share)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("coordinator")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

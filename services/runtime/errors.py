"""One error hierarchy; every error has a stable code that clients can branch on."""

from __future__ import annotations

from typing import ClassVar


class CoordinatorError(Exception):
    """Root of the project's errors. ``code`` is stable; ``message`` is for people."""

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(CoordinatorError):
    code = "config"


class BadRequest(CoordinatorError):
    code = "bad_request"


class PromptTooLarge(BadRequest):
    code = "prompt_too_large"


class TooLarge(BadRequest):
    """A request (or an answer) that does not fit in one NATS message (the server's
    ``max_payload``): refused whole, never cut."""

    code = "too_large"


class UnsupportedCapability(BadRequest):
    """The model exists in the fleet, but no live worker's copy of it can do what the request
    needs (tools, images, embeddings, thinking, insert); the message is Ollama's words."""

    code = "unsupported_capability"


class NoWorker(CoordinatorError):
    """No live worker can serve the request right now."""

    code = "no_worker"


class NotFound(CoordinatorError):
    code = "not_found"


class WaitTimeout(CoordinatorError):
    code = "timeout"


class Unavailable(CoordinatorError):
    """A dependency (the bus, the database) did not answer."""

    code = "unavailable"
    retryable = True


class BackendError(CoordinatorError):
    """The model server answered with an error."""

    code = "backend_error"


class BackendTimeout(BackendError):
    code = "backend_timeout"
    retryable = True


class BackendUnavailable(BackendError):
    """The model server could not be reached at all."""

    code = "backend_unavailable"
    retryable = True


class SearchError(CoordinatorError):
    """The search engine (SearXNG) answered, but not with usable results."""

    code = "search_error"


class SearchTimeout(SearchError):
    code = "search_timeout"
    retryable = True


class SearchUnavailable(SearchError):
    """The search engine could not be reached, or said it is overloaded (HTTP 502/503/504)."""

    code = "search_unavailable"
    retryable = True


class SearchRateLimited(SearchError):
    """HTTP 429: SearXNG's limiter (or an upstream engine) refuses more queries for now."""

    code = "search_rate_limited"
    retryable = True


class NoResults(SearchError):
    code = "no_results"


class Cancelled(CoordinatorError):
    """The task's client cancelled it (``coordinator.cancel``); says nothing about the worker."""

    code = "cancelled"


class WorkerLost(CoordinatorError):
    """The worker running a task stopped (or died) before the task's outcome was recorded."""

    code = "worker_lost"

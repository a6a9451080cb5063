"""One error hierarchy, and the catalogue of its codes.

Every error is a `CoordinatorError` with a stable ``code`` that clients branch on and a
``message`` for people. Each code is defined once, by one class: a subclass that names a code
registers it in the catalogue (`CoordinatorError.__init_subclass__`), and a second class naming
a code already taken is refused when its module is imported. So an error reply, or a failed
task's ``(code, message)``, maps back to its class (`from_code`, as nats.py's ``from_error``
does), and a code no class here names (a newer service's) becomes a `RemoteError` that keeps
it. Nobody matches on message text or class names.

The codes of failures recorded in ``failed`` events (``wake_timeout``, ``too_many_attempts``,
...) are classes here too, so that a code read back from a reply is the same catalogue entry
whether it was raised or recorded.

Every class with a code lives here, so the catalogue is whole in any process that imports this
module (a client never needs the service's code to map a reply back).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

_catalogue: dict[str, type[CoordinatorError]] = {}


class CoordinatorError(Exception):
    """Root of the project's errors. ``code`` is stable; ``message`` is for people."""

    code: str = "internal"
    """The error's code: a class attribute, except on `RemoteError` and the gateway's
    ``ApiError``, which carry the code they were given."""
    retryable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500
    """The HTTP status of a request refused with this code: the gateway's, for every API it
    serves (Ollama's, OpenAI's)."""
    failed_http_status: ClassVar[int] = 502
    """The HTTP status of a task that ran and failed with this code: by default the upstream
    (the model server) failed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if isinstance(code, str):  # a subclass without a code of its own shares its parent's
            _register(code, cls)


def _register(code: str, cls: type[CoordinatorError]) -> None:
    known = _catalogue.get(code)
    # The same class again is a module imported twice (a reload), not a second definition.
    if known is not None and _name(known) != _name(cls):
        raise TypeError(f"error code {code!r} is defined twice: by {_name(known)} and {_name(cls)}")
    _catalogue[code] = cls


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_register(CoordinatorError.code, CoordinatorError)


class RemoteError(CoordinatorError):
    """An error a service replied with whose code no class in the catalogue names; it keeps
    the code, so a client can still branch on it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def from_code(code: str, message: str) -> CoordinatorError:
    """The error a reply's (or a failed task's) ``code`` and ``message`` stand for: an
    instance of the class that defines the code, else a `RemoteError` that keeps it."""
    cls = _catalogue.get(code)
    return cls(message) if cls is not None else RemoteError(code, message)


def error_class(code: str) -> type[CoordinatorError]:
    """The class that defines ``code``; `RemoteError` for a code none here names (what it
    says of itself, its HTTP statuses, is then the root's)."""
    return _catalogue.get(code, RemoteError)


def catalogue() -> Mapping[str, type[CoordinatorError]]:
    """Every code registered so far and its class (read-only)."""
    return MappingProxyType(_catalogue)


class ConfigError(CoordinatorError):
    code = "config"


class BadRequest(CoordinatorError):
    code = "bad_request"
    http_status = 400


class PromptTooLarge(BadRequest):
    code = "prompt_too_large"


class TooLarge(BadRequest):
    """A request (or an answer) that does not fit in one NATS message (the server's
    ``max_payload``): refused whole, never cut."""

    code = "too_large"
    http_status = 413


class UnsupportedCapability(BadRequest):
    """The model exists in the fleet, but no live worker's copy of it can do what the request
    needs (tools, images, embeddings, thinking, insert); the message is Ollama's words."""

    code = "unsupported_capability"


class Unsupported(BadRequest):
    """A feature of a client API (a request field, a remote image) the fleet does not honour:
    refused by name, never silently dropped."""

    code = "unsupported"


class NoWorker(CoordinatorError):
    """No live worker can serve the request right now."""

    code = "no_worker"
    http_status = 404  # Ollama's status for an unknown model (503 when no worker is live)


class WorkerUnavailable(NoWorker):
    """The designated worker cannot take the task; never silently rerouted."""

    code = "worker_unavailable"
    http_status = 503


class NoAlternativeWorker(NoWorker):
    """The reaper found no other live worker for a task it had to move (lesson 4)."""

    code = "no_alternative_worker"
    http_status = 503


class TooManyAttempts(CoordinatorError):
    """The reaper gave up on a task after ``MAX_ATTEMPTS`` attempts."""

    code = "too_many_attempts"


class WakeTimeout(CoordinatorError):
    """A sleeping worker was woken for a task but did not start it within ``WAKE_WAIT_S``."""

    code = "wake_timeout"
    failed_http_status = 503


class NotFound(CoordinatorError):
    code = "not_found"
    http_status = 404


class Forbidden(CoordinatorError):
    """The asker's identity may not ask this (another worker's consumer, say)."""

    code = "forbidden"
    http_status = 403


class WaitTimeout(CoordinatorError):
    code = "timeout"
    http_status = failed_http_status = 504


class Unavailable(CoordinatorError):
    """A dependency (the bus, the database) did not answer."""

    code = "unavailable"
    http_status = 503
    retryable = True


class NoResponder(CoordinatorError):
    """Nobody answers a service's subject (the service is not running), or nothing arrived in
    time."""

    code = "no_responder"
    http_status = 503


class BackendError(CoordinatorError):
    """The model server answered with an error."""

    code = "backend_error"


class InsufficientStorage(BackendError):
    """A machine without the disk space a change to its models needs (a pull): refused
    before it starts."""

    code = "insufficient_storage"
    http_status = failed_http_status = 507


class BackendServerError(BackendError):
    """The model server failed at its own work: an HTTP 5xx (a runner that crashed or ran
    out of memory, a server too busy), an error it reported mid-stream, or a stream it cut
    short. Another server may well do the work: retryable, and the worker that saw it is
    degraded until its probe finds the backend working."""

    code = "backend_server_error"
    retryable = True


class BackendTimeout(BackendError):
    code = "backend_timeout"
    failed_http_status = 504
    retryable = True

    def __init__(self, message: str, *, stalled: bool = False) -> None:
        super().__init__(message)
        self.stalled = stalled
        """True for a generation that sent no first token within ``FIRST_TOKEN_TIMEOUT_S``,
        or nothing for ``PROGRESS_TIMEOUT_S`` mid-stream: the backend hangs, and the worker
        is degraded (False: the task's own timeout ran out)."""


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


class StreamDiverged(CoordinatorError):
    """A streamed task was run again (its worker was lost mid-answer) and the answer of the
    new attempt does not continue what the stream had already written: a stream cannot take
    text back, so it ends with this error naming the task, whose whole answer can be read."""

    code = "stream_diverged"


class InvalidApiKey(CoordinatorError):
    """A gateway request without a key the gateway knows (OpenAI's code for a 401)."""

    code = "invalid_api_key"


class StopRequested(CoordinatorError):
    """The process was told to stop before it was ready (say, while it waited for NATS)."""

    code = "stopped"


class WorkerStopping(CoordinatorError):
    """A worker was stopped and its grace period ran out before the task's step finished."""

    code = "worker_stopped"


class WorkerLost(CoordinatorError):
    """The worker running a task stopped (or died) before the task's outcome was recorded."""

    code = "worker_lost"


class DuplicateWorker(CoordinatorError):
    """Another live process holds this worker id (two units started the same worker)."""

    code = "duplicate_worker"


class LeaseLost(CoordinatorError):
    """Another process took this worker id's registration while this one held it."""

    code = "lease_lost"


class RebuildBusy(CoordinatorError):
    """A rebuild of the statistics is running already."""

    code = "busy"
    http_status = 503


class JudgeUnavailable(CoordinatorError):
    """Neither judge host answers (or serves the judge model)."""

    code = "judge_unavailable"


class Unstorable(CoordinatorError):
    """This event's data can never be stored (for example text PostgreSQL refuses)."""

    code = "unstorable"


class Conflict(CoordinatorError):
    """The change asked for contradicts the state (an exclusion already withdrawn)."""

    code = "conflict"


class SubmissionLost(CoordinatorError):
    """The task's ``submitted`` event is not in the log any more: it cannot be rebuilt."""

    code = "submission_lost"

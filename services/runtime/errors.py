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

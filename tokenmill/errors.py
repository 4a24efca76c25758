"""Typed errors for user mistakes: each message says what was wrong and what is allowed."""


class TokenmillError(Exception):
    """Base class of all errors tokenmill raises on purpose."""


class ModelLoadError(TokenmillError):
    """A model path, file or format that cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture has no implementation here."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request that can never be served (bad prompt, too long, ...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context or the KV cache."""


class EngineOverloadedError(TokenmillError):
    """The engine's waiting queue is full (max_waiting_requests): try again later."""


class EngineDeadError(TokenmillError):
    """The engine loop has stopped (it failed, or the engine was shut down): no request can be served."""


class RequestFailedError(TokenmillError):
    """Requests whose own work failed inside an engine step (a bug, not a user mistake).

    The engine found them by re-running the failed step's parts, aborted them, and put the
    other requests of the step back to be recomputed: only these requests are told.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the engine step failed for requests {request_ids[:5]}: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause

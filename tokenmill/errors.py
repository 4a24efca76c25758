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

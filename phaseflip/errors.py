"""Typed errors a user of phaseflip can meet. Each message says what to do about it."""

from __future__ import annotations


class PhaseflipError(Exception):
    """Base class of every error phaseflip raises on purpose."""


class ModelLoadError(PhaseflipError):
    """The model directory is missing, malformed or of an unsupported architecture."""


class InvalidRequestError(PhaseflipError, ValueError):
    """A request or a sampling parameter is invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens exceed the model context or the KV pool."""


class CapacityError(PhaseflipError):
    """The KV pool is too small for the configuration (e.g. a token budget below one request)."""

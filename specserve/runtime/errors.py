"""Typed errors. The HTTP layer turns `InvalidRequestError` into a 400 naming `field`."""

from __future__ import annotations

from specserve.kernels.errors import SpecserveError

__all__ = ["SpecserveError", "InvalidRequestError", "ModelLoadError", "ModelNotFoundError",
           "QueueFullError"]


class InvalidRequestError(SpecserveError, ValueError):
    """Bad user input: a request field has a value we cannot serve."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(SpecserveError):
    """A model path that is missing, not a model, or of an unsupported architecture."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model this server does not serve (HTTP 404, OpenAI's shape)."""

    def __init__(self, model: str, served: str | None = None) -> None:
        hint = f" This server serves `{served}`." if served else ""
        super().__init__("model", f"The model `{model}` does not exist.{hint}")
        self.model = model


class QueueFullError(SpecserveError):
    """More requests waiting than `--max-queued-requests` allows (HTTP 503, as SGLang)."""

"""Edge model backends (the SLM) behind :class:`edge_sdk.backends.base.SLMBackend`."""

from edge_sdk.backends.base import SLMBackend

__all__ = ["SLMBackend"]

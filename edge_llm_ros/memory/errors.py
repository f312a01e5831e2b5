"""Typed errors of the semantic memory (edge_llm_ros.memory). Each message says what to do."""
from edge_llm_ros.errors import EngineError, InvalidRequestError, ModelLoadError


class MemoryStoreError(ModelLoadError):
    """memory.store cannot be used: not writable, corrupt, foreign, or no sqlite-vec."""


class StoreModelMismatchError(MemoryStoreError):
    """The store was embedded by another model (id or dimensions): re-embed it first."""


class InvalidMemoryRequestError(InvalidRequestError):
    """A remember/recall/forget request is malformed (empty text, k out of range, ...)."""


class EmptyInputError(InvalidMemoryRequestError):
    """A text or query is empty (or only whitespace)."""


class FrameMismatchError(InvalidMemoryRequestError):
    """A pose filter names a frame no posed memory is in (memory does not transform poses)."""


class EmbeddingServiceError(EngineError):
    """The embedding node's ~/embed is unreachable, timed out or answered with an error."""

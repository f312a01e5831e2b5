"""Typed engine errors. Every message says what the user should do."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model folder or file is missing, corrupt or of an unsupported kind."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or tensor type cannot be converted or run."""


class ConversionError(EngineError):
    """Converting a checkpoint to ONNX failed; nothing was written to the cache."""


class InvalidRequestError(EngineError, ValueError):
    """A generation request is malformed (empty prompt, unknown role, bad value)."""


class InvalidSamplingError(InvalidRequestError):
    """A sampling value is out of range (negative temperature, top_p outside (0, 1], ...)."""


class InvalidSchemaError(InvalidRequestError):
    """A JSON schema given as response format is not valid JSON Schema."""


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus requested tokens) does not fit in the model's context."""


class AdapterError(EngineError):
    """A LoRA adapter cannot be loaded or used (convert/lora.py, runtime/lora_adapter.py)."""


class AdapterFileError(AdapterError):
    """A LoRA adapter file or folder is missing, corrupt, truncated or not a LoRA adapter."""


class AdapterMismatchError(AdapterError):
    """A LoRA adapter was made for another base model (architecture, shapes or vocabulary)."""


class LoraTargetsMissingError(AdapterError):
    """The model folder predates model.yaml's lora_targets: reconvert it to use adapters."""


class AdapterRequestError(InvalidRequestError):
    """A goal's adapters are unusable: unknown name, bad scale, more than the limit."""


class EmbeddingInputError(InvalidRequestError):
    """An embed / rerank request is malformed (no texts, too long, too many, bad dimensions)."""


class WrongModelKindError(InvalidRequestError):
    """A request the loaded folder cannot serve: embed on a chat model, generate on an encoder."""

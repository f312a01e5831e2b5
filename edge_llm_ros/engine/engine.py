"""The engine facade: load a converted model once, then validate and run requests.

    engine = Engine(EngineConfig(model_dir=''))        # '' = the embedded SmolLM2
    prepared = engine.prepare(GenerationRequest(prompt='What color is the sky?'))
    for event in engine.generate(prepared):            # or generate(request): prepares too
        print(event.text_delta, end='')

One generation runs at a time (the KV cache is shared); a new ``generate`` call ends a previous
generation that was not iterated to the end (it finishes as CANCELLED).
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import threading
import time
from typing import List, Optional, Sequence, Tuple, Union

from edge_llm_ros.engine import constraint as constraint_mod
from edge_llm_ros.engine.errors import EngineError, ModelLoadError
from edge_llm_ros.engine.generator import Generation
from edge_llm_ros.engine.kv_cache import KVCache, SNAPSHOT_DTYPES
from edge_llm_ros.engine.model import load_model_info, OnnxDecoder, SessionConfig
from edge_llm_ros.engine.request import prepare, PreparedRequest
from edge_llm_ros.engine.tokenizer import TextTokenizer
from edge_llm_ros.engine.types import ChatMessage, GenerationRequest


@dataclass
class EngineConfig:
    """How to load and run the model (see the engine contract)."""

    model_dir: str = ''            # '' = embedded SmolLM2 (default_model.ensure_default_model())
    providers: tuple = ('CPUExecutionProvider',)
    provider_options: tuple = ()   # one dict per provider
    intra_op_threads: int = 0      # 0 = onnxruntime's default
    intra_op_affinity: str = ''    # onnxruntime 'session.intra_op_thread_affinities' string
    max_context: int = 2048        # KV cache capacity (must not exceed the model's maximum)
    # Saved session prefixes: 'float32' = exact copies at the KV buffers' precision; 'int8' =
    # 3.8x smaller but lossy (see kv_cache). The live cache always keeps full precision.
    kv_dtype: str = 'float32'
    prefix_reuse: bool = True
    max_sessions: int = 8          # LRU of saved per-session KV prefixes
    prefill_chunk: int = 256       # prompt positions per forward (bounds memory, cancel latency)


class Engine:
    """A loaded model with its KV cache; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.kv_dtype not in SNAPSHOT_DTYPES:
            raise ModelLoadError(f'kv_dtype {config.kv_dtype!r} is not one of '
                                 f'{", ".join(SNAPSHOT_DTYPES)}')
        if config.prefill_chunk < 1:
            raise ModelLoadError(f'prefill_chunk must be >= 1, got {config.prefill_chunk}')
        if config.max_sessions < 0:
            raise ModelLoadError(f'max_sessions must be >= 0, got {config.max_sessions}')
        model_dir = config.model_dir
        if not model_dir:
            from edge_llm_ros.engine.default_model import ensure_default_model
            model_dir = str(ensure_default_model())
        self.model_dir = model_dir
        self.info = load_model_info(model_dir)
        self.tokenizer = TextTokenizer.from_dir(model_dir)
        self._decoder: Optional[OnnxDecoder] = OnnxDecoder(model_dir, self.info, SessionConfig(
            providers=tuple(config.providers),
            provider_options=tuple(config.provider_options),
            intra_op_threads=config.intra_op_threads,
            intra_op_affinity=config.intra_op_affinity,
            max_context=config.max_context))
        self._cache = KVCache(self._decoder.kv_buffers, self._decoder.capacity,
                              snapshot_dtype=config.kv_dtype,
                              max_sessions=config.max_sessions if config.prefix_reuse else 0)
        self._lock = threading.RLock()
        self._active: Optional[Generation] = None
        self._compile_schema = functools.lru_cache(maxsize=16)(self._compile)
        self.model_name = self.info.name
        self.context_length = self._decoder.capacity
        self.vocab_size = self.info.vocab_size
        self.providers = self._decoder.providers

    # --- requests ----------------------------------------------------------------------------
    def _compile(self, schema_text: str) -> object:
        return constraint_mod.JsonSchemaConstraint.compile(schema_text, self.tokenizer)

    def _open_decoder(self) -> OnnxDecoder:
        if self._decoder is None:
            raise EngineError('this engine was closed: create a new Engine')
        return self._decoder

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate a request once (no model call) into what generate() runs.

        Raises an InvalidRequestError subclass saying what to change. The prompt is tokenized
        and a JSON schema compiled here; DeclaredEmbeddings are checked by shape and must be
        bound (PreparedRequest.bind) before generate().
        """
        decoder = self._open_decoder()
        return prepare(request, self.tokenizer, self.info.hidden_size, self.context_length,
                       self._compile_schema, decoder.act_dtype)

    def generate(self, request: Union[PreparedRequest, GenerationRequest]) -> Generation:
        """Return the Generation of a prepared request, to iterate.

        A GenerationRequest is prepared first (a convenience for scripts and tests; a server
        prepares at admission and passes the PreparedRequest).
        """
        t0 = time.perf_counter()
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        if not prepared.bound:
            raise EngineError('the request declares prefix_embeddings that were never bound: '
                              'call prepared.bind(array) before generate()')
        with self._lock:
            decoder = self._open_decoder()
            if self._active is not None:
                self._active.abandon()
            if not self.config.prefix_reuse:
                self._cache.reset()
            generation = Generation(decoder, self._cache, self.tokenizer, prepared,
                                    self.config.prefill_chunk, self._lock, t0,
                                    on_end=self._ended)
            self._active = generation
        return generation

    def _ended(self, generation: Generation) -> None:
        if self._active is generation:
            self._active = None

    # --- text --------------------------------------------------------------------------------
    def tokenize(self, text: str = '', messages: Sequence[ChatMessage] = (),
                 add_generation_prompt: bool = True) -> List[int]:
        """Token ids of raw text, or of messages rendered with the chat template."""
        if messages:
            return self.tokenizer.encode_chat(list(messages), add_generation_prompt)
        return self.tokenizer.encode(text)

    def token_strings(self, ids) -> List[str]:
        return self.tokenizer.token_strings(ids)

    # --- state -------------------------------------------------------------------------------
    def kv_occupancy(self) -> Tuple[int, int]:
        """(positions used, capacity) of the live KV cache."""
        return self._cache.occupancy()

    def saved_sessions(self) -> List[str]:
        """Return the session ids whose KV prefixes are saved, least recently used first."""
        return self._cache.sessions()

    def reset_cache(self, sessions: bool = True) -> None:
        """Forget the live KV cache (and the saved session prefixes unless sessions=False)."""
        with self._lock:
            if self._active is not None:
                self._active.abandon()
            self._cache.reset()
            if sessions:
                self._cache.clear_sessions()

    def close(self) -> None:
        """Free the session and the KV buffers; the engine cannot be used afterwards."""
        with self._lock:
            if self._active is not None:
                self._active.abandon()
            self._cache.reset()
            self._cache.clear_sessions()
            self._decoder = None

"""The engine facade: load a converted model once, then validate and run requests.

    engine = Engine(EngineConfig(model_dir=''))        # '' = the embedded SmolLM2
    prepared = engine.prepare(GenerationRequest(prompt='What color is the sky?'))
    for event in engine.generate(prepared):            # or generate(request): prepares too
        print(event.text_delta, end='')

One generation runs at a time (the KV cache is shared); a new ``generate`` call ends a previous
generation that was not iterated to the end (it finishes as CANCELLED).

The model's family (config/models: reasoning tags, tool-call format) is found from model.yaml,
or named by EngineConfig.model_family; a model no family matches still runs, with generic JSON
tool calls and no reasoning tags (model_info() says why no family was found).
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import operator
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from edge_llm_ros.engine import constraint as constraint_mod
from edge_llm_ros.engine.errors import EngineError, InvalidRequestError, ModelLoadError
from edge_llm_ros.engine.generator import Generation
from edge_llm_ros.engine.gguf_tokenizer import CHAT_TEMPLATE_FILE
from edge_llm_ros.engine.kv_cache import KVCache, SNAPSHOT_DTYPES
from edge_llm_ros.engine.model import load_model_info, OnnxDecoder, SessionConfig
from edge_llm_ros.engine.model_config import (family_for_model_dir, load_family,
                                              ModelConfigError, ModelFamilyConfig)
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
    # config/models family name (or a family .yaml path) instead of the one model.yaml matches.
    model_family: str = ''


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
        self.family, self.family_error = _family(model_dir, config.model_family)
        self._eos = _end_ids(self.tokenizer, self.family)
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
                       self._compile_schema, decoder.act_dtype, family=self.family,
                       vocab_size=self.vocab_size)

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
                                    on_end=self._ended, eos=self._eos)
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

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (InvalidRequestError for an id outside the vocabulary)."""
        checked = []
        for i in ids:
            try:
                value = operator.index(i)  # ints and numpy integers, not floats
            except TypeError:
                value = None
            if value is None or isinstance(i, bool):
                raise InvalidRequestError(f'token ids must be integers, not {type(i).__name__}')
            if not 0 <= value < self.tokenizer.vocab_size:
                raise InvalidRequestError(f'token id {value} is outside the vocabulary '
                                          f'(0..{self.tokenizer.vocab_size - 1})')
            checked.append(value)
        return self.tokenizer.decode(checked, skip_special_tokens=skip_special_tokens)

    # --- model -------------------------------------------------------------------------------
    def model_info(self) -> Dict[str, Any]:
        """Describe the model for ~/get_model_info: what it is, its template, what it can do."""
        family = self.family
        reasoning = family.reasoning if family is not None else None
        fmt = family.tool_call_format if family is not None else 'generic_json'
        path = os.path.join(self.model_dir, CHAT_TEMPLATE_FILE)
        with open(path, encoding='utf-8') as f:
            template = f.read()
        return {
            'model_name': self.model_name,
            'model_dir': self.model_dir,
            'architecture': self.info.architecture,
            'quantization': quantization_text(self.info.extra.get('quantization')),
            'context_length': int(self.context_length),
            'max_position_embeddings': int(self.info.max_position_embeddings),
            'vocab_size': int(self.vocab_size),
            'providers': list(self.providers),
            'chat_template': template,
            'family': family.family if family is not None else '',
            'family_error': self.family_error,
            'tool_call_format': fmt,
            'capabilities': {
                'tools': fmt != 'none',
                'reasoning': reasoning is not None,
                'reasoning_can_disable': family is not None and family.can_disable_reasoning,
                'embeddings_input': True,
            },
        }

    # --- state -------------------------------------------------------------------------------
    def kv_occupancy(self) -> Tuple[int, int]:
        """(positions used, capacity) of the live KV cache."""
        return self._cache.occupancy()

    def saved_sessions(self) -> List[str]:
        """Return the session ids whose KV prefixes are saved, least recently used first."""
        return self._cache.sessions()

    def reset_sessions(self, session_id: str = '') -> int:
        """Drop one session's KV prefix ('' = every session and the live cache).

        Returns how many sessions had a kept prefix (saved, or in the live cache). An unknown
        session id is a no-op that returns 0, not an error: saved prefixes are an LRU and may
        already have been evicted, so "forget this conversation" must not depend on that
        race. A generation running on the dropped prefix is ended first (CANCELLED), since
        its cache is going away.
        """
        if not isinstance(session_id, str):
            raise InvalidRequestError('session_id must be text')
        with self._lock:
            if not session_id:
                count = len(self._cache.known_sessions())
                self.reset_cache()
                return count
            if self._active is not None and self._cache.owner == session_id:
                self._active.abandon()
            return int(self._cache.drop_session(session_id))

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


def _family(model_dir: str, name: str) -> Tuple[Optional[ModelFamilyConfig], str]:
    """Find the model's family, or (None, why none matched); a named family must load."""
    if name:
        return load_family(name), ''
    try:
        return family_for_model_dir(model_dir), ''
    except ModelConfigError as exc:
        return None, str(exc)


def _end_ids(tokenizer: TextTokenizer, family: Optional[ModelFamilyConfig]) -> frozenset:
    """EOS ids of model.yaml plus the family's stop tokens that are tokens of this vocabulary.

    A GGUF names one EOS, but e.g. Llama 3.1 also ends turns with <|eom_id|> after a tool
    call; the family config lists them (config/models `stop_tokens`).
    """
    ids = set(tokenizer.eos_token_ids)
    for text in family.stop_tokens if family is not None else ():
        token = tokenizer.hf_tokenizer.token_to_id(text)
        if token is not None:
            ids.add(int(token))
    return frozenset(ids)


def quantization_text(quant: Any) -> str:
    """One line for model.yaml's quantization section (e.g. 'int4, block 32, from Q4_1+Q8_0')."""
    if not isinstance(quant, dict):
        return str(quant or '')
    parts = []
    if quant.get('bits'):
        parts.append(f'int{quant["bits"]}')
    if quant.get('block_size'):
        parts.append(f'block {quant["block_size"]}')
    if quant.get('source_types'):
        parts.append('from ' + '+'.join(map(str, quant['source_types'])))
    if quant.get('precision') and not parts:
        parts.append(str(quant['precision']))
    return ', '.join(parts)

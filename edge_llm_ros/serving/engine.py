"""The local backend: a converted model loaded once, serving goals through one scheduler.

    engine = Engine(EngineConfig(model_dir=''))        # '' = the embedded SmolLM2
    prepared = engine.prepare(GenerationRequest(prompt='What color is the sky?'))
    for event in engine.generate(prepared):            # or generate(request): prepares too
        print(event.text_delta, end='')

Every goal runs through the same scheduler (serving/scheduler.py) and executor
(serving/executor.py) over ``parallel_sequences`` KV slots (docs/batching.md): the node's
worker drives that loop on its thread, and ``generate`` drives it on the caller's thread for
one goal (any other submitted goal advances with it). A single stream is the scheduler with
one slot. A new ``generate`` call ends a previous generation that was not iterated to the end
(it finishes as CANCELLED).

Warm prompts (EngineConfig.warm_prompts, add_warm_prompt; serving/warm_prompts.py) are
system prompts prefilled at init, each as one goal through the same scheduler, and pinned in
the prefix cache; with session_store they are restored from it instead (into an empty slot,
so the first goal copies nothing), unless the stored state is of another model, converter
version or KV layout: that StoredWarmStateError is logged, the prompt prefilled again, and
model_info() reports it as the prompt's status.

The model's family (config/models: reasoning tags, tool-call format) is found from model.yaml,
or named by EngineConfig.model_family; a model no family matches still runs, with generic JSON
tool calls and no reasoning tags (model_info() says why no family was found).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import functools
import logging
import math
import operator
import os
import threading
import time
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

from edge_llm_ros.errors import EngineError, InvalidRequestError, ModelLoadError
from edge_llm_ros.model_format import (CHAT_TEMPLATE_FILE, embedded_model, KV_INT8_MODEL_FILE,
                                       load_model_info, ModelInfo)
from edge_llm_ros.runtime import constraint as constraint_mod, media
from edge_llm_ros.runtime.conversation import committed, Conversation, reply_turn
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.kv_cache import KVCache, Reuse, SNAPSHOT_DTYPES
from edge_llm_ros.runtime.mmproj_encoder import open_vision
from edge_llm_ros.runtime.model_config import (family_for_model_dir, load_family, ModelConfigError,
                                               ModelFamilyConfig)
from edge_llm_ros.runtime.request import bind_conversation, prepare, PreparedRequest
from edge_llm_ros.runtime.sequence import Sequence as TokenSequence
from edge_llm_ros.runtime.speculative import build_speculation, SpeculativeConfig
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import (ChatMessage, GenerationRequest, GenerationResult,
                                        StopReason, TokenEvent)
from edge_llm_ros.serving import warm_prompts as warm_mod
from edge_llm_ros.serving.adapters import AdapterLimits, Adapters
from edge_llm_ros.serving.embedding import (is_encoder_folder, not_a_chat_model,
                                            not_an_embedding_model)
from edge_llm_ros.serving.executor import Executor, probe_rows, RowPolicy
from edge_llm_ros.serving.goal import CancelReason, Goal
from edge_llm_ros.serving.loop import StepLoop
from edge_llm_ros.serving.scheduler import Checkpoint, Commit, Report, Scheduler
from edge_llm_ros.serving.session_store import open_sessions
from edge_llm_ros.serving.warm_prompts import (StoredWarmStateError, WarmPrompt,
                                               WarmPromptError)

_log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """How to load and run the model (see the engine contract)."""

    model_dir: str = ''            # '' = the embedded SmolLM2 (model_format.embedded_model())
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
    # Byte bound of the saved prefixes, in memory and in session_store (docs/sessions.md).
    session_max_bytes: int = 256 << 20
    session_store: str = ''        # SQLite file the saved prefixes persist in; '' = memory only
    prefill_chunk: int = 256       # prompt positions per step (bounds memory, cancel latency)
    # config/models family name (or a family .yaml path) instead of the one model.yaml matches.
    model_family: str = ''
    # Sequence slots (continuous batching, docs/batching.md): each holds max_context positions.
    parallel_sequences: int = 1
    # Bytes the KV buffers may take; 0 = KV_MEMORY_FRACTION of the memory available at load.
    kv_memory_limit: int = 0
    # CPU kernels of a kquant model's ops (runtime/native_ops.KERNEL_CHOICES; 'auto' = best).
    kernel: str = 'auto'
    # Speculative decoding and grammar fast-forward (runtime/speculative.py).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # System prompts prefilled at init and pinned in the prefix cache: text, or 'file:<path>'
    # (serving/warm_prompts.py). They need prefix_reuse.
    warm_prompts: Tuple[str, ...] = ()
    # LoRA adapters loaded at init: (name, LoRA GGUF or PEFT folder, default scale) each, and
    # what a goal may ask of them (serving/adapters.py).
    lora_adapters: Tuple[Tuple[str, str, float], ...] = ()
    lora_max_per_goal: int = 4
    lora_max_scale: float = 4.0
    # Tokens one image may take when a request sets no max_image_tokens of its own; 0 = no cap
    # but the context's (a 1080p frame is 2,691 Qwen-VL tokens: board profiles set one).
    max_image_tokens: int = 0


PARALLEL_SEQUENCES_MAX = 64
# Ends whose turn joins the session's conversation.
_COMMITTED = (StopReason.STOP, StopReason.LENGTH, StopReason.TOOL_CALLS)
KV_MEMORY_FRACTION = 0.8   # of psutil's available memory, leaving room for weights and Python


def kv_budget_bytes(info: ModelInfo, max_context: int, slots: int,
                    kv_dtype: str = 'float32') -> int:
    """Bytes of the per-slot state buffers the decoder preallocates.

    slots x (attention layers x (K, V) x kv_heads x L x head_dim + the fixed-size states:
    a conv layer's kernel - 1 positions x hidden, a recurrent layer's conv inputs and
    delta-rule state: model.yaml layer_states). With kv_dtype int8 each (head, position) row
    of K or V is head_dim bytes plus its float32 scale.
    """
    kv_len = info.kv_max_context or max_context
    itemsize = 2 if info.activation_dtype == 'float16' else 4
    if kv_dtype == 'int8':   # a (head, position) row: head_dim bytes and its float32 scale
        kv = sum(2 * heads * (dim + 4) for heads, dim in map(info.kv_dims, info.kv_layers))
    else:                    # a shared-KV layer (gemma4) keeps none: counted once
        kv = info.kv_values_per_position * itemsize
    kv *= kv_len
    states = sum(math.prod(info.state_of(i).shape) for i in info.conv_layers)
    return slots * (kv + states * itemsize)


def live_kv_dtype(kv_dtype: str, model_dir: str) -> str:
    """Return the live KV buffers' dtype for kv.dtype: int8 where the folder has the int8 graph.

    A GroupQueryAttention graph, or a folder converted before model_kv_int8.onnx existed,
    keeps float32 live buffers with int8 snapshots (what kv.dtype int8 meant before), with
    one WARNING saying how to get the int8 live KV where the op library's attention runs.
    """
    if kv_dtype != 'int8' or os.path.isfile(os.path.join(model_dir, KV_INT8_MODEL_FILE)):
        return kv_dtype
    _log.warning('kv.dtype int8: %s has no %s, so the live KV stays float32 and only saved '
                 'prefixes are int8 (a restore is then close to, not bit-equal with, the '
                 'uninterrupted run). For int8 live KV run `python -m '
                 'edge_llm_ros.convert.kv_int8_graph %s` (models converted with the op '
                 "library's attention only) or reconvert the model", model_dir,
                 KV_INT8_MODEL_FILE, model_dir)
    return 'float32'


def kv_limit(config: 'EngineConfig') -> Tuple[int, str]:
    """Return the bytes the KV may take and where that bound comes from, in words."""
    if config.kv_memory_limit:
        return config.kv_memory_limit, 'kv_memory_limit'
    import psutil
    return (int(psutil.virtual_memory().available * KV_MEMORY_FRACTION),
            f'{KV_MEMORY_FRACTION:.0%} of the available memory')


def check_kv_budget(info: ModelInfo, config: 'EngineConfig', pinned: int = 0,
                    limit: Optional[Tuple[int, str]] = None, live: str = 'float32') -> int:
    """Return the KV bytes of parallel_sequences slots, or raise ModelLoadError if too many.

    Runs before anything is allocated; the budget is the slots' KV buffers plus the bound of
    the saved session prefixes (session_max_bytes, when prefixes are kept) plus `pinned`, the
    warm prompts' bytes (over the budget with them: WarmPromptError), and the message names
    the bytes and what to lower. limit: kv_limit(config), when already known; live: the
    live KV buffers' dtype (live_kv_dtype).
    """
    n = config.parallel_sequences
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= PARALLEL_SEQUENCES_MAX:
        raise ModelLoadError(f'parallel_sequences must be an integer in '
                             f'1..{PARALLEL_SEQUENCES_MAX}, got {n!r}')
    if config.kv_memory_limit < 0:
        raise ModelLoadError(f'kv_memory_limit must be >= 0, got {config.kv_memory_limit}')
    need = kv_budget_bytes(info, config.max_context, n, live)
    saved = config.session_max_bytes if config.prefix_reuse and config.max_sessions else 0
    limit, source = limit or kv_limit(config)
    if need + saved <= limit < need + saved + pinned:
        raise WarmPromptError(
            f'the warm prompts need {pinned} bytes of pinned KV beside the {need} bytes of '
            f'the KV slots and {saved} bytes of saved session prefixes (session_max_bytes), '
            f'more than {limit} bytes ({source}): drop or shorten warm prompts, or lower '
            'session_max_bytes, parallel_sequences or max_context')
    if need + saved > limit:
        one = kv_budget_bytes(info, config.max_context, 1, live)
        raise ModelLoadError(
            f'the KV cache (and conv states) of {n} parallel sequence(s) x '
            f'{config.max_context} positions needs '
            f'{need} bytes ({need / 2**20:.1f} MiB; {one / 2**20:.1f} MiB per sequence) plus '
            f'{saved} bytes of saved session prefixes (session_max_bytes), more than {limit} '
            f'bytes ({source}): lower parallel_sequences or max_context (or '
            'session_max_bytes)')
    return need


class Engine:
    """A loaded model with its KV slots, scheduler and executor; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.kv_dtype not in SNAPSHOT_DTYPES:
            raise ModelLoadError(f'kv_dtype {config.kv_dtype!r} is not one of '
                                 f'{", ".join(SNAPSHOT_DTYPES)}')
        if config.prefill_chunk < 1:
            raise ModelLoadError(f'prefill_chunk must be >= 1, got {config.prefill_chunk}')
        if config.max_sessions < 0:
            raise ModelLoadError(f'max_sessions must be >= 0, got {config.max_sessions}')
        if config.max_image_tokens < 0:
            raise ModelLoadError(f'max_image_tokens must be >= 0 (0: no cap), got '
                                 f'{config.max_image_tokens}')
        model_dir = config.model_dir or str(embedded_model())
        self.model_dir = model_dir
        if is_encoder_folder(model_dir):   # serving/embedding.py serves those
            raise not_a_chat_model(model_dir)
        self.info = load_model_info(model_dir)
        # A hybrid's conv state is that of its last position (model.yaml layer_states): its
        # slots and session snapshots keep copies at a prompt's and a turn's end, where prefix
        # reuse may stop (runtime/kv_cache.py).
        self.prefix_reuse = config.prefix_reuse
        self.tokenizer = TextTokenizer.from_dir(model_dir)
        self.family, self.family_error = _family(model_dir, config.model_family)
        warm = self._load_warm_prompts(config)
        self._kv_limit = kv_limit(config)   # add_warm_prompt checks against it too
        self.live_kv_dtype = live_kv_dtype(config.kv_dtype, model_dir)
        self.kv_bytes = check_kv_budget(self.info, config, sum(
            warm_mod.snapshot_bytes(self.info, p.tokens, config.kv_dtype) for p in warm),
            self._kv_limit, self.live_kv_dtype)
        self._eos = _end_ids(self.tokenizer, self.family)
        self._decoder: Optional[OnnxDecoder] = OnnxDecoder(model_dir, self.info,
                                                           self._session_config(config))
        # Before any cache holds positions: the probe writes into every slot.
        self.rows: RowPolicy = probe_rows(self._decoder)
        # A VLM folder's vision encoder and how its images sit in the prompt (else None).
        self.vision, self._layout = open_vision(
            model_dir, self.info.extra, self.tokenizer, providers=tuple(config.providers),
            provider_options=tuple(config.provider_options), threads=config.intra_op_threads)
        if self._layout is not None and self._layout.bidirectional and \
                not self._decoder.bidirectional_images:
            self._layout.refuse_images(
                f'{self._layout.projector} images need bidirectional attention over their '
                'tokens, and this model.onnx was converted without it: reconvert the model '
                'with --mmproj and a current edge-llm-convert (text still works)')
        # LoRA adapters per goal (registered on the decoder's op nodes at the first load).
        self.adapters = Adapters(self._decoder.enable_lora, self.info,
                                 AdapterLimits(config.lora_max_per_goal, config.lora_max_scale))
        for name, path, scale in config.lora_adapters:
            self.adapters.load(name, path, scale)
        self.speculation = build_speculation(config.speculative, self._decoder, self.tokenizer,
                                             model_dir, self._session_config(config))
        # Restores the sessions saved for this model (SessionStoreError on a bad store).
        store = open_sessions(config, model_dir, self._decoder.slot_buffers(0),
                              self._decoder.capacity, self._decoder.slot_states(0))
        # One cache per slot; they share the saved session prefixes (a session continues in
        # whichever slot is free).
        self._caches = [KVCache(self._decoder.slot_buffers(i), self._decoder.capacity,
                                snapshot_dtype=config.kv_dtype, store=store,
                                states=self._decoder.slot_states(i),
                                scales=self._decoder.slot_scales(i))
                        for i in range(config.parallel_sequences)]
        self._lock = threading.RLock()
        self._store = store
        self._scheduler = Scheduler(self._caches, config.prefill_chunk, config.prefix_reuse,
                                    end_ops=self._end_ops, on_end=self._goal_ended)
        self._held: Dict[int, tuple] = {}   # goal uid -> the adapter uses it acquired
        self.loop = StepLoop(self._scheduler, Executor(self._decoder, self._caches, self.rows,
                                                       self._start_sequence, self.speculation),
                             self._lock)
        self._solo: Optional[Generation] = None
        self._compile_schema = functools.lru_cache(maxsize=16)(self._compile)
        self.model_name = self.info.name
        self.context_length = self._decoder.capacity
        self.vocab_size = self.info.vocab_size
        self.providers = self._decoder.providers
        self.kernel = self._decoder.kernel  # the matmul kernels that run, e.g. 'kquant (avx2)'
        self._warm: Dict[str, WarmPrompt] = {}   # by key, in the order they were added
        try:
            for prompt in warm:
                self._pin(prompt, at_configure=True)
        except BaseException:
            self.close()   # releases sessions.store for the next configure
            raise
        self._store.keep_pinned_rows()   # the store forgets prompts no longer configured

    def _load_warm_prompts(self, config: EngineConfig) -> List[WarmPrompt]:
        """Read, render and check config.warm_prompts (WarmPromptError saying what to change)."""
        if config.warm_prompts and not config.prefix_reuse:
            raise WarmPromptError('warm prompts are reused through the prefix cache: set '
                                  'kv.prefix_reuse true, or drop kv.warm_prompts')
        prompts: Dict[str, WarmPrompt] = {}
        for source in config.warm_prompts:
            prompt = warm_mod.load(source, self.tokenizer, self.family, config.max_context)
            prompts.setdefault(prompt.key, prompt)
        return list(prompts.values())

    def _pin(self, prompt: WarmPrompt, at_configure: bool = False) -> WarmPrompt:
        """Pin a warm prompt's KV: restored from the store, else prefilled as one goal.

        A stored state this model cannot use (StoredWarmStateError) is logged and kept as the
        prompt's status; the prompt is prefilled again and saved anew. A prefilled prompt is
        on disk before this returns, so the first goals do not share the CPU with its write.
        At configure a restored prompt is also made live in an empty slot (the prefilled one
        is live in its slot already): the first goal reuses it there without a restore copy.
        """
        t0 = time.perf_counter()
        stored_error = ''
        try:
            snap = self._store.stored_pin(prompt.key)
        except StoredWarmStateError as exc:
            stored_error = f'{type(exc).__name__}: {exc}'
            _log.warning('warm prompt %r: %s', prompt.label, stored_error)
            snap = None
        if snap is not None and tuple(snap.keys) == prompt.ids:
            self._store.pin(prompt.key, snap, save=False)
            if at_configure:
                self._make_live(snap)
            how = 'restored from sessions.store'
        else:
            # The normal run path: a goal of the prompt's ids and one token, then its KV.
            request = replace(self.prepare(GenerationRequest(
                prompt='.', use_chat_template=False, max_tokens=1)),
                prompt_ids=prompt.ids, keys=prompt.ids, speculative=False)
            generation = self.generate(request)
            result = generation.run_to_end()
            if result.stop_reason not in (StopReason.STOP, StopReason.LENGTH):
                raise WarmPromptError(f'prefilling warm prompt {prompt.label!r} ended '
                                      f'{result.stop_reason.value}: {result.error}')
            cache = self._caches[generation.goal.slot]
            snap = cache.snapshot_prefix(len(prompt.ids))
            if tuple(snap.keys) != prompt.ids:
                raise EngineError(f'warm prompt {prompt.label!r}: slot '
                                  f'{generation.goal.slot} does not hold its prefill')
            how = f'prefilled in {time.perf_counter() - t0:.2f} s'
            self._store.pin(prompt.key, snap)
            if self._store.persistent:
                t1 = time.perf_counter()
                saved = threading.Event()
                self._store.when_saved(saved.set)
                saved.wait()
                how += f', saved in {time.perf_counter() - t1:.2f} s'
            if stored_error:
                how = 're-' + how
        _log.info('warm prompt %r: %d tokens, %d bytes of KV pinned, %s', prompt.label,
                  prompt.tokens, snap.nbytes, how)
        pinned = replace(prompt, nbytes=snap.nbytes, restored=how.startswith('restored'),
                         stored_error=stored_error)
        self._warm[prompt.key] = pinned
        return pinned

    def _make_live(self, snap) -> None:
        """Copy a restored warm prompt's KV into the first empty slot (none empty: nothing)."""
        for cache in self._caches:
            if cache.length == 0:
                cache.apply(Reuse(len(snap.keys), snap))
                return

    def add_warm_prompt(self, text: str = '', path: str = '') -> WarmPrompt:
        """Prefill and pin one more warm prompt (text, 'file:<path>', or a file path).

        Runs goals on the caller's thread: the node's worker calls it between jobs. Raises
        WarmPromptError (unreadable, empty, too long, over the KV budget) and pins nothing
        then. A prompt already warm is returned as it is.
        """
        if bool(text) == bool(path):
            raise WarmPromptError('give a warm prompt as text or as a file path: exactly one '
                                  'of them')
        with self._lock:
            self._open_decoder()
            if not self.prefix_reuse:
                raise WarmPromptError('warm prompts are reused through the prefix cache: set '
                                      'kv.prefix_reuse true')
            prompt = warm_mod.load(text, self.tokenizer, self.family, self.context_length,
                                   path)
            if prompt.key in self._warm:
                return self._warm[prompt.key]
            limit, source = self._kv_limit
            saved = self.config.session_max_bytes if self.config.max_sessions else 0
            pinned = self._store.pinned_nbytes()
            more = warm_mod.snapshot_bytes(self.info, prompt.tokens, self.config.kv_dtype)
            if self.kv_bytes + saved + pinned + more > limit:
                raise WarmPromptError(
                    f'warm prompt {prompt.label!r} needs {more} bytes of pinned KV; with the '
                    f'{pinned} bytes of the warm prompts kept, the {self.kv_bytes} bytes of the '
                    f'KV slots and {saved} bytes of saved session prefixes that is more than '
                    f'{limit} bytes ({source}): shorten it, or raise kv.memory_limit (or lower '
                    'sessions.max_bytes) and configure again')
            return self._pin(prompt)

    def warm_prompts(self) -> List[WarmPrompt]:
        """Return the warm prompts pinned, in the order they were added."""
        return list(self._warm.values())

    def _session_config(self, config: EngineConfig) -> SessionConfig:
        return SessionConfig(
            providers=tuple(config.providers), provider_options=tuple(config.provider_options),
            intra_op_threads=config.intra_op_threads,
            intra_op_affinity=config.intra_op_affinity, max_context=config.max_context,
            slots=config.parallel_sequences, kernel=config.kernel, kv_dtype=self.live_kv_dtype)

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
        if getattr(request, 'session_id', '') and self._store.max_sessions == 0:
            raise InvalidRequestError(
                'this node keeps no sessions (kv.prefix_reuse false or kv.max_sessions 0): '
                'send the whole conversation without a session_id, or enable them')
        if not getattr(request, 'max_image_tokens', 0) and self.config.max_image_tokens:
            request = replace(request, max_image_tokens=self.config.max_image_tokens)
        # Adapters first: an unknown name or a bad scale is refused before any tokenizing.
        uses, lora_set = self.adapters.resolve(getattr(request, 'lora', None) or {})
        prepared = prepare(request, self.tokenizer, self.info.hidden_size, self.context_length,
                           self._compile_schema, decoder.act_dtype, family=self.family,
                           vocab_size=self.vocab_size, layout=self._layout)
        return replace(prepared, lora=uses, lora_set=lora_set) if uses else prepared

    def _start_sequence(self, goal: Goal, request: PreparedRequest) -> TokenSequence:
        """Build the runtime state of a goal that got a slot (the executor's Start).

        A session goal's prompt is built here, after the goals before it in its session
        ended: the stored turns first, then its own (runtime/conversation.py).
        """
        # Released when the goal ends, however it ends (_goal_ended): failing here included.
        self.adapters.acquire(request.lora)
        if request.lora:
            self._held[goal.uid] = request.lora
        if request.awaits_conversation:
            stored = self._store.conversation(request.session_id) or Conversation()
            request = bind_conversation(request, stored, self.tokenizer, self.context_length)
        if request.images:
            request = self._encode_images(request)
        seq = TokenSequence(self.tokenizer, request, goal.output, self._eos, t0=goal.t0)
        # A separate draft model runs without the goal's adapters (they are made for this
        # base, not for it): its drafts would be the base model's, so an adapter goal decodes
        # plainly there (its ids are the same either way: verify passes are row-exact).
        drafts_elsewhere = self.speculation.draft_model is not None
        if request.speculative and not (request.lora and drafts_elsewhere):
            seq.speculator = self.speculation.start(request.prompt_ids)
        return seq

    def _encode_images(self, request: PreparedRequest) -> PreparedRequest:
        """Run the vision encoder on the request's images and bind their rows (engine thread).

        A frame its session already holds (same content) takes the stored rows.
        """
        known = {k.digest: k.embeds for k in request.kept_images}
        encoded = [self.vision.rows_of(image, f'images[{i}]', known)
                   for i, image in enumerate(request.images)]
        return request.bind_images([e.rows for e in encoded], [e.digest for e in encoded])

    def _end_ops(self, goal: Goal, slot: int) -> list:
        """After a goal's end in `slot`: commit its session's turn, else checkpoint the slot.

        Only a turn that ended well (stop, length, tool calls) joins the conversation; a
        cancelled or failed one leaves it as it was.
        """
        if goal.sequence is None:   # its start failed
            return [Checkpoint(slot)]
        request, result = goal.sequence.request, goal.sequence.result
        if request.session is None or result.stop_reason not in _COMMITTED:
            return [Checkpoint(slot)]
        reply = reply_turn(result.text, result.tool_calls)
        return [Commit(slot, request.session_id,
                       committed(request.session, reply, result.token_ids,
                                 request.stored_images(), request.lora_set))]

    def _goal_ended(self, goal: Goal) -> None:
        """Free the adapters a goal acquired at its start (once, whatever ended it)."""
        uses = self._held.pop(goal.uid, None)
        if uses:
            self.adapters.release(uses)

    def when_saved(self, goal: Goal, done: Callable[[], None]) -> None:
        """Call done() once an ended goal's committed turn persists (at once if none).

        The worker delivers a session goal's end through this: a turn whose result a client
        saw survives a kill -9 (sessions.store; without a store: at once).
        """
        # goal.request: the goal's sequence is released when it ends.
        if not goal.request.session_id or goal.result is None \
                or goal.result.stop_reason not in _COMMITTED:
            done()
            return
        self._store.when_saved(done)

    def embed(self, texts, is_query: bool = False, dimensions: int = 0,
              truncate: bool = False):
        """Refuse: a chat folder embeds nothing (serving/embedding.EmbeddingEngine does)."""
        raise not_an_embedding_model(self.model_name)

    def rerank(self, query, documents, top_n: int = 0, truncate: bool = False):
        """Refuse: a chat folder scores nothing (serving/embedding.EmbeddingEngine does)."""
        raise not_an_embedding_model(self.model_name)

    def generate(self, request: Union[PreparedRequest, GenerationRequest]) -> 'Generation':
        """Submit one goal and return its Generation, which steps the engine as it is iterated.

        A GenerationRequest is prepared first (a convenience for scripts and tests; a server
        prepares at admission and passes the PreparedRequest).
        """
        t0 = time.perf_counter()
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        if not prepared.bound:
            raise EngineError('the request declares prefix_embeddings or images that were never '
                              'bound: call prepared.bind(array) / with_frames(frames) before '
                              'generate()')
        with self._lock:
            self._open_decoder()
            if self._solo is not None:
                self._solo.abandon()
            goal = Goal(prepared, t0=t0)
            self._scheduler.submit(goal)
            self._solo = Generation(self, goal)
        return self._solo

    def scheduler(self) -> Scheduler:
        """Return the scheduler over the engine's parallel_sequences slots."""
        self._open_decoder()
        return self._scheduler

    def step(self) -> Report:
        """Run an admission plan, then a decode plan, on this thread."""
        self._open_decoder()
        return self.loop.step()

    def run_plan(self) -> Report:
        """Run the next plan (admission or decode) on this thread."""
        self._open_decoder()
        return self.loop.run_plan()

    def end_goal(self, goal: Goal, reason: CancelReason) -> None:
        """Cancel a goal and end it now (not at the next step)."""
        with self._lock:
            if not self._scheduler.cancel(goal, reason):
                self._run_ends()

    # --- text --------------------------------------------------------------------------------
    def tokenize(self, text: str = '', messages: Sequence[ChatMessage] = (),
                 add_generation_prompt: bool = True) -> List[int]:
        """Token ids of raw text, or of messages rendered with the chat template."""
        if messages:
            return self.tokenizer.encode_chat(list(messages), add_generation_prompt)
        return self.tokenizer.encode(text)

    def token_strings(self, ids) -> List[str]:
        return self.tokenizer.token_strings(ids)

    def check_video(self, name: str) -> None:
        """Raise ImageInputError naming `name` unless this model takes video clips."""
        media.check_video(self._layout, name)

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
            'gguf_name': self.info.gguf_name,
            'parameters': int(self.info.parameters),
            'model_dir': self.model_dir,
            'architecture': self.info.architecture,
            'quantization': quantization_text(self.info.extra.get('quantization')),
            'context_length': int(self.context_length),
            'max_position_embeddings': int(self.info.max_position_embeddings),
            'vocab_size': int(self.vocab_size),
            'providers': list(self.providers),
            'kernel': self.kernel,
            'chat_template': template,
            'family': family.family if family is not None else '',
            'family_error': self.family_error,
            'tool_call_format': fmt,
            'warm_prompts': [{'label': p.label, 'tokens': p.tokens, 'bytes': p.nbytes,
                              'status': p.status} for p in self._warm.values()],
            'capabilities': {
                'tools': fmt != 'none',
                'reasoning': reasoning is not None,
                'reasoning_can_disable': family is not None and family.can_disable_reasoning,
                'embeddings_input': True,
                'vision': self.vision is not None,
            },
        }

    # --- state -------------------------------------------------------------------------------
    def kv_occupancy(self) -> Tuple[int, int]:
        """(positions used, capacity) of the live KV caches (summed over the slots)."""
        used = sum(c.length for c in self._caches)
        return used, self._caches[0].capacity * len(self._caches)

    def saved_sessions(self) -> List[str]:
        """Return the session ids whose KV prefixes are saved, least recently used first."""
        return self._caches[0].sessions()

    def session(self, session_id: str) -> Optional['SessionInfo']:
        """Describe one session: its turns, tokens and KV bytes (None when none is kept)."""
        with self._lock:
            conversation = self._store.conversation(session_id)
            snap = self._store.get(session_id)
            live = max((c.live_bytes() for c in self._caches if c.owner == session_id),
                       default=0)
            if conversation is None and snap is None and not live:
                return None
            saved = snap.nbytes if snap is not None else 0
            return SessionInfo(session_id, conversation or Conversation(), max(saved, live))

    def sessions(self) -> List['SessionInfo']:
        """Describe every session kept, least recently used first."""
        with self._lock:
            ids = list(self._store.ids())
            ids += [c.owner for c in self._caches if c.owner and c.owner not in ids]
            return [info for info in map(self.session, ids) if info is not None]

    def conversations(self) -> Dict[str, Conversation]:
        """Return every kept session's conversation, least recently used first."""
        with self._lock:
            found = ((sid, self._store.conversation(sid)) for sid in self._store.ids())
            return {sid: conv for sid, conv in found if conv is not None}

    def adopt_conversations(self, conversations: Mapping[str, Conversation]) -> int:
        """Keep another model's sessions as text (Conversation.as_text), in the given order.

        Their next turn renders and prefills the whole conversation for this model. Sessions
        this engine already keeps (restored from sessions.store) stay as they are. Returns
        how many were adopted.
        """
        adopted = 0
        with self._lock:
            for session_id, conversation in conversations.items():
                if session_id not in self._store:
                    self._store.commit(session_id, conversation.as_text())
                    adopted += 1
        return adopted

    def reset_sessions(self, session_id: str = '') -> int:
        """Drop one session's KV prefix ('' = every session and the live caches).

        Returns how many sessions had a kept prefix (saved, or in a live cache). An unknown
        session id is a no-op that returns 0, not an error: saved prefixes are an LRU and may
        already have been evicted, so "forget this conversation" must not depend on that
        race. A goal running on the dropped prefix is ended first (CANCELLED), since its
        cache is going away; paused goals keep their parked KV and are not affected.
        """
        if not isinstance(session_id, str):
            raise InvalidRequestError('session_id must be text')
        with self._lock:
            if not session_id:
                count = len({s for c in self._caches for s in c.known_sessions()})
                self.reset_cache()
                return count
            for goal in self._scheduler.live():
                if self._caches[goal.slot].owner == session_id:
                    self._scheduler.cancel(goal, CancelReason.SESSION_RESET)
            self._run_ends()
            # Every slot's cache forgets its live copy (all of them: no short cut).
            dropped = [c.drop_session(session_id) for c in self._caches]
            return int(any(dropped))

    def reset_cache(self, sessions: bool = True) -> None:
        """Forget the live KV caches (and the saved session prefixes unless sessions=False).

        Goals holding a slot end first (CANCELLED: their KV is going away); paused goals
        keep their parked KV and waiting goals their place. The worker calls this only
        between goals (run_between_jobs), so no goal it drives is ended here.
        """
        with self._lock:
            for goal in self._scheduler.live():
                self._scheduler.cancel(goal, CancelReason.SESSION_RESET)
            self._run_ends()
            for cache in self._caches:
                cache.reset()
            if sessions:
                self._caches[0].clear_sessions()

    def _run_ends(self) -> None:
        """End the cancelled goals now (their results set; checkpoints run)."""
        self.loop.executor.run(self._scheduler.reap_plan())

    def close(self) -> None:
        """Free the session and the KV buffers; the engine cannot be used afterwards."""
        with self._lock:
            if self._decoder is None:
                return
            self.loop.abort(CancelReason.SHUTDOWN)
            for cache in self._caches[1:]:
                cache.checkpoint()
                cache.reset()
            self._caches[0].close()  # flushes persisted sessions, keeps them on disk
            self._decoder = None


@dataclass(frozen=True)
class SessionInfo:
    """What ~/get_session reports of one session."""

    session_id: str
    conversation: Conversation
    kv_bytes: int        # its saved KV prefix, or the live one in a slot (the larger)


class Generation:
    """One goal driven on the caller's thread: iterate its TokenEvents (Engine.generate).

    Each ``next`` runs plans until the goal has a new token or has ended (the first token
    comes right after the prompt's last prefill chunk); ``result`` is the goal's result once
    it ended. ``cancel()`` may come from any thread: the goal ends at the next admission plan
    with StopReason.CANCELLED. An abandoned or interrupted generation yields nothing more.
    """

    def __init__(self, engine: Engine, goal: Goal) -> None:
        self._engine = engine
        self.goal = goal
        self._next = 0
        self._closed = False

    @property
    def result(self) -> Optional[GenerationResult]:
        return self.goal.result

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        goal = self.goal
        events = goal.output.events
        try:
            while self._next >= len(events) and not self._closed:
                if goal.done:
                    raise StopIteration
                self._engine.run_plan()
        except StopIteration:
            raise
        except BaseException:
            if not goal.done:
                # A KeyboardInterrupt mid-call: end every goal, forget the KV it left.
                self._engine.reset_cache(sessions=False)
            self._closed = True
            raise
        if self._closed:
            raise StopIteration
        event = events[self._next]
        self._next += 1
        return event

    def cancel(self) -> None:
        """Stop at the next step boundary (thread-safe)."""
        self._engine.scheduler().cancel(self.goal, CancelReason.CLIENT)

    def run_to_end(self) -> GenerationResult:
        """Consume every event and return the result."""
        for _ in self:
            pass
        assert self.goal.result is not None
        return self.goal.result

    def abandon(self) -> None:
        """End a generation that will not be iterated further (result: CANCELLED)."""
        self._closed = True
        if not self.goal.done:
            self._engine.end_goal(self.goal, CancelReason.SUPERSEDED)


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
    if quant.get('weights') == 'kquant':  # GGUF blocks as they are: no bits or block size
        parts.append('kquant (GGUF blocks)')
    elif quant.get('bits'):
        parts.append(f'int{quant["bits"]}')
    if quant.get('block_size') and quant.get('weights') != 'kquant':
        parts.append(f'block {quant["block_size"]}')
    if quant.get('source_types'):
        parts.append('from ' + '+'.join(map(str, quant['source_types'])))
    if quant.get('precision') and not parts:
        parts.append(str(quant['precision']))
    return ', '.join(parts)

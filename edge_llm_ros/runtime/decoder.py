"""ONNX decoder session: one onnxruntime session, IOBinding, preallocated KV buffers.

One graph serves prefill and decode (see the engine contract): inputs ``input_ids [B, s]``,
``inputs_embeds [B, e, hidden]`` (fed ahead of the ids), ``seqlens_k [B]`` (total - 1),
``total_sequence_length []``, ``logits_count [1]`` and
``past_key_values.{i}.key/value [B, kv_heads, L, head_dim]``; outputs
``logits [B, logits_count, vocab]`` (the last positions; 1 except in a verify pass) and
``present.{i}.key/value``. A VLM whose image tokens attend both ways (gemma3) also takes
``bidirectional [1]`` (int32; 1 for a forward over one image's rows). A hybrid's conv layer
(lfm2; model.yaml ``layer_states``) has no KV: it takes ``past_conv.{i}`` [B, kernel - 1,
hidden] and gives ``present_conv.{i}``, its conv state, bound like the KV buffers.

The KV buffers are allocated once and bound as BOTH past and present: GroupQueryAttention then
writes the new positions in place (share-buffer mode) and nothing is copied between steps. The
small decode inputs are numpy arrays bound once and rewritten in place each step.

Sequence slots (``SessionConfig.slots`` = N, docs/batching.md): the buffers are
``[N, kv_heads, L, head_dim]``; slot i is the contiguous view ``buf[i:i+1]``. A prefill runs
one slot (batch 1, over that slot's views); ``decode_rows`` runs rows 0..b-1 in one call with
per-row lengths in ``seqlens_k`` (GroupQueryAttention's per-sequence lengths). Every binding is
built at init, so a step only writes ints and runs. With N = 1, decode() feeds one row through
the binding of slot 0.

Conv states (``state_buffers``, [N, kernel - 1, hidden] per conv layer) hold no positions: a
call writes the state of every row it runs, so ``decode_rows`` keeps the rows it is told to
keep (padding rows over a slot whose sequence is between prefill chunks). Such a decoder is not
``rewindable``: a slot's state is that of its last position, never of an earlier one.

``verify`` runs several ids of one slot and returns the logits of every one of them (a
speculative verify pass). Only a graph with ``attention: causal`` (model.yaml) promises that
those are the bits the same ids fed one decode step at a time would give (``row_exact``).
"""
from __future__ import annotations

from dataclasses import dataclass
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort

from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import (BIDIRECTIONAL_INPUT, CONV_STATE_PAST, CONV_STATE_PRESENT,
                                       MODEL_FILE, ModelInfo, REGENERATE_HINT)
from edge_llm_ros.runtime import native_ops
_ORT_DTYPES = {'tensor(float)': np.float32, 'tensor(float16)': np.float16}


@dataclass(frozen=True)
class SessionConfig:
    """How the onnxruntime session runs (chosen once, at load)."""

    providers: Tuple[str, ...] = ('CPUExecutionProvider',)
    provider_options: Tuple[dict, ...] = ()  # one dict per provider, or empty
    intra_op_threads: int = 0                # 0 = onnxruntime's default
    intra_op_affinity: str = ''              # 'session.intra_op_thread_affinities'
    max_context: int = 2048                  # KV positions to allocate
    slots: int = 1                           # sequence slots (rows of the KV buffers)
    # The native op library's kernels (native_ops.KERNEL_CHOICES): 'auto' = the best this
    # CPU has; a board profile may pin one (an unsupported pin is a KernelPinError).
    kernel: str = 'auto'


def check_providers(providers: Sequence[str], provider_options: Sequence[dict]) -> None:
    """Raise ModelLoadError when a provider is unknown to (or not built into) this onnxruntime."""
    if not providers:
        raise ModelLoadError('no execution provider given: use e.g. CPUExecutionProvider')
    available = ort.get_available_providers()
    bad = [p for p in providers if p not in available]
    if bad:
        raise ModelLoadError(
            f'execution provider(s) {", ".join(bad)} not available in this onnxruntime '
            f'{ort.__version__} build; available: {", ".join(available)}')
    if provider_options and len(provider_options) != len(providers):
        raise ModelLoadError(f'{len(provider_options)} provider_options for {len(providers)} '
                             'providers: give one dict per provider (or none)')


def _session_options(config: SessionConfig) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if config.intra_op_threads < 0:
        raise ModelLoadError(f'intra_op_threads must be >= 0, got {config.intra_op_threads}')
    if config.intra_op_threads:
        opts.intra_op_num_threads = config.intra_op_threads
    if config.intra_op_affinity:
        if config.intra_op_threads < 2:
            raise ModelLoadError(
                'intra_op_affinity needs intra_op_threads >= 2 (it lists the cores of the '
                'threads after the first, e.g. "1;2;3" for 4 threads)')
        entries = config.intra_op_affinity.split(';')
        if len(entries) != config.intra_op_threads - 1:
            raise ModelLoadError(
                f'intra_op_affinity {config.intra_op_affinity!r} has {len(entries)} entries; '
                f'{config.intra_op_threads} threads need {config.intra_op_threads - 1} '
                '(";"-separated 1-based processor ids, one entry per thread after the first, '
                'e.g. "2;3;4" or "1,2;3,4")')
        opts.add_session_config_entry('session.intra_op_thread_affinities',
                                      config.intra_op_affinity)
    return opts


class OnnxDecoder:
    """The model's forward pass, with KV buffers preallocated and bound once.

    ``forward`` and ``decode`` return a view of one preallocated logits buffer: read it (or copy
    it) before the next call.
    """

    def __init__(self, model_dir: str, spec: ModelInfo, config: SessionConfig) -> None:
        self.info = spec
        model_path = os.path.join(model_dir, MODEL_FILE)
        if not os.path.isfile(model_path):
            raise ModelLoadError(f'{model_path} is missing: {REGENERATE_HINT}')
        if config.max_context < 1:
            raise ModelLoadError(f'max_context must be >= 1, got {config.max_context}')
        if config.max_context > spec.max_position_embeddings:
            raise ModelLoadError(
                f'max_context {config.max_context} exceeds the model max_position_embeddings '
                f'{spec.max_position_embeddings}: lower max_context')
        # LongRoPE models (phi3) were converted with their short-context factors: past the
        # original context llama.cpp switches to the long ones, so outputs would diverge.
        rope_max = int((spec.extra.get('rope_scaling') or {}).get('max_context') or 0)
        if rope_max and config.max_context > rope_max:
            raise ModelLoadError(
                f'max_context {config.max_context} exceeds {rope_max}, the context this '
                "model's rope scaling was converted for: lower max_context")
        if spec.kv_max_context is not None and config.max_context > spec.kv_max_context:
            raise ModelLoadError(
                f'max_context {config.max_context} exceeds the static KV length '
                f'{spec.kv_max_context} the graph was built for: lower max_context or reconvert')
        check_providers(config.providers, config.provider_options)
        opts = _session_options(config)
        unknown = [d for d in spec.op_domains if d != native_ops.DOMAIN]
        if unknown:
            raise UnsupportedModelError(f'{model_dir} needs op domains {", ".join(unknown)}, '
                                        f'which this runtime lacks: {REGENERATE_HINT}')
        # Which matmul kernels run: the library's CPU kernels for GGUF blocks, else MLAS.
        self.kernel = 'matmulnbits (MLAS)'
        if native_ops.DOMAIN in spec.op_domains:
            path = native_ops.register(opts, f'model {model_dir} (weights: kquant)',
                                       config.kernel)
            self.kernel = f'kquant ({native_ops.kernel_name(path)})'
        providers = list(config.providers)
        if config.provider_options:
            providers = list(zip(config.providers, config.provider_options))
        try:
            self._session = ort.InferenceSession(model_path, sess_options=opts,
                                                 providers=providers)
        except Exception as e:  # onnxruntime raises several unrelated types here
            raise ModelLoadError(f'onnxruntime could not load {model_path} (and its '
                                 f'model.onnx.data): {e}. {REGENERATE_HINT[0].upper()}'
                                 f'{REGENERATE_HINT[1:]}') from None
        self.providers = tuple(self._session.get_providers())
        if config.slots < 1:
            raise ModelLoadError(f'slots must be >= 1, got {config.slots}')
        self._check_io(model_path, config.slots)
        self.capacity = config.max_context
        self.slots = config.slots
        kv_len = spec.kv_max_context or config.max_context
        kv_shape = (self.slots, spec.num_kv_heads, kv_len, spec.head_dim)
        # Owned here for the session's life: the OrtValues below point into these arrays.
        # K and V of each attention layer (spec.kv_layers, in order) ...
        self.kv_buffers: List[np.ndarray] = [
            np.zeros(kv_shape, dtype=self._kv_dtype) for _ in range(2 * len(spec.kv_layers))]
        # ... and the state of each conv layer (spec.conv_layers, in order).
        self.state_buffers: List[np.ndarray] = [
            np.zeros((self.slots,) + spec.state_of(i).shape, dtype=self._kv_dtype)
            for i in spec.conv_layers]
        # Whether a slot's state can be cut back to an earlier position (KV only).
        self.rewindable = spec.rewindable
        self._logits = np.zeros((self.slots, 1, spec.vocab_size), dtype=np.float32)
        self._one_logit = np.ones((1,), dtype=np.int64)   # logits_count but in verify passes
        self._verify_logits = np.zeros((1, 0, spec.vocab_size), dtype=np.float32)
        self._verify_bindings: Dict[Tuple[int, int], tuple] = {}   # (slot, n) -> binding
        # Whether a verify pass gives a position the bits a decode step gives it.
        # (the converter writes attention 'causal' only when every matmul is the op library's)
        self.row_exact = spec.attention == 'causal' and native_ops.DOMAIN in spec.op_domains
        self.logits = self._logits[0].reshape(-1)  # the view a single-row call returns
        self._keep: list = []   # numpy views the OrtValues below point into
        # One binding per slot (prefill, and decode of slot 0) ...
        self._slot_bindings = [self._rows_binding(slice(i, i + 1)) for i in range(self.slots)]
        self._binding = self._slot_bindings[0]
        # ... and one per row count b for batched decode over rows 0..b-1 (N > 1 only).
        self._rows: List[Tuple[ort.IOBinding, np.ndarray, np.ndarray, np.ndarray]] = []
        if self.slots > 1:
            self._rows_total = np.zeros((), dtype=np.int32)
            total = ort.OrtValue.ortvalue_from_numpy(self._rows_total)
            for b in range(1, self.slots + 1):
                binding = self._rows_binding(slice(0, b))
                ids = np.zeros((b, 1), dtype=np.int64)
                seqlens = np.zeros((b,), dtype=np.int32)
                inputs = {'input_ids': self._value(ids), 'seqlens_k': self._value(seqlens),
                          'total_sequence_length': total,
                          'logits_count': self._value(self._one_logit)}
                if self.accepts_embeds:
                    inputs['inputs_embeds'] = self._value(
                        np.zeros((b, 0, spec.hidden_size), dtype=self.act_dtype))
                for name, value in inputs.items():
                    binding.bind_ortvalue_input(name, value)
                self._rows.append((binding, ids, seqlens, self._logits[:b].reshape(b, -1)))
        # Decode inputs of slot 0: bound once, rewritten in place every step.
        self._ids1 = np.zeros((1, 1), dtype=np.int64)
        self._no_embeds = np.zeros((1, 0, spec.hidden_size), dtype=self.act_dtype)
        self._seqlens = np.zeros((1,), dtype=np.int32)
        self._total = np.zeros((), dtype=np.int32)
        self._decode_inputs = {
            'input_ids': ort.OrtValue.ortvalue_from_numpy(self._ids1),
            'seqlens_k': ort.OrtValue.ortvalue_from_numpy(self._seqlens),
            'total_sequence_length': ort.OrtValue.ortvalue_from_numpy(self._total),
            'logits_count': ort.OrtValue.ortvalue_from_numpy(self._one_logit),
        }
        if self.accepts_embeds:
            self._decode_inputs['inputs_embeds'] = ort.OrtValue.ortvalue_from_numpy(
                self._no_embeds)
        self._prefill_keep: list = []  # keeps the last prefill's input arrays alive
        self._decode_bound = False
        self._bind(self._decode_inputs)
        self._decode_bound = True

    # --- graph checks ------------------------------------------------------------------------
    def _check_io(self, model_path: str, slots: int) -> None:
        spec = self.info
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        want_in = ['input_ids', 'seqlens_k', 'total_sequence_length', 'logits_count']
        want_out = ['logits']
        for i in spec.kv_layers:
            want_in += [f'past_key_values.{i}.key', f'past_key_values.{i}.value']
            want_out += [f'present.{i}.key', f'present.{i}.value']
        for i in spec.conv_layers:
            want_in.append(CONV_STATE_PAST.format(i))
            want_out.append(CONV_STATE_PRESENT.format(i))
        missing = [n for n in want_in if n not in inputs] + \
            [n for n in want_out if n not in outputs]
        if missing:
            raise ModelLoadError(
                f'{model_path} does not match model.yaml ({spec.num_layers} layers): missing '
                f'graph inputs/outputs {", ".join(missing[:6])}: {REGENERATE_HINT}')
        # The first layer's state (every layer holds one): its batch and dtype are the graph's.
        first = (f'past_key_values.{spec.kv_layers[0]}.key' if spec.kv_layers
                 else CONV_STATE_PAST.format(spec.conv_layers[0]))
        batch = inputs[first].shape[0]
        if slots > 1 and isinstance(batch, int):
            raise ModelLoadError(
                f'{model_path} was converted with a fixed batch of {batch}, so it cannot run '
                f'{slots} parallel sequences: reconvert it with a current edge-llm-convert '
                '(converter version 4 or later), or set parallel_sequences to 1')
        self.accepts_embeds = 'inputs_embeds' in inputs
        # A VLM graph whose image rows may attend both ways: every binding reads one shared
        # flag, 1 only while forward(bidirectional=True) runs.
        self.bidirectional_images = BIDIRECTIONAL_INPUT in inputs
        self._image_flag = np.zeros((1,), dtype=np.int32)
        self._image_flag_value = ort.OrtValue.ortvalue_from_numpy(self._image_flag)
        kv_type = inputs[first].type
        if kv_type not in _ORT_DTYPES:
            raise UnsupportedModelError(f'{model_path}: KV inputs of type {kv_type} are not '
                                        'supported (float or float16)')
        self._kv_dtype = _ORT_DTYPES[kv_type]
        self.act_dtype = _ORT_DTYPES.get(
            inputs['inputs_embeds'].type if self.accepts_embeds else kv_type, np.float32)
        logits_shape = outputs['logits'].shape
        if isinstance(logits_shape[-1], int) and logits_shape[-1] != spec.vocab_size:
            raise ModelLoadError(f'{model_path}: logits width {logits_shape[-1]} != vocab_size '
                                 f'{spec.vocab_size} in model.yaml: {REGENERATE_HINT}')

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        """Wrap array's memory in an OrtValue (no copy: tested) and keep the array alive."""
        self._keep.append(array)
        return ort.OrtValue.ortvalue_from_numpy(array)

    def _rows_binding(self, rows: slice) -> ort.IOBinding:
        """Build a binding whose KV (past = present) and logits are these buffer rows."""
        binding = self._session.io_binding()
        if self.bidirectional_images:
            binding.bind_ortvalue_input(BIDIRECTIONAL_INPUT, self._image_flag_value)
        for n, i in enumerate(self.info.kv_layers):
            for j, kind in enumerate(('key', 'value')):
                value = self._value(self.kv_buffers[2 * n + j][rows])
                binding.bind_ortvalue_input(f'past_key_values.{i}.{kind}', value)
                binding.bind_ortvalue_output(f'present.{i}.{kind}', value)
        for buf, i in zip(self.state_buffers, self.info.conv_layers):
            value = self._value(buf[rows])
            binding.bind_ortvalue_input(CONV_STATE_PAST.format(i), value)
            binding.bind_ortvalue_output(CONV_STATE_PRESENT.format(i), value)
        width = rows.stop - rows.start
        binding.bind_ortvalue_output('logits', self._value(self._logits[:width]))
        return binding

    def slot_buffers(self, slot: int) -> List[np.ndarray]:
        """Slot's KV views [1, kv_heads, L, head_dim] per buffer (what its KVCache tracks)."""
        return [buf[slot:slot + 1] for buf in self.kv_buffers]

    def slot_states(self, slot: int) -> List[np.ndarray]:
        """Slot's conv-state views [1, kernel - 1, hidden] (empty: a model of KV only)."""
        return [buf[slot:slot + 1] for buf in self.state_buffers]

    # --- running -----------------------------------------------------------------------------
    def _bind(self, values: Dict[str, ort.OrtValue]) -> None:
        for name, value in values.items():
            self._binding.bind_ortvalue_input(name, value)

    def decode(self, token_id: int, past_len: int) -> np.ndarray:
        """One token at position past_len; returns the logits view [vocab]. The hot path."""
        if not self._decode_bound:
            self._bind(self._decode_inputs)
            self._prefill_keep = []
            self._decode_bound = True
        self._ids1[0, 0] = token_id
        self._seqlens[0] = past_len
        self._total[()] = past_len + 1
        self._session.run_with_iobinding(self._binding)
        return self.logits

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int],
                    keep: Sequence[int] = ()) -> np.ndarray:
        """Run one decode step of rows 0..b-1 (N > 1); returns the logits view [b, vocab].

        Row i feeds tokens[i] at positions[i] of slot i (b = len(tokens)); the view is valid
        until the next call.

        A row whose slot is idle must still be fed: give it a position past that slot's kept
        KV (its own length), where the write lands in garbage space. A conv state has no such
        space: the rows in `keep` get their conv states back after the call (a few KB each).
        """
        binding, ids, seqlens, logits = self._rows[len(tokens) - 1]
        ids[:, 0] = tokens
        seqlens[:] = positions
        self._rows_total[()] = int(seqlens.max()) + 1
        kept = [(row, [buf[row].copy() for buf in self.state_buffers])
                for row in keep] if self.state_buffers else ()
        self._session.run_with_iobinding(binding)
        for row, states in kept:
            for buf, state in zip(self.state_buffers, states):
                buf[row] = state
        return logits

    def forward(self, ids: np.ndarray, embeds: Optional[np.ndarray], past_len: int,
                slot: int = 0, bidirectional: bool = False) -> np.ndarray:
        """Run ``embeds`` (ahead) then ``ids`` at positions past_len.. of a slot: logits [vocab].

        ids: int [s] or [1, s] (s may be 0 when embeds are given); embeds: [e, hidden] or
        [1, e, hidden] or None. The caller keeps past_len + e + s within the capacity.
        bidirectional: every position of this forward sees all of its keys (one image's rows
        of a VLM whose image tokens attend both ways; needs bidirectional_images).
        """
        ids = np.asarray(ids).reshape(-1)
        if bidirectional and not self.bidirectional_images:
            raise ModelLoadError('this model.onnx has no bidirectional input for image '
                                 'attention: reconvert it with --mmproj and a current '
                                 'edge-llm-convert')
        if embeds is None and ids.shape[0] == 1 and slot == 0:
            return self.decode(int(ids[0]), past_len)
        n_emb = 0
        if embeds is not None:
            if not self.accepts_embeds:
                raise ModelLoadError('this model.onnx has no inputs_embeds input: reconvert it '
                                     'with a current edge-llm-convert to feed embeddings')
            embeds = np.ascontiguousarray(embeds, dtype=self.act_dtype).reshape(
                1, -1, self.info.hidden_size)
            n_emb = embeds.shape[1]
        n = n_emb + ids.shape[0]
        if n == 0:
            raise ValueError('forward needs at least one id or embedding')
        if past_len < 0 or past_len + n > self.capacity:
            raise ValueError(f'positions {past_len}..{past_len + n} outside the KV capacity '
                             f'{self.capacity}')
        ids2 = np.ascontiguousarray(ids, dtype=np.int64).reshape(1, -1)
        arrays = {'input_ids': ids2, 'seqlens_k': self._seqlens,
                  'total_sequence_length': self._total, 'logits_count': self._one_logit}
        if self.accepts_embeds:
            arrays['inputs_embeds'] = embeds if embeds is not None else self._no_embeds
        values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()}
        self._prefill_keep = [arrays, values]
        binding = self._slot_bindings[slot]
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        if slot == 0:
            self._decode_bound = False
        self._seqlens[0] = past_len + n - 1
        self._total[()] = past_len + n
        self._image_flag[0] = int(bidirectional)
        try:
            self._session.run_with_iobinding(binding)
        finally:
            self._image_flag[0] = 0
        return self.logits

    def verify(self, ids: Sequence[int], past_len: int, slot: int = 0) -> np.ndarray:
        """Feed ids at positions past_len.. of a slot; return the logits of each [n, vocab].

        Row i holds the next-token logits after ids[i]. The view is valid until the next
        verify call. The caller keeps past_len + n within the capacity. Each (slot, n) gets a
        binding on first use, so a pass only writes ints and runs, like a decode step.
        """
        n = len(ids)
        if n < 1 or past_len < 0 or past_len + n > self.capacity:
            raise ValueError(f'verify of {n} ids at {past_len} is outside the KV capacity '
                             f'{self.capacity}')
        if self._verify_logits.shape[1] < n:   # one logits buffer; its views are bound
            self._verify_logits = np.zeros((1, max(n, 8), self.info.vocab_size), np.float32)
            self._verify_bindings.clear()
        entry = self._verify_bindings.get((slot, n))
        if entry is None:
            entry = self._verify_bindings[(slot, n)] = self._verify_binding(slot, n)
        binding, fed, seqlens, total = entry
        fed[0, :] = ids
        seqlens[0] = past_len + n - 1
        total[()] = past_len + n
        self._session.run_with_iobinding(binding)
        return self._verify_logits[0, :n]

    def _verify_binding(self, slot: int, n: int) -> tuple:
        binding = self._rows_binding(slice(slot, slot + 1))
        fed = np.zeros((1, n), dtype=np.int64)
        seqlens = np.zeros((1,), dtype=np.int32)
        total = np.zeros((), dtype=np.int32)
        inputs = {'input_ids': fed, 'seqlens_k': seqlens, 'total_sequence_length': total,
                  'logits_count': np.array([n], dtype=np.int64)}
        if self.accepts_embeds:
            inputs['inputs_embeds'] = self._no_embeds
        for name, array in inputs.items():
            binding.bind_ortvalue_input(name, self._value(array))
        binding.bind_ortvalue_output('logits', self._value(self._verify_logits[:, :n]))
        return binding, fed, seqlens, total

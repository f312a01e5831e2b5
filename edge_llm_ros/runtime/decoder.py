"""ONNX decoder session: one onnxruntime session, IOBinding, preallocated KV and state buffers.

One entry point, ``run(rows)`` (runtime/rows.py): each row is one slot's next positions (a
decode step, a prefill chunk, a verify pass, an image's embeddings) and asks logits for its
last positions. A step's rows run in ONE model call on a varlen graph (converter 9, every
graph with the op library's CausalAttention): inputs ``input_ids [1, T]`` (the rows' tokens
packed), ``inputs_embeds [E, hidden]`` scattered to ``embeds_at [E, 1]``, ``rows [R, 4]``
(slot, start, length, bidirectional) and ``logits_at [K]``; output ``logits [1, K, vocab]``.
The ops read each row's slot of ``past_key_values.{i}.key/value [N, kv_heads, L, head_dim]``
and, in a hybrid (lfm2; model.yaml ``layer_states``), of ``past_conv.{i} [N, kernel - 1,
hidden]``; a slot no row names is not touched.

A graph without a row table (GroupQueryAttention, or converter <= 8) takes a batch of rows of
one length over slots 0..b-1 (``seqlens_k [B]``, ``total_sequence_length``,
``logits_count``): its decode steps go in one call and every other row in a call of its own
(_BatchedCalls).

With ``kv_dtype`` int8 (kv.dtype, docs/sessions.md) the decoder loads model_kv_int8.onnx
(convert/kv_int8_graph.py): the same graph over int8 KV buffers, each with a float32 scale
buffer ``past_key_values.{i}.key_scale`` [N, kv_heads, L, 1] (one scale per row); the op
library's attention quantizes new rows as it writes them and reads the int8 directly.

The state buffers are allocated once and bound as BOTH past and present: the attention (and
ShortConv) ops write the new positions in place and nothing is copied between steps. Slot i
of a buffer is the contiguous view ``buf[i:i+1]`` (what its KVCache tracks).

A conv state holds no positions: a slot's state is that of its last position, never of an
earlier one, so such a decoder is not ``rewindable``. Only a graph with ``attention: causal``
whose every matmul is the op library's promises that a position's logits are the same bits
whatever else its call runs (``row_exact``: a verify pass equals decode steps).
"""
from __future__ import annotations

from dataclasses import dataclass
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort

from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import (BATCHED_INPUTS, BIDIRECTIONAL_INPUT, CONV_STATE_PAST,
                                       CONV_STATE_PRESENT, KV_INT8_MODEL_FILE, MODEL_FILE,
                                       ModelInfo, REGENERATE_HINT, ROPE_POSITIONS_INPUT,
                                       ROWS_INPUT, VARLEN_INPUTS)
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.lora_ops import LoraOps
from edge_llm_ros.runtime.rows import check_rows, pack, Row
_ORT_DTYPES = {'tensor(float)': np.float32, 'tensor(float16)': np.float16}
KV_DTYPES = ('float32', 'int8')   # SessionConfig.kv_dtype


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
    # The live KV buffers' dtype: 'float32' (the graph's, model.onnx) or 'int8' (int8 rows
    # with float32 scales, model_kv_int8.onnx).
    kv_dtype: str = 'float32'


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
    """The model's forward pass over rows, with its state buffers preallocated and bound once.

    ``run`` returns a view of a preallocated logits buffer: read it (or copy it) before the
    next call.
    """

    def __init__(self, model_dir: str, spec: ModelInfo, config: SessionConfig) -> None:
        self.info = spec
        if config.kv_dtype not in KV_DTYPES:
            raise ModelLoadError(f'kv_dtype {config.kv_dtype!r} is not one of '
                                 f'{", ".join(KV_DTYPES)}')
        self.kv_int8 = config.kv_dtype == 'int8'
        model_path = os.path.join(model_dir, MODEL_FILE)
        if not os.path.isfile(model_path):
            raise ModelLoadError(f'{model_path} is missing: {REGENERATE_HINT}')
        if self.kv_int8:
            model_path = os.path.join(model_dir, KV_INT8_MODEL_FILE)
            if not os.path.isfile(model_path):
                raise ModelLoadError(
                    f'kv.dtype int8 needs {model_path} (the graph over int8 KV buffers), which '
                    'this folder lacks: run `python -m edge_llm_ros.convert.kv_int8_graph '
                    f'{model_dir}` (or reconvert the model), or set kv.dtype float32')
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
        # Owned here for the session's life: the OrtValues below point into these arrays.
        # K and V of each attention layer (spec.kv_layers, in order; each its own heads and
        # head size: gemma4's differ by layer; a shared-KV layer has none) ...
        self.kv_buffers: List[np.ndarray] = [
            np.zeros((self.slots, spec.kv_dims(i)[0], kv_len, spec.kv_dims(i)[1]),
                     dtype=self._kv_dtype) for i in spec.kv_layers for _ in range(2)]
        # ... with int8 KV, one float32 scale per row of each (K, V, K, V, ... as above).
        self.kv_scales: List[np.ndarray] = [
            np.zeros(b.shape[:3] + (1,), dtype=np.float32) for b in self.kv_buffers
        ] if self.kv_int8 else []
        # ... and the state of each conv layer (spec.conv_layers, in order).
        self.state_buffers: List[np.ndarray] = [
            np.zeros((self.slots,) + spec.state_of(i).shape, dtype=self._state_dtype)
            for i in spec.conv_layers]
        # Whether a slot's state can be cut back to an earlier position (KV only).
        self.rewindable = spec.rewindable
        # Whether a verify pass gives a position the bits a decode step gives it.
        # (the converter writes attention 'causal' only when every matmul is the op library's)
        self.row_exact = spec.attention == 'causal' and native_ops.DOMAIN in spec.op_domains
        self._keep: list = []   # numpy views the OrtValues below point into
        # How rows become onnxruntime runs: chosen here, once.
        self._calls = (_VarlenCalls(self) if self.varlen else _BatchedCalls(self))
        self._model_dir = model_dir
        self.lora: Optional[LoraOps] = None   # enable_lora(): adapters per row

    def enable_lora(self) -> LoraOps:
        """Return the decoder's LoRA registry (made once); rows then name adapters (Row.lora)."""
        if self.lora is None:
            if not self.varlen or native_ops.DOMAIN not in self.info.op_domains:
                raise UnsupportedModelError(
                    f'{self._model_dir}: LoRA adapters need a graph of the op library '
                    '(KQuantMatMul weights and a row table): convert the model from a GGUF '
                    'with a current edge-llm-convert')
            self.lora = LoraOps(self.info)
        return self.lora

    # --- graph checks ------------------------------------------------------------------------
    def _check_io(self, model_path: str, slots: int) -> None:
        spec = self.info
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        # A varlen graph (converter 9) runs rows; an older or GroupQueryAttention graph a
        # batch of equal-length rows (_BatchedCalls).
        self.varlen = ROWS_INPUT in inputs
        self.mrope = ROPE_POSITIONS_INPUT in inputs   # qwen2vl: rows carry 3-D positions
        want_in = list(VARLEN_INPUTS if self.varlen else BATCHED_INPUTS)
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
        if spec.conv_layers and not self.varlen:
            raise ModelLoadError(f'{model_path} holds conv states but no row table (converter '
                                 f'8): {REGENERATE_HINT}')
        self.accepts_embeds = 'inputs_embeds' in inputs
        # Whether a row may be bidirectional (one image's rows seeing each other both ways):
        # a varlen graph's row table says it per row; an older graph reads one shared flag.
        self.bidirectional_images = self.varlen or BIDIRECTIONAL_INPUT in inputs
        kv_type = inputs[first].type
        if self.kv_int8 and spec.kv_layers:
            scale = f'past_key_values.{spec.kv_layers[0]}.key_scale'
            if kv_type != 'tensor(int8)' or scale not in inputs:
                raise ModelLoadError(f'{model_path} is not a graph over int8 KV buffers: '
                                     'run `python -m edge_llm_ros.convert.kv_int8_graph` on '
                                     'its folder again, or set kv.dtype float32')
            self._kv_dtype = np.int8
            # Conv states (a hybrid's) stay at the graph's activation dtype.
            act = (inputs['inputs_embeds'].type if self.accepts_embeds else
                   inputs[CONV_STATE_PAST.format(spec.conv_layers[0])].type
                   if spec.conv_layers else 'tensor(float)')
            self.act_dtype = self._state_dtype = _ORT_DTYPES.get(act, np.float32)
            self._check_logits(model_path, outputs)
            return
        if kv_type not in _ORT_DTYPES:
            raise UnsupportedModelError(f'{model_path}: KV inputs of type {kv_type} are not '
                                        'supported (float or float16)')
        self._kv_dtype = self._state_dtype = _ORT_DTYPES[kv_type]
        self.act_dtype = _ORT_DTYPES.get(
            inputs['inputs_embeds'].type if self.accepts_embeds else kv_type, np.float32)
        self._check_logits(model_path, outputs)

    def _check_logits(self, model_path: str, outputs: dict) -> None:
        spec = self.info
        logits_shape = outputs['logits'].shape
        if isinstance(logits_shape[-1], int) and logits_shape[-1] != spec.vocab_size:
            raise ModelLoadError(f'{model_path}: logits width {logits_shape[-1]} != vocab_size '
                                 f'{spec.vocab_size} in model.yaml: {REGENERATE_HINT}')

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        """Wrap array's memory in an OrtValue (no copy: tested) and keep the array alive."""
        self._keep.append(array)
        return ort.OrtValue.ortvalue_from_numpy(array)

    def _state_binding(self, rows: slice) -> ort.IOBinding:
        """Build a binding whose KV and conv states (past = present) are these slots."""
        binding = self._session.io_binding()
        for n, i in enumerate(self.info.kv_layers):
            for j, kind in enumerate(('key', 'value')):
                value = self._value(self.kv_buffers[2 * n + j][rows])
                binding.bind_ortvalue_input(f'past_key_values.{i}.{kind}', value)
                binding.bind_ortvalue_output(f'present.{i}.{kind}', value)
                if self.kv_scales:
                    value = self._value(self.kv_scales[2 * n + j][rows])
                    binding.bind_ortvalue_input(f'past_key_values.{i}.{kind}_scale', value)
                    binding.bind_ortvalue_output(f'present.{i}.{kind}_scale', value)
        for buf, i in zip(self.state_buffers, self.info.conv_layers):
            value = self._value(buf[rows])
            binding.bind_ortvalue_input(CONV_STATE_PAST.format(i), value)
            binding.bind_ortvalue_output(CONV_STATE_PRESENT.format(i), value)
        return binding

    def slot_buffers(self, slot: int) -> List[np.ndarray]:
        """Slot's KV views [1, kv_heads, L, head_dim] per buffer (what its KVCache tracks)."""
        return [buf[slot:slot + 1] for buf in self.kv_buffers]

    def slot_scales(self, slot: int) -> List[np.ndarray]:
        """Slot's int8-KV scale views [1, kv_heads, L, 1] per buffer (empty: float KV)."""
        return [buf[slot:slot + 1] for buf in self.kv_scales]

    def slot_states(self, slot: int) -> List[np.ndarray]:
        """Slot's conv-state views [1, kernel - 1, hidden] (empty: a model of KV only)."""
        return [buf[slot:slot + 1] for buf in self.state_buffers]

    # --- running -----------------------------------------------------------------------------
    def run(self, rows: Sequence[Row]) -> np.ndarray:
        """Run the rows (at most one per slot); return their logits [K, vocab], in row order.

        K is the sum of the rows' `logits`; the view is valid until the next call. The caller
        keeps each row inside the KV capacity (check_rows says what is wrong otherwise).
        """
        check_rows(rows, self.slots, self.capacity)
        if not self.accepts_embeds and any(r.embeds is not None for r in rows):
            raise ModelLoadError('this model.onnx has no inputs_embeds input: reconvert it '
                                 'with a current edge-llm-convert to feed embeddings')
        if not self.bidirectional_images and any(r.bidirectional for r in rows):
            raise ModelLoadError('this model.onnx has no bidirectional input for image '
                                 'attention: reconvert it with --mmproj and a current '
                                 'edge-llm-convert')
        if self.lora is None and any(r.lora for r in rows):
            raise ValueError('rows name LoRA adapters, but the decoder has none: '
                             'enable_lora() and add them first')
        return self._calls.run(rows)


class _VarlenCalls:
    """One onnxruntime run per step: the rows packed (runtime/rows.py) over every slot.

    The KV and conv buffers of all slots are bound once; a call binds its small packed
    inputs and a view of one logits buffer. A step of R decode steps only (the hot loop)
    writes ints into arrays made once per R, which stay bound while R does not change:
    rebinding costs about 0.3 ms a step, 5 % of a SmolLM2 token.
    """

    def __init__(self, dec: OnnxDecoder) -> None:
        self._dec = dec
        self._session = dec._session
        self._binding = dec._state_binding(slice(0, dec.slots))
        self._hidden = dec.info.embed_width   # qwen3vl: the DeepStack rows too
        self._logits = np.zeros((1, 0, dec.info.vocab_size), dtype=np.float32)
        self._logit_values: Dict[int, ort.OrtValue] = {}   # K -> view of self._logits
        self._inputs: tuple = ()   # the last call's packed arrays (their OrtValues read them)
        self._steps: Dict[int, tuple] = {}   # R -> the inputs of R decode steps
        self._bound_steps = 0      # R whose decode-step inputs are bound now (0: none)

    def _logits_value(self, k: int) -> ort.OrtValue:
        value = self._logit_values.get(k)
        if value is None:
            if self._logits.shape[1] < k:   # grow; the old views go with the old buffer
                self._logits = np.zeros((1, max(k, 2 * self._logits.shape[1], 8),
                                         self._logits.shape[2]), dtype=np.float32)
                self._logit_values.clear()
            value = self._logit_values[k] = ort.OrtValue.ortvalue_from_numpy(
                self._logits[:, :k])
        return value

    def run(self, rows: Sequence[Row]) -> np.ndarray:
        if all(row.decode_step for row in rows):
            return self._run_steps(rows)
        packed = pack(rows, self._hidden, self._dec.act_dtype, self._dec.mrope)
        self._inputs = packed.arrays()
        k = packed.logits_at.shape[0]
        self._bind(self._inputs, k)
        self._bound_steps = 0
        self._session_run(rows)
        return self._logits[0, :k]

    def _session_run(self, rows: Sequence[Row]) -> None:
        """Run the bound call; rows naming adapters hand the op their table for it."""
        lora = self._dec.lora
        if lora is None or not any(row.lora for row in rows):
            self._session.run_with_iobinding(self._binding)
            return
        lora.set_rows([row.lora for row in rows], [row.length for row in rows])
        try:
            self._session.run_with_iobinding(self._binding)
        finally:
            lora.clear()

    def _bind(self, arrays: tuple, k: int) -> None:
        binding = self._binding
        for name, array in zip(VARLEN_INPUTS + (ROPE_POSITIONS_INPUT,), arrays):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_ortvalue_output('logits', self._logits_value(k))

    def _run_steps(self, rows: Sequence[Row]) -> np.ndarray:
        """R decode steps: write their tokens and positions into R's arrays and run."""
        r = len(rows)
        arrays = self._steps.get(r)
        if arrays is None:   # the layout of any R decode steps; tokens and slots vary
            arrays = self._steps[r] = pack([Row(i, 0, np.zeros(1, np.int64)) for i in range(r)],
                                           self._hidden, self._dec.act_dtype,
                                           self._dec.mrope).arrays()
        ids, table = arrays[0], arrays[3]
        for i, row in enumerate(rows):
            ids[0, i] = row.ids[0]
            table[i, 0] = row.slot
            table[i, 1] = row.start
            if self._dec.mrope:
                arrays[5][:, i] = row.rope_positions()[:, 0]
        if self._bound_steps != r:
            self._bind(arrays, r)
            self._bound_steps = r
        self._session_run(rows)
        return self._logits[0, :r]


class _BatchedCalls:
    """Rows on a graph without a row table (GroupQueryAttention, or converter <= 8).

    Such a graph runs rows of one length over slots 0..b-1 in one call. Decode steps (one
    token with its logits) go together in one call, which needs them to fill slots 0..b-1
    (the caller pads: Executor); every other row is a call of its own. The logits are
    copied into one buffer in row order.
    """

    def __init__(self, dec: OnnxDecoder) -> None:
        self._dec = dec
        self._session = dec._session
        info = dec.info
        self._logits = np.zeros((dec.slots, 1, info.vocab_size), dtype=np.float32)
        self._out = np.zeros((dec.slots, info.vocab_size), dtype=np.float32)
        self._image_flag = np.zeros((1,), dtype=np.int32)
        image_flag = dec._value(self._image_flag)
        self._one_logit = np.ones((1,), dtype=np.int64)
        self._no_embeds = np.zeros((1, 0, info.hidden_size), dtype=dec.act_dtype)
        self._total = np.zeros((), dtype=np.int32)
        total = dec._value(self._total)
        # One binding per slot (rows of their own) and one per row count b of decode steps
        # over slots 0..b-1: built here, so a decode step only writes ints and runs.
        self._slot_bindings = []
        for slot in range(dec.slots):
            binding = dec._state_binding(slice(slot, slot + 1))
            if BIDIRECTIONAL_INPUT in _input_names(self._session):
                binding.bind_ortvalue_input(BIDIRECTIONAL_INPUT, image_flag)
            self._slot_bindings.append(binding)
        self._steps: List[Tuple[ort.IOBinding, np.ndarray, np.ndarray]] = []
        for b in range(1, dec.slots + 1):
            binding = dec._state_binding(slice(0, b))
            if BIDIRECTIONAL_INPUT in _input_names(self._session):
                binding.bind_ortvalue_input(BIDIRECTIONAL_INPUT, image_flag)
            ids = np.zeros((b, 1), dtype=np.int64)
            seqlens = np.zeros((b,), dtype=np.int32)
            inputs = {'input_ids': dec._value(ids), 'seqlens_k': dec._value(seqlens),
                      'total_sequence_length': total,
                      'logits_count': dec._value(self._one_logit)}
            if dec.accepts_embeds:
                inputs['inputs_embeds'] = dec._value(
                    np.zeros((b, 0, info.hidden_size), dtype=dec.act_dtype))
            for name, value in inputs.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output('logits', dec._value(self._logits[:b]))
            self._steps.append((binding, ids, seqlens))
        self._inputs: list = []   # the last row call's arrays (their OrtValues read them)

    def run(self, rows: Sequence[Row]) -> np.ndarray:
        k = sum(row.logits for row in rows)
        if self._out.shape[0] < k:
            self._out = np.zeros((k, self._out.shape[1]), dtype=np.float32)
        steps = [row for row in rows if row.decode_step]
        if steps:
            step_logits = self._steps_call(steps)
        at = 0
        for row in rows:
            if row.decode_step:
                self._out[at] = step_logits[row.slot]
            elif row.logits:
                self._out[at:at + row.logits] = self._row_call(row)
            else:
                self._row_call(row)
            at += row.logits
        return self._out[:k]

    def _steps_call(self, steps: Sequence[Row]) -> np.ndarray:
        b = len(steps)
        if sorted(row.slot for row in steps) != list(range(b)):
            raise ValueError(f'decode steps on slots {sorted(r.slot for r in steps)}: this '
                             'graph runs them over slots 0..b-1 only (pad the others)')
        binding, ids, seqlens = self._steps[b - 1]
        for row in steps:
            ids[row.slot, 0] = row.ids[0]
            seqlens[row.slot] = row.start
        self._total[()] = int(seqlens.max()) + 1
        self._session.run_with_iobinding(binding)
        return self._logits[:b, 0]

    def _row_call(self, row: Row) -> np.ndarray:
        """Run one row in its slot; return the logits of its last max(logits, 1) positions."""
        dec = self._dec
        n = row.length
        count = max(row.logits, 1)
        arrays = {'input_ids': np.ascontiguousarray(row.ids, dtype=np.int64).reshape(1, -1),
                  'seqlens_k': np.array([row.start + n - 1], dtype=np.int32),
                  'total_sequence_length': np.array(row.start + n, dtype=np.int32),
                  'logits_count': np.array([count], dtype=np.int64)}
        if dec.accepts_embeds:
            arrays['inputs_embeds'] = self._no_embeds if row.embeds is None else \
                np.ascontiguousarray(row.embeds, dtype=dec.act_dtype).reshape(
                    1, -1, dec.info.hidden_size)
        logits = np.zeros((1, count, dec.info.vocab_size), dtype=np.float32)
        binding = self._slot_bindings[row.slot]
        values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()}
        self._inputs = [arrays, values]
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output('logits', ort.OrtValue.ortvalue_from_numpy(logits))
        self._image_flag[0] = int(row.bidirectional)
        try:
            self._session.run_with_iobinding(binding)
        finally:
            self._image_flag[0] = 0
        return logits[0, count - row.logits:] if row.logits else logits[0]


def _input_names(session: ort.InferenceSession) -> set:
    return {i.name for i in session.get_inputs()}

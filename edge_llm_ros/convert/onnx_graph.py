"""Build the ONNX decoder graph (one graph for prefill and decode) from block-quantized weights.

Per layer: RMSNorm (SkipSimplifiedLayerNormalization fuses the residual add) -> fused QKV
MatMulNBits -> GroupQueryAttention (RoPE inside, KV past/present share-buffer layout) ->
MatMulNBits -> RMSNorm -> fused gate/up MatMulNBits -> SiLU * up -> MatMulNBits. The embedding
is GatherBlockQuantized over the same blocks a tied lm_head's MatMulNBits reads. Logits are
computed for the last `logits_count` positions only (1, or k + 1 in a speculative verify pass).
A graph with the op library's CausalAttention (attention='causal') is varlen instead: a
step's rows packed into batch 1, each over its own slot (a row table, runtime/rows.py),
embeddings scattered to their packed places and logits at `logits_at`.
I/O names and shapes: runtime/decoder.py (and model_format.VARLEN_INPUTS, BATCHED_INPUTS).

With weights='kquant' (GraphOptions.kquant) every matrix whose GGUF type the project's op
library holds (convert/gguf_weights.py) is an edge_llm_ros.KQuantMatMul over its GGUF bytes
instead, and a token table of such a type an edge_llm_ros.KQuantGather over the same bytes a
tied lm_head reads; other types stay MatMulNBits. Such graphs also take the library's
CausalAttention instead of GroupQueryAttention (GraphOptions.attention).

Exact GGUF Q4_1 weights carry a per-block offset; each such MatMulNBits either gets the offsets
folded into extra 4-bit blocks, fed the input's block means appended to it (ReduceMean +
Concat, no extra matmul), or adds them as an exact float term (see GraphOptions.offset_levels).
"""
from dataclasses import dataclass
import math
from typing import BinaryIO, Dict, List, Optional, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto

from edge_llm_ros.convert.checkpoint import DELTA_CHUNK, ModelSpec
from edge_llm_ros.convert.gguf_weights import GgufWeights
from edge_llm_ros.convert.quant import BlockWeights, fold_offsets
from edge_llm_ros.model_format import (CONV_STATE_PAST, CONV_STATE_PRESENT, DATA_FILE,
                                       ROPE_POSITIONS_INPUT, ROWS_INPUT)

OPSET = 21
IR_VERSION = 10  # onnx 1.23 writes 14 by default; onnxruntime accepts <= 10 everywhere
MS_DOMAIN = 'com.microsoft'
KQUANT_DOMAIN = 'edge_llm_ros'  # native/src/ort_op.cpp (runtime/native_ops.DOMAIN)
BATCH_DIM = 'batch'  # symbolic batch dimension of every graph input/output (sequence slots)
_INLINE_BYTES = 1024  # smaller initializers stay inside model.onnx
_FLOAT_TYPES = {'float32': (np.float32, TensorProto.FLOAT),
                'float16': (np.float16, TensorProto.FLOAT16)}


def initializer(name: str, array: np.ndarray, data: Optional[BinaryIO] = None,
                location: str = DATA_FILE) -> onnx.TensorProto:
    """Return the initializer `name` holding `array`.

    With `data` (an open file named `location` next to the model), an array above 1 KiB is
    appended to it now and the graph keeps only a reference to it.
    """
    array = np.ascontiguousarray(array)
    if data is None or array.nbytes <= _INLINE_BYTES:
        return numpy_helper.from_array(array, name)
    # Page-align big tensors so onnxruntime can map them instead of copying.
    align = 4096 if array.nbytes >= 1 << 20 else 64
    offset = -(-data.tell() // align) * align
    data.write(b'\0' * (offset - data.tell()))
    array.tofile(data)
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                         dims=array.shape, data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (('location', location), ('offset', str(offset)),
                       ('length', str(array.nbytes))):
        t.external_data.add(key=key, value=value)
    return t


@dataclass(frozen=True)
class GraphOptions:
    """How the graph is built: activation dtype, static KV length, MatMulNBits accuracy."""

    activation_dtype: str = 'float32'
    max_context: Optional[int] = None  # None = dynamic KV length ('max_ctx')
    # MatMulNBits accuracy_level: 4 quantizes activations to int8 per block inside the
    # kernel (the fast CPU path); 0 computes in the activation dtype.
    accuracy_level: int = 4
    # Per-block weight offsets (exact GGUF Q4_1): 0 adds the exact float term
    # block_means(x) @ (bs * offsets).T after each matmul (2 more nodes and a float matmul);
    # n > 0 folds them into n 4-bit levels of extra blocks of the same MatMulNBits, fed the
    # block means appended to x (quant.fold_offsets: ~0.1% error per offset at n=2).
    offset_levels: int = 0
    # The attention op: 'gqa' (onnxruntime's GroupQueryAttention) or 'causal' (the op
    # library's CausalAttention, which computes each position alone: one position's logits
    # are the same bits in a verify pass over several, as speculative decoding needs; kquant
    # graphs, float32 only).
    attention: str = 'gqa'
    # A VLM whose image tokens attend to each other both ways (gemma3): an image's row of
    # the row table is marked bidirectional (the engine does it). 'causal' attention only.
    bidirectional_images: bool = False


Weight = Union[BlockWeights, GgufWeights]


@dataclass(frozen=True)
class WeightRef:
    """What the graph needs to reuse written weights (the tied lm_head): names and shape."""

    names: Dict[str, str]
    n: int
    k: int
    bits: int
    block_size: int
    nbytes: int
    offsets: Optional[np.ndarray] = None  # [N, K/bs] when the weight has per-block offsets
    default_zp: bool = False  # every zero point is 2**(bits-1): MatMulNBits needs none
    kquant_type: int = 0  # ggml type id of GGUF blocks read by KQuantMatMul (0: MatMulNBits)


@dataclass
class LayerWeights:
    """One decoder layer, ready for the graph (norm weights as float32 vectors)."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    qkv: List[Weight]      # [fused q|k|v] or [q, k, v] when their formats differ
    qkv_bias: Optional[np.ndarray]
    o: Weight
    gate_up: List[Weight]  # [fused gate|up] or [gate, up]
    down: Weight
    q_norm: Optional[np.ndarray] = None  # per-head RMSNorm weights [head_dim] (qwen3)
    k_norm: Optional[np.ndarray] = None
    post_attn_norm: Optional[np.ndarray] = None  # gemma3: norms of the attention / MLP output
    post_ffn_norm: Optional[np.ndarray] = None
    attn_gate: Optional[Weight] = None  # qwen35: attention output times sigmoid(h @ gate.T)


@dataclass
class ConvLayerWeights:
    """One gated short-convolution layer of a hybrid (lfm2), ready for the graph."""

    attn_norm: np.ndarray   # the operator norm
    ffn_norm: np.ndarray
    in_proj: Weight         # [3 * hidden, hidden]: B, C, x rows
    conv: np.ndarray        # [hidden, kernel] float32, the oldest position first
    out_proj: Weight
    gate_up: List[Weight]
    down: Weight


@dataclass
class RecurrentLayerWeights:
    """One Gated DeltaNet layer of a hybrid (qwen35), ready for the graph."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    qkv: Weight             # [(2 Hk + Hv) D, hidden]: the conv input (q, k, v channels)
    z: Weight               # [Hv D, hidden]: the output gate
    alpha: Weight           # [Hv, hidden]: the decay's input
    beta: Weight            # [Hv, hidden]: the update strength's input
    conv: np.ndarray        # [(2 Hk + Hv) D, kernel] float32, the oldest position first
    dt_bias: np.ndarray     # [Hv]
    a: np.ndarray           # [Hv] (-exp(A_log), as the GGUF stores it)
    norm: np.ndarray        # [D]: the gated RMSNorm's weight
    out: Weight             # [hidden, Hv D]
    gate_up: List[Weight]
    down: Weight


@dataclass
class MambaLayerWeights:
    """One Mamba-2 layer of a hybrid (granitehybrid), ready for the graph."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    z: Weight               # [H P, hidden]: the gate (ssm_in's first rows)
    xbc: Weight             # [H P + 2 G N, hidden]: the conv input (x, B, C)
    dt: Weight              # [H, hidden]: the time step's input
    conv: np.ndarray        # [H P + 2 G N, kernel] float32, the oldest position first
    conv_bias: np.ndarray   # [H P + 2 G N]
    dt_bias: np.ndarray     # [H]
    a: np.ndarray           # [H] (-exp(A_log), as the GGUF stores it)
    d: np.ndarray           # [H]: the skip term D x
    norm: np.ndarray        # [H P]: the grouped RMSNorm's weight
    out: Weight             # [hidden, H P]
    gate_up: List[Weight]
    down: Weight


@dataclass
class Gemma4LayerWeights:
    """One gemma4 layer, ready for the graph (k, v, k_norm None on a shared-KV layer)."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    q: Weight
    k: Optional[Weight]
    v: Optional[Weight]
    o: Weight
    gate_up: List[Weight]
    down: Weight
    q_norm: np.ndarray
    k_norm: Optional[np.ndarray]
    post_attn_norm: np.ndarray
    post_ffn_norm: np.ndarray
    ple_gate: Optional[Weight] = None   # per-layer embeddings (None: the model has none)
    ple_proj: Optional[Weight] = None
    ple_post_norm: Optional[np.ndarray] = None
    out_scale: Optional[float] = None   # layer_output_scale


def rope_cache(spec: ModelSpec, length: int, local: bool = False) -> tuple:
    """cos/sin tables [length, rotary_dims/2] for NEOX RoPE (float64 math, float32 out).

    Scaled as llama.cpp does: every angle times rope_scale (its freq_scale), frequency i
    divided by rope_freq_factors[i] (rope_freqs: Llama 3.1; rope_factors_short: Phi-3), cos
    and sin times rope_attn_factor. Sliding-window layers (local) use their own base and
    scale and no factors (gemma3 passes none).
    """
    dims = spec.local_head_dim if local and spec.local_head_dim else spec.rotary_dims
    half = dims // 2
    theta = spec.local_rope_theta if local else spec.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2 / dims))
    inv_freq = inv_freq * (spec.local_rope_scale if local else spec.rope_scale)
    if spec.rope_freq_factors is not None and not local:
        inv_freq = inv_freq / np.asarray(spec.rope_freq_factors, dtype=np.float64)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    m = spec.rope_attn_factor
    return (m * np.cos(angles)).astype(np.float32), (m * np.sin(angles)).astype(np.float32)


class DecoderGraph:
    """Accumulates nodes and initializers; call add_embedding, add_layer..., finish.

    With `data_file` every initializer above 1 KiB is appended to that open file as it is
    added (the graph keeps only an external-data reference), so converting needs memory for
    one layer, not the whole model. Save the result next to the file as model.onnx.
    """

    def __init__(self, spec: ModelSpec, opts: GraphOptions,
                 data_file: Optional[BinaryIO] = None) -> None:
        if opts.activation_dtype not in _FLOAT_TYPES:
            raise ValueError(f'activation_dtype must be one of {sorted(_FLOAT_TYPES)}')
        self.spec = spec
        self.opts = opts
        self.np_dtype, self.onnx_dtype = _FLOAT_TYPES[opts.activation_dtype]
        self.nodes: List[onnx.NodeProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self.weight_bytes = 0  # bytes of linear weights read per decoded token
        self.ops_used: set = set()  # custom op domains the graph needs (model.yaml lists them)
        self._count = 0
        self._block_means: Dict[str, str] = {}
        self._with_means: Dict[tuple, str] = {}
        self._consts: Dict[str, str] = {}
        self._x = ''         # hidden state entering the next layer's norm
        self._residual = ''  # residual stream (empty before layer 0)
        self._deepstack: List[str] = []   # qwen3vl: each DeepStack layer's rows [1, T, H]
        self._data = data_file
        self._embed: Optional[WeightRef] = None
        self._per_layer = ''  # gemma4: the per-layer inputs [1, S, layers, E]
        kv_len = opts.max_context if opts.max_context else 'max_ctx'
        # 'batch' is symbolic: one row per sequence slot (the reshapes use 0, so the body is
        # batch-generic).
        t = self.onnx_dtype
        # The library's attention takes a row table: a varlen graph (the rows of a step
        # packed into batch 1, each over its own slot: runtime/rows.py). GroupQueryAttention
        # takes a batch of equal-length rows over slots 0..B-1.
        self.varlen = opts.attention == 'causal'
        if spec.deepstack_layers and not self.varlen:
            raise ValueError("DeepStack (deepstack_layers) needs the op library's attention "
                             "(attention='causal')")
        if self.varlen:
            # qwen3vl: an embedding row is hidden x (1 + deepstack_layers) wide (the image's
            # main row, then one per DeepStack layer).
            self.inputs = [
                helper.make_tensor_value_info('input_ids', TensorProto.INT64, [1, 'tokens']),
                helper.make_tensor_value_info('inputs_embeds', t, [
                    'embeds', spec.hidden_size * (1 + spec.deepstack_layers)]),
                helper.make_tensor_value_info('embeds_at', TensorProto.INT64, ['embeds', 1]),
                helper.make_tensor_value_info(ROWS_INPUT, TensorProto.INT32, ['rows', 4]),
                helper.make_tensor_value_info('logits_at', TensorProto.INT64, ['logits']),
            ]
            logits_shape = [1, 'logits', spec.vocab_size]
        else:
            self.inputs = [
                helper.make_tensor_value_info('input_ids', TensorProto.INT64,
                                              [BATCH_DIM, 's_ids']),
                helper.make_tensor_value_info('inputs_embeds', t,
                                              [BATCH_DIM, 's_emb', spec.hidden_size]),
                helper.make_tensor_value_info('seqlens_k', TensorProto.INT32, [BATCH_DIM]),
                helper.make_tensor_value_info('total_sequence_length', TensorProto.INT32, []),
                # How many of the last positions get logits.
                helper.make_tensor_value_info('logits_count', TensorProto.INT64, [1]),
            ]
            logits_shape = [BATCH_DIM, 'n_logits', spec.vocab_size]
        self.outputs = [helper.make_tensor_value_info('logits', TensorProto.FLOAT,
                                                      logits_shape)]
        for i in range(spec.num_layers):
            if spec.is_recurrent(i):
                if not self.varlen:
                    raise ValueError("Gated DeltaNet layers need the op library's attention "
                                     "(attention='causal')")
                # Conv inputs and delta state in one vector per slot (GatedDeltaNet).
                shape = [BATCH_DIM, spec.recurrent_state_floats]
                self.inputs.append(helper.make_tensor_value_info(CONV_STATE_PAST.format(i),
                                                                 TensorProto.FLOAT, shape))
                self.outputs.append(helper.make_tensor_value_info(
                    CONV_STATE_PRESENT.format(i), TensorProto.FLOAT, shape))
                continue
            if spec.is_conv(i):
                if not self.varlen:
                    raise ValueError("conv layers need the op library's attention "
                                     "(attention='causal')")
                # B * x of the last kernel - 1 positions: bound as past and present (ShortConv).
                shape = [BATCH_DIM, spec.conv_kernel - 1, spec.hidden_size]
                self.inputs.append(helper.make_tensor_value_info(CONV_STATE_PAST.format(i),
                                                                 t, shape))
                self.outputs.append(helper.make_tensor_value_info(
                    CONV_STATE_PRESENT.format(i), t, shape))
                continue
            if spec.kv_owner(i) >= 0:
                continue  # a shared-KV layer (gemma4) reads its owner's present.*
            # Each layer its own heads and head size (gemma4's local and global layers differ).
            kv_shape = [BATCH_DIM, spec.layer_kv_heads(i), kv_len, spec.layer_head_dim(i)]
            for kind in ('key', 'value'):
                self.inputs.append(helper.make_tensor_value_info(
                    f'past_key_values.{i}.{kind}', t, kv_shape))
                self.outputs.append(helper.make_tensor_value_info(f'present.{i}.{kind}', t,
                                                                  kv_shape))
        if spec.rope_sections:
            if not self.varlen:
                raise ValueError("M-RoPE (rope_sections) needs the op library's attention "
                                 "(attention='causal')")
            self.inputs.append(helper.make_tensor_value_info(
                ROPE_POSITIONS_INPUT, TensorProto.INT32, [3, 'tokens']))
        if opts.bidirectional_images and not self.varlen:
            raise ValueError('bidirectional_images needs the op library attention '
                             "(attention='causal')")
        cache_len = opts.max_context or spec.max_position_embeddings
        local = [spec.is_local(i) for i in range(spec.num_layers) if spec.is_attention(i)]
        # No attention layer rotates (granitehybrid without RoPE, whose GGUFs say 2**20
        # positions): no table per position, an identity row per packed token instead.
        self._nope_per_token = self.varlen and not spec.rope_sections and all(
            spec.is_nope(i) for i in range(spec.num_layers) if spec.is_attention(i))
        if self._nope_per_token:
            self._identity_rope_rows()
        elif not all(local):
            cos, sin = rope_cache(spec, cache_len)
            if spec.rotary_permuted:
                # Dims past rotary_dims rotate by angle 0 (checkpoint.rotary_order).
                pad = spec.head_dim // 2 - cos.shape[1]
                cos = np.pad(cos, ((0, 0), (0, pad)), constant_values=1.0)
                sin = np.pad(sin, ((0, 0), (0, pad)), constant_values=0.0)
            self._init('cos_cache', cos.astype(self.np_dtype))
            self._init('sin_cache', sin.astype(self.np_dtype))
            if any(spec.is_nope(i) for i in range(spec.num_layers)):
                # Layers without RoPE (smollm3) turn by angle 0: x * 1 - y * 0 is x exactly.
                self._init('cos_cache_nope', np.ones_like(cos, dtype=self.np_dtype))
                self._init('sin_cache_nope', np.zeros_like(sin, dtype=self.np_dtype))
        if any(local):
            cos, sin = rope_cache(spec, cache_len, local=True)
            self._init('cos_cache_local', cos.astype(self.np_dtype))
            self._init('sin_cache_local', sin.astype(self.np_dtype))
        if spec.rope_sections:
            self._mrope_tables()

    def _mrope_tables(self) -> None:
        """Add cos_tokens / sin_tokens [T, half]: each packed token's M-RoPE rows.

        Pair k of a token turns by its position of section sec(k) (t, h or w: llama.cpp's
        rope_multi, sector k mod the sections' sum): cos_cache[rope_positions[sec(k), t], k],
        one GatherElements per table; the attention reads them a row per token.
        """
        s0, s1, s2 = self.spec.rope_sections
        total = sum(self.spec.rope_sections)
        sector = np.arange(self.spec.rotary_dims // 2) % total
        section = np.where(sector < s0, 0, np.where(sector < s0 + s1, 1, 2)).astype(np.int64)
        if self.spec.mrope_interleaved:
            # qwen3vl (ggml's IMROPE): t, h, w by k mod 3 while k < 3 x that section, else
            # the fourth position, 0 for text and images (such a pair is not rotated).
            section = np.full_like(section, 3)
            for j, size in enumerate((s0, s1, s2)):
                section[(sector % 3 == j) & (sector < 3 * size) & (section == 3)] = j
        which = self._init('mrope_section', np.minimum(section, 2))
        per_pair = self._name('mrope/positions')
        self.nodes.append(helper.make_node('Gather', [ROPE_POSITIONS_INPUT, which],
                                           [per_pair], axis=0))   # [half, T]
        if (section == 3).any():
            kept = self._init('mrope_rotated', (section < 3).astype(np.int32)[:, None])
            self.nodes.append(helper.make_node('Mul', [per_pair, kept],
                                               [self._name('mrope/fourth')]))
            per_pair = self.nodes[-1].output[0]
        index = self._name('mrope/index')
        self.nodes.append(helper.make_node('Transpose', [per_pair], [self._name('mrope/t')],
                                           perm=[1, 0]))
        self.nodes.append(helper.make_node('Cast', [self.nodes[-1].output[0]], [index],
                                           to=TensorProto.INT64))   # [T, half]
        for table in ('cos', 'sin'):
            self.nodes.append(helper.make_node('GatherElements', [f'{table}_cache', index],
                                               [f'{table}_tokens'], axis=0))

    def _identity_rope_rows(self) -> None:
        """cos_tokens_nope = 1 and sin_tokens_nope = 0, [tokens, head_dim / 2] (rope_per_token)."""
        half = self.spec.head_dim // 2
        (shape,) = self._node('Shape', ['input_ids'], name='nope/shape')
        (tokens,) = self._node('Slice', [shape, self._const_i64('nope_one', [1]),
                                         self._const_i64('nope_two', [2])], name='nope/tokens')
        (rows,) = self._node('Concat', [tokens, self._const_i64('nope_half', [half])],
                             name='nope/rows', axis=0)
        for table, value in (('cos', 1.0), ('sin', 0.0)):
            one = self._init(f'{table}_nope_row', np.full((1, half), value, np.float32))
            self.nodes.append(helper.make_node('Expand', [one, rows], [f'{table}_tokens_nope'],
                                               name=f'nope/{table}'))

    # --- helpers -------------------------------------------------------------------------------
    def _name(self, base: str) -> str:
        self._count += 1
        return f'{base}_{self._count}'

    def _init(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(initializer(name, array, self._data, DATA_FILE))
        return name

    def _node(self, op: str, inputs: List[str], n_out: int = 1, domain: str = '',
              name: str = '', outputs: Optional[List[str]] = None, **attrs) -> List[str]:
        # Named nodes (weights' prefixes, unique per layer) keep their name; others get a
        # counter.
        node_name = name or self._name(op)
        outs = outputs or [f'{node_name}/out{j}' for j in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=node_name,
                                           domain=domain or None, **attrs))
        return outs

    def _const_i64(self, name: str, values) -> str:
        if name not in self._consts:
            self._consts[name] = self._init(name, np.array(values, dtype=np.int64))
        return name

    def _weights(self, prefix: str, w: Weight, gathered: bool = False) -> WeightRef:
        """Write a weight's codes, scales and zero points (offsets are written by their user).

        Default zero points are left out, except for a `gathered` table (the embedding).
        GGUF blocks are written as they are, one uint8 row of blocks per output.
        """
        if isinstance(w, GgufWeights):
            self.weight_bytes += w.nbytes
            self.ops_used.add(KQUANT_DOMAIN)
            n, k = w.shape
            return WeightRef({'W': self._init(prefix + '.gguf_blocks', w.raw)}, n, k, 0, 0,
                             w.nbytes, kquant_type=w.type_id)
        default_zp = w.default_zero_points()
        names = {'B': self._init(prefix + '.qweight', w.packed),
                 'scales': self._init(prefix + '.scales', w.scales.astype(self.np_dtype))}
        if gathered or not default_zp:
            names['zp'] = self._init(prefix + '.zero_points', w.packed_zero_points())
        nbytes = w.nbytes() - (w.packed_zero_points().nbytes if default_zp else 0)
        self.weight_bytes += nbytes
        n, k = w.shape
        return WeightRef(names, n, k, w.bits, w.block_size, nbytes, w.offsets, default_zp)

    def _means(self, x: str, bs: int) -> str:
        """Mean of x over each K block, [1, S, K/bs].

        Reshape + ReduceMean: measured ~8% faster decode on SmolLM2 than one AveragePool
        (which reads S as channels) or a matmul with a 0/1 block indicator.
        """
        key = f'{x}/{bs}'
        if key not in self._block_means:
            blocks = self._const_i64(f'shape_blocks_of_{bs}', [0, 0, -1, bs])
            (r,) = self._node('Reshape', [x, blocks])
            axes = self._const_i64('axes_last', [-1])
            (self._block_means[key],) = self._node('ReduceMean', [r, axes], keepdims=0)
        return self._block_means[key]

    def _append_means(self, x: str, bs: int, copies: int) -> str:
        """[x, means, means, ...]: the input of a weight with folded offsets."""
        key = (x, bs, copies)
        if key not in self._with_means:
            means = self._means(x, bs)
            (self._with_means[key],) = self._node('Concat', [x] + [means] * copies, axis=-1)
        return self._with_means[key]

    def _linear(self, x: str, w: Optional[Weight], prefix: str,
                bias: Optional[np.ndarray] = None, ref: Optional[WeightRef] = None,
                glu: str = '') -> str:
        """Add x @ W.T as MatMulNBits (+ the exact-Q4_1 offset term); `ref` reuses weights.

        Offsets are folded into the weight (offset_levels > 0) unless the weights are shared
        (the tied lm_head reads the embedding table, which cannot carry extra blocks). GGUF
        blocks become one KQuantMatMul, the bias fused into it, and with `glu` (GGUF blocks
        only: the op's attribute) a gated MLP's activation of its gate|up rows too.
        """
        if isinstance(w, GgufWeights) or (ref is not None and ref.kquant_type):
            ref = ref or self._weights(prefix, w)
            inputs = [x, ref.names['W']]
            if bias is not None:
                inputs.append(self._init(prefix + '.bias', bias.astype(np.float32)))
            (y,) = self._node('KQuantMatMul', inputs, domain=KQUANT_DOMAIN, name=prefix,
                              quant_type=ref.kquant_type, K=ref.k, N=ref.n,
                              **({'glu': glu} if glu else {}))
            return y
        if glu:
            raise ValueError(f'{prefix}: a fused glu needs GGUF blocks (KQuantMatMul)')
        k_in = None
        # Folding needs 4-bit blocks; 8-bit weights with offsets (Q5_1, Q5_K) keep the exact
        # float term.
        if ref is None and w.offsets is not None and self.opts.offset_levels and w.bits == 4:
            k_in = w.shape[1]
            w, copies = fold_offsets(w, self.opts.offset_levels)
            k_in += copies * k_in // w.block_size
            x = self._append_means(x, w.block_size, copies)
        ref = ref or self._weights(prefix, w)
        n, names = ref.n, ref.names
        inputs = [x, names['B'], names['scales'], '' if ref.default_zp else names['zp']]
        if bias is not None:
            inputs += ['', self._init(prefix + '.bias', bias.astype(self.np_dtype))]
        while not inputs[-1]:  # trailing optional inputs left out
            inputs.pop()
        (y,) = self._node('MatMulNBits', inputs, domain=MS_DOMAIN, name=prefix, K=k_in or ref.k,
                          N=n, bits=ref.bits, block_size=ref.block_size,
                          accuracy_level=self.opts.accuracy_level)
        if ref.offsets is not None:
            # Exact term: sum_b block_sum_b(x) * offset_b, with block sums = bs * means (the
            # power-of-two scale is folded into the stored offsets, exactly).
            bs = ref.block_size
            off_t = self._init(prefix + '.offsets_t', (ref.offsets.T * bs).astype(self.np_dtype))
            (corr,) = self._node('MatMul', [self._means(x, bs), off_t], name=prefix + '/offsets')
            (y,) = self._node('Add', [y, corr])
        return y

    def _norm(self, gamma: np.ndarray, prefix: str) -> str:
        return self._init(prefix, gamma.astype(self.np_dtype))

    # --- model pieces --------------------------------------------------------------------------
    def add_embedding(self, embed: Weight) -> None:
        """Token embeddings (GatherBlockQuantized), with inputs_embeds concatenated ahead."""
        self._embed = self._weights('embed', embed, gathered=True)
        self._finish_embedding(self._gather(embed, self._embed, 'embed'))

    def _gather(self, table: Weight, ref: WeightRef, prefix: str) -> str:
        """Gather input_ids' rows [*, S, width] of a table (never the whole table a token)."""
        width = ref.k
        names = ref.names
        self.weight_bytes -= ref.nbytes  # one row per token, not the table
        if isinstance(table, GgufWeights):
            (rows,) = self._node('KQuantGather', [names['W'], 'input_ids'],
                                 domain=KQUANT_DOMAIN, name=prefix,
                                 quant_type=table.type_id, K=width)
            return rows
        flat = self._const_i64(f'shape_{prefix}_rows', [ref.n, width * table.bits // 8])
        (packed,) = self._node('Reshape', [names['B'], flat])
        (rows,) = self._node('GatherBlockQuantized',
                             [packed, 'input_ids', names['scales'], names['zp']],
                             domain=MS_DOMAIN, name=prefix,
                             bits=table.bits, block_size=table.block_size, gather_axis=0,
                             quantize_axis=1)
        if table.offsets is not None:
            bs = table.block_size
            nb = width // bs
            off = self._init(f'{prefix}.offsets', table.offsets.astype(self.np_dtype))
            (off_rows,) = self._node('Gather', [off, 'input_ids'], axis=0)
            axes = self._const_i64('axes_last', [-1])
            (off_rows,) = self._node('Unsqueeze', [off_rows, axes])
            blocks = self._const_i64(f'shape_blocks_{nb}x{bs}', [0, 0, nb, bs])
            (r,) = self._node('Reshape', [rows, blocks])
            (r,) = self._node('Add', [r, off_rows])
            back_name = 'shape_hidden' if prefix == 'embed' else f'shape_{prefix}_width'
            back = self._const_i64(back_name, [0, 0, width])
            (rows,) = self._node('Reshape', [r, back])
        return rows

    def _finish_embedding(self, rows: str) -> None:
        s = self.spec
        if s.embed_scale != 1.0:
            # Token rows only: llama.cpp leaves raw embeddings (inputs_embeds) unscaled.
            scale = self._init('embed_scale', np.array(s.embed_scale, self.np_dtype))
            (rows,) = self._node('Mul', [rows, scale])
        if not self.varlen:
            (self._x,) = self._node('Concat', ['inputs_embeds', rows], axis=1)
            return
        # The embeddings take their packed places (embeds_at) among the token rows.
        flat = self._const_i64('shape_tokens_hidden', [-1, s.hidden_size])
        (rows,) = self._node('Reshape', [rows, flat])
        embeds = 'inputs_embeds'
        if s.deepstack_layers:
            embeds = self._deepstack_rows(rows)
        (rows,) = self._node('ScatterND', [rows, 'embeds_at', embeds])
        batch1 = self._const_i64('shape_batch1_hidden', [1, -1, s.hidden_size])
        (self._x,) = self._node('Reshape', [rows, batch1])

    def _deepstack_rows(self, rows: str) -> str:
        """Split the wide inputs_embeds; return its main rows, keep `deepstack_<i>` [1, T, H].

        Each DeepStack part is scattered to its image tokens' places over zeros (text adds
        nothing), to be added after layer i (llama.cpp's qwen3vl graph).
        """
        s = self.spec
        h = s.hidden_size
        parts = self._node('Split', ['inputs_embeds'], n_out=1 + s.deepstack_layers, axis=1,
                           num_outputs=1 + s.deepstack_layers)
        (zeros,) = self._node('Mul', [rows, self._init('deepstack_zero',
                                                       np.array(0, self.np_dtype))])
        batch1 = self._const_i64('shape_batch1_hidden', [1, -1, h])
        self._deepstack = []
        for i, part in enumerate(parts[1:]):
            (placed,) = self._node('ScatterND', [zeros, 'embeds_at', part])
            (placed,) = self._node('Reshape', [placed, batch1])
            self._deepstack.append(placed)
        return parts[0]

    def _input_norm(self, gamma: np.ndarray, p: str) -> tuple:
        """Normalize the layer's input (the residual add fused in): (h, residual)."""
        eps = float(self.spec.rms_norm_eps)
        gamma = self._norm(gamma, f'{p}.attn_norm')
        if not self._residual:
            (h,) = self._node('SimplifiedLayerNormalization', [self._x, gamma],
                              name=f'{p}/attn_norm', axis=-1, epsilon=eps, stash_type=1)
            return h, self._x
        h, _, _, residual = self._node('SkipSimplifiedLayerNormalization',
                                       [self._x, self._residual, gamma], n_out=4,
                                       domain=MS_DOMAIN, name=f'{p}/attn_norm', epsilon=eps)
        return h, residual

    def add_conv_layer(self, i: int, cw: ConvLayerWeights) -> None:
        """One gated short-convolution layer (lfm2) reading/writing its conv state.

        in_proj -> B, C, x; the op library's ShortConv gives C * conv(B * x) over the
        state past_conv.{i} (= present_conv.{i}, updated in place) -> out_proj; then the
        MLP as in every layer (llama.cpp's build_shortconv_block).
        """
        p = f'layers.{i}'
        h, residual = self._input_norm(cw.attn_norm, p)
        bcx = self._linear(h, cw.in_proj, f'{p}.conv.in_proj')
        self.ops_used.add(KQUANT_DOMAIN)
        weight = self._init(f'{p}.conv.weight', np.ascontiguousarray(cw.conv, np.float32))
        y, _ = self._node('ShortConv', [bcx, weight, CONV_STATE_PAST.format(i), '', ROWS_INPUT],
                          outputs=[self._name(f'{p}/conv/out'), CONV_STATE_PRESENT.format(i)],
                          domain=KQUANT_DOMAIN, name=f'{p}/conv')
        o = self._linear(y, cw.out_proj, f'{p}.conv.out_proj')
        self._mlp(o, residual, cw.ffn_norm, cw.gate_up, cw.down, p)

    def add_recurrent_layer(self, i: int, rw: RecurrentLayerWeights) -> None:
        """One Gated DeltaNet layer (qwen35) reading/writing its state past_conv.{i}.

        qkv, z, alpha, beta projections; the op library's GatedDeltaNet gives the conv, the
        delta rule and the gated norm over the state (= present_conv.{i}, updated in place)
        -> ssm_out; then the MLP (llama.cpp's build_layer_attn_linear).
        """
        s = self.spec
        p = f'layers.{i}'
        h, residual = self._input_norm(rw.attn_norm, p)
        qkv = self._linear(h, rw.qkv, f'{p}.gdn.qkv_proj')
        z = self._linear(h, rw.z, f'{p}.gdn.z_proj')
        alpha = self._linear(h, rw.alpha, f'{p}.gdn.alpha_proj')
        beta = self._linear(h, rw.beta, f'{p}.gdn.beta_proj')
        self.ops_used.add(KQUANT_DOMAIN)
        f32 = np.float32
        consts = [self._init(f'{p}.gdn.{name}', np.ascontiguousarray(v, f32))
                  for name, v in (('conv', rw.conv), ('dt_bias', rw.dt_bias), ('a', rw.a),
                                  ('norm', rw.norm))]
        y, _ = self._node('GatedDeltaNet',
                          [qkv, z, alpha, beta, *consts, CONV_STATE_PAST.format(i), '',
                           ROWS_INPUT],
                          outputs=[self._name(f'{p}/gdn/out'), CONV_STATE_PRESENT.format(i)],
                          domain=KQUANT_DOMAIN, name=f'{p}/gdn', k_heads=s.ssm_k_heads,
                          v_heads=s.ssm_v_heads, head_dim=s.ssm_head_dim,
                          epsilon=float(s.rms_norm_eps), chunk=DELTA_CHUNK)
        o = self._linear(y, rw.out, f'{p}.gdn.out_proj')
        self._mlp(o, residual, rw.ffn_norm, rw.gate_up, rw.down, p)

    def add_mamba_layer(self, i: int, mw: MambaLayerWeights) -> None:
        """One Mamba-2 layer (granitehybrid) reading/writing its state past_conv.{i}.

        z, xBC and dt projections (ssm_in's rows); the op library's Mamba2 gives the conv,
        the selective scan, the gate and the grouped norm over the state (= present_conv.{i},
        updated in place) -> ssm_out; then the MLP (llama.cpp's build_mamba2_layer).
        """
        s = self.spec
        p = f'layers.{i}'
        h, residual = self._input_norm(mw.attn_norm, p)
        z = self._linear(h, mw.z, f'{p}.mamba.z_proj')
        xbc = self._linear(h, mw.xbc, f'{p}.mamba.xbc_proj')
        dt = self._linear(h, mw.dt, f'{p}.mamba.dt_proj')
        self.ops_used.add(KQUANT_DOMAIN)
        consts = [self._init(f'{p}.mamba.{name}', np.ascontiguousarray(v, np.float32))
                  for name, v in (('conv', mw.conv), ('conv_bias', mw.conv_bias),
                                  ('dt_bias', mw.dt_bias), ('a', mw.a), ('d', mw.d),
                                  ('norm', mw.norm))]
        y, _ = self._node('Mamba2', [xbc, z, dt, *consts, CONV_STATE_PAST.format(i), '',
                                     ROWS_INPUT],
                          outputs=[self._name(f'{p}/mamba/out'), CONV_STATE_PRESENT.format(i)],
                          domain=KQUANT_DOMAIN, name=f'{p}/mamba', heads=s.mamba_heads,
                          head_dim=s.mamba_head_dim, groups=s.mamba_groups,
                          d_state=s.mamba_state, epsilon=float(s.rms_norm_eps))
        o = self._linear(y, mw.out, f'{p}.mamba.out_proj')
        self._mlp(o, residual, mw.ffn_norm, mw.gate_up, mw.down, p)

    def _residual_scaled(self, x: str, p: str) -> str:
        """Granite: a residual branch times residual_scale before its add (else x itself)."""
        if not self.spec.residual_scale:
            return x
        if not any(t.name == 'residual_scale' for t in self.initializers):
            self._init('residual_scale', np.array(self.spec.residual_scale, self.np_dtype))
        (y,) = self._node('Mul', [x, 'residual_scale'], name=f'{p}/residual_scale')
        return y

    def add_layer(self, i: int, lw: LayerWeights) -> None:
        """One decoder layer reading/writing past_key_values.{i} / present.{i}."""
        s = self.spec
        eps = float(s.rms_norm_eps)
        p = f'layers.{i}'
        h, residual = self._input_norm(lw.attn_norm, p)
        q_k_v = self._qkv(h, lw, p)
        local = s.is_local(i)
        rope = ('cos_cache_local', 'sin_cache_local') if local else ('cos_cache', 'sin_cache')
        if s.rope_sections:   # a row per packed token (M-RoPE), not per KV position
            rope = ('cos_tokens', 'sin_tokens')
        if s.is_nope(i):
            rope = ('cos_cache_nope', 'sin_cache_nope')
        if s.is_nope(i) and self._nope_per_token:
            rope = ('cos_tokens_nope', 'sin_tokens_nope')
        # A local layer's query sees the last sliding_window keys, itself included, as in
        # llama.cpp (n_swa) and HF; GQA's local_window_size counts the same way (checked
        # against llama.cpp in test_llama_cpp_parity: one key more or less moves logits ~1).
        scale = s.attention_scale or 1.0 / math.sqrt(s.head_dim)
        past = [f'past_key_values.{i}.key', f'past_key_values.{i}.value']
        outputs = [self._name(f'{p}/attn/out'), f'present.{i}.key', f'present.{i}.value']
        if self.varlen:
            # seqlens_k, total_sequence_length and the call-wide bidirectional flag are left
            # out: the row table says each row's slot, start, length and attention.
            inputs = q_k_v + past + ['', '', *rope, '', ROWS_INPUT]
            self.ops_used.add(KQUANT_DOMAIN)
            norms = {} if lw.q_norm is None else {
                'q_norm': lw.q_norm.astype(np.float32).tolist(),
                'k_norm': lw.k_norm.astype(np.float32).tolist(), 'norm_epsilon': eps}
            if s.rope_sections or self._nope_per_token:
                norms['rope_per_token'] = 1
            attn, _, _ = self._node('CausalAttention', inputs, outputs=outputs,
                                    domain=KQUANT_DOMAIN, name=f'{p}/attn',
                                    num_heads=s.num_heads, kv_num_heads=s.num_kv_heads,
                                    scale=float(scale),
                                    window=s.sliding_window if local else 0, **norms)
        else:
            inputs = q_k_v + past + ['seqlens_k', 'total_sequence_length', *rope]
            window = {'local_window_size': s.sliding_window} if local else {}
            attn, _, _ = self._node(
                'GroupQueryAttention', inputs, outputs=outputs, domain=MS_DOMAIN,
                name=f'{p}/attn', num_heads=s.num_heads, kv_num_heads=s.num_kv_heads,
                scale=scale, do_rotary=1, rotary_interleaved=0, **window)
        if lw.attn_gate is not None:
            gate = self._linear(h, lw.attn_gate, f'{p}.attn.gate_proj')
            (sig,) = self._node('Sigmoid', [gate])
            (attn,) = self._node('Mul', [attn, sig])
        o = self._linear(attn, lw.o, f'{p}.attn.o_proj')
        if lw.post_attn_norm is not None:
            o = self._plain_norm(o, lw.post_attn_norm, f'{p}.post_attn_norm')
        self._mlp(o, residual, lw.ffn_norm, lw.gate_up, lw.down, p, lw.post_ffn_norm)
        if i < len(self._deepstack):
            # The layer's output (residual + MLP) plus its DeepStack rows: added to the MLP
            # part, which the next norm adds to the residual.
            (self._x,) = self._node('Add', [self._x, self._deepstack[i]])

    def add_per_layer_inputs(self, table: Weight, model_proj: Weight,
                             proj_norm: np.ndarray) -> None:
        """Gemma 4's per-layer inputs [1, S, layers, E], after add_embedding (llama.cpp's).

        The table's rows of the tokens (gathered, in its GGUF type) times sqrt(E), plus the
        embedding projected (times 1/sqrt(hidden)) and normalized per layer, times 1/sqrt(2).
        """
        s = self.spec
        e = s.per_layer_embed
        rows = self._gather(table, self._weights('ple_embed', table, gathered=True),
                            'ple_embed')
        per_layer = self._const_i64(f'shape_layers_{e}', [0, 0, s.num_layers, e])
        scale = self._init('ple_embed_scale', np.array(np.sqrt(np.float32(e)), self.np_dtype))
        (rows,) = self._node('Mul', [rows, scale])
        (rows,) = self._node('Reshape', [rows, per_layer])
        proj = self._linear(self._x, model_proj, 'ple_model_proj')
        inv = self._init('ple_proj_scale', np.array(1 / np.sqrt(np.float32(s.hidden_size)),
                                                    self.np_dtype))
        (proj,) = self._node('Mul', [proj, inv])
        (proj,) = self._node('Reshape', [proj, per_layer])
        proj = self._plain_norm(proj, proj_norm, 'ple_proj_norm')
        (mixed,) = self._node('Add', [proj, rows])
        half = self._init('ple_input_scale', np.array(1 / np.sqrt(np.float32(2)),
                                                      self.np_dtype))
        (self._per_layer,) = self._node('Mul', [mixed, half])

    def add_gemma4_layer(self, i: int, lw: Gemma4LayerWeights) -> None:
        """One gemma4 layer (llama.cpp's src/models/gemma4.cpp), varlen graphs only.

        Its own head size and KV heads; q, k normalized by the op, V without weights here;
        a shared-KV layer reads its owner's present.* (stored by the owner's node earlier in
        the same run) and stores nothing. Then the gemma3-like post-norms and MLP, the
        per-layer input gated in, and the layer's output scale.
        """
        s = self.spec
        if not self.varlen:
            raise ValueError("gemma4 layers need the op library's attention "
                             "(attention='causal')")
        eps = float(s.rms_norm_eps)
        p = f'layers.{i}'
        d, kv_heads = s.layer_head_dim(i), s.layer_kv_heads(i)
        h, residual = self._input_norm(lw.attn_norm, p)
        q = self._linear(h, lw.q, f'{p}.attn.q_proj')
        local = s.is_local(i)
        rope = ('cos_cache_local', 'sin_cache_local') if local else ('cos_cache', 'sin_cache')
        owner = s.kv_owner(i)
        attrs = {'num_heads': s.num_heads, 'kv_num_heads': kv_heads,
                 'scale': float(s.attention_scale or 1.0 / math.sqrt(d)),
                 'window': s.sliding_window if local else 0,
                 'q_norm': lw.q_norm.astype(np.float32).tolist(), 'norm_epsilon': eps}
        self.ops_used.add(KQUANT_DOMAIN)
        if owner < 0:
            k = self._linear(h, lw.k, f'{p}.attn.k_proj')
            v = self._linear(h, lw.v, f'{p}.attn.v_proj')
            ones = np.ones(d, np.float32)
            v = self._head_norm(v, ones, f'{p}.attn.v_norm', d)
            inputs = [q, k, v, f'past_key_values.{i}.key', f'past_key_values.{i}.value',
                      '', '', *rope, '', ROWS_INPUT]
            outputs = [self._name(f'{p}/attn/out'), f'present.{i}.key', f'present.{i}.value']
            attrs['k_norm'] = lw.k_norm.astype(np.float32).tolist()
        else:
            inputs = [q, '', '', f'present.{owner}.key', f'present.{owner}.value', '', '',
                      *rope, '', ROWS_INPUT]
            outputs = [self._name(f'{p}/attn/out')]
            attrs['shared_kv'] = 1
        (attn,) = self._node('CausalAttention', inputs, outputs=outputs,
                             domain=KQUANT_DOMAIN, name=f'{p}/attn', **attrs)[:1]
        o = self._linear(attn, lw.o, f'{p}.attn.o_proj')
        o = self._plain_norm(o, lw.post_attn_norm, f'{p}.post_attn_norm')
        self._mlp(o, residual, lw.ffn_norm, lw.gate_up, lw.down, p, lw.post_ffn_norm)
        (out,) = self._node('Add', [self._x, self._residual])
        if lw.ple_gate is not None:
            g = self._linear(out, lw.ple_gate, f'{p}.ple.gate')
            (g,) = self._node('Gelu', [g], approximate='tanh')
            index = self._const_i64(f'{p}.ple.index', [i])
            (this,) = self._node('Gather', [self._per_layer, index], axis=2)
            (this,) = self._node('Squeeze', [this, self._const_i64('axes_2', [2])])
            (g,) = self._node('Mul', [g, this])
            y = self._linear(g, lw.ple_proj, f'{p}.ple.proj')
            y = self._plain_norm(y, lw.ple_post_norm, f'{p}.ple.post_norm')
            (out,) = self._node('Add', [out, y])
        if lw.out_scale is not None:
            scale = self._init(f'{p}.out_scale', np.array(lw.out_scale, self.np_dtype))
            (out,) = self._node('Mul', [out, scale])
        self._x, self._residual = out, ''

    def _mlp(self, o: str, residual: str, ffn_norm: np.ndarray, gate_up: List[Weight],
             down: Weight, p: str, post_ffn_norm: Optional[np.ndarray] = None) -> None:
        """Add the mixer's output `o` to the residual, then the gated MLP of the layer."""
        gamma = self._norm(ffn_norm, f'{p}.ffn_norm')
        o = self._residual_scaled(o, f'{p}/attn')
        h, _, _, residual = self._node('SkipSimplifiedLayerNormalization',
                                       [o, residual, gamma], n_out=4, domain=MS_DOMAIN,
                                       name=f'{p}/ffn_norm', epsilon=float(self.spec.rms_norm_eps))
        if len(gate_up) == 1 and isinstance(gate_up[0], GgufWeights):
            # One op: the gate|up product and its activation (the product is never stored).
            act = self._linear(h, gate_up[0], f'{p}.mlp.gate_up_proj', glu=self.spec.activation)
        else:
            act = self._gated(h, gate_up, p)
        self._x = self._linear(act, down, f'{p}.mlp.down_proj')
        if post_ffn_norm is not None:
            self._x = self._plain_norm(self._x, post_ffn_norm, f'{p}.post_ffn_norm')
        self._x = self._residual_scaled(self._x, f'{p}/mlp')
        self._residual = residual

    def _gated(self, h: str, gate_up: List[Weight], p: str) -> str:
        """act(h @ gate.T) * (h @ up.T) in ONNX ops (MatMulNBits, or gate and up of two types)."""
        if len(gate_up) == 1:
            gu = self._linear(h, gate_up[0], f'{p}.mlp.gate_up_proj')
            gate, up = self._node('Split', [gu], n_out=2, axis=-1, num_outputs=2)
        else:
            gate = self._linear(h, gate_up[0], f'{p}.mlp.gate_proj')
            up = self._linear(h, gate_up[1], f'{p}.mlp.up_proj')
        if self.spec.activation == 'gelu_tanh':
            (act,) = self._node('Gelu', [gate], approximate='tanh')
        else:
            (sig,) = self._node('Sigmoid', [gate])
            (act,) = self._node('Mul', [gate, sig])
        (act,) = self._node('Mul', [act, up])
        return act

    def _plain_norm(self, x: str, gamma: np.ndarray, prefix: str) -> str:
        """Normalize x alone (gemma3's post-norms, applied before the residual add)."""
        (y,) = self._node('SimplifiedLayerNormalization', [x, self._norm(gamma, prefix)],
                          name=f'{prefix}/norm', axis=-1, epsilon=float(self.spec.rms_norm_eps),
                          stash_type=1)
        return y

    def _qkv(self, h: str, lw: LayerWeights, p: str) -> List[str]:
        """Compute the first three inputs of GQA: packed QKV (one matmul) or q, k, v.

        With per-head q/k norms the packed output is split and q, k normalized (GQA ropes
        them afterwards, as llama.cpp does); the library's CausalAttention normalizes them
        itself (its q_norm / k_norm attributes), so its inputs stay as the matmuls give them.
        """
        s = self.spec
        norm_here = lw.q_norm is not None and self.opts.attention != 'causal'
        if len(lw.qkv) == 1:
            qkv = self._linear(h, lw.qkv[0], f'{p}.attn.qkv_proj', bias=lw.qkv_bias)
            if not norm_here:
                return [qkv, '', '']
            q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            sizes = self._const_i64(f'split_qkv_{q_out}_{kv_out}', [q_out, kv_out, kv_out])
            outs = self._node('Split', [qkv, sizes], n_out=3, axis=-1)
        else:
            outs, row = [], 0
            for w, role in zip(lw.qkv, 'qkv'):
                n = w.shape[0]
                bias = None if lw.qkv_bias is None else lw.qkv_bias[row:row + n]
                outs.append(self._linear(h, w, f'{p}.attn.{role}_proj', bias=bias))
                row += n
        if norm_here:
            outs[0] = self._head_norm(outs[0], lw.q_norm, f'{p}.attn.q_norm')
            outs[1] = self._head_norm(outs[1], lw.k_norm, f'{p}.attn.k_norm')
        return outs

    def _head_norm(self, x: str, gamma: np.ndarray, prefix: str, d: int = 0) -> str:
        """Apply RMSNorm to every head of x [1, S, heads*d] over d (0: head_dim)."""
        d = d or self.spec.head_dim
        heads = self._const_i64(f'shape_heads_of_{d}', [0, 0, -1, d])
        (r,) = self._node('Reshape', [x, heads])
        (n,) = self._node('SimplifiedLayerNormalization', [r, self._norm(gamma, prefix)],
                          name=f'{prefix}/norm', axis=-1, epsilon=float(self.spec.rms_norm_eps),
                          stash_type=1)
        flat = self._const_i64('shape_flat_heads', [0, 0, -1])
        (y,) = self._node('Reshape', [n, flat])
        return y

    def finish(self, final_norm: np.ndarray, lm_head: Optional[Weight]) -> onnx.ModelProto:
        """Add the final norm and lm_head (tied if None) on the positions that get logits.

        Those are logits_at (varlen), or the last logits_count positions of each row.
        """
        s = self.spec
        r_last = None
        if self.varlen:
            (x_last,) = self._node('Gather', [self._x, 'logits_at'], axis=1)
            if self._residual:
                (r_last,) = self._node('Gather', [self._residual, 'logits_at'], axis=1)
        else:
            (starts,) = self._node('Neg', ['logits_count'])
            ends = self._const_i64('slice_last_end', [np.iinfo(np.int64).max])
            axes = self._const_i64('slice_axis_seq', [1])
            (x_last,) = self._node('Slice', [self._x, starts, ends, axes])
            if self._residual:
                (r_last,) = self._node('Slice', [self._residual, starts, ends, axes])
        gamma = self._norm(final_norm, 'final_norm')
        if r_last is None:  # the last layer's output is whole (gemma4)
            (h,) = self._node('SimplifiedLayerNormalization', [x_last, gamma],
                              name='final_norm', axis=-1, epsilon=float(s.rms_norm_eps),
                              stash_type=1)
        else:
            h, _, _, _ = self._node('SkipSimplifiedLayerNormalization',
                                    [x_last, r_last, gamma], n_out=4, domain=MS_DOMAIN,
                                    name='final_norm', epsilon=float(s.rms_norm_eps))
        if lm_head is None:
            self.weight_bytes += self._embed.nbytes
            logits = self._linear(h, None, 'lm_head', ref=self._embed)
        else:
            logits = self._linear(h, lm_head, 'lm_head')
        if self.onnx_dtype != TensorProto.FLOAT:
            (logits,) = self._node('Cast', [logits], to=TensorProto.FLOAT)
        if s.logit_scale:
            # llama.cpp's ggml_scale by 1 / logit_scale (the quotient in float32).
            inv = np.float32(1) / np.float32(s.logit_scale)
            (logits,) = self._node('Mul', [logits, self._init('logit_scale_inv', inv)])
        if s.final_logit_softcap > 0:
            cap = self._init('logit_softcap', np.array(s.final_logit_softcap, np.float32))
            inv = np.array(1 / s.final_logit_softcap, np.float32)
            inv = self._init('logit_softcap_inv', inv)
            (logits,) = self._node('Mul', [logits, inv])
            (logits,) = self._node('Tanh', [logits])
            (logits,) = self._node('Mul', [logits, cap])
        self.nodes.append(helper.make_node('Identity', [logits], ['logits'], name='logits'))
        graph = helper.make_graph(self.nodes, 'edge_llm_decoder', self.inputs, self.outputs,
                                  self.initializers)
        opsets = [helper.make_opsetid('', OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        opsets += [helper.make_opsetid(d, 1) for d in sorted(self.ops_used)]
        model = helper.make_model(graph, opset_imports=opsets,
                                  producer_name='edge_llm_ros.convert')
        model.ir_version = IR_VERSION
        return model

"""Read GGUF files and HF safetensors folders into one in-memory form for the converter.

Both readers expose the decoder as `ModelSpec` (hyper-parameters) plus `SourceTensor`s under
canonical keys ('embed', 'final_norm', 'lm_head', '{layer}.q', '{layer}.attn_norm', ...).
Weights are [out_features, in_features] with Q/K rows in NEOX order (HF's rotate_half
layout): llama.cpp permutes llama Q/K rows for its interleaved RoPE, so the GGUF reader undoes
that permutation (a row permutation, exact on quantized rows too).
"""
from dataclasses import dataclass, field
import json
import pathlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from edge_llm_ros.convert.architectures import (Architecture, architecture, HF_MODEL_TYPES,
                                                llama3_rope_factors, ROPE_SCALING_TYPES,
                                                SUPPORTED_ARCHITECTURES, swa_layers)
from edge_llm_ros.convert.gguf_file import open_gguf, unpermute_llama_rows
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

# GGML tensor types the converter accepts (each checked against llama.cpp in
# test_llama_cpp_parity); others are refused by name.
SUPPORTED_GGML_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0',
                        'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K', 'IQ4_NL', 'IQ4_XS')
LAYER_ROLES = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
# A hybrid layer's kind (ModelSpec.layer_kinds): GQA, a gated short convolution (lfm2), or a
# Gated DeltaNet layer (qwen35).
ATTENTION, CONV, RECURRENT = 'attention', 'conv', 'recurrent'
# Positions per chunk of Gated DeltaNet's chunked form (the op's `chunk`): a token reads its
# chunk's start state (not written until the chunk ends) and solves against the chunk's
# earlier tokens, which a slot keeps beside that state. On CPU the chunk's own terms grow with
# its length while the state's do not: at Qwen3.5-2B's shape 8 was the fastest of 4-64
# (bench/bench_gated_delta.py: 1.1x the recurrent form's op, prefill and decode) and keeps
# the state at 1.12x the d x d state alone (32: 1.47x and no faster).
DELTA_CHUNK = 8
GGUF_LAYER_NAMES = {
    'attn_norm': 'attn_norm.weight', 'ffn_norm': 'ffn_norm.weight',
    'q': 'attn_q.weight', 'k': 'attn_k.weight', 'v': 'attn_v.weight',
    'o': 'attn_output.weight', 'gate': 'ffn_gate.weight', 'up': 'ffn_up.weight',
    'down': 'ffn_down.weight', 'q_bias': 'attn_q.bias', 'k_bias': 'attn_k.bias',
    'v_bias': 'attn_v.bias', 'q_norm': 'attn_q_norm.weight',
    'k_norm': 'attn_k_norm.weight', 'post_attn_norm': 'post_attention_norm.weight',
    'post_ffn_norm': 'post_ffw_norm.weight', 'qkv': 'attn_qkv.weight',
    'in_proj': 'shortconv.in_proj.weight', 'conv': 'shortconv.conv.weight',
    'out_proj': 'shortconv.out_proj.weight',
    # qwen35's Gated DeltaNet layers (its attn_qkv is their conv input, read as
    # gdn_qkv) and the output gate of its attention layers (split from attn_q).
    'gdn_z': 'attn_gate.weight', 'ssm_conv': 'ssm_conv1d.weight',
    'ssm_dt': 'ssm_dt.bias', 'ssm_a': 'ssm_a', 'ssm_beta': 'ssm_beta.weight',
    'ssm_alpha': 'ssm_alpha.weight', 'ssm_norm': 'ssm_norm.weight',
    'ssm_out': 'ssm_out.weight',
    # granitehybrid's Mamba-2 layers (ssm_in: z | xBC | dt rows, split by the reader).
    'ssm_in': 'ssm_in.weight', 'ssm_conv_bias': 'ssm_conv1d.bias',
    'ssm_d': 'ssm_d'}
_HF_LAYER = {'attn_norm': 'input_layernorm.weight', 'ffn_norm': 'post_attention_layernorm.weight',
             'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
             'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
             'gate': 'mlp.gate_proj.weight', 'up': 'mlp.up_proj.weight',
             'down': 'mlp.down_proj.weight', 'q_bias': 'self_attn.q_proj.bias',
             'k_bias': 'self_attn.k_proj.bias', 'v_bias': 'self_attn.v_proj.bias',
             'q_norm': 'self_attn.q_norm.weight', 'k_norm': 'self_attn.k_norm.weight',
             'qkv': 'self_attn.qkv_proj.weight', 'gate_up': 'mlp.gate_up_proj.weight'}
# Gemma 3 has four norms per layer: its post_attention_layernorm is applied to the attention
# output (GGUF post_attention_norm), pre_feedforward_layernorm is the MLP's input norm.
_HF_GEMMA3_LAYER = dict(_HF_LAYER, ffn_norm='pre_feedforward_layernorm.weight',
                        post_attn_norm='post_attention_layernorm.weight',
                        post_ffn_norm='post_feedforward_layernorm.weight')
# LFM2 (transformers' Lfm2): operator_norm is the input norm of both kinds of layer, the MLP
# is w1 (gate), w3 (up), w2 (down), and a conv layer has conv.{in_proj,conv,out_proj}.
_HF_LFM2_LAYER = {'attn_norm': 'operator_norm.weight', 'ffn_norm': 'ffn_norm.weight',
                  'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
                  'v': 'self_attn.v_proj.weight', 'o': 'self_attn.out_proj.weight',
                  'q_norm': 'self_attn.q_layernorm.weight',
                  'k_norm': 'self_attn.k_layernorm.weight', 'gate': 'feed_forward.w1.weight',
                  'up': 'feed_forward.w3.weight', 'down': 'feed_forward.w2.weight',
                  'in_proj': 'conv.in_proj.weight', 'conv': 'conv.conv.weight',
                  'out_proj': 'conv.out_proj.weight'}
# The final norm's HF names, first found wins: transformers' Lfm2 calls it embedding_norm;
# model.norm, the other families' name, is taken as well.
_HF_FINAL_NORMS = {'lfm2': ('model.embedding_norm.weight', 'model.norm.weight')}
# LFM2 layer_types values -> ModelSpec.layer_kinds.
_HF_LFM2_KINDS = {'conv': CONV, 'full_attention': ATTENTION}
# Longest conv kernel the op library's ShortConv takes (ELK_SHORTCONV_MAX_KERNEL).
MAX_CONV_KERNEL = 16


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a llama-family decoder."""

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tied_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3)
    # RoPE angle of frequency i at position p: p * rope_scale * theta**(-2i/d) / factors[i]
    # (llama.cpp's freq_scale and rope_freqs; Llama 3.1 scaling is the factors).
    rope_scale: float = 1.0
    rope_freq_factors: Optional[Tuple[float, ...]] = None
    # Leading dims of each head that are rotated (0: all; Phi-4-mini rotates 3/4).
    rope_dims: int = 0
    # cos/sin multiplier (llama.cpp's rope.scaling.attn_factor: Phi-3 LongRoPE's mscale).
    rope_attn_factor: float = 1.0
    # The context the rope factors were chosen for (LongRoPE short factors: the original
    # context); 0 = any. llama.cpp picks the long factors beyond it.
    rope_factors_max_context: int = 0
    post_norms: bool = False        # gemma3: norms of attention and MLP outputs
    activation: str = 'silu'        # 'silu' or 'gelu_tanh'
    embed_scale: float = 1.0        # token embeddings times this (gemma: sqrt(hidden))
    attention_scale: float = 0.0    # q.k multiplier; 0: 1/sqrt(head_dim)
    # Sliding-window attention: a local layer's query sees the last `sliding_window` keys
    # (itself included; llama.cpp's n_swa), with its own RoPE base and scale.
    sliding_window: int = 0
    local_layers: Tuple[bool, ...] = ()
    local_rope_theta: float = 0.0
    local_rope_scale: float = 1.0
    final_logit_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    # Hybrid models (lfm2): each layer's kind, ATTENTION or CONV (empty: every layer is
    # attention), and the short convolution's kernel (positions; its state keeps one fewer).
    layer_kinds: Tuple[str, ...] = ()
    conv_kernel: int = 0
    # M-RoPE (qwen2vl): rotary pairs per section (t, h, w), llama.cpp's rope.dimension_sections
    # without its unused fourth; empty: one position for every pair.
    rope_sections: Tuple[int, ...] = ()
    mrope_interleaved: bool = False   # qwen3vl: sections interleaved pair by pair
    # qwen3vl: an image row carries this many hidden-size rows more, added to the hidden
    # states after layers 0 .. deepstack_layers - 1 (llama.cpp's n_deepstack_layers).
    deepstack_layers: int = 0
    # Gated DeltaNet layers (qwen35): key/query heads, value heads and their size (d_k = d_v).
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    # Attention output times sigmoid(gate), the gate rows read beside q (qwen35).
    gated_attention: bool = False
    # The reader reordered each q/k head's dims so that the partial NEOX rotary is a
    # half-split rotary over the whole head, identity beyond rotary_dims (the graph pads
    # cos/sin with 1/0): the op library's attention rotates whole heads (qwen35).
    rotary_permuted: bool = False
    # gemma4 (convert/gemma4.py): sliding-window layers' own head size and KV heads (0: as
    # the global layers'), the first layer that reads an earlier layer's KV (0: none), each
    # layer's MLP width (empty: intermediate_size), the per-layer embedding width (0: none),
    # and V normalized (RMSNorm without weights) as llama.cpp's gemma4 graph does.
    local_head_dim: int = 0
    local_kv_heads: int = 0
    kv_shared_from: int = 0
    layer_intermediate: Tuple[int, ...] = ()
    per_layer_embed: int = 0
    v_norm: bool = False
    # Layers that attend without RoPE (smollm3's every fourth); empty: every layer rotates.
    nope_layers: Tuple[bool, ...] = ()
    # Mamba-2 layers (granitehybrid; layer kind RECURRENT): heads of mamba_head_dim, groups of
    # B and C of mamba_state each (0: the recurrent layers are Gated DeltaNet layers).
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    # Granite's multipliers: each residual branch (mixer and MLP output) times residual_scale
    # before its add, the logits divided by logit_scale (0: neither).
    residual_scale: float = 0.0
    logit_scale: float = 0.0

    def layer_head_dim(self, layer: int) -> int:
        """Return `layer`'s head size."""
        return self.local_head_dim if self.is_local(layer) and self.local_head_dim \
            else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Return `layer`'s KV head count."""
        return self.local_kv_heads if self.is_local(layer) and self.local_kv_heads \
            else self.num_kv_heads

    def layer_ff(self, layer: int) -> int:
        """Return `layer`'s MLP width."""
        return self.layer_intermediate[layer] if self.layer_intermediate \
            else self.intermediate_size

    def kv_owner(self, layer: int) -> int:
        """Return the layer whose KV `layer` reads (-1: it keeps its own; llama.cpp's reuse).

        Shared layers read the last layer of their kind (sliding-window or global) before
        kv_shared_from.
        """
        if not self.kv_shared_from or layer < self.kv_shared_from:
            return -1
        return self.kv_shared_from - (2 if self.is_local(layer) else 1)

    @property
    def rotary_dims(self) -> int:
        """Rotated dims per head."""
        return self.rope_dims or self.head_dim

    def is_conv(self, layer: int) -> bool:
        """Whether `layer` is a gated short convolution (no attention, no KV)."""
        return bool(self.layer_kinds) and self.layer_kinds[layer] == CONV

    def is_recurrent(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet layer (no attention, no KV)."""
        return bool(self.layer_kinds) and self.layer_kinds[layer] == RECURRENT

    def is_attention(self, layer: int) -> bool:
        """Whether `layer` attends (keeps KV)."""
        return not self.layer_kinds or self.layer_kinds[layer] == ATTENTION

    @property
    def mamba_channels(self) -> int:
        """Channels of a Mamba-2 layer's conv: x, B and C."""
        return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state

    @property
    def recurrent_state_floats(self) -> int:
        """Floats of one recurrent layer's state per slot (conv inputs, then the SSM state).

        Gated DeltaNet: per value head the chunked form's state (native gated_delta.h): the
        d x d delta state at the chunk's start and the chunk's tokens so far; Mamba-2: heads x
        state x head_dim.
        """
        if self.mamba_heads:
            return ((self.conv_kernel - 1) * self.mamba_channels
                    + self.mamba_heads * self.mamba_state * self.mamba_head_dim)
        d = self.ssm_head_dim
        channels = (2 * self.ssm_k_heads + self.ssm_v_heads) * d
        head = d * d + DELTA_CHUNK * (2 * d + 1)   # S0, then the chunk's keys, values, decays
        return (self.conv_kernel - 1) * channels + self.ssm_v_heads * head

    def is_nope(self, layer: int) -> bool:
        """Whether `layer` attends without RoPE (its q and k are not rotated)."""
        return bool(self.nope_layers) and self.nope_layers[layer]

    def is_local(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer."""
        return bool(self.sliding_window and self.local_layers and self.local_layers[layer])


@dataclass
class SourceTensor:
    """One tensor as stored in the source: raw GGML blocks or a float array.

    `shape` is the logical numpy shape ([out, in] for matrices). For block types `data` is
    uint8 [rows, row_bytes]; for float types it is the array itself.
    """

    name: str
    qtype: str
    shape: Tuple[int, ...]
    data: np.ndarray
    # llama.cpp's Q/K row permutation to undo over this many heads when the rows are read
    # (0: none). Kept lazy so that loading maps the file without copying any tensor.
    permute_heads: int = 0
    shift: float = 0.0  # added to every value by dequantize (Gemma's HF norm weights)
    # Rows taken, in this order, of the stored ones (None: all): qwen35's q/gate split and
    # rotary reorder (row gathers, exact on quantized rows). Kept lazy as permute_heads.
    row_order: Optional[np.ndarray] = None

    def values(self) -> np.ndarray:
        """Return the stored rows (raw blocks or floats), Q/K permutation undone."""
        data = self.data
        if self.permute_heads:
            data = unpermute_llama_rows(np.asarray(data), self.permute_heads)
        if self.row_order is not None:
            data = np.asarray(data)[self.row_order]
        return data

    def rows(self, start: int, stop: int) -> 'SourceTensor':
        """Rows [start, stop) of a matrix (blocks run along rows, so this is exact)."""
        return SourceTensor(self.name, self.qtype, (stop - start,) + tuple(self.shape[1:]),
                            self.values()[start:stop], shift=self.shift)

    def dequantize(self) -> np.ndarray:
        """Return the tensor as float32 in its logical shape."""
        data = self.values()
        if self.qtype == 'F32':
            out = np.asarray(data, dtype=np.float32).reshape(self.shape)
        elif self.qtype == 'F16':
            out = np.asarray(data).astype(np.float32).reshape(self.shape)
        elif self.qtype == 'BF16' and data.dtype == np.uint16:
            out = (data.astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        else:
            import gguf
            qtype = gguf.GGMLQuantizationType[self.qtype]
            out = gguf.quants.dequantize(np.asarray(data), qtype).reshape(self.shape)
        return out + np.float32(self.shift) if self.shift else out


@dataclass
class Checkpoint:
    """A decoder checkpoint: spec, tensors by canonical key, and how to write its tokenizer."""

    spec: ModelSpec
    source_path: pathlib.Path
    tensors: Dict[str, SourceTensor]
    # write_tokenizer(out_dir) -> {'bos_token_id', 'eos_token_ids', 'add_bos_token'}
    write_tokenizer: Callable[[pathlib.Path], dict] = field(repr=False, default=None)
    # Gives the pages of a memory-mapped source back to the OS (their contents stay readable).
    release: Callable[[], None] = field(repr=False, default=lambda: None)

    def tensor(self, key: str) -> SourceTensor:
        """Return a tensor by canonical key; a missing one is a corrupt checkpoint."""
        try:
            return self.tensors[key]
        except KeyError:
            raise ModelLoadError(
                f'{self.source_path}: tensor {key!r} is missing; the checkpoint is incomplete '
                f'or not a {self.spec.architecture} decoder') from None

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds a tensor under `key`."""
        return key in self.tensors

    def matrices(self) -> List[SourceTensor]:
        """Return the tensors the graph multiplies by (2-D; an lfm2 conv kernel is not one)."""
        return [t for k, t in self.tensors.items() if len(t.shape) == 2
                and not k.endswith(('.conv', '.ssm_conv'))]

    def source_types(self) -> List[str]:
        """Sorted tensor types of the matrices (what the quantization came from)."""
        return sorted({t.qtype for t in self.matrices()})


def load_checkpoint(source: str) -> Checkpoint:
    """Open a GGUF file or an HF folder; raise ModelLoadError/UnsupportedModelError."""
    path = pathlib.Path(source).expanduser().resolve()
    if not path.exists():
        raise ModelLoadError(f'{path}: no such file or folder; give a .gguf file or an HF '
                             'folder with config.json and *.safetensors')
    try:
        return load_hf_folder(path) if path.is_dir() else _load_gguf(path)
    except (TypeError, ValueError, KeyError) as exc:
        # Metadata of an unexpected form (e.g. per-layer head counts) or a malformed header.
        raise UnsupportedModelError(f'{path}: cannot read the model description ({exc!r}); '
                                    'it is not a plain '
                                    f'{"/".join(SUPPORTED_ARCHITECTURES)} checkpoint') from exc


# --- GGUF -----------------------------------------------------------------------------------

def gguf_field(reader, key: str, default=None, required: bool = False):
    """Return metadata `key` of an open GGUF (`default` when absent, or an error if required)."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelLoadError(f'GGUF metadata key {key!r} is missing; the file is not a '
                                 'complete llama.cpp model')
        return default
    value = f.contents()
    return value


def _load_gguf(path: pathlib.Path) -> Checkpoint:
    reader = open_gguf(path)
    arch = gguf_field(reader, 'general.architecture', required=True)
    family = architecture(arch, str(path))
    if family.name == 'gemma4':
        from edge_llm_ros.convert.gemma4 import load_gemma4_gguf
        return load_gemma4_gguf(path, reader)

    def key(k: str, default=None, required: bool = False):
        return gguf_field(reader, f'{arch}.{k}', default, required)

    scaling = key('rope.scaling.type', 'none') or 'none'
    if scaling not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(
            f'{path}: RoPE scaling type {scaling!r} is not supported (supported: '
            f'{", ".join(ROPE_SCALING_TYPES)}, Llama 3 rope_freqs and Phi-3 LongRoPE factors); '
            'use a GGUF of the model without long-context scaling or one converted for its '
            'base context')
    # As llama.cpp: the factor applies whatever the type says (0 or absent: none).
    factor = float(key('rope.scaling.factor', 0.0) or key('rope.scale_linear', 0.0) or 0.0)
    hidden = int(key('embedding_length', required=True))
    heads = int(key('attention.head_count', required=True))
    kv_heads, kinds = _kv_heads(path, family, key('attention.head_count_kv', heads))
    head_dim = int(key('attention.key_length', hidden // heads))
    rope_dims = int(key('rope.dimension_count', head_dim))
    if not (0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise UnsupportedModelError(f'{path}: rope.dimension_count {rope_dims} does not fit '
                                    f'head size {head_dim}; the header is corrupt')
    layers = int(key('block_count', required=True))
    n_ff = int(key('feed_forward_length', required=True))
    names = {t.name: t for t in reader.tensors}
    wanted = {'embed': 'token_embd.weight', 'final_norm': family.final_norm,
              'lm_head': 'output.weight'}
    if kinds and len(kinds) != layers:
        raise ModelLoadError(f'{path}: attention.head_count_kv has {len(kinds)} entries for '
                             f'{layers} layers: the GGUF contradicts itself')
    conv_kernel = 0
    if family.conv_layers:
        conv_kernel = _check_hybrid(path, key, names)
    recurrent: dict = {}
    if family.mamba_layers:
        recurrent = _check_mamba(path, key, names, kinds, hidden)
        conv_kernel = recurrent.pop('conv_kernel')
    if family.recurrent_layers:
        layers -= int(key('nextn_predict_layers', 0) or 0)  # MTP blocks: not run, not read
        kinds, recurrent = _check_recurrent(path, key, names, layers)
        conv_kernel = recurrent.pop('conv_kernel')
    for i in range(layers):
        for role, suffix in GGUF_LAYER_NAMES.items():
            wanted[f'{i}.{role}'] = f'blk.{i}.{suffix}'
    tensors = {ckey: gguf_tensor(path, names[gname]) for ckey, gname in wanted.items()
               if gname in names}
    if family.recurrent_layers:
        _qwen35_tensors(tensors, kinds, heads, kv_heads, head_dim, rope_dims)
    if family.mamba_layers:
        _mamba_tensors(tensors, kinds, recurrent)
    if family.gguf_permuted_qk:
        # llama.cpp stored Q/K with interleaved RoPE pairs; read them back as NEOX halves.
        for i in range(layers):
            for role, n in (('q', heads), ('k', kv_heads)):
                for k in (f'{i}.{role}', f'{i}.{role}_bias'):
                    if k in tensors:
                        tensors[k].permute_heads = n
    _split_fused(path, tensors, layers, heads * head_dim, kv_heads * head_dim, n_ff)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{path}: token_embd.weight is missing; the GGUF is incomplete')
    ctx = int(key('context_length', 2048))
    factors, factors_ctx = _rope_factors(path, key, names, rope_dims, ctx)
    window, local = 0, ()
    local_theta = 0.0
    if family.swa_period and int(key('attention.sliding_window', 0) or 0) > 0:
        window = int(key('attention.sliding_window'))
        period = key('attention.sliding_window_pattern', family.swa_period)
        if not isinstance(period, int):
            raise UnsupportedModelError(f'{path}: a per-layer sliding_window_pattern array is '
                                        'not supported; use a GGUF with the period form')
        local = swa_layers(period, layers)
        local_theta = _f32(key('rope.freq_base_swa', family.swa_rope_base))
    sections: Tuple[int, ...] = ()
    if family.mrope:
        raw = [int(v) for v in (key('rope.dimension_sections', required=True) or ())]
        raw = (raw + [0] * 4)[:4]
        if raw[3] or sum(raw) != rope_dims // 2 or min(raw[:3]) < 0:
            raise UnsupportedModelError(
                f'{path}: rope.dimension_sections {raw} must split the {rope_dims // 2} '
                'rotary pairs into t, h, w sections (the fourth 0), as Qwen2-VL / Qwen2.5-VL '
                '/ Qwen3-VL GGUFs do')
        sections = tuple(raw[:3])
    deepstack = int(key('n_deepstack_layers', 0) or 0) if family.deepstack else 0
    if not 0 <= deepstack < layers:
        raise UnsupportedModelError(f'{path}: n_deepstack_layers {deepstack} must be under the '
                                    f'{layers} layers (llama.cpp adds the DeepStack rows after '
                                    'the first layers and needs one after them)')
    spec = ModelSpec(
        architecture=arch,
        name=str(gguf_field(reader, 'general.name', path.stem)),
        num_layers=layers, hidden_size=hidden, intermediate_size=n_ff,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=tensors['embed'].shape[0], max_position_embeddings=ctx,
        rope_theta=_f32(key('rope.freq_base', 10000.0)),
        rms_norm_eps=_f32(key('attention.layer_norm_rms_epsilon', 1e-5)),
        tied_embeddings='lm_head' not in tensors,
        attention_bias='0.q_bias' in tensors, qk_norm=family.qk_norm,
        rope_scale=1.0 / factor if factor else 1.0, rope_freq_factors=factors,
        rope_dims=0 if rope_dims == head_dim else rope_dims,
        rope_attn_factor=_f32(key('rope.scaling.attn_factor', 1.0)),
        rope_factors_max_context=factors_ctx, layer_kinds=kinds, conv_kernel=conv_kernel,
        rope_sections=sections, mrope_interleaved=family.mrope_interleaved,
        deepstack_layers=deepstack,
        **recurrent,
        **_family_extras(family, hidden, heads, head_dim, layers, window, local, local_theta,
                         float(key('final_logit_softcapping', 0.0) or 0.0)))

    def write_tokenizer(out_dir: pathlib.Path) -> dict:
        return _write_gguf_tokenizer(reader, out_dir)

    def release() -> None:
        import mmap
        mm = getattr(reader.data, '_mmap', None)
        if mm is not None and hasattr(mmap, 'MADV_DONTNEED'):
            mm.madvise(mmap.MADV_DONTNEED)

    ckpt = Checkpoint(spec, path, tensors, write_tokenizer, release)
    _check_shapes(ckpt)
    return ckpt


def _kv_heads(path: pathlib.Path, family: Architecture,
              value) -> Tuple[int, Tuple[str, ...]]:
    """Read attention.head_count_kv: one count, or (hybrids) one per layer, 0 = no attention.

    A 0 is a conv layer (lfm2) or a Mamba-2 layer (granitehybrid). Returns the attention
    layers' KV head count and the layer kinds (empty: all attention).
    """
    if not isinstance(value, (list, tuple)):
        return int(value), ()
    counts = [int(v) for v in value]
    if not (family.conv_layers or family.mamba_layers):
        raise UnsupportedModelError(f'{path}: per-layer attention.head_count_kv is not '
                                    f'supported for {family.name}; use a GGUF with one count')
    kv = sorted({c for c in counts if c > 0})
    if len(kv) != 1:
        raise UnsupportedModelError(
            f'{path}: attention layers with KV head counts {kv or "none"}: the converter '
            'builds one KV head count for every attention layer (and needs at least one)')
    other = RECURRENT if family.mamba_layers else CONV
    return kv[0], tuple(other if c == 0 else ATTENTION for c in counts)


def _check_hybrid(path: pathlib.Path, key, names: dict) -> int:
    """Check what the converter builds of an lfm2 GGUF; return its conv kernel (l_cache)."""
    kernel = int(key('shortconv.l_cache', 0) or 0)
    if not 2 <= kernel <= MAX_CONV_KERNEL:
        raise ModelLoadError(f'{path}: shortconv.l_cache {kernel} is not a conv kernel of '
                             f'2..{MAX_CONV_KERNEL} positions; the GGUF is incomplete or '
                             'corrupt')
    if int(key('attention.sliding_window', 0) or 0) > 0:
        raise UnsupportedModelError(f'{path}: an lfm2 model with a sliding window is not '
                                    'supported yet; use one with full attention')
    if key('attention.causal', True) is False or 'dense_2.weight' in names:
        raise UnsupportedModelError(f'{path}: an LFM2 embedding model (bidirectional or '
                                    'ColBERT) is not a text decoder; convert a generative '
                                    'LFM2 checkpoint')
    if any('ffn_gate_exps' in n for n in names):
        raise UnsupportedModelError(f'{path}: mixture-of-experts layers are not supported')
    return kernel


def _check_recurrent(path: pathlib.Path, key, names: dict,
                     layers: int) -> Tuple[Tuple[str, ...], dict]:
    """Read a qwen35 GGUF's Gated DeltaNet hyper-parameters (llama.cpp's keys).

    Returns the layer kinds (attention.recurrent_layers, else every full_attention_interval-th
    layer attends) and the ModelSpec fields of the DeltaNet layers.
    """
    if any('ffn_gate_exps' in n or 'ffn_gate_inp' in n for n in names):
        raise UnsupportedModelError(f'{path}: a Qwen3.5 mixture-of-experts model (qwen35moe '
                                    'layers) is not supported; use a dense Qwen3.5 GGUF')
    kernel = int(key('ssm.conv_kernel', 0) or 0)
    state = int(key('ssm.state_size', 0) or 0)
    k_heads = int(key('ssm.group_count', 0) or 0)
    v_heads = int(key('ssm.time_step_rank', 0) or 0)
    inner = int(key('ssm.inner_size', 0) or 0)
    if not (2 <= kernel <= MAX_CONV_KERNEL and 0 < state <= 256 and k_heads > 0 and
            v_heads > 0 and v_heads % k_heads == 0 and inner == v_heads * state):
        raise ModelLoadError(
            f'{path}: ssm.conv_kernel {kernel}, ssm.state_size {state}, ssm.group_count '
            f'{k_heads}, ssm.time_step_rank {v_heads}, ssm.inner_size {inner} do not describe '
            f'Gated DeltaNet layers the op library runs (kernel 2..{MAX_CONV_KERNEL}, heads of '
            'at most 256, value heads a multiple of key heads, inner = value heads x state); '
            'the GGUF is incomplete or corrupt')
    flags = key('attention.recurrent_layers')
    if flags is not None:
        kinds = tuple(RECURRENT if bool(f) else ATTENTION for f in list(flags)[:layers])
    else:
        interval = int(key('full_attention_interval', 4) or 4)
        kinds = tuple(ATTENTION if (i + 1) % interval == 0 else RECURRENT
                      for i in range(layers))
    if len(kinds) != layers or ATTENTION not in kinds:
        raise UnsupportedModelError(f'{path}: {kinds.count(ATTENTION)} attention layers of '
                                    f'{layers}: the converter needs at least one')
    return kinds, {'conv_kernel': kernel, 'ssm_k_heads': k_heads, 'ssm_v_heads': v_heads,
                   'ssm_head_dim': state, 'gated_attention': True, 'rotary_permuted': True}


# The Granite 4.0-H variants the converter builds, and those it refuses (their MoE FFNs).
GRANITE_DENSE = 'Granite 4.0-H Micro (dense FFNs)'
GRANITE_MOE = 'Granite 4.0-H Tiny and Small (mixture-of-experts FFNs)'


def mamba_shape_runs(kernel: int, state: int, groups: int, heads: int, inner: int) -> bool:
    """Whether Mamba-2 layers of this shape are ones the op library's Mamba2 runs."""
    return (2 <= kernel <= MAX_CONV_KERNEL and state > 0 and groups > 0 and heads > 0 and
            heads % groups == 0 and inner % heads == 0 and 0 < inner // heads <= 256)


def hf_layer_kinds(src: pathlib.Path, types, layers: int,
                   kinds: Dict[str, str]) -> Tuple[str, ...]:
    """Map config.json's layer_types (names: `kinds`' keys) to ModelSpec.layer_kinds.

    One entry per layer, and at least one attention layer (the converter needs one).
    """
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(kinds):
        raise ModelLoadError(f'{src}: layer_types is not one {" / ".join(kinds)} '
                             'entry per layer; download config.json again')
    out = tuple(kinds[t] for t in types)
    if ATTENTION not in out:
        attention = next(name for name, kind in kinds.items() if kind == ATTENTION)
        raise UnsupportedModelError(f'{src}: no {attention} layer; the converter needs '
                                    'at least one')
    return out


def _check_mamba(path: pathlib.Path, key, names: dict, kinds: Tuple[str, ...],
                 hidden: int) -> dict:
    """Read a granitehybrid GGUF's Mamba-2 hyper-parameters and Granite's multipliers.

    Returns the ModelSpec fields (conv_kernel among them: the caller takes it out).
    """
    if any('ffn_gate_inp' in n or '_exps' in n or '_shexp' in n for n in names) or \
            int(key('expert_count', 0) or 0) > 0:
        raise UnsupportedModelError(
            f'{path}: a {GRANITE_MOE} GGUF: mixture-of-experts layers are not supported; '
            f'supported: {GRANITE_DENSE}')
    kernel = int(key('ssm.conv_kernel', 0) or 0)
    state = int(key('ssm.state_size', 0) or 0)
    groups = int(key('ssm.group_count', 0) or 0)
    heads = int(key('ssm.time_step_rank', 0) or 0)
    inner = int(key('ssm.inner_size', 0) or 0)
    if not mamba_shape_runs(kernel, state, groups, heads, inner):
        raise ModelLoadError(
            f'{path}: ssm.conv_kernel {kernel}, ssm.state_size {state}, ssm.group_count '
            f'{groups}, ssm.time_step_rank {heads}, ssm.inner_size {inner} do not describe '
            f'Mamba-2 layers the op library runs (kernel 2..{MAX_CONV_KERNEL}, heads a '
            'multiple of groups, heads of at most 256 dims); the GGUF is incomplete or corrupt')
    if not kinds or ATTENTION not in kinds:
        raise UnsupportedModelError(f'{path}: a granitehybrid GGUF without per-layer '
                                    'attention.head_count_kv (0 = a Mamba-2 layer) or without '
                                    'an attention layer is not supported')
    out = {'conv_kernel': kernel, 'mamba_heads': heads, 'mamba_head_dim': inner // heads,
           'mamba_groups': groups, 'mamba_state': state,
           'residual_scale': _f32(key('residual_scale', 0.0) or 0.0),
           'logit_scale': _f32(key('logit_scale', 0.0) or 0.0),
           'embed_scale': _f32(key('embedding_scale', 0.0) or 0.0) or 1.0,
           'attention_scale': _f32(key('attention.scale', 0.0) or 0.0)}
    # Granite's RoPE switch (llama.cpp: rope.scaling.finetuned, default true): false, as
    # Granite 4.0-H writes it, is no RoPE on any layer.
    if key('rope.scaling.finetuned', True) is False:
        out['nope_layers'] = (True,) * len(kinds)
    return out


def _mamba_tensors(tensors: Dict[str, SourceTensor], kinds: Tuple[str, ...],
                   fields: dict) -> None:
    """Name granitehybrid's Mamba-2 tensors as the graph reads them (lazy row views).

    ssm_in's rows are z | x, B, C | dt (ssm_z, ssm_xbc, ssm_dtp); ssm_a, ssm_d and ssm_norm
    are read as vectors ([1, heads] and [groups, d_inner / groups] in the GGUF).
    """
    inner = fields['mamba_heads'] * fields['mamba_head_dim']
    channels = inner + 2 * fields['mamba_groups'] * fields['mamba_state']
    for i, kind in enumerate(kinds):
        if kind != RECURRENT:
            continue
        p = f'{i}.'
        t = tensors.pop(p + 'ssm_in', None)
        if t is not None and len(t.shape) == 2 and \
                t.shape[0] == inner + channels + fields['mamba_heads']:
            for role, a, b in (('ssm_z', 0, inner), ('ssm_xbc', inner, inner + channels),
                               ('ssm_dtp', inner + channels, t.shape[0])):
                tensors[p + role] = SourceTensor(t.name, t.qtype, (b - a,) + tuple(t.shape[1:]),
                                                 t.data, row_order=np.arange(a, b))
        elif t is not None:
            tensors[p + 'ssm_in'] = t   # _check_shapes names what is wrong
        for role in ('ssm_a', 'ssm_d', 'ssm_norm'):
            v = tensors.get(p + role)
            if v is not None and len(v.shape) == 2:
                v.shape = (int(np.prod(v.shape)),)


def rotary_order(head_dim: int, rotary: int) -> np.ndarray:
    """Return one head's dims reordered for a half-split rotary over the whole head.

    A partial NEOX rotary of `rotary` dims (pairs i, i + rotary / 2) becomes the pairs
    i, i + head_dim / 2; the other dims are paired with each other (rotated by angle 0, cos 1
    and sin 0: unchanged, exactly).
    """
    half, rest = rotary // 2, (head_dim - rotary) // 2
    return np.concatenate([np.arange(half), rotary + np.arange(rest),
                           half + np.arange(half), rotary + rest + np.arange(rest)])


def _qwen35_tensors(tensors: Dict[str, SourceTensor], kinds: Tuple[str, ...], heads: int,
                    kv_heads: int, head_dim: int, rope_dims: int) -> None:
    """Name qwen35's tensors as the graph reads them (all lazy row gathers, no copies).

    A DeltaNet layer's attn_qkv is its conv input (gdn_qkv); an attention layer's attn_q holds
    each head's query then its output gate (split into q and gate), its q/k rows and norms are
    reordered by rotary_order; post_attention_norm is the FFN's input norm.
    """
    order = rotary_order(head_dim, rope_dims)
    for i, kind in enumerate(kinds):
        p = f'{i}.'
        if p + 'post_attn_norm' in tensors:
            tensors[p + 'ffn_norm'] = tensors.pop(p + 'post_attn_norm')
        if kind == RECURRENT:
            if p + 'qkv' in tensors:
                tensors[p + 'gdn_qkv'] = tensors.pop(p + 'qkv')
            continue
        q = tensors.get(p + 'q')
        if q is None or q.shape[0] != 2 * heads * head_dim:
            continue  # _check_shapes names what is wrong
        base = np.arange(heads)[:, None] * 2 * head_dim
        q_rows = (base + order[None, :]).reshape(-1)
        gate_rows = (base + head_dim + np.arange(head_dim)[None, :]).reshape(-1)
        shape = (heads * head_dim,) + tuple(q.shape[1:])
        tensors[p + 'q'] = SourceTensor(q.name, q.qtype, shape, q.data, row_order=q_rows)
        tensors[p + 'attn_gate'] = SourceTensor(q.name, q.qtype, shape, q.data,
                                                row_order=gate_rows)
        k = tensors.get(p + 'k')
        if k is not None and k.shape[0] == kv_heads * head_dim:
            k_rows = (np.arange(kv_heads)[:, None] * head_dim + order[None, :]).reshape(-1)
            k.row_order = k_rows
        for norm in ('q_norm', 'k_norm'):
            t = tensors.get(p + norm)
            if t is not None and t.shape == (head_dim,):
                t.row_order = order


def _family_extras(family: Architecture, hidden: int, heads: int, head_dim: int, layers: int,
                   window: int, local: Tuple[bool, ...], local_theta: float,
                   softcap: float) -> dict:
    """Return the ModelSpec fields a family adds to the llama skeleton (as llama.cpp)."""
    out = {'post_norms': family.post_norms, 'activation': family.activation}
    if family.no_rope_period:
        # llama.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0.
        out['nope_layers'] = tuple((i + 1) % family.no_rope_period == 0 for i in range(layers))
    if family.embed_scale:
        out['embed_scale'] = float(np.sqrt(np.float32(hidden)))  # sqrtf(n_embd)
    if family.name == 'gemma3':
        # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(n_embd/n_head).
        out['attention_scale'] = float(1.0 / np.sqrt(np.float32(
            hidden // heads if layers == 62 else head_dim)))
        if window:
            out.update(sliding_window=window, local_layers=local, local_rope_theta=local_theta)
        else:
            out['final_logit_softcap'] = softcap  # only the non-SWA graph caps its logits
    return out


def _split_fused(path: pathlib.Path, tensors: Dict[str, SourceTensor], layers: int,
                 q_out: int, kv_out: int, n_ff: int) -> None:
    """Split Phi-3's fused attn_qkv (q|k|v rows) and ffn_up (gate|up rows) into the roles."""
    for i in range(layers):
        p = f'{i}.'
        qkv = tensors.pop(p + 'qkv', None)
        if qkv is not None:
            if qkv.shape[0] != q_out + 2 * kv_out:
                raise ModelLoadError(f'{path}: tensor {qkv.name} has {qkv.shape[0]} rows, but '
                                     f"the header's heads need {q_out + 2 * kv_out}: the file "
                                     'contradicts itself; convert the model again')
            tensors[p + 'q'] = qkv.rows(0, q_out)
            tensors[p + 'k'] = qkv.rows(q_out, q_out + kv_out)
            tensors[p + 'v'] = qkv.rows(q_out + kv_out, q_out + 2 * kv_out)
        up = tensors.get(p + 'up')
        if up is not None and p + 'gate' not in tensors and up.shape[0] == 2 * n_ff:
            # llama.cpp's SWIGLU on the fused rows: silu(first half) * second half.
            tensors[p + 'gate'], tensors[p + 'up'] = up.rows(0, n_ff), up.rows(n_ff, 2 * n_ff)


def _rope_factors(path: pathlib.Path, key, names: dict, rope_dims: int,
                  ctx: int) -> Tuple[Optional[Tuple[float, ...]], int]:
    """Per-frequency RoPE divisors: Llama 3's rope_freqs, or Phi-3 LongRoPE's short factors.

    llama.cpp uses rope_factors_long only when the context it runs with exceeds
    rope.scaling.original_context_length; the converted graph takes the short ones and
    records that context (longer contexts are refused at conversion).
    """
    if 'rope_freqs.weight' in names:
        return _rope_freqs(path, names['rope_freqs.weight'], rope_dims), 0
    if 'rope_factors_short.weight' in names:
        orig = int(key('rope.scaling.original_context_length', ctx) or ctx)
        return _rope_freqs(path, names['rope_factors_short.weight'], rope_dims), orig
    if 'rope_factors_long.weight' in names:
        raise UnsupportedModelError(f'{path}: rope_factors_long without rope_factors_short; '
                                    'convert the model again with llama.cpp')
    return None, 0


def _rope_freqs(path: pathlib.Path, t, rope_dims: int) -> Tuple[float, ...]:
    """Read a per-frequency RoPE divisor tensor (rope_freqs / rope_factors_*)."""
    factors = gguf_tensor(path, t).dequantize().reshape(-1)
    if factors.shape[0] != rope_dims // 2 or not (np.isfinite(factors).all() and
                                                  (factors > 0).all()):
        raise ModelLoadError(f'{path}: tensor {t.name} has {factors.shape[0]} '
                             f'values, expected {rope_dims // 2} positive ones (rotary dims '
                             '/ 2); the GGUF contradicts its own header: convert the model again')
    return tuple(float(f) for f in factors)


def _f32(value) -> float:
    """Return a GGUF float32 as its shortest round-trip decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def gguf_tensor(path: pathlib.Path, t) -> SourceTensor:
    """Return a GGUF reader tensor as a SourceTensor (its bytes mapped, not copied)."""
    qname = t.tensor_type.name
    if qname not in SUPPORTED_GGML_TYPES:
        raise UnsupportedModelError(
            f'{path}: tensor {t.name} has type {qname}, which the converter does not read '
            f'(supported: {", ".join(SUPPORTED_GGML_TYPES)}); pick a GGUF quantized as '
            'Q4_0/Q4_1/Q4_K_M/Q8_0 or re-quantize it with llama-quantize')
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = t.data
    expected = t.n_bytes
    if data.nbytes != expected:
        raise ModelLoadError(f'{path}: tensor {t.name} is truncated ({data.nbytes} of '
                             f'{expected} bytes from byte {t.data_offset}); download the file '
                             'again')
    if qname == 'BF16':
        data = data.view(np.uint16)
    return SourceTensor(t.name, qname, shape, data)


def _write_gguf_tokenizer(reader, out_dir: pathlib.Path) -> dict:
    from edge_llm_ros.convert.gguf_tokenizer import write_tokenizer_files
    specials = write_tokenizer_files(reader, out_dir) or {}
    bos = specials.get('bos_token_id', gguf_field(reader, 'tokenizer.ggml.bos_token_id'))
    eos_ids: List[int] = list(specials.get('eos_token_ids', []))
    for k in ('tokenizer.ggml.eos_token_id', 'tokenizer.ggml.eot_token_id',
              'tokenizer.ggml.eom_token_id'):
        v = gguf_field(reader, k)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    add_bos = specials.get('add_bos_token',
                           gguf_field(reader, 'tokenizer.ggml.add_bos_token', False))
    return {'bos_token_id': None if bos is None else int(bos),
            'eos_token_ids': [int(e) for e in eos_ids], 'add_bos_token': bool(add_bos)}


# --- HF safetensors ---------------------------------------------------------------------------

def load_hf_folder(folder: pathlib.Path) -> Checkpoint:
    cfg_path = folder / 'config.json'
    if not cfg_path.is_file():
        raise ModelLoadError(f'{folder}: config.json is missing; an HF checkpoint folder needs '
                             'config.json, *.safetensors and tokenizer.json')
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f'{cfg_path}: not valid JSON ({exc})') from exc
    model_type = cfg.get('model_type')
    from edge_llm_ros.convert import gemma4
    if model_type in gemma4.HF_MODEL_TYPES:
        from edge_llm_ros.convert.gemma4 import load_gemma4_hf
        return load_gemma4_hf(folder, cfg, read_safetensors,
                              lambda out_dir: write_hf_tokenizer(folder, cfg, out_dir))
    from edge_llm_ros.convert import granite
    if model_type in granite.HF_MODEL_TYPES:
        return granite.load_granite_hf(folder, cfg, read_safetensors,
                                       lambda out_dir: write_hf_tokenizer(folder, cfg, out_dir))
    from edge_llm_ros.convert import qwen35
    if model_type in qwen35.HF_MODEL_TYPES + qwen35.MOE_MODEL_TYPES:
        return qwen35.load_qwen35_hf(folder, cfg, read_safetensors,
                                     lambda out_dir: write_hf_tokenizer(folder, cfg, out_dir))
    if 'text_config' in cfg:
        raise UnsupportedModelError(f'{folder}: a multimodal checkpoint ({model_type}); '
                                    'convert the text model (e.g. its GGUF, or the '
                                    'Gemma3ForCausalLM / *-text checkpoint)')
    family = architecture(HF_MODEL_TYPES.get(model_type, model_type), f'{folder} (model_type)')
    arch = family.name
    hybrid: dict = {}
    if family.conv_layers:
        cfg, hybrid = _hf_lfm2(folder, cfg)
    act = cfg.get('hidden_activation') or cfg.get('hidden_act') or 'silu'
    if _HF_ACTIVATIONS.get(act) != family.activation:
        raise UnsupportedModelError(f'{folder}: activation {act!r} is not what {arch} uses '
                                    f'({family.activation}); the checkpoint is not a plain '
                                    f'{arch} model')
    raw = hf_model_prefixed(read_safetensors(safetensors_files(folder)))
    heads = int(cfg['num_attention_heads'])
    hidden = int(cfg['hidden_size'])
    head_dim = int(cfg.get('head_dim') or hidden // heads)
    rope_dims = int(float(cfg.get('partial_rotary_factor', 1.0)) * hidden) // heads
    theta = float(cfg.get('rope_theta', 10000.0))
    ctx = int(cfg.get('max_position_embeddings', 2048))
    scaling = cfg.get('rope_scaling')
    if scaling and cfg.get('original_max_position_embeddings'):  # Phi-3 keeps it at the top
        scaling = dict(scaling, original_max_position_embeddings=scaling.get(
            'original_max_position_embeddings', cfg['original_max_position_embeddings']))
    rope = _hf_rope_scaling(folder, scaling, rope_dims, theta, ctx)
    final_norms = _HF_FINAL_NORMS.get(arch, ('model.norm.weight',))
    wanted = {'embed': 'model.embed_tokens.weight',
              'final_norm': next((n for n in final_norms if n in raw), final_norms[0]),
              'lm_head': 'lm_head.weight'}
    layers = int(cfg['num_hidden_layers'])
    layer_names = {'gemma3': _HF_GEMMA3_LAYER, 'lfm2': _HF_LFM2_LAYER}.get(arch, _HF_LAYER)
    for i in range(layers):
        for role, suffix in layer_names.items():
            wanted[f'{i}.{role}'] = f'model.layers.{i}.{suffix}'
    tensors = {k: raw[n] for k, n in wanted.items() if n in raw}
    tied = bool(cfg.get('tie_word_embeddings', family.embed_scale)) or 'lm_head' not in tensors
    if tied:
        tensors.pop('lm_head', None)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{folder}: model.embed_tokens.weight is missing')
    if family.hf_norm_shift:
        for k, t in tensors.items():
            if k.endswith('norm'):
                t.shift = family.hf_norm_shift
    n_ff = int(cfg['intermediate_size'])
    for i in range(layers):
        if f'{i}.gate_up' in tensors:
            tensors[f'{i}.up'] = tensors.pop(f'{i}.gate_up')
        conv = tensors.get(f'{i}.conv')
        if conv is not None and len(conv.shape) == 3 and conv.shape[1] == 1:
            # nn.Conv1d's depthwise [channels, 1, kernel], squeezed as llama.cpp's converter
            # does (the GGUF's [channels, kernel]).
            shape = (conv.shape[0], conv.shape[2])
            tensors[f'{i}.conv'] = SourceTensor(conv.name, conv.qtype, shape,
                                                np.asarray(conv.data).reshape(shape))
    kv_heads = int(cfg.get('num_key_value_heads', heads))
    _split_fused(folder, tensors, layers, heads * head_dim, kv_heads * head_dim, n_ff)
    extras = _family_extras(family, hidden, heads, head_dim, layers, 0, (), 0.0,
                            float(cfg.get('final_logit_softcapping') or 0.0))
    if arch == 'gemma3':
        extras.update(_hf_gemma3(cfg, layers, rope))
    if family.no_rope_period:
        extras['nope_layers'] = _hf_nope_layers(folder, cfg, layers, family.no_rope_period)
    extras.update(hybrid)
    spec = ModelSpec(
        architecture=arch, name=folder.name, num_layers=layers, hidden_size=hidden,
        intermediate_size=n_ff, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=tensors['embed'].shape[0], max_position_embeddings=ctx,
        rope_theta=theta, rms_norm_eps=float(cfg.get('rms_norm_eps', 1e-6)),
        tied_embeddings=tied, attention_bias='0.q_bias' in tensors, qk_norm=family.qk_norm,
        rope_scale=rope['scale'], rope_freq_factors=rope['factors'],
        rope_dims=0 if rope_dims == head_dim else rope_dims,
        rope_attn_factor=rope['attn_factor'], rope_factors_max_context=rope['factors_ctx'],
        **extras)

    def write_tokenizer(out_dir: pathlib.Path) -> dict:
        return write_hf_tokenizer(folder, cfg, out_dir)

    ckpt = Checkpoint(spec, folder, tensors, write_tokenizer)
    _check_shapes(ckpt)
    return ckpt


def hf_model_prefixed(raw: Dict[str, SourceTensor]) -> Dict[str, SourceTensor]:
    """Return the tensors under 'model.'-prefixed names where a folder saved them bare.

    A base model saved without its head (transformers' Qwen3Model, Gemma3TextModel: the
    Qwen3-Embedding and EmbeddingGemma folders) names its tensors embed_tokens.weight,
    layers.{i}...., norm.weight; a *ForCausalLM folder names them model.....
    """
    if 'model.embed_tokens.weight' in raw or 'embed_tokens.weight' not in raw:
        return raw
    return {k if k.startswith('lm_head.') else 'model.' + k: t for k, t in raw.items()}


def _hf_nope_layers(folder: pathlib.Path, cfg: dict, layers: int,
                    period: int) -> Tuple[bool, ...]:
    """Return the layers without RoPE of an HF SmolLM3 config.

    no_rope_layers holds 1 for a layer that rotates and 0 for one that does not; without it,
    every no_rope_layer_interval-th layer (default: the family's period) does not.
    """
    flags = cfg.get('no_rope_layers')
    if flags is None:
        step = int(cfg.get('no_rope_layer_interval') or period)
        return tuple((i + 1) % step == 0 for i in range(layers))
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f'{folder}: no_rope_layers must hold one 0 or 1 per layer '
                             f'({layers}); got {flags!r}: the config.json is corrupt')
    return tuple(f == 0 for f in flags)


# HF hidden_act / hidden_activation -> the family's activation name.
_HF_ACTIVATIONS = {'silu': 'silu', 'swish': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh'}


def _hf_gemma3(cfg: dict, layers: int, rope: dict) -> dict:
    """Gemma 3's attention extras from an HF config (as its modeling code reads them)."""
    out = {'attention_scale': float(cfg.get('query_pre_attn_scalar', 256)) ** -0.5}
    window = int(cfg.get('sliding_window') or 0)
    if window:
        types = cfg.get('layer_types')
        if types:
            local = tuple(t == 'sliding_attention' for t in types)
        else:
            local = swa_layers(int(cfg.get('sliding_window_pattern', 6)), layers)
        out.update(sliding_window=window, local_layers=local,
                   local_rope_theta=float(cfg.get('rope_local_base_freq', 10000.0)),
                   final_logit_softcap=0.0)
    return out


def _hf_lfm2(folder: pathlib.Path, cfg: dict) -> Tuple[dict, dict]:
    """Read an LFM2 config (transformers' Lfm2Config) for the HF reader.

    Returns the config with the keys the reader takes (intermediate_size, rms_norm_eps,
    rope_theta, tie_word_embeddings, ...) set to what transformers builds, and the ModelSpec's
    layer_kinds and conv_kernel. Refuses embedding models and kernels as the GGUF reader does,
    and what llama.cpp's lfm2 graph has no place for (conv biases).
    """
    src = folder / 'config.json'
    if ({'Lfm2Model', 'Lfm2BidirectionalModel'} & set(cfg.get('architectures') or ())
            or (folder / '1_Dense').is_dir()):
        raise UnsupportedModelError(f'{folder}: an LFM2 embedding model (bidirectional or '
                                    'ColBERT) is not a text decoder; convert a generative '
                                    'LFM2 checkpoint (Lfm2ForCausalLM)')
    layers = int(cfg['num_hidden_layers'])
    types = cfg.get('layer_types')
    if types is None:
        # Older configs list the attention layers; neither key: all attention (transformers).
        idxs = cfg.get('full_attn_idxs')
        attn = set(range(layers)) if idxs is None else {int(i) for i in idxs}
        if not attn <= set(range(layers)):
            raise ModelLoadError(f'{src}: full_attn_idxs {sorted(attn)} name layers beyond '
                                 f'num_hidden_layers {layers}: the config contradicts itself; '
                                 'download config.json again')
        types = ['full_attention' if i in attn else 'conv' for i in range(layers)]
    if not isinstance(types, list):
        raise ModelLoadError(f'{src}: layer_types is {types!r}, not a list of layer types; '
                             'download config.json again')
    if len(types) != layers:
        raise ModelLoadError(f'{src}: layer_types has {len(types)} entries for '
                             f'num_hidden_layers {layers}: the config contradicts itself; '
                             'download config.json again')
    unknown = sorted({str(t) for t in types} - set(_HF_LFM2_KINDS))
    if unknown:
        raise UnsupportedModelError(f'{src}: layer_types {unknown} are not LFM2 layers (conv, '
                                    'full_attention); the checkpoint is not a plain LFM2 '
                                    'decoder: convert an LFM2 / LFM2.5 text model')
    if 'full_attention' not in types:
        raise UnsupportedModelError(f'{src}: no full_attention layer; the converter builds '
                                    'LFM2 with at least one attention layer')
    kernel = int(cfg.get('conv_L_cache', 3))
    if not 2 <= kernel <= MAX_CONV_KERNEL:
        raise UnsupportedModelError(f'{src}: conv_L_cache {kernel} is not a conv kernel of '
                                    f'2..{MAX_CONV_KERNEL} positions; the converter builds '
                                    "those (LFM2's is 3)")
    if cfg.get('conv_bias'):
        raise UnsupportedModelError(f"{src}: conv_bias is set; llama.cpp's lfm2 graph and "
                                    'this converter have no conv biases: convert an LFM2 '
                                    'checkpoint without them (every LFM2 / LFM2.5 release)')
    # transformers' Lfm2MLP: 2/3 of the configured width, times the multiplier, rounded up to
    # block_multiple_of. llama.cpp's converter rounds even without a multiplier; LFM2 releases
    # set one (1.0), so both give the same width.
    n_ff = int(cfg.get('block_ff_dim', cfg.get('intermediate_size')))
    if cfg.get('block_auto_adjust_ff_dim', True):
        n_ff = int(2 * n_ff / 3)
        multiplier = cfg.get('block_ffn_dim_multiplier', 1.0)
        if multiplier is not None:
            multiple = int(cfg.get('block_multiple_of', 256))
            n_ff = multiple * ((int(multiplier * n_ff) + multiple - 1) // multiple)
    rope = cfg.get('rope_parameters') or {}   # transformers 5's form
    out = dict(cfg, intermediate_size=n_ff, rms_norm_eps=cfg.get('norm_eps', 1e-5),
               rope_theta=cfg.get('theta', cfg.get('rope_theta', rope.get('rope_theta', 1e6))),
               rope_scaling=cfg.get('rope_scaling') or rope or None,
               tie_word_embeddings=cfg.get('tie_word_embeddings',
                                           cfg.get('tie_embedding', True)),
               max_position_embeddings=cfg.get('max_position_embeddings', 128000))
    return out, {'layer_kinds': tuple(_HF_LFM2_KINDS[t] for t in types),
                 'conv_kernel': kernel}


def _hf_rope_scaling(folder: pathlib.Path, scaling: Optional[dict], rope_dims: int,
                     theta: float, ctx: int) -> dict:
    """Return the RoPE scaling of an HF config's rope_scaling, as ModelSpec fields.

    As llama.cpp's converter turns it into GGUF metadata (linear: freq_scale; llama3:
    rope_freqs; longrope: short factors and attn_factor; see _rope_factors).
    """
    out = {'scale': 1.0, 'factors': None, 'attn_factor': 1.0, 'factors_ctx': 0}
    kind = (scaling or {}).get('rope_type', (scaling or {}).get('type')) or 'default'
    if kind == 'default':
        return out
    if kind == 'linear':
        out['scale'] = 1.0 / float(scaling['factor'])
    elif kind == 'llama3':
        out['factors'] = llama3_rope_factors(
            rope_dims, theta, float(scaling['factor']), float(scaling['low_freq_factor']),
            float(scaling['high_freq_factor']),
            int(scaling['original_max_position_embeddings']))
    elif kind in ('longrope', 'su'):
        orig = int(scaling.get('original_max_position_embeddings') or ctx)
        ratio = ctx / orig
        if ratio > 1.0:
            out['attn_factor'] = _f32(np.sqrt(1 + np.log(ratio) / np.log(orig)))
        out['factors'] = tuple(float(f) for f in scaling['short_factor'])
        out['factors_ctx'] = orig
        if len(out['factors']) != rope_dims // 2:
            raise ModelLoadError(f'{folder}: rope_scaling.short_factor has '
                                 f'{len(out["factors"])} values, expected {rope_dims // 2}')
    else:
        raise UnsupportedModelError(f'{folder}: rope_scaling type {kind!r} is not supported '
                                    '(supported: default, linear, llama3, longrope); use a '
                                    'checkpoint without it')
    return out


def safetensors_files(folder: pathlib.Path) -> List[pathlib.Path]:
    """Return the folder's *.safetensors files, sorted (a typed error when it has none)."""
    files = sorted(folder.glob('*.safetensors'))
    if not files:
        raise ModelLoadError(f'{folder}: no *.safetensors files; PyTorch .bin checkpoints are '
                             'not read (convert them to safetensors first)')
    return files


def read_safetensors(files: List[pathlib.Path]) -> Dict[str, SourceTensor]:
    try:
        from safetensors import deserialize, safe_open
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelLoadError('reading HF checkpoints needs the `safetensors` package: '
                             'pip install safetensors') from exc
    out: Dict[str, SourceTensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework='numpy') as sf:
                keys = list(sf.keys())
                dtypes = {k: sf.get_slice(k).get_dtype() for k in keys}
                for k in keys:
                    if dtypes[k] in ('F32', 'F16'):
                        arr = sf.get_tensor(k)
                        out[k] = SourceTensor(k, dtypes[k], tuple(arr.shape), arr)
            if any(d == 'BF16' for d in dtypes.values()):
                # numpy has no bfloat16: take the raw bytes from the library and widen them.
                for name, info in deserialize(f.read_bytes()):
                    if info['dtype'] == 'BF16':
                        arr = np.frombuffer(info['data'], dtype=np.uint16)
                        out[name] = SourceTensor(name, 'BF16', tuple(info['shape']),
                                                 arr.reshape(info['shape']))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f'{f}: not a readable safetensors file ({exc}); download it '
                                 'again') from exc
        unsupported = {k: d for k, d in dtypes.items() if d not in ('F32', 'F16', 'BF16')}
        if unsupported:
            name, dtype = next(iter(unsupported.items()))
            raise UnsupportedModelError(f'{f}: tensor {name} has dtype {dtype}; only F32/F16/'
                                        'BF16 safetensors are converted')
    return out


def write_hf_tokenizer(folder: pathlib.Path, cfg: dict, out_dir: pathlib.Path,
                       chat: bool = True) -> dict:
    """Copy tokenizer.json (and, for a chat model, its chat template); return the specials."""
    import shutil
    tok_json = folder / 'tokenizer.json'
    if not tok_json.is_file():
        raise ModelLoadError(f'{folder}: tokenizer.json is missing (a fast HF tokenizer is '
                             'needed; save it with transformers: tokenizer.save_pretrained)')
    shutil.copyfile(tok_json, out_dir / 'tokenizer.json')
    tcfg = {}
    if (folder / 'tokenizer_config.json').is_file():
        tcfg = json.loads((folder / 'tokenizer_config.json').read_text())
    template = tcfg.get('chat_template')
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
        by_name = {t.get('name'): t.get('template') for t in template}
        template = by_name.get('default') or next(iter(by_name.values()), None)
    if template is None and (folder / 'chat_template.jinja').is_file():
        template = (folder / 'chat_template.jinja').read_text()
    if template is None and chat:
        raise ModelLoadError(f'{folder}: no chat template (tokenizer_config.json has no '
                             'chat_template); use an instruct checkpoint')
    if chat:
        (out_dir / 'chat_template.jinja').write_text(template)
    vocab = hf_token_ids(tok_json)
    gen = {}
    if (folder / 'generation_config.json').is_file():
        gen = json.loads((folder / 'generation_config.json').read_text())

    def token_id(value):
        if isinstance(value, dict):
            value = value.get('content')
        return vocab.get(value) if isinstance(value, str) else value

    bos = gen.get('bos_token_id', cfg.get('bos_token_id', token_id(tcfg.get('bos_token'))))
    eos = gen.get('eos_token_id', cfg.get('eos_token_id'))
    eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    tok_eos = token_id(tcfg.get('eos_token'))
    if tok_eos is not None and tok_eos not in eos_ids:
        eos_ids.append(tok_eos)
    pad = cfg.get('pad_token_id', token_id(tcfg.get('pad_token')))
    return {'bos_token_id': None if bos is None else int(bos),
            'eos_token_ids': [int(e) for e in eos_ids],
            'add_bos_token': bool(tcfg.get('add_bos_token', False)),
            'add_eos_token': bool(tcfg.get('add_eos_token', False)),
            'pad_token_id': None if pad is None else int(pad)}


def hf_token_ids(tok_json: pathlib.Path) -> Dict[str, int]:
    data = json.loads(tok_json.read_text())
    ids = dict(data.get('model', {}).get('vocab', {}) or {})
    for t in data.get('added_tokens', []):
        ids[t['content']] = t['id']
    return ids


# --- checks ------------------------------------------------------------------------------------

def _check_shapes(ckpt: Checkpoint) -> None:
    s = ckpt.spec
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    expect = {'embed': (s.vocab_size, s.hidden_size), 'final_norm': (s.hidden_size,)}
    if not s.tied_embeddings:
        expect['lm_head'] = (s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        expect.update({
            f'{i}.attn_norm': (s.hidden_size,), f'{i}.ffn_norm': (s.hidden_size,),
            f'{i}.gate': (s.intermediate_size, s.hidden_size),
            f'{i}.up': (s.intermediate_size, s.hidden_size),
            f'{i}.down': (s.hidden_size, s.intermediate_size)})
        if s.is_recurrent(i) and s.mamba_heads:
            inner, ch = s.mamba_heads * s.mamba_head_dim, s.mamba_channels
            expect.update({f'{i}.ssm_z': (inner, s.hidden_size),
                           f'{i}.ssm_xbc': (ch, s.hidden_size),
                           f'{i}.ssm_dtp': (s.mamba_heads, s.hidden_size),
                           f'{i}.ssm_conv': (ch, s.conv_kernel),
                           **({f'{i}.ssm_conv_bias': (ch,)} if ckpt.has(f'{i}.ssm_conv_bias')
                              else {}),
                           f'{i}.ssm_dt': (s.mamba_heads,), f'{i}.ssm_a': (s.mamba_heads,),
                           f'{i}.ssm_d': (s.mamba_heads,), f'{i}.ssm_norm': (inner,),
                           f'{i}.ssm_out': (s.hidden_size, inner)})
            continue
        if s.is_recurrent(i):
            d, hk, hv = s.ssm_head_dim, s.ssm_k_heads, s.ssm_v_heads
            expect.update({f'{i}.gdn_qkv': ((2 * hk + hv) * d, s.hidden_size),
                           f'{i}.gdn_z': (hv * d, s.hidden_size),
                           f'{i}.ssm_conv': ((2 * hk + hv) * d, s.conv_kernel),
                           f'{i}.ssm_dt': (hv,), f'{i}.ssm_a': (hv,),
                           f'{i}.ssm_beta': (hv, s.hidden_size),
                           f'{i}.ssm_alpha': (hv, s.hidden_size),
                           f'{i}.ssm_norm': (d,), f'{i}.ssm_out': (s.hidden_size, hv * d)})
            continue
        if s.is_conv(i):
            expect.update({f'{i}.in_proj': (3 * s.hidden_size, s.hidden_size),
                           f'{i}.conv': (s.hidden_size, s.conv_kernel),
                           f'{i}.out_proj': (s.hidden_size, s.hidden_size)})
            continue
        expect.update({
            f'{i}.q': (q_out, s.hidden_size), f'{i}.k': (kv_out, s.hidden_size),
            f'{i}.v': (kv_out, s.hidden_size), f'{i}.o': (s.hidden_size, q_out)})
        if s.attention_bias:
            expect.update({f'{i}.q_bias': (q_out,), f'{i}.k_bias': (kv_out,),
                           f'{i}.v_bias': (kv_out,)})
        if s.qk_norm:
            expect.update({f'{i}.q_norm': (s.head_dim,), f'{i}.k_norm': (s.head_dim,)})
        if s.post_norms:
            expect.update({f'{i}.post_attn_norm': (s.hidden_size,),
                           f'{i}.post_ffn_norm': (s.hidden_size,)})
    for k, shape in expect.items():
        t = ckpt.tensor(k)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f'{ckpt.source_path}: tensor {t.name} has shape {t.shape}, '
                                 f"but the header's hyper-parameters need {shape}: the file "
                                 'contradicts itself; convert the model again')
        if (len(shape) == 1 or k.endswith(('.conv', '.ssm_conv'))) and \
                t.qtype not in ('F32', 'F16', 'BF16'):
            raise UnsupportedModelError(f'{ckpt.source_path}: vector {t.name} is stored as '
                                        f'{t.qtype}; only float vectors are supported')

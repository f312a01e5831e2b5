"""Read a Qwen3.5 (dense) HF safetensors folder into the form the qwen35 GGUF reader gives.

As llama.cpp's converter (convert_hf_to_gguf.py, Qwen3_5TextModel) turns the checkpoint into
a GGUF, so that a folder and the GGUF made of it convert to the same graph:

* Qwen3_5ForConditionalGeneration's text model (config text_config, tensors under
  model.language_model.) or Qwen3_5ForCausalLM's (model.); the vision tower and the MTP
  block are not read;
* the RMSNorm weights are stored minus one (x * (1 + w)); all of them but the DeltaNet's
  gated norm (linear_attn.norm) get the one back;
* A_log becomes ssm_a = -exp(A_log); conv1d's [channels, 1, kernel] is squeezed;
* with fewer key than value heads, the value heads are reordered from grouped by key head
  (HF: value head h reads key head h // (v / k)) to tiled (value head h reads key head
  h % k, as ggml broadcasts and the op library reads them): the V rows of in_proj_qkv, the
  rows of in_proj_z / in_proj_a / in_proj_b, A_log, dt_bias, the V channels of conv1d and the
  columns of out_proj. Row reorders stay lazy (SourceTensor.row_order).

The tensors then go through the GGUF reader's own qwen35 step (checkpoint._qwen35_tensors:
the q / output-gate split and the partial-rotary reorder).
"""
import pathlib
from typing import Dict, Optional

import numpy as np

from edge_llm_ros.convert.architectures import ARCHITECTURES
from edge_llm_ros.convert.checkpoint import (_check_shapes, _family_extras, _qwen35_tensors,
                                             ATTENTION, Checkpoint, hf_layer_kinds,
                                             MAX_CONV_KERNEL, ModelSpec, RECURRENT,
                                             safetensors_files, SourceTensor)
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

HF_MODEL_TYPES = ('qwen3_5', 'qwen3_5_text')
MOE_MODEL_TYPES = ('qwen3_5_moe', 'qwen3_5_moe_text')
# Canonical key (as the GGUF reader names it before _qwen35_tensors) -> HF name in a layer.
_HF_LAYER = {'attn_norm': 'input_layernorm.weight',
             'post_attn_norm': 'post_attention_layernorm.weight',
             'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
             'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
             'q_norm': 'self_attn.q_norm.weight', 'k_norm': 'self_attn.k_norm.weight',
             'gate': 'mlp.gate_proj.weight', 'up': 'mlp.up_proj.weight',
             'down': 'mlp.down_proj.weight', 'qkv': 'linear_attn.in_proj_qkv.weight',
             'gdn_z': 'linear_attn.in_proj_z.weight', 'ssm_conv': 'linear_attn.conv1d.weight',
             'ssm_dt': 'linear_attn.dt_bias', 'ssm_a': 'linear_attn.A_log',
             'ssm_beta': 'linear_attn.in_proj_b.weight',
             'ssm_alpha': 'linear_attn.in_proj_a.weight', 'ssm_norm': 'linear_attn.norm.weight',
             'ssm_out': 'linear_attn.out_proj.weight'}
# Norms stored minus one (Qwen3NextRMSNorm); linear_attn.norm (ssm_norm) is not one of them.
_SHIFTED = ('attn_norm', 'post_attn_norm', 'q_norm', 'k_norm')
_LAYER_KINDS = {'linear_attention': RECURRENT, 'full_attention': ATTENTION}


def tiled_v_order(k_heads: int, v_heads: int, size: int) -> np.ndarray:
    """Return the rows of `v_heads` heads of `size` taken in tiled order (llama.cpp's reorder).

    Row j of the result is row order[j] of the grouped layout [k0: v0..v(r-1), k1: ...].
    """
    r = v_heads // k_heads
    return np.arange(v_heads * size).reshape(k_heads, r, size).transpose(1, 0, 2).reshape(-1)


def _float(t: SourceTensor) -> np.ndarray:
    """Return a float tensor's values as float32 (BF16 widened)."""
    return t.dequantize()


def _as_source(t: SourceTensor, values: np.ndarray) -> SourceTensor:
    """Return float32 `values` as a SourceTensor named as `t`, of their own shape."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return SourceTensor(t.name, 'F32', tuple(values.shape), values)


def load_qwen35_hf(folder: pathlib.Path, cfg: dict, read_safetensors, write_tokenizer
                   ) -> Checkpoint:
    """Read a Qwen3.5 dense HF folder as llama.cpp's converter reads it."""
    src = folder / 'config.json'
    text = cfg.get('text_config') or cfg
    prefix = 'model.language_model.' if 'text_config' in cfg else 'model.'
    if cfg.get('model_type') in MOE_MODEL_TYPES or text.get('num_experts'):
        raise UnsupportedModelError(f'{src}: a Qwen3.5 mixture-of-experts model is not '
                                    'converted; use a dense Qwen3.5 checkpoint (0.8B-27B)')
    act = text.get('hidden_act') or 'silu'
    if act not in ('silu', 'swish'):
        raise UnsupportedModelError(f'{src}: activation {act!r} is not the one of Qwen3.5 '
                                    '(silu)')
    layers = int(text['num_hidden_layers'])
    types = text.get('layer_types')
    if types is None:
        interval = int(text.get('full_attention_interval', 4))
        types = ['full_attention' if (i + 1) % interval == 0 else 'linear_attention'
                 for i in range(layers)]
    kinds = hf_layer_kinds(src, types, layers, _LAYER_KINDS)
    kernel = int(text.get('linear_conv_kernel_dim', 4))
    d_k = int(text.get('linear_key_head_dim', 128))
    d_v = int(text.get('linear_value_head_dim', 128))
    k_heads = int(text.get('linear_num_key_heads', 16))
    v_heads = int(text.get('linear_num_value_heads', 32))
    if not (2 <= kernel <= MAX_CONV_KERNEL and d_k == d_v and 0 < d_k <= 256 and
            k_heads > 0 and v_heads % k_heads == 0):
        raise UnsupportedModelError(
            f'{src}: linear_conv_kernel_dim {kernel}, key/value head dims {d_k}/{d_v}, key/'
            f'value heads {k_heads}/{v_heads} are not Gated DeltaNet layers the op library '
            f'runs (kernel 2..{MAX_CONV_KERNEL}, equal head dims of at most 256, value heads '
            'a multiple of key heads)')
    if text.get('attn_output_gate') is False:
        raise UnsupportedModelError(f'{src}: attention without its output gate is not '
                                    'Qwen3.5 (attn_output_gate false)')
    raw = read_safetensors(safetensors_files(folder))
    wanted = {'embed': prefix + 'embed_tokens.weight', 'final_norm': prefix + 'norm.weight',
              'lm_head': 'lm_head.weight'}
    for i in range(layers):
        for role, suffix in _HF_LAYER.items():
            wanted[f'{i}.{role}'] = f'{prefix}layers.{i}.{suffix}'
    tensors = {k: raw[n] for k, n in wanted.items() if n in raw}
    if text.get('tie_word_embeddings', cfg.get('tie_word_embeddings', False)):
        tensors.pop('lm_head', None)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{folder}: {prefix}embed_tokens.weight is missing')
    for k, t in tensors.items():
        if k == 'final_norm' or k.split('.', 1)[-1] in _SHIFTED:
            t.shift = 1.0
    _linear_attention(tensors, kinds, k_heads, v_heads, d_k)
    heads = int(text['num_attention_heads'])
    kv_heads = int(text.get('num_key_value_heads', heads))
    hidden = int(text['hidden_size'])
    head_dim = int(text.get('head_dim') or hidden // heads)
    rope = text.get('rope_parameters') or text.get('rope_scaling') or {}
    factor = float(rope.get('partial_rotary_factor', text.get('partial_rotary_factor', 0.25)))
    rope_dims = int(head_dim * factor)
    if not (0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise UnsupportedModelError(f'{src}: partial_rotary_factor {factor} does not give an '
                                    f'even rotary size within the head size {head_dim}')
    _qwen35_tensors(tensors, kinds, heads, kv_heads, head_dim, rope_dims)
    family = ARCHITECTURES['qwen35']
    spec = ModelSpec(
        architecture='qwen35', name=folder.name, num_layers=layers, hidden_size=hidden,
        intermediate_size=int(text['intermediate_size']), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=tensors['embed'].shape[0],
        max_position_embeddings=int(text.get('max_position_embeddings', 262144)),
        rope_theta=float(rope.get('rope_theta', text.get('rope_theta', 1e7))),
        rms_norm_eps=float(text.get('rms_norm_eps', 1e-6)),
        tied_embeddings='lm_head' not in tensors, attention_bias=False,
        qk_norm=family.qk_norm, rope_dims=0 if rope_dims == head_dim else rope_dims,
        layer_kinds=kinds, conv_kernel=kernel, ssm_k_heads=k_heads, ssm_v_heads=v_heads,
        ssm_head_dim=d_k, gated_attention=True, rotary_permuted=True,
        **_family_extras(family, hidden, heads, head_dim, layers, 0, (), 0.0, 0.0))
    ckpt = Checkpoint(spec, folder, tensors, write_tokenizer)
    _check_shapes(ckpt)
    return ckpt


def recurrent_a_and_conv(tensors: Dict[str, SourceTensor], p: str,
                         head_order: Optional[np.ndarray] = None,
                         conv_rows: Optional[np.ndarray] = None) -> None:
    """Store a recurrent layer's A_log as the GGUF's A, its Conv1d kernel [C, 1, K] as [C, K].

    Shared by the DeltaNet (qwen35) and Mamba-2 (granite) layers; head_order and conv_rows
    reorder the heads and channels where the GGUF tiles them otherwise.
    """
    a = tensors.get(p + 'ssm_a')
    if a is not None:
        values = ssm_a_of(a)
        tensors[p + 'ssm_a'] = _as_source(a, values if head_order is None else values[head_order])
    conv = tensors.get(p + 'ssm_conv')
    if conv is not None and len(conv.shape) == 3 and conv.shape[1] == 1:
        values = _float(conv).reshape(conv.shape[0], conv.shape[2])
        if conv_rows is not None and values.shape[0] == conv_rows.shape[0]:
            values = values[conv_rows]
        tensors[p + 'ssm_conv'] = _as_source(conv, values)


def _linear_attention(tensors: Dict[str, SourceTensor], kinds, k_heads: int, v_heads: int,
                      d: int) -> None:
    """Turn each DeltaNet layer's HF tensors into the GGUF's (A_log, conv squeeze, V order)."""
    reorder = v_heads != k_heads
    v_rows = tiled_v_order(k_heads, v_heads, d)
    v_heads_order = tiled_v_order(k_heads, v_heads, 1)
    qk = 2 * k_heads * d
    conv_rows = np.concatenate([np.arange(qk), qk + v_rows])
    for i, kind in enumerate(kinds):
        if kind != RECURRENT:
            continue
        p = f'{i}.'
        if not reorder:
            recurrent_a_and_conv(tensors, p)
            continue
        recurrent_a_and_conv(tensors, p, v_heads_order, conv_rows)
        dt = tensors.get(p + 'ssm_dt')
        if dt is not None and dt.shape == (v_heads,):
            tensors[p + 'ssm_dt'] = _as_source(dt, _float(dt)[v_heads_order])
        qkv = tensors.get(p + 'qkv')
        if qkv is not None and qkv.shape[0] == qk + v_heads * d:
            qkv.row_order = np.concatenate([np.arange(qk), qk + v_rows])
        for role, order in (('gdn_z', v_rows), ('ssm_beta', v_heads_order),
                            ('ssm_alpha', v_heads_order)):
            t = tensors.get(p + role)
            if t is not None and t.shape[0] == order.shape[0]:
                t.row_order = order
        out = tensors.get(p + 'ssm_out')
        if out is not None and len(out.shape) == 2 and out.shape[1] == v_heads * d:
            tensors[p + 'ssm_out'] = SourceTensor(out.name, out.qtype, out.shape,
                                                  np.ascontiguousarray(out.data[:, v_rows]))


def ssm_a_of(a_log: SourceTensor) -> np.ndarray:
    """Return ssm_a = -exp(A_log), as llama.cpp's converter computes it from a checkpoint.

    Its torch.exp keeps the checkpoint's bfloat16: a BF16 A_log gives bfloat16 rates.
    """
    values = -np.exp(_float(a_log).reshape(-1))
    return _round_bf16(values) if a_log.qtype == 'BF16' else values


def _round_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and widen them back."""
    bits = values.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)

"""Read a Granite 4.0-H (dense) HF safetensors folder into the form the granitehybrid GGUF gives.

As llama.cpp's converter (convert_hf_to_gguf.py, GraniteHybridModel) turns the checkpoint into
a GGUF, so that a folder and the GGUF made of it convert to the same graph:

* GraniteMoeHybridForCausalLM with no experts (Micro): `layer_types` names each layer
  `mamba` or `attention`; the mixture-of-experts variants (H-Tiny, H-Small) are refused;
* the shared MLP's `input_linear` holds the gate rows then the up rows (llama.cpp splits it
  into ffn_gate and ffn_up), `output_linear` is ffn_down;
* a Mamba-2 mixer's `A_log` becomes ssm_a = -exp(A_log) (in bfloat16 when the checkpoint is,
  as torch computes it there), Conv1d's [channels, 1, kernel] is squeezed, `dt_bias` is
  ssm_dt.bias; `in_proj` keeps its z | xBC | dt rows (the GGUF reader's split follows);
* Granite's four multipliers (embedding, residual, attention, logits) as the GGUF's keys,
  rounded to float32 as the GGUF stores them; `position_embedding_type` "nope" is llama.cpp's
  rope.scaling.finetuned false (no RoPE on any layer).
"""
import pathlib
from typing import Dict

import numpy as np

from edge_llm_ros.convert.architectures import ARCHITECTURES
from edge_llm_ros.convert.checkpoint import (_check_shapes, _f32, _family_extras,
                                             _mamba_tensors, ATTENTION, Checkpoint,
                                             GRANITE_DENSE, GRANITE_MOE, hf_layer_kinds,
                                             mamba_shape_runs, MAX_CONV_KERNEL, ModelSpec,
                                             RECURRENT, safetensors_files, SourceTensor)
from edge_llm_ros.convert.qwen35 import recurrent_a_and_conv
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

HF_MODEL_TYPES = ('granitemoehybrid',)
# Canonical key (as the GGUF reader names it) -> HF name in a layer.
_HF_LAYER = {'attn_norm': 'input_layernorm.weight', 'ffn_norm': 'post_attention_layernorm.weight',
             'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
             'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
             'gate_up': 'shared_mlp.input_linear.weight',
             'down': 'shared_mlp.output_linear.weight',
             'ssm_in': 'mamba.in_proj.weight', 'ssm_conv': 'mamba.conv1d.weight',
             'ssm_conv_bias': 'mamba.conv1d.bias', 'ssm_dt': 'mamba.dt_bias',
             'ssm_a': 'mamba.A_log', 'ssm_d': 'mamba.D', 'ssm_norm': 'mamba.norm.weight',
             'ssm_out': 'mamba.out_proj.weight'}
_LAYER_KINDS = {'mamba': RECURRENT, 'attention': ATTENTION}


def load_granite_hf(folder: pathlib.Path, cfg: dict, read_safetensors, write_tokenizer
                    ) -> Checkpoint:
    """Read a Granite 4.0-H dense HF folder as llama.cpp's converter reads it."""
    src = folder / 'config.json'
    if int(cfg.get('num_local_experts', 0) or 0) > 0:
        raise UnsupportedModelError(
            f'{src}: a {GRANITE_MOE} checkpoint (num_local_experts '
            f'{cfg["num_local_experts"]}): mixture-of-experts layers are not supported; '
            f'supported: {GRANITE_DENSE}')
    act = cfg.get('hidden_act') or 'silu'
    if act not in ('silu', 'swish'):
        raise UnsupportedModelError(f'{src}: activation {act!r} is not the one of Granite '
                                    '4.0-H (silu)')
    if cfg.get('mamba_proj_bias'):
        raise UnsupportedModelError(f'{src}: Mamba-2 projections with biases '
                                    '(mamba_proj_bias true) are not the layers of Granite 4.0-H')
    layers = int(cfg['num_hidden_layers'])
    kinds = hf_layer_kinds(src, cfg.get('layer_types'), layers, _LAYER_KINDS)
    hidden = int(cfg['hidden_size'])
    kernel = int(cfg.get('mamba_d_conv', 4))
    state = int(cfg.get('mamba_d_state', 128))
    groups = int(cfg.get('mamba_n_groups', 1))
    m_heads = int(cfg.get('mamba_n_heads', 128))
    inner = int(cfg.get('mamba_expand', 2)) * hidden
    if not mamba_shape_runs(kernel, state, groups, m_heads, inner):
        raise UnsupportedModelError(
            f'{src}: mamba_d_conv {kernel}, mamba_d_state {state}, mamba_n_groups {groups}, '
            f'mamba_n_heads {m_heads}, d_inner {inner} are not Mamba-2 layers the op library '
            f'runs (kernel 2..{MAX_CONV_KERNEL}, heads a multiple of groups, heads of at most '
            '256 dims)')
    raw = read_safetensors(safetensors_files(folder))
    wanted = {'embed': 'model.embed_tokens.weight', 'final_norm': 'model.norm.weight',
              'lm_head': 'lm_head.weight'}
    for i in range(layers):
        for role, suffix in _HF_LAYER.items():
            wanted[f'{i}.{role}'] = f'model.layers.{i}.{suffix}'
    tensors = {k: raw[n] for k, n in wanted.items() if n in raw}
    if cfg.get('tie_word_embeddings', False):
        tensors.pop('lm_head', None)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{folder}: model.embed_tokens.weight is missing')
    n_ff = _split_gate_up(src, tensors, layers)
    _mamba_mixers(tensors, kinds)
    fields = {'mamba_heads': m_heads, 'mamba_head_dim': inner // m_heads,
              'mamba_groups': groups, 'mamba_state': state,
              'residual_scale': _f32(cfg.get('residual_multiplier', 0.0) or 0.0),
              'logit_scale': _f32(cfg.get('logits_scaling', 0.0) or 0.0),
              'embed_scale': _f32(cfg.get('embedding_multiplier', 0.0) or 0.0) or 1.0,
              'attention_scale': _f32(cfg.get('attention_multiplier', 0.0) or 0.0)}
    if cfg.get('position_embedding_type', 'rope') == 'nope':
        fields['nope_layers'] = (True,) * layers
    _mamba_tensors(tensors, kinds, fields)
    heads = int(cfg['num_attention_heads'])
    kv_heads = int(cfg.get('num_key_value_heads', heads))
    head_dim = hidden // heads
    family = ARCHITECTURES['granitehybrid']
    spec = ModelSpec(
        architecture='granitehybrid', name=folder.name, num_layers=layers, hidden_size=hidden,
        intermediate_size=n_ff, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=tensors['embed'].shape[0],
        max_position_embeddings=int(cfg.get('max_position_embeddings', 131072)),
        rope_theta=_f32(cfg.get('rope_theta', 10000.0)),
        rms_norm_eps=_f32(cfg.get('rms_norm_eps', 1e-5)),
        tied_embeddings='lm_head' not in tensors, attention_bias=False,
        qk_norm=family.qk_norm, layer_kinds=kinds, conv_kernel=kernel,
        mrope_interleaved=family.mrope_interleaved, **fields,
        **_family_extras(family, hidden, heads, head_dim, layers, 0, (), 0.0, 0.0))
    ckpt = Checkpoint(spec, folder, tensors, write_tokenizer)
    _check_shapes(ckpt)
    return ckpt


def _split_gate_up(src: pathlib.Path, tensors: Dict[str, SourceTensor], layers: int) -> int:
    """Split each shared MLP's input_linear into its gate rows then up rows; return the width."""
    widths = set()
    for i in range(layers):
        t = tensors.pop(f'{i}.gate_up', None)
        if t is None:
            continue
        if len(t.shape) != 2 or t.shape[0] % 2:
            raise ModelLoadError(f'{src}: layer {i} shared_mlp.input_linear is {t.shape}, not '
                                 'the gate and up rows of one MLP; the checkpoint is corrupt')
        n_ff = t.shape[0] // 2
        widths.add(n_ff)
        for role, a in (('gate', 0), ('up', n_ff)):
            tensors[f'{i}.{role}'] = SourceTensor(t.name, t.qtype, (n_ff, t.shape[1]), t.data,
                                                  row_order=np.arange(a, a + n_ff))
    if len(widths) != 1:
        raise ModelLoadError(f'{src}: shared_mlp.input_linear widths {sorted(widths) or "none"}:'
                             ' the converter needs one MLP width in every layer')
    return widths.pop()


def _mamba_mixers(tensors: Dict[str, SourceTensor], kinds) -> None:
    """Turn each Mamba-2 layer's HF tensors into the GGUF's (A_log, Conv1d's kernel)."""
    for i, kind in enumerate(kinds):
        if kind != RECURRENT:
            continue
        recurrent_a_and_conv(tensors, f'{i}.')

"""Read a Gemma 4 text GGUF (`gemma4`: E2B / E4B) into the converter's ModelSpec and tensors.

What it adds to the gemma3 skeleton, as llama.cpp's src/models/gemma4.cpp computes it:

* per-layer embeddings: a [vocab, layers * E] table (per_layer_token_embd, gathered per
  token), the input embedding projected to the same width (per_layer_model_proj) and
  normalized per layer, mixed into each layer's output through a gate (inp_gate), a
  projection back (proj) and a norm (post_norm);
* sliding-window and global layers (attention.sliding_window_pattern, one flag a layer) with
  their own head sizes (key_length / key_length_swa) and KV head counts, global layers'
  "proportional" RoPE written as rope_freqs (1e30 divisors stop the unrotated pairs);
* the last attention.shared_kv_layers layers keep no KV: each reads the last earlier layer of
  its kind (llama.cpp's reuse callback);
* V normalized without weights, attention scale 1, a scalar output scale per layer
  (layer_output_scale), and MLPs whose width may differ by layer (use_double_wide_mlp).

Refused by name: mixture-of-experts layers (26B-A4B), fused attn_qkv, layers without attn_v
(attention_k_eq_v), and sliding-window layers with partial rotary.
"""
import pathlib
from typing import Dict, Tuple

import numpy as np

from edge_llm_ros.convert.checkpoint import (_f32, _rope_freqs, _write_gguf_tokenizer,
                                             Checkpoint, gguf_field, gguf_tensor, ModelSpec,
                                             SourceTensor)
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

# Canonical key -> GGUF name (per layer: blk.{i}.<name>).
_GLOBAL = {'embed': 'token_embd.weight', 'final_norm': 'output_norm.weight',
           'lm_head': 'output.weight', 'ple_embed': 'per_layer_token_embd.weight',
           'ple_model_proj': 'per_layer_model_proj.weight',
           'ple_proj_norm': 'per_layer_proj_norm.weight'}
_LAYER = {'attn_norm': 'attn_norm.weight', 'ffn_norm': 'ffn_norm.weight',
          'q': 'attn_q.weight', 'k': 'attn_k.weight', 'v': 'attn_v.weight',
          'o': 'attn_output.weight', 'gate': 'ffn_gate.weight', 'up': 'ffn_up.weight',
          'down': 'ffn_down.weight', 'q_norm': 'attn_q_norm.weight',
          'k_norm': 'attn_k_norm.weight', 'post_attn_norm': 'post_attention_norm.weight',
          'post_ffn_norm': 'post_ffw_norm.weight', 'ple_gate': 'inp_gate.weight',
          'ple_proj': 'proj.weight', 'ple_post_norm': 'post_norm.weight',
          'out_scale': 'layer_output_scale.weight'}
_VECTORS = ('attn_norm', 'ffn_norm', 'q_norm', 'k_norm', 'post_attn_norm', 'post_ffn_norm',
            'ple_post_norm', 'out_scale')


def _per_layer(path: pathlib.Path, value, layers: int, what: str) -> Tuple[int, ...]:
    """Return a header value that is one number or one per layer, as one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != layers:
            raise ModelLoadError(f'{path}: {what} has {len(value)} entries for {layers} '
                                 'layers: the GGUF contradicts itself')
        return tuple(int(v) for v in value)
    return (int(value),) * layers


def _one_per_kind(path: pathlib.Path, counts: Tuple[int, ...], local: Tuple[bool, ...],
                  what: str) -> Tuple[int, int]:
    """Return (global, local) of a per-layer count that must be constant per layer kind."""
    out = []
    for kind in (False, True):
        values = sorted({c for c, is_local in zip(counts, local) if is_local == kind})
        if len(values) > 1:
            raise UnsupportedModelError(f'{path}: {what} differs among layers of one kind '
                                        f'({values}); the converter builds one value for the '
                                        'sliding-window layers and one for the global ones')
        out.append(values[0] if values else 0)
    return out[0], out[1]


def load_gemma4_gguf(path: pathlib.Path, reader) -> Checkpoint:
    """Read an open gemma4 GGUF; raise ModelLoadError / UnsupportedModelError."""
    def key(k: str, default=None, required: bool = False):
        return gguf_field(reader, f'gemma4.{k}', default, required)

    names = {t.name: t for t in reader.tensors}
    layers = int(key('block_count', required=True))
    if any('_exps' in n or 'ffn_gate_inp' in n for n in names):
        raise UnsupportedModelError(f'{path}: Gemma 4 mixture-of-experts layers (26B-A4B) '
                                    'are not converted; use Gemma 4 E2B, E4B or a dense '
                                    'checkpoint')
    if any(n.endswith('attn_qkv.weight') for n in names):
        raise UnsupportedModelError(f'{path}: a fused attn_qkv is not converted for gemma4; '
                                    "convert the model with llama.cpp's convert_hf_to_gguf.py "
                                    '(separate attn_q/attn_k/attn_v)')
    hidden = int(key('embedding_length', required=True))
    heads = _per_layer(path, key('attention.head_count', required=True), layers,
                       'attention.head_count')
    if len(set(heads)) != 1:
        raise UnsupportedModelError(f'{path}: query head counts differ by layer ({heads}); '
                                    'the converter builds one count')
    pattern = key('attention.sliding_window_pattern', required=True)
    if not isinstance(pattern, (list, tuple)) or len(pattern) != layers:
        raise ModelLoadError(f'{path}: attention.sliding_window_pattern is not one flag per '
                             'layer: the GGUF is not a complete gemma4 model')
    local = tuple(bool(p) for p in pattern)
    window = int(key('attention.sliding_window', 0) or 0)
    if any(local) and window <= 0:
        raise ModelLoadError(f'{path}: sliding-window layers but no attention.sliding_window')
    kv_heads, local_kv = _one_per_kind(
        path, _per_layer(path, key('attention.head_count_kv', heads[0]), layers,
                         'attention.head_count_kv'), local, 'attention.head_count_kv')
    head_dim = int(key('attention.key_length', required=True))
    local_dim = int(key('attention.key_length_swa', head_dim))
    for k, v in (('value_length', head_dim), ('value_length_swa', local_dim)):
        if int(key(f'attention.{k}', v)) != v:
            raise UnsupportedModelError(f'{path}: attention.{k} differs from the key length; '
                                        'Gemma 4 has equal K and V head sizes')
    if int(key('rope.dimension_count', head_dim)) != head_dim:
        raise UnsupportedModelError(f'{path}: global layers rotate part of each head without '
                                    'rope_freqs; not a Gemma 4 layout the converter builds')
    if int(key('rope.dimension_count_swa', local_dim)) != local_dim:
        raise UnsupportedModelError(f'{path}: sliding-window layers with partial rotary are '
                                    'not converted (the op library rotates whole heads)')
    ff = _per_layer(path, key('feed_forward_length', required=True), layers,
                    'feed_forward_length')
    shared = int(key('attention.shared_kv_layers', 0) or 0)
    shared_from = layers - shared if shared else 0
    if shared and (shared_from < 2 or local[shared_from - 1] or not local[shared_from - 2]):
        raise UnsupportedModelError(
            f'{path}: {shared} shared-KV layers of {layers}: the last two layers that keep KV '
            'must be a sliding-window then a global one (llama.cpp reads those)')
    per_layer = int(key('embedding_length_per_layer_input', 0) or 0)
    wanted = dict(_GLOBAL)
    for i in range(layers):
        for role, suffix in _LAYER.items():
            wanted[f'{i}.{role}'] = f'blk.{i}.{suffix}'
    tensors: Dict[str, SourceTensor] = {k: gguf_tensor(path, names[g])
                                        for k, g in wanted.items() if g in names}
    if 'embed' not in tensors:
        raise ModelLoadError(f'{path}: token_embd.weight is missing; the GGUF is incomplete')
    factors = None
    if 'rope_freqs.weight' in names:
        factors = _rope_freqs(path, names['rope_freqs.weight'], head_dim)
    ctx = int(key('context_length', 2048))
    spec = ModelSpec(
        architecture='gemma4', name=str(gguf_field(reader, 'general.name', path.stem)),
        num_layers=layers, hidden_size=hidden, intermediate_size=max(ff),
        num_heads=heads[0], num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=tensors['embed'].shape[0], max_position_embeddings=ctx,
        rope_theta=_f32(key('rope.freq_base', 10000.0)),
        rms_norm_eps=_f32(key('attention.layer_norm_rms_epsilon', 1e-6)),
        tied_embeddings='lm_head' not in tensors, attention_bias=False, qk_norm=True,
        rope_freq_factors=factors, post_norms=True, activation='gelu_tanh',
        embed_scale=float(np.sqrt(np.float32(hidden))), attention_scale=1.0,
        sliding_window=window if any(local) else 0, local_layers=local,
        local_rope_theta=_f32(key('rope.freq_base_swa', 10000.0)),
        # llama.cpp caps at 30 when the key is absent (its hparams default).
        final_logit_softcap=float(key('final_logit_softcapping', 30.0)),
        local_head_dim=local_dim if local_dim != head_dim else 0,
        local_kv_heads=local_kv if local_kv != kv_heads else 0,
        kv_shared_from=shared_from, layer_intermediate=ff, per_layer_embed=per_layer,
        v_norm=True)

    def write_tokenizer(out_dir: pathlib.Path) -> dict:
        return _write_gguf_tokenizer(reader, out_dir)

    def release() -> None:
        import mmap
        mm = getattr(reader.data, '_mmap', None)
        if mm is not None and hasattr(mmap, 'MADV_DONTNEED'):
            mm.madvise(mmap.MADV_DONTNEED)

    ckpt = Checkpoint(spec, path, tensors, write_tokenizer, release)
    check_gemma4_shapes(ckpt)
    return ckpt


def expected_shapes(s: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Return the shape of every tensor the gemma4 graph reads, by canonical key."""
    h, e = s.hidden_size, s.per_layer_embed
    out = {'embed': (s.vocab_size, h), 'final_norm': (h,)}
    if not s.tied_embeddings:
        out['lm_head'] = (s.vocab_size, h)
    if e:
        out.update(ple_embed=(s.vocab_size, e * s.num_layers),
                   ple_model_proj=(e * s.num_layers, h), ple_proj_norm=(e,))
    for i in range(s.num_layers):
        d, ff = s.layer_head_dim(i), s.layer_ff(i)
        q_out, kv_out = s.num_heads * d, s.layer_kv_heads(i) * d
        p = f'{i}.'
        out.update({p + 'attn_norm': (h,), p + 'ffn_norm': (h,), p + 'q': (q_out, h),
                    p + 'o': (h, q_out), p + 'gate': (ff, h), p + 'up': (ff, h),
                    p + 'down': (h, ff), p + 'q_norm': (d,), p + 'post_attn_norm': (h,),
                    p + 'post_ffn_norm': (h,)})
        if s.kv_owner(i) < 0:
            out.update({p + 'k': (kv_out, h), p + 'v': (kv_out, h), p + 'k_norm': (d,)})
        if e:
            out.update({p + 'ple_gate': (e, h), p + 'ple_proj': (h, e),
                        p + 'ple_post_norm': (h,)})
    return out


def check_gemma4_shapes(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint whose tensors do not fit its header (or miss one)."""
    for k, shape in expected_shapes(ckpt.spec).items():
        if k.endswith('.v') and not ckpt.has(k) and ckpt.has(k[:-1] + 'k'):
            raise UnsupportedModelError(
                f'{ckpt.source_path}: layer {k.split(".")[0]} has no attn_v (V taken from K, '
                'attention_k_eq_v): not converted yet; use Gemma 4 E2B / E4B')
        t = ckpt.tensor(k)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f'{ckpt.source_path}: tensor {t.name} has shape {t.shape}, '
                                 f"but the header's hyper-parameters need {shape}: the file "
                                 'contradicts itself; convert the model again')
        if (len(shape) == 1 or k.split('.')[-1] in _VECTORS) and \
                t.qtype not in ('F32', 'F16', 'BF16'):
            raise UnsupportedModelError(f'{ckpt.source_path}: vector {t.name} is stored as '
                                        f'{t.qtype}; only float vectors are supported')
    for i in range(ckpt.spec.num_layers):
        scale = ckpt.tensors.get(f'{i}.out_scale')
        if scale is not None and tuple(scale.shape) != (1,):
            raise ModelLoadError(f'{ckpt.source_path}: tensor {scale.name} has shape '
                                 f'{scale.shape}, not one value; convert the model again')


# --- HF safetensors (Gemma4ForCausalLM / Gemma4ForConditionalGeneration's text model) --------
# Canonical key -> HF name under the text model's prefix (llama.cpp's tensor_mapping).
_HF_GLOBAL = {'embed': 'embed_tokens.weight', 'final_norm': 'norm.weight',
              'ple_embed': 'embed_tokens_per_layer.weight',
              'ple_model_proj': 'per_layer_model_projection.weight',
              'ple_proj_norm': 'per_layer_projection_norm.weight'}
_HF_LAYER = {'attn_norm': 'input_layernorm.weight', 'ffn_norm': 'pre_feedforward_layernorm.weight',
             'post_attn_norm': 'post_attention_layernorm.weight',
             'post_ffn_norm': 'post_feedforward_layernorm.weight',
             'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
             'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
             'q_norm': 'self_attn.q_norm.weight', 'k_norm': 'self_attn.k_norm.weight',
             'gate': 'mlp.gate_proj.weight', 'up': 'mlp.up_proj.weight',
             'down': 'mlp.down_proj.weight', 'ple_gate': 'per_layer_input_gate.weight',
             'ple_proj': 'per_layer_projection.weight',
             'ple_post_norm': 'post_per_layer_input_norm.weight', 'out_scale': 'layer_scalar'}
HF_MODEL_TYPES = ('gemma4', 'gemma4_text')


def load_gemma4_hf(folder: pathlib.Path, cfg: dict, read_safetensors, write_tokenizer
                   ) -> Checkpoint:
    """Read a Gemma 4 HF folder as llama.cpp's converter reads it (norms as stored)."""
    src = folder / 'config.json'
    text = cfg.get('text_config') or cfg
    prefix = 'model.language_model.' if 'text_config' in cfg else 'model.'
    if text.get('attention_k_eq_v'):
        raise UnsupportedModelError(f'{src}: attention_k_eq_v (V taken from K) is not '
                                    'converted yet; use Gemma 4 E2B / E4B')
    if text.get('enable_moe_block') or text.get('num_experts'):
        raise UnsupportedModelError(f'{src}: Gemma 4 mixture-of-experts layers (26B-A4B) are '
                                    'not converted; use Gemma 4 E2B, E4B or a dense checkpoint')
    act = text.get('hidden_activation') or text.get('hidden_act') or 'gelu_pytorch_tanh'
    if act != 'gelu_pytorch_tanh':
        raise UnsupportedModelError(f'{src}: activation {act!r} is not the one of Gemma 4 '
                                    '(gelu_pytorch_tanh)')
    layers = int(text['num_hidden_layers'])
    types = text.get('layer_types')
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f'{src}: layer_types is not one entry per layer; download '
                             'config.json again')
    local = tuple(t == 'sliding_attention' for t in types)
    head_dim = int(text.get('global_head_dim') or text['head_dim'])
    local_dim = int(text['head_dim'])
    kv_local = int(text.get('num_key_value_heads', text['num_attention_heads']))
    kv_global = int(text.get('num_global_key_value_heads') or kv_local)
    rope = text.get('rope_parameters') or {}
    full, swa = rope.get('full_attention', {}), rope.get('sliding_attention', {})
    if float(swa.get('partial_rotary_factor', 1.0)) != 1.0:
        raise UnsupportedModelError(f'{src}: sliding-window layers with partial rotary are not '
                                    'converted (the op library rotates whole heads)')
    rotated = int(head_dim * float(full.get('partial_rotary_factor', 1.0)) / 2)
    # As llama.cpp's converter writes rope_freqs (float32 1e30: the GGUF's own bits).
    factors = (1.0,) * rotated + (float(np.float32(1e30)),) * (head_dim // 2 - rotated)
    shared = int(text.get('num_kv_shared_layers') or 0)
    shared_from = layers - shared if shared else 0
    if shared and (shared_from < 2 or local[shared_from - 1] or not local[shared_from - 2]):
        raise UnsupportedModelError(f'{src}: {shared} shared-KV layers of {layers}: the last '
                                    'two layers that keep KV must be a sliding-window then a '
                                    'global one')
    n_ff = int(text['intermediate_size'])
    ff = tuple(n_ff * (2 if text.get('use_double_wide_mlp') and i >= shared_from > 0 else 1)
               for i in range(layers))
    files = sorted(folder.glob('*.safetensors'))
    if not files:
        raise ModelLoadError(f'{folder}: no *.safetensors files')
    raw = read_safetensors(files)
    wanted = {k: prefix + n for k, n in _HF_GLOBAL.items()}
    wanted['lm_head'] = 'lm_head.weight'
    for i in range(layers):
        for role, suffix in _HF_LAYER.items():
            wanted[f'{i}.{role}'] = f'{prefix}layers.{i}.{suffix}'
    tensors = {k: raw[n] for k, n in wanted.items() if n in raw}
    if text.get('tie_word_embeddings', cfg.get('tie_word_embeddings', True)):
        tensors.pop('lm_head', None)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{folder}: {prefix}embed_tokens.weight is missing')
    for i in range(layers):
        scale = tensors.get(f'{i}.out_scale')
        if scale is not None and scale.shape == ():
            tensors[f'{i}.out_scale'] = SourceTensor(scale.name, scale.qtype, (1,),
                                                     np.asarray(scale.data).reshape(1))
    hidden = int(text['hidden_size'])
    softcap = text.get('final_logit_softcapping')
    spec = ModelSpec(
        architecture='gemma4', name=folder.name, num_layers=layers, hidden_size=hidden,
        intermediate_size=max(ff), num_heads=int(text['num_attention_heads']),
        num_kv_heads=kv_global, head_dim=head_dim, vocab_size=tensors['embed'].shape[0],
        max_position_embeddings=int(text.get('max_position_embeddings', 131072)),
        rope_theta=float(full.get('rope_theta', 1e6)),
        rms_norm_eps=float(text.get('rms_norm_eps', 1e-6)),
        tied_embeddings='lm_head' not in tensors, attention_bias=False, qk_norm=True,
        rope_freq_factors=factors if rotated * 2 < head_dim else None, post_norms=True,
        activation='gelu_tanh', embed_scale=float(np.sqrt(np.float32(hidden))),
        attention_scale=1.0, sliding_window=int(text.get('sliding_window') or 0)
        if any(local) else 0, local_layers=local,
        local_rope_theta=float(swa.get('rope_theta', 10000.0)),
        final_logit_softcap=float(30.0 if softcap is None else softcap),
        local_head_dim=local_dim if local_dim != head_dim else 0,
        local_kv_heads=kv_local if kv_local != kv_global else 0,
        kv_shared_from=shared_from, layer_intermediate=ff,
        per_layer_embed=int(text.get('hidden_size_per_layer_input') or 0), v_norm=True)
    ckpt = Checkpoint(spec, folder, tensors, write_tokenizer)
    check_gemma4_shapes(ckpt)
    return ckpt

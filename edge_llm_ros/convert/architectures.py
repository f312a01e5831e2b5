"""What each supported decoder family stores and computes beyond the shared llama skeleton.

The converter reads every family into one form (checkpoint.ModelSpec + canonical tensor keys)
and the graph builder switches on the flags here, so adding a family is a row in
ARCHITECTURES plus whatever new piece the flags name. What a flag means follows llama.cpp
(src/models/<family>.cpp), which defines the GGUF format.
"""
from dataclasses import dataclass
import math
from typing import Dict, Tuple

from edge_llm_ros.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    """One family: how its GGUF tensors are laid out and which optional pieces it has."""

    name: str
    # llama.cpp's converter permutes llama Q/K rows for its interleaved RoPE; the reader undoes it.
    gguf_permuted_qk: bool
    # Per-head RMSNorm of q and k (weights [head_dim]) after the projection, before RoPE.
    qk_norm: bool
    covers: str  # the checkpoints users know it by, for error messages and docs
    # RMSNorm of the attention output and of the MLP output before each residual add (gemma3).
    post_norms: bool = False
    # Gated MLP activation: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU, ggml_gelu's tanh form).
    activation: str = 'silu'
    # Token embeddings are multiplied by sqrt(hidden) (gemma; not inputs_embeds).
    embed_scale: bool = False
    # HF RMSNorm weights are stored minus 1 (Gemma3RMSNorm computes x * (1 + w)); llama.cpp's
    # converter adds it to every *norm.weight, so GGUF norms are used as they are.
    hf_norm_shift: float = 0.0
    # Sliding-window layers: every `swa_period`-th layer (1-based) is global, the others local
    # (llama.cpp's set_swa_pattern), when the file has a sliding window; 0 = no local layers.
    swa_period: int = 0
    # RoPE base of local layers when the GGUF has no rope.freq_base_swa (llama.cpp's default).
    swa_rope_base: float = 0.0
    # Hybrid: layers whose attention.head_count_kv entry is 0 are gated short convolutions
    # (lfm2: llama.cpp's build_shortconv_block), the others GQA; the head count per layer is
    # an array in the GGUF.
    conv_layers: bool = False
    # The final norm's GGUF tensor (lfm2 stores it as token_embd_norm: llama.cpp's name fix).
    final_norm: str = 'output_norm.weight'
    # M-RoPE (qwen2vl): rope.dimension_sections splits each head's rotary pairs into t, h, w
    # sections, each turned by its own position (equal for text: plain NEOX RoPE).
    mrope: bool = False
    # Interleaved M-RoPE (qwen3vl, ggml's GGML_ROPE_TYPE_IMROPE): pair k turns with t, h, w
    # by k mod 3 while k < 3 x that section, else with the fourth position (0: unrotated).
    mrope_interleaved: bool = False
    # DeepStack (qwen3vl): n_deepstack_layers image rows more per image token, added to the
    # hidden states after the first layers (llama.cpp's n_deepstack_layers key).
    deepstack: bool = False
    # Hybrid: Gated DeltaNet layers (qwen35: llama.cpp's build_layer_attn_linear) beside
    # gated full-attention layers (q rows interleave each head's query and output gate); every
    # full_attention_interval-th layer attends. Its FFN input norm is post_attention_norm.
    recurrent_layers: bool = False
    # Every no_rope_period-th layer (1-based) attends without RoPE (smollm3: llama.cpp's
    # n_no_rope_layer_step, fixed at 4 for the family; the GGUF has no key for it). 0: none.
    no_rope_period: int = 0
    # Hybrid: Mamba-2 layers (granitehybrid: llama.cpp's build_mamba2_layer; the layers whose
    # attention.head_count_kv entry is 0) beside attention layers, with Granite's multipliers
    # (embedding, residual, attention and logit scales; llama.cpp's granite keys). Its
    # attention layers rotate only when rope.scaling.finetuned says so (Granite's switch).
    mamba_layers: bool = False


ARCHITECTURES: Dict[str, Architecture] = {
    'llama': Architecture('llama', True, False,
                          'Llama 1/2/3.x, SmolLM, Mistral, DeepSeek-R1-Distill-Llama'),
    'qwen2': Architecture('qwen2', False, False, 'Qwen2/2.5, DeepSeek-R1-Distill-Qwen'),
    'qwen3': Architecture('qwen3', False, True, 'Qwen3 dense'),
    'gemma3': Architecture('gemma3', False, True, 'Gemma 3 270M/1B/4B text',
                           post_norms=True, activation='gelu_tanh', embed_scale=True,
                           hf_norm_shift=1.0, swa_period=6, swa_rope_base=10000.0),
    'qwen2vl': Architecture('qwen2vl', False, False, 'Qwen2-VL / Qwen2.5-VL language model '
                            '(qwen2 with M-RoPE)', mrope=True),
    'qwen3vl': Architecture('qwen3vl', False, True, 'Qwen3-VL dense language model (qwen3 '
                            'with interleaved M-RoPE and DeepStack)', mrope=True,
                            mrope_interleaved=True, deepstack=True),
    'phi3': Architecture('phi3', False, False, 'Phi-3/3.5 mini, Phi-4-mini'),
    'lfm2': Architecture('lfm2', False, True, 'LFM2 / LFM2.5 350M-2.6B (hybrid: gated short '
                         'convolutions and GQA)', conv_layers=True,
                         final_norm='token_embd_norm.weight'),
    'qwen35': Architecture('qwen35', False, True, 'Qwen3.5 dense 0.8B-27B text (hybrid: Gated '
                           'DeltaNet and gated attention)', recurrent_layers=True),
    'smollm3': Architecture('smollm3', True, False, 'SmolLM3 3B (llama with no RoPE on every '
                            'fourth layer)', no_rope_period=4),
    # Q/K rows permuted as llama's (llama.cpp's granite converters; ROPE_TYPE_NORM).
    'granitehybrid': Architecture('granitehybrid', True, False, 'Granite 4.0-H dense '
                                  '(Micro; hybrid: Mamba-2 and attention)', mamba_layers=True),
    # Its layers, norms and per-layer embeddings are read by convert/gemma4.py.
    'gemma4': Architecture('gemma4', False, True, 'Gemma 4 E2B/E4B text (per-layer '
                           'embeddings, shared-KV layers)', post_norms=True,
                           activation='gelu_tanh', embed_scale=True),
}
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = tuple(ARCHITECTURES)
# HF config model_type -> family (same tensors and graph).
HF_MODEL_TYPES: Dict[str, str] = {'llama': 'llama', 'mistral': 'llama', 'qwen2': 'qwen2',
                                  'qwen3': 'qwen3', 'gemma3_text': 'gemma3', 'phi3': 'phi3',
                                  'smollm3': 'smollm3'}
# rope.scaling.type values the converter computes (llama.cpp's names); llama3 scaling has no
# type key in a GGUF: it is the rope_freqs tensor, and Phi-3 LongRoPE is its
# rope_factors_short/long tensors.
ROPE_SCALING_TYPES = ('none', 'linear')


def swa_layers(period: int, num_layers: int) -> Tuple[bool, ...]:
    """Which layers use the sliding window: all but every period-th (llama.cpp's pattern)."""
    if period <= 0:
        return (False,) * num_layers
    return tuple(i % period < period - 1 for i in range(num_layers))


def architecture(name: str, source: str) -> Architecture:
    """Return the family `name`; UnsupportedModelError lists the supported ones otherwise."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        listed = '; '.join(f'{a.name} ({a.covers})' for a in ARCHITECTURES.values())
        raise UnsupportedModelError(f'{source}: architecture {name!r} is not supported; '
                                    f'supported: {listed}')
    return arch


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> Tuple[float, ...]:
    """Per-frequency divisors of Llama 3.1-style RoPE scaling (what a GGUF's rope_freqs holds).

    Frequencies whose wavelength exceeds original_context / low_freq_factor are slowed by
    `factor`, those shorter than original_context / high_freq_factor are kept, and the band
    between is interpolated smoothly.
    """
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = ((original_context / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)

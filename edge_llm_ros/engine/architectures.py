"""What each supported decoder family stores and computes beyond the shared llama skeleton.

The converter reads every family into one form (checkpoint.ModelSpec + canonical tensor keys)
and the graph builder switches on the flags here, so adding a family is a row in
ARCHITECTURES plus whatever new piece the flags name. What a flag means follows llama.cpp
(src/models/<family>.cpp), which defines the GGUF format.
"""
from dataclasses import dataclass
import math
from typing import Dict, Tuple

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    """One family: how its GGUF tensors are laid out and which optional pieces it has."""

    name: str
    # llama.cpp's converter permutes llama Q/K rows for its interleaved RoPE; the reader undoes it.
    gguf_permuted_qk: bool
    # Per-head RMSNorm of q and k (weights [head_dim]) after the projection, before RoPE.
    qk_norm: bool
    covers: str  # the checkpoints users know it by, for error messages and docs


ARCHITECTURES: Dict[str, Architecture] = {
    'llama': Architecture('llama', True, False,
                          'Llama 1/2/3.x, SmolLM, Mistral, DeepSeek-R1-Distill-Llama'),
    'qwen2': Architecture('qwen2', False, False, 'Qwen2/2.5, DeepSeek-R1-Distill-Qwen'),
    'qwen3': Architecture('qwen3', False, True, 'Qwen3 dense'),
}
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = tuple(ARCHITECTURES)
# rope.scaling.type values the converter computes (llama.cpp's names); llama3 scaling has no
# type key in a GGUF: it is the rope_freqs tensor.
ROPE_SCALING_TYPES = ('none', 'linear')


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

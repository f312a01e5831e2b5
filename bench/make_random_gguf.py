"""Write random-weight GGUFs at the real shapes of the families the converter supports.

    .venv/bin/python bench/make_random_gguf.py qwen2-7b .cache/random_gguf/qwen2-7b.gguf
    .venv/bin/python bench/make_random_gguf.py --list
    .venv/bin/python bench/make_random_gguf.py qwen2-7b out.gguf --convert out_dir

The speed of a matmul does not depend on the values, so these files benchmark the engine and
llama.cpp on models nobody can download here (no complete DeepSeek-R1-Distill weights are in
the registries). Shapes, metadata keys and tensor names are the real ones; the type mix is
llama.cpp's Q4_K_M recipe (llama-quant.cpp's llama_tensor_get_type: Q6_K for the head and
for attn_v / ffn_down of the layers llama-quantize gives more bits, Q5_K for a fused attn_qkv,
Q4_K elsewhere, F32 vectors; a matrix whose rows are not a whole number of 256-wide
super-blocks falls back as llama-quantize does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and
F16 if not even 32-wide blocks fit); the vocabulary is a byte-level BPE one of the real size
whose first ids are the 256 byte symbols.

Blocks are random bytes with their fp16 scales set so that each matrix's rows dequantize to
about 1/sqrt(fan_in) spread (gguf-py cannot encode K-quants): valid blocks, written tensor by
tensor (the writer holds one tensor at a time; the 7B file is ~4.7 GB).

--convert runs edge-llm-convert on the result in a child process and prints its peak RSS next
to the file size (the converter must stay within 1.3x); --weights picks its weight format.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# fp16 scale fields of one block per type: (d offset, dmin offset or None, dmin / d).
_SCALE_FIELDS: Dict[str, Tuple[int, Optional[int], float]] = {
    'Q4_K': (0, 2, 7.5), 'Q5_K': (0, 2, 15.5), 'Q6_K': (208, None, 0.0),
    'Q4_0': (0, None, 0.0), 'Q8_0': (0, None, 0.0), 'Q5_0': (0, None, 0.0),
    'Q5_1': (0, 2, -15.5),
}
# llama-quantize's fallback when a row is not a whole number of 256-wide K-quant super-blocks
# (Qwen2.5-0.5B's 896, Gemma 3 1B's 1152); F16 when not even the fallback's 32 fit.
_NOT_256 = {'Q4_K': 'Q5_0', 'Q5_K': 'Q5_1', 'Q6_K': 'Q8_0'}


@dataclass(frozen=True)
class Shape:
    """One member of a family at its real size (the HF config's numbers)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    context: int
    rope_theta: float
    eps: float
    tied: bool
    pre: str                      # tokenizer.ggml.pre
    covers: str
    extra: Dict[str, object] = field(default_factory=dict)


SHAPES: Dict[str, Shape] = {
    # DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-Math-7B): the seeds' model family at its size.
    'qwen2-7b': Shape('qwen2', 3584, 28, 28, 4, 128, 18944, 152064, 131072, 10000.0, 1e-6,
                      False, 'deepseek-r1-qwen', 'DeepSeek-R1-Distill-Qwen-7B',
                      {'r1_specials': True}),
    'qwen2-0.5b': Shape('qwen2', 896, 24, 14, 2, 64, 4864, 151936, 32768, 1e6, 1e-6, True,
                        'qwen2', 'Qwen2.5-0.5B-Instruct'),
    # 1536 = 6 x 256: every matrix keeps its K-quant type (no fallback, unlike 0.5B's 896).
    'qwen2-1.5b': Shape('qwen2', 1536, 28, 12, 2, 128, 8960, 151936, 32768, 1e6, 1e-6, True,
                        'qwen2', 'Qwen2.5-1.5B-Instruct'),
    'llama3-1b': Shape('llama', 2048, 16, 32, 8, 64, 8192, 128256, 131072, 500000.0, 1e-5,
                       True, 'llama-bpe', 'Llama-3.2-1B-Instruct',
                       {'llama3_rope': (32.0, 1.0, 4.0, 8192)}),
    'qwen3-0.6b': Shape('qwen3', 1024, 28, 16, 8, 128, 3072, 151936, 40960, 1e6, 1e-6, True,
                        'qwen2', 'Qwen3-0.6B'),
    'gemma3-1b': Shape('gemma3', 1152, 26, 4, 1, 256, 6912, 262144, 32768, 1e6, 1e-6, True,
                       'default', 'gemma-3-1b-it', {'sliding_window': 512}),
    # Phi-4-mini (3.8B; no Phi-3 family member is smaller): fused qkv / gate|up, LongRoPE
    # factors, 3/4 of each head rotated.
    'phi4-mini': Shape('phi3', 3072, 32, 24, 8, 128, 8192, 200064, 131072, 10000.0, 1e-5,
                       True, 'gpt-4o', 'Phi-4-mini-instruct',
                       {'rope_dims': 96, 'longrope_orig': 4096}),
    # LFM2-1.2B: 10 gated short-convolution layers and 6 GQA layers (its layer_types), a conv
    # kernel of 3 (conv_L_cache), FFN 8192 (block_ff_dim 12288 auto-adjusted: 2/3, multiple
    # of 256, as llama.cpp's converter computes it).
    'lfm2-1.2b': Shape('lfm2', 2048, 16, 32, 8, 64, 8192, 65536, 128000, 1e6, 1e-5, True,
                       'lfm2', 'LFM2-1.2B',
                       {'attention_layers': (2, 5, 8, 10, 12, 14), 'conv_kernel': 3}),
    # Qwen3.5-2B: 18 Gated DeltaNet layers (16 key and 16 value heads of 128, conv kernel 4)
    # and 6 gated attention layers (every 4th: 8 query heads of 256 with their output gates,
    # 2 KV heads, a quarter of each head rotated, RoPE base 1e7), FFN 6144, a tied 248k
    # vocabulary.
    'qwen35-2b': Shape('qwen35', 2048, 24, 8, 2, 256, 6144, 248320, 262144, 1e7, 1e-6, True,
                       'qwen35', 'Qwen3.5-2B',
                       {'rope_dims': 64, 'gdn': (4, 16, 16, 128), 'interval': 4}),
    # Gemma 4 E2B: 35 layers, each 5th global (8 heads of 512, a quarter rotated, RoPE 1e6)
    # and the rest sliding-window (8 heads of 256, window 512, RoPE 1e4), one KV head; the
    # last 20 layers share KV (llama.cpp's reuse) and have double-wide MLPs (12288);
    # per-layer embeddings of 256 (a [262144, 35 x 256] table); tied 262k head, soft cap 30.
    'gemma4-e2b': Shape('gemma4', 1536, 35, 8, 1, 512, 6144, 262144, 131072, 1e6, 1e-6, True,
                        'default', 'gemma-4-E2B-it',
                        {'sliding_window': 512, 'swa_head_dim': 256, 'swa_every': 5,
                         'real_layers': 35, 'shared_kv': 20, 'double_wide': True,
                         'per_layer': 256, 'rope_swa': 1e4, 'rope_dims': 512, 'softcap': 30.0}),
    # Gemma 4 E4B: 42 layers, each 6th global; two KV heads; the last 18 layers share KV
    # and keep E4B's single-width MLP (use_double_wide_mlp false); the rest as E2B.
    'gemma4-e4b': Shape('gemma4', 2560, 42, 8, 2, 512, 10240, 262144, 131072, 1e6, 1e-6, True,
                        'default', 'gemma-4-E4B-it',
                        {'sliding_window': 512, 'swa_head_dim': 256, 'swa_every': 6,
                         'real_layers': 42, 'shared_kv': 18, 'double_wide': False,
                         'per_layer': 256, 'rope_swa': 1e4, 'rope_dims': 512, 'softcap': 30.0}),
    # The language models of the Qwen-VL pairs (bench/bench_vlm.py): qwen2 / qwen3 with M-RoPE
    # (rope.dimension_sections in rotary pairs) and the image wrapper tokens in the vocabulary;
    # Qwen3-VL's image rows are 1 + 3 DeepStack widths wide (n_deepstack_layers).
    'qwen2.5vl-3b': Shape('qwen2vl', 2048, 36, 16, 2, 128, 11008, 151936, 128000, 1e6, 1e-6,
                          True, 'qwen2', 'Qwen2.5-VL-3B-Instruct (language model)',
                          {'rope_sections': (16, 24, 24, 0), 'vision': True}),
    'qwen3vl-2b': Shape('qwen3vl', 2048, 28, 16, 8, 128, 6144, 151936, 262144, 5e6, 1e-6,
                        True, 'qwen2', 'Qwen3-VL-2B-Instruct (language model)',
                        {'rope_sections': (24, 20, 20, 0), 'deepstack': 3, 'vision': True}),
}
# Qwen-VL's image wrapper tokens (mtmd writes them around each image; control tokens).
QWEN_VISION_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|image_pad|>')
R1_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}"
    '<｜end▁of▁sentence｜>{% endif %}{% endfor %}'
    '{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}')
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def quant_type(role: str, layer: int, layers: int) -> str:
    """llama.cpp's Q4_K_M choice for one tensor (llama-quant.cpp's use_more_bits rule)."""
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or \
        (layer - layers // 8) % 3 == 2
    if role == 'output':
        return 'Q6_K'
    if role == 'attn_qkv':  # fused: Q4_K_M gives it Q5_K in every layer
        return 'Q5_K'
    if role in ('attn_v', 'ffn_down') and more_bits:
        return 'Q6_K'
    return 'Q4_K'


def vocabulary(shape: Shape) -> Tuple[List[str], List[int], Dict[str, int]]:
    """Tokens, token types and special ids: bytes first, filler words, specials last."""
    if shape.extra.get('r1_specials'):
        specials = ['<｜end▁of▁sentence｜>', '<｜User｜>', '<｜Assistant｜>',
                    '<｜begin▁of▁sentence｜>', '<|EOT|>', '<think>', '</think>']
        ids = {'eos': 0, 'bos': 3}
    else:
        specials = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] + (
            list(QWEN_VISION_TOKENS) if shape.extra.get('vision') else [])
        ids = {'eos': 2, 'bos': 0}
    n_words = shape.vocab - 257 - len(specials)
    # 'Ġw' and 'Ġw1' are what the two merges below produce.
    from tokenizers import pre_tokenizers
    # The 256 byte-level symbols (any order: llama.cpp and the converter look them up).
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = symbols + ['Ġw'] + [f'Ġw{i}' for i in range(n_words)] + specials
    types = [1] * (shape.vocab - len(specials)) + [3] * len(specials)
    base = shape.vocab - len(specials)
    return tokens, types, {k: base + v for k, v in ids.items()}


def tensor_plan(shape: Shape) -> Iterator[Tuple[str, Tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols] or [n], type) in llama.cpp's order."""
    s, x = shape, shape.extra
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # llama-quantize gives a tied embedding (it is also the head) the head's type.
    yield 'token_embd.weight', (s.vocab, s.hidden), 'Q6_K' if s.tied else 'Q4_K'
    if not s.tied:
        yield 'output.weight', (s.vocab, s.hidden), 'Q6_K'
    # lfm2's final norm is token_embd_norm (llama.cpp's name for it).
    yield ('token_embd_norm.weight' if s.arch == 'lfm2' else 'output_norm.weight'), \
        (s.hidden,), 'F32'
    if s.arch == 'gemma4':
        # Q4_K_M: the per-layer table is a token embedding (tied: the head's Q6_K); the
        # projection is never quantized (llama-quant.cpp), F16 as the HF converter writes it.
        yield 'per_layer_token_embd.weight', (s.vocab, x['per_layer'] * s.layers), 'Q6_K'
        yield 'per_layer_model_proj.weight', (x['per_layer'] * s.layers, s.hidden), 'F16'
        yield 'per_layer_proj_norm.weight', (x['per_layer'],), 'F32'
    if 'llama3_rope' in x or s.arch == 'gemma4':
        yield 'rope_freqs.weight', (s.head_dim // 2,), 'F32'
    if 'longrope_orig' in x:
        yield 'rope_factors_long.weight', (int(x['rope_dims']) // 2,), 'F32'
        yield 'rope_factors_short.weight', (int(x['rope_dims']) // 2,), 'F32'
    for i in range(s.layers):
        p = f'blk.{i}.'
        yield p + 'attn_norm.weight', (s.hidden,), 'F32'
        if s.arch == 'qwen35':
            yield from _qwen35_layer(s, p, i)
            continue
        if s.arch == 'gemma4':
            yield from _gemma4_layer(s, p, i)
            continue
        if s.arch == 'lfm2' and i not in x['attention_layers']:
            # Q4_K_M leaves the [hidden, 3] kernel F32 (3 values a row: no block fits).
            yield p + 'shortconv.in_proj.weight', (3 * s.hidden, s.hidden), 'Q4_K'
            yield p + 'shortconv.conv.weight', (s.hidden, int(x['conv_kernel'])), 'F32'
            yield p + 'shortconv.out_proj.weight', (s.hidden, s.hidden), 'Q4_K'
            yield from _ffn(s, p, i)
            continue
        if s.arch == 'phi3':
            yield p + 'attn_qkv.weight', (q + 2 * kv, s.hidden), 'Q5_K'
        else:
            yield p + 'attn_q.weight', (q, s.hidden), 'Q4_K'
            yield p + 'attn_k.weight', (kv, s.hidden), 'Q4_K'
            yield p + 'attn_v.weight', (kv, s.hidden), quant_type('attn_v', i, s.layers)
        if s.arch in ('qwen2', 'qwen2vl'):
            for r, n in (('q', q), ('k', kv), ('v', kv)):
                yield f'{p}attn_{r}.bias', (n,), 'F32'
        if s.arch in ('qwen3', 'qwen3vl', 'gemma3', 'lfm2'):
            yield p + 'attn_q_norm.weight', (s.head_dim,), 'F32'
            yield p + 'attn_k_norm.weight', (s.head_dim,), 'F32'
        yield p + 'attn_output.weight', (s.hidden, q), 'Q4_K'
        if s.arch == 'gemma3':
            yield p + 'post_attention_norm.weight', (s.hidden,), 'F32'
        yield from _ffn(s, p, i)
        if s.arch == 'gemma3':
            yield p + 'post_ffw_norm.weight', (s.hidden,), 'F32'


def _qwen35_layer(s: Shape, p: str, i: int) -> Iterator[Tuple[str, Tuple[int, ...], str]]:
    """Yield a qwen35 layer after its attn_norm: DeltaNet or gated attention, then the MLP."""
    kernel, k_heads, v_heads, d = s.extra['gdn']
    if (i + 1) % int(s.extra['interval']):
        channels = (2 * k_heads + v_heads) * d
        yield p + 'attn_qkv.weight', (channels, s.hidden), 'Q5_K'   # Q4_K_M's attn_qkv rule
        yield p + 'attn_gate.weight', (v_heads * d, s.hidden), 'Q4_K'
        yield p + 'ssm_conv1d.weight', (channels, kernel), 'F32'     # not quantized
        yield p + 'ssm_dt.bias', (v_heads,), 'F32'
        yield p + 'ssm_a', (v_heads,), 'F32'
        yield p + 'ssm_beta.weight', (v_heads, s.hidden), 'Q4_K'
        yield p + 'ssm_alpha.weight', (v_heads, s.hidden), 'Q4_K'
        yield p + 'ssm_norm.weight', (d,), 'F32'
        yield p + 'ssm_out.weight', (s.hidden, v_heads * d), 'Q4_K'
    else:
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        yield p + 'attn_q.weight', (2 * q, s.hidden), 'Q4_K'   # each head's query, then gate
        yield p + 'attn_k.weight', (kv, s.hidden), 'Q4_K'
        yield p + 'attn_v.weight', (kv, s.hidden), quant_type('attn_v', i, s.layers)
        yield p + 'attn_q_norm.weight', (s.head_dim,), 'F32'
        yield p + 'attn_k_norm.weight', (s.head_dim,), 'F32'
        yield p + 'attn_output.weight', (s.hidden, q), 'Q4_K'
    yield from _ffn(s, p, i, norm='post_attention_norm.weight')


def gemma4_layout(s: Shape) -> Tuple[List[bool], int]:
    """Return (sliding-window flag per layer, KV-owning layers) of a gemma4 shape.

    Every `swa_every`-th layer is global. With fewer layers than the real model's, the
    owners shrink to a whole number of periods in its proportion (E2B: 15 of 35), so the
    last owner is global and the one before sliding-window, as llama.cpp's reuse reads them.
    """
    x = s.extra
    period = int(x['swa_every'])
    pattern = [(i + 1) % period != 0 for i in range(s.layers)]
    real_layers = int(x['real_layers'])
    owners = real_layers - int(x['shared_kv'])
    if s.layers != real_layers:
        owners = period * max(1, round(s.layers * owners / real_layers / period))
    return pattern, min(owners, s.layers)


def _gemma4_ff(s: Shape) -> List[int]:
    """Return each layer's MLP width (E2B's shared-KV layers have double-wide MLPs)."""
    owners = gemma4_layout(s)[1]
    wide = 2 if s.extra['double_wide'] else 1
    return [s.ff * (wide if i >= owners else 1) for i in range(s.layers)]


def _gemma4_layer(s: Shape, p: str, i: int) -> Iterator[Tuple[str, Tuple[int, ...], str]]:
    """Yield a gemma4 layer after its attn_norm (shared-KV layers have no k / v)."""
    pattern, owners = gemma4_layout(s)
    d = int(s.extra['swa_head_dim']) if pattern[i] else s.head_dim
    yield p + 'attn_q.weight', (s.heads * d, s.hidden), 'Q4_K'
    if i < owners:
        yield p + 'attn_k.weight', (s.kv_heads * d, s.hidden), 'Q4_K'
        # llama-quantize counts attn_v over the tensors that exist: the owners.
        yield p + 'attn_v.weight', (s.kv_heads * d, s.hidden), quant_type('attn_v', i, owners)
        yield p + 'attn_k_norm.weight', (d,), 'F32'
    yield p + 'attn_q_norm.weight', (d,), 'F32'
    yield p + 'attn_output.weight', (s.hidden, s.heads * d), 'Q4_K'
    yield p + 'post_attention_norm.weight', (s.hidden,), 'F32'
    yield from _ffn(s, p, i, ff=_gemma4_ff(s)[i])
    yield p + 'post_ffw_norm.weight', (s.hidden,), 'F32'
    e = int(s.extra['per_layer'])
    yield p + 'inp_gate.weight', (e, s.hidden), 'Q4_K'
    yield p + 'proj.weight', (s.hidden, e), 'Q4_K'
    yield p + 'post_norm.weight', (s.hidden,), 'F32'
    yield p + 'layer_output_scale.weight', (1,), 'F32'


def _ffn(s: Shape, p: str, i: int, norm: str = 'ffn_norm.weight', ff: int = 0
         ) -> Iterator[Tuple[str, Tuple[int, ...], str]]:
    """Yield a layer's MLP norm and matrices (tensor_plan's order)."""
    ff = ff or s.ff
    yield p + norm, (s.hidden,), 'F32'
    if s.arch == 'phi3':
        yield p + 'ffn_up.weight', (2 * ff, s.hidden), 'Q4_K'
    else:
        yield p + 'ffn_gate.weight', (ff, s.hidden), 'Q4_K'
        yield p + 'ffn_up.weight', (ff, s.hidden), 'Q4_K'
    yield p + 'ffn_down.weight', (s.hidden, ff), quant_type('ffn_down', i, s.layers)


def fallback_type(qtype: str, row: int) -> str:
    """Return the type llama-quantize writes for `qtype` rows of `row` values (its fallback)."""
    if qtype in _NOT_256 and row % 256:
        qtype = _NOT_256[qtype]
        if row % 32:
            qtype = 'F16'
    return qtype


def gguf_plan(shape: Shape) -> List[Tuple[str, Tuple[int, ...], str]]:
    """tensor_plan with the fallback applied to matrices: what the file holds."""
    return [(n, sh, fallback_type(t, sh[1]) if len(sh) == 2 else t)
            for n, sh, t in tensor_plan(shape)]


class BlockMaker:
    """Random valid blocks of a GGML type whose rows dequantize to a chosen spread."""

    def __init__(self, seed: int) -> None:
        """Draw every block from one seeded generator."""
        self.rng = np.random.default_rng(seed)
        self._unit: Dict[str, float] = {}

    def _spread(self, qtype: str) -> float:
        """Std of a block of random codes with d = 1 (measured once per type)."""
        if qtype not in self._unit:
            import gguf
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            raw = self._raw(64, 8 * block, qtype, np.ones((64, 8)))
            w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
            self._unit[qtype] = float(np.std(w))
        return self._unit[qtype]

    def _raw(self, rows: int, cols: int, qtype: str, d: np.ndarray) -> np.ndarray:
        import gguf
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        nb = cols // block
        raw = np.frombuffer(self.rng.bytes(rows * nb * size), np.uint8).reshape(rows, nb, size)
        raw = raw.copy()
        d_at, dmin_at, ratio = _SCALE_FIELDS[qtype]
        for at, f in ((d_at, 1.0), (dmin_at, ratio)):
            if at is not None:
                raw[..., at:at + 2] = (d * f).astype(np.float16)[..., None].view(np.uint8)
        return raw.reshape(rows, nb * size)

    def matrix(self, rows: int, cols: int, qtype: str) -> np.ndarray:
        """uint8 [rows, row_bytes] of `qtype` blocks, rows dequantizing to ~1/sqrt(cols)."""
        import gguf
        if qtype == 'F16':
            w = self.rng.standard_normal((rows, cols), np.float32) / math.sqrt(cols)
            return w.astype(np.float16)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
        d = (1 / math.sqrt(cols)) / self._spread(qtype)
        signs = self.rng.choice(np.array([-d, d], np.float32), size=(rows, cols // block))
        return self._raw(rows, cols, qtype, signs)


def _vector(name: str, n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    if name.endswith(('shortconv.conv.weight', 'ssm_conv1d.weight')):
        # [channels, kernel], F32 as llama.cpp reads it
        kernel = int(shape.extra['conv_kernel'] if 'conv_kernel' in shape.extra
                     else shape.extra['gdn'][0])
        return (rng.standard_normal((n, kernel)) / math.sqrt(kernel)).astype(np.float32)
    if name.endswith('ssm_a'):   # -exp(A_log): a negative decay rate per value head
        return -rng.uniform(0.2, 2.0, n).astype(np.float32)
    if name == 'rope_freqs.weight' and shape.arch == 'gemma4':
        # proportional RoPE: a quarter of the global heads' pairs rotate, 1e30 stops the rest
        return np.where(np.arange(n) < n // 4, 1.0, 1e30).astype(np.float32)
    if name.endswith(('attn_q_norm.weight', 'attn_k_norm.weight')) and shape.arch == 'gemma4':
        # d**-0.25 each: scores of 1/sqrt(d) spread under Gemma 4's attention scale of 1
        return ((1.0 + 0.1 * rng.standard_normal(n)) * n ** -0.25).astype(np.float32)
    if name == 'rope_freqs.weight':
        from edge_llm_ros.convert.architectures import llama3_rope_factors
        f, lo, hi, orig = shape.extra['llama3_rope']
        return np.array(llama3_rope_factors(shape.head_dim, shape.rope_theta, f, lo, hi, orig),
                        np.float32)
    if name.startswith('rope_factors_'):
        grow = 1.0 if 'short' in name else 40.0
        return np.geomspace(1.0, grow, n).astype(np.float32)
    if name.endswith('.bias'):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def write_random_gguf(path: pathlib.Path, name: str, seed: int = 0,
                      layers: Optional[int] = None) -> pathlib.Path:
    """Write SHAPES[name] (optionally with fewer layers) to `path`, tensor by tensor."""
    import gguf
    shape = SHAPES[name]
    if layers:
        shape = Shape(**{**shape.__dict__, 'layers': layers})
    path.parent.mkdir(parents=True, exist_ok=True)
    s, x = shape, shape.extra
    part = path.with_name(path.name + '.partial')  # renamed into place only when complete
    w = gguf.GGUFWriter(str(part), s.arch)
    header = {'name': f'random-{name}', 'block_count': s.layers, 'context_length': s.context,
              'embedding_length': s.hidden, 'feed_forward_length': s.ff,
              'head_count': s.heads, 'head_count_kv': _kv_heads(s), 'key_length': s.head_dim,
              'value_length': s.head_dim, 'rope_freq_base': s.rope_theta,
              'layer_norm_rms_eps': s.eps, 'vocab_size': s.vocab,
              'rope_dimension_count': int(x.get('rope_dims', s.head_dim)),
              'file_type': gguf.LlamaFileType.MOSTLY_Q4_K_M}
    if s.arch == 'gemma4':
        header['feed_forward_length'] = _gemma4_ff(s)
    for key, value in header.items():
        getattr(w, f'add_{key}')(value)
    if s.arch == 'gemma4':
        pattern, owners = gemma4_layout(s)
        w.add_sliding_window_pattern(pattern)
        w.add_shared_kv_layers(s.layers - owners)
        w.add_key_length_swa(int(x['swa_head_dim']))
        w.add_value_length_swa(int(x['swa_head_dim']))
        w.add_rope_dimension_count_swa(int(x['swa_head_dim']))
        w.add_rope_freq_base_swa(float(x['rope_swa']))
        w.add_embedding_length_per_layer_input(int(x['per_layer']))
        w.add_final_logit_softcapping(float(x['softcap']))
    if 'sliding_window' in x:
        w.add_sliding_window(int(x['sliding_window']))
    if 'rope_sections' in x:
        w.add_rope_dimension_sections(list(x['rope_sections']))
    if 'deepstack' in x:
        w.add_num_deepstack_layers(int(x['deepstack']))
    if 'conv_kernel' in x:
        w.add_shortconv_l_cache(int(x['conv_kernel']))
    if 'gdn' in x:
        kernel, k_heads, v_heads, d = x['gdn']
        rot = int(x['rope_dims']) // 2
        first = -(-rot // 3)
        w.add_rope_dimension_sections([first, first, rot - 2 * first, 0])
        w.add_ssm_conv_kernel(kernel)
        w.add_ssm_state_size(d)
        w.add_ssm_group_count(k_heads)
        w.add_ssm_time_step_rank(v_heads)
        w.add_ssm_inner_size(v_heads * d)
        w.add_full_attention_interval(int(x['interval']))
    if 'longrope_orig' in x:
        orig = int(x['longrope_orig'])
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(s.context / orig) /
                                                  math.log(orig)))
        w.add_sliding_window(0)
    tokens, types, ids = vocabulary(s)
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre(s.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(['Ġ w', 'Ġw 1'])
    w.add_bos_token_id(ids['bos'])
    w.add_eos_token_id(ids['eos'])
    w.add_add_bos_token(bool(x.get('r1_specials')))
    w.add_chat_template(R1_TEMPLATE if x.get('r1_specials') else CHATML)
    plan = gguf_plan(s)
    for tname, tshape, qtype in plan:
        if qtype == 'F32':
            w.add_tensor_info(tname, tshape, np.dtype(np.float32), 4 * math.prod(tshape))
        elif qtype == 'F16':
            w.add_tensor_info(tname, tshape, np.dtype(np.float16), 2 * tshape[0] * tshape[1])
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            nbytes = tshape[0] * tshape[1] // block * size
            w.add_tensor_info(tname, (tshape[0], tshape[1] // block * size),
                              np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    maker = BlockMaker(seed)
    rng = np.random.default_rng(seed + 1)
    for tname, tshape, qtype in plan:
        if qtype == 'F32':
            w.write_tensor_data(_vector(tname, tshape[0], s, rng))
        else:
            w.write_tensor_data(maker.matrix(tshape[0], tshape[1], qtype))
    w.close()
    os.replace(part, path)
    return path


def _kv_heads(s: Shape):
    """Return head_count_kv: one count, or (lfm2) one per layer, 0 for a conv layer."""
    if s.arch != 'lfm2':
        return s.kv_heads
    return [s.kv_heads if i in s.extra['attention_layers'] else 0 for i in range(s.layers)]


def convert_peak_rss(gguf_path: pathlib.Path, out_dir: pathlib.Path,
                     weights: Optional[str] = None) -> dict:
    """Convert in a child process; return its peak RSS, wall time and the sizes.

    The peak is that child's own (wait4's rusage), not the largest of every child so far.
    """
    import tempfile
    cmd = [sys.executable, '-m', 'edge_llm_ros.convert.converter', str(gguf_path), str(out_dir),
           '--force', '--quiet'] + (['--weights', weights] if weights else [])
    t0 = time.monotonic()
    with tempfile.TemporaryFile('w+') as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f'conversion failed ({proc.returncode}): {err.read()[-2000:]}')
    size = gguf_path.stat().st_size
    out_size = sum(f.stat().st_size for f in out_dir.iterdir())
    peak = usage.ru_maxrss * 1024  # KiB on Linux
    return {'gguf': str(gguf_path), 'gguf_bytes': size, 'onnx_folder_bytes': out_size,
            'weights': weights or 'default', 'peak_rss_bytes': peak,
            'rss_over_gguf': peak / size, 'seconds': round(time.monotonic() - t0, 1)}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: write (and optionally convert) one shape; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('shape', nargs='?', choices=sorted(SHAPES))
    p.add_argument('out', nargs='?', help='the .gguf to write')
    p.add_argument('--list', action='store_true', help='print the shapes and exit')
    p.add_argument('--layers', type=int, default=None, help='fewer layers (same layer shape)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--convert', metavar='OUT_DIR', default=None,
                   help='convert the file and print peak RSS vs file size (JSON)')
    p.add_argument('--weights', default=None, choices=('kquant', 'matmulnbits'),
                   help="--convert's weight format (default: the converter's)")
    args = p.parse_args(argv)
    if args.list or not args.shape:
        for k, v in SHAPES.items():
            print(f'{k:12s} {v.arch:7s} {v.covers}')
        return 0
    if not args.out:
        p.error('give the output .gguf path')
    out = pathlib.Path(args.out)
    if not out.is_file():
        write_random_gguf(out, args.shape, args.seed, args.layers)
    print(json.dumps({'gguf': str(out), 'bytes': out.stat().st_size}))
    if args.convert:
        print(json.dumps(convert_peak_rss(out, pathlib.Path(args.convert), args.weights)))
    return 0


if __name__ == '__main__':
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    sys.exit(main())

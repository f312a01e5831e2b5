"""Tiny random GGUFs per architecture and tensor type, written the way llama.cpp expects them.

Real metadata keys and tensor names/layouts (gguf's constants), a 289-token byte-level BPE
vocabulary llama.cpp loads (tiny_model's), and shapes that are multiples of 256 so every
K-quant and IQ type has whole super-blocks. Matrices are stored in `ParityCase.wtype`; norm
vectors and rope_freqs stay F32 as llama.cpp's converter writes them.

Types gguf.quants can encode (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from
random float weights. For the others (K-quants, IQ4_NL, IQ4_XS), which gguf-py cannot
encode, blocks are random bytes with their fp16 super-scales set so the dequantized rows have
the wanted spread: a valid block of that type, just not one llama-quantize would pick.
"""
from dataclasses import dataclass
import pathlib
from typing import Dict, Optional, Tuple, Union

import gguf
import numpy as np
from tiny_model import (add_tokenizer, BOS_ID, EOS_ID, llama_cpp_permute, tiny_vocab,
                        TinyDims, write_hf_folder)

from edge_llm_ros.convert.architectures import llama3_rope_factors

# Byte offsets of the fp16 scale fields inside one block, per type gguf-py cannot encode
# (ggml-common.h block layouts): (d offset, dmin offset or None, dmin / d). dmin / d is the
# mean code, so that with random scales and mins (same mean) the weights are centred, as
# blocks quantized from real weights are.
RAW_SCALE_FIELDS: Dict[str, Tuple[int, Optional[int], float]] = {
    'Q2_K': (80, 82, 1.5), 'Q3_K': (108, None, 0.0), 'Q4_K': (0, 2, 7.5),
    'Q5_K': (0, 2, 15.5), 'Q6_K': (208, None, 0.0), 'IQ4_NL': (0, None, 0.0),
    'IQ4_XS': (0, None, 0.0),
}
# lfm2: hidden 256, heads of 64, GQA 4/2, RoPE base 1e6 (LFM2's), a conv layer on either
# side of an attention layer (LFM2's first and last layers are conv), a conv kernel of 3
# (LFM2's l_cache). Three layers: each matmul adds llama.cpp's activation rounding, which the
# conv layers' products B * x * C amplify (5 layers: ~0.5 of llama.cpp's own logits off the
# exact ones).
LFM2_DIMS = TinyDims(hidden=256, layers=3, heads=4, kv_heads=2, intermediate=512, context=1024,
                     rms_eps=1e-5, key_length=64, rope_theta=1e6)
LFM2_CONV_KERNEL = 3


def layer_kinds(case: 'ParityCase') -> Tuple[str, ...]:
    """Return each layer's kind: 'attention', or 'conv' (lfm2: the odd layers attend)."""
    if case.arch != 'lfm2':
        return ('attention',) * case.dims.layers
    return tuple('attention' if i % 2 else 'conv' for i in range(case.dims.layers))


@dataclass(frozen=True)
class ParityCase:
    """One tiny model: family, tensor type of the matrices, and the family's options."""

    arch: str = 'llama'
    wtype: str = 'Q8_0'
    seed: int = 0
    # Multiples of 256 (K-quant super-blocks); qwen3 uses head_dim 64 too (of hidden / heads).
    dims: TinyDims = TinyDims(hidden=256, intermediate=512, rms_eps=1e-6, key_length=64)
    tied: bool = False
    llama3_rope: bool = False  # write a rope_freqs tensor (Llama 3.1 scaling, original ctx 64)
    linear_rope: float = 0.0   # rope.scaling.type linear with this factor
    chain: float = 0.25        # weight of the head's next-token term (see random_weights)
    # gemma3: sliding_window (0: none) and the sliding_window_pattern key (0: not written,
    # llama.cpp's period 6 applies); rope_freq_base_swa key (0: not written).
    window: int = 0
    swa_pattern: int = 0
    swa_base: float = 0.0
    # phi3: LongRoPE factors (short/long tensors, original context 256 = the runner's
    # context, so llama.cpp picks the short ones) and the rotated share of each head.
    longrope: bool = False
    rotary: float = 1.0
    softcap: float = 0.0  # gemma3 final_logit_softcapping key (llama.cpp uses it without SWA)
    vision: Union[bool, str] = False  # the image wrapper tokens: tiny_vocab(vision)
    # qwen2vl: rope.dimension_sections (t, h, w, 0) in rotary pairs (Qwen2.5-VL's 16:24:24).
    rope_sections: Tuple[int, ...] = (8, 12, 12, 0)

    @property
    def tag(self) -> str:
        d = self.dims
        extra = ('' if d == ParityCase.dims else f'-h{d.heads}x{d.head_dim}')
        extra += ('-l3rope' if self.llama3_rope else '') + (
            f'-lin{self.linear_rope:g}' if self.linear_rope else '') + (
            '-tied' if self.tied else '')
        extra += (f'-w{self.window}p{self.swa_pattern}' if self.window else '') + (
            f'-swab{self.swa_base:g}' if self.swa_base else '') + (
            '-longrope' if self.longrope else '') + (
            f'-rot{self.rotary:g}' if self.rotary != 1.0 else '') + (
            f'-cap{self.softcap:g}' if self.softcap else '') + ('-vlm' if self.vision else '')
        return f'{self.arch}-{self.wtype.lower()}-s{self.seed}{extra}'

    @property
    def rope_dims(self) -> int:
        return int(self.rotary * self.dims.head_dim)


def random_weights(case: ParityCase) -> Dict[str, np.ndarray]:
    """Float32 weights in HF layout (NEOX Q/K rows), scaled 1/sqrt(fan_in)."""
    rng = np.random.default_rng(case.seed)
    vocab = len(tiny_vocab(case.vision))
    c, d = case, case.dims
    hd = d.head_dim

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # A tied head reads the embedding: smaller rows keep its logits in a trained model's range.
    w = {'embed': (rng.standard_normal((vocab, d.hidden)) * (0.3 if c.tied else 1.0)
                   ).astype(np.float32),
         'final_norm': norm(d.hidden)}
    if not c.tied:
        w['lm_head'] = mat(vocab, d.hidden, 4.0)  # write_gguf adds the next-token term
    kinds = layer_kinds(c)
    for i in range(d.layers):
        p = f'{i}.'
        w[p + 'attn_norm'], w[p + 'ffn_norm'] = norm(d.hidden), norm(d.hidden)
        if kinds[i] == 'conv':
            # B, C, x rows; a depthwise kernel per channel (the oldest position first).
            w[p + 'in_proj'] = mat(3 * d.hidden, d.hidden)
            w[p + 'conv'] = mat(d.hidden, LFM2_CONV_KERNEL)
            w[p + 'out_proj'] = mat(d.hidden, d.hidden)
            w[p + 'gate'] = mat(d.intermediate, d.hidden)
            w[p + 'up'] = mat(d.intermediate, d.hidden)
            w[p + 'down'] = mat(d.hidden, d.intermediate)
            continue
        w[p + 'q'] = mat(d.heads * hd, d.hidden)
        w[p + 'k'] = mat(d.kv_heads * hd, d.hidden)
        w[p + 'v'] = mat(d.kv_heads * hd, d.hidden)
        w[p + 'o'] = mat(d.hidden, d.heads * hd)
        w[p + 'gate'] = mat(d.intermediate, d.hidden)
        w[p + 'up'] = mat(d.intermediate, d.hidden)
        w[p + 'down'] = mat(d.hidden, d.intermediate)
        if c.arch in ('qwen2', 'qwen2vl'):
            for r, n in (('q', d.heads), ('k', d.kv_heads), ('v', d.kv_heads)):
                w[f'{p}{r}_bias'] = (0.1 * rng.standard_normal(n * hd)).astype(np.float32)
        if c.arch in ('qwen3', 'gemma3', 'lfm2'):
            w[p + 'q_norm'], w[p + 'k_norm'] = norm(hd), norm(hd)
        if c.arch == 'gemma3':  # GGUF values: llama.cpp's converter has added HF's +1
            # Large post-norms, as trained Gemmas have: the blocks' outputs then weigh
            # against the embedding (scaled by sqrt(hidden) = 16) in the residual stream, so
            # attention features (window, RoPE bases) show in the logits.
            w[p + 'post_attn_norm'] = 8 * norm(d.hidden)
            w[p + 'post_ffn_norm'] = 8 * norm(d.hidden)
    return w


def longrope_factors(n: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Short and long LongRoPE factors (short near 1, long up to ~16: clearly different)."""
    rng = np.random.default_rng(seed + 7)
    short = 1.0 + 0.5 * rng.random(n)
    long = np.geomspace(1.0, 16.0, n) * (1.0 + 0.1 * rng.random(n))
    return short.astype(np.float32), long.astype(np.float32)


def random_blocks(rows: int, cols: int, wtype: str, std: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a type gguf-py cannot encode, rows dequantizing to ~std spread."""
    qtype = gguf.GGMLQuantizationType[wtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d_at, dmin_at, dmin_ratio = RAW_SCALE_FIELDS[wtype]

    def set_scales(d: np.ndarray) -> None:
        for at, f in ((d_at, 1.0), (dmin_at, dmin_ratio)):
            if at is not None:
                f16 = (d * f).astype(np.float16)[..., None]
                raw[..., at:at + 2] = np.ascontiguousarray(f16).view(np.uint8)

    set_scales(np.ones(raw.shape[:2]))
    spread = float(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    # Random signs per block: IQ4's grid is not centred, and one sign everywhere would give
    # every matrix a common bias that swamps the rest.
    set_scales(std / spread * rng.choice([-1.0, 1.0], size=raw.shape[:2]))
    return raw.reshape(rows, -1)


def write_gguf(path, case: ParityCase, header: Optional[Dict[str, object]] = None,
               skip: Tuple[str, ...] = (), tokenizer: Optional[Dict[str, str]] = None
               ) -> pathlib.Path:
    """Write the case's GGUF (all matrices in case.wtype) and return its path.

    header overrides what the header says (keys: head_count, rope_scaling_type, ...; the
    tensors keep the case's shapes) to make contradicting files; skip leaves out tensors
    whose name contains one of its strings; tokenizer: add_tokenizer's pre / template.
    """
    path = pathlib.Path(path)
    if case.arch == 'qwen35':
        return write_qwen35_gguf(path, case)
    c, d = case, case.dims
    w = random_weights(c)
    rng = np.random.default_rng(c.seed + 1000)
    vocab = tiny_vocab(c.vision)
    writer = gguf.GGUFWriter(str(path), c.arch)
    meta = {'block_count': d.layers, 'context_length': d.context,
            'embedding_length': d.hidden, 'feed_forward_length': d.intermediate,
            'head_count': d.heads, 'head_count_kv': d.kv_heads, 'key_length': d.head_dim,
            'value_length': d.head_dim, 'rope_freq_base': d.rope_theta,
            'layer_norm_rms_eps': d.rms_eps, 'rope_dimension_count': c.rope_dims,
            'vocab_size': len(vocab)}
    if c.linear_rope:
        meta.update(rope_scaling_type=gguf.RopeScalingType.LINEAR,
                    rope_scaling_factor=c.linear_rope)
    if c.window:
        meta['sliding_window'] = c.window
    if c.swa_pattern:
        meta['sliding_window_pattern'] = c.swa_pattern
    if c.swa_base:
        meta['rope_freq_base_swa'] = c.swa_base
    if c.softcap:
        meta['final_logit_softcapping'] = c.softcap
    if c.arch == 'qwen2vl':
        meta['rope_dimension_sections'] = list(c.rope_sections)
    if c.arch == 'phi3':
        meta['sliding_window'] = 0  # what llama.cpp's converter writes for Phi-4
    if c.arch == 'lfm2':
        # KV heads per layer, 0 for a conv layer (llama.cpp's LFM2Model.set_gguf_parameters).
        meta['head_count_kv'] = [d.kv_heads if k == 'attention' else 0 for k in layer_kinds(c)]
        meta['shortconv_l_cache'] = LFM2_CONV_KERNEL
    if c.longrope:
        # As convert_hf_to_gguf for a 4096-context model trained at 256.
        meta.update(rope_scaling_orig_ctx_len=256,
                    rope_scaling_attn_factors=float(np.sqrt(1 + np.log(16) / np.log(256))),
                    context_length=4096)
    meta.update(header or {})
    # llama.cpp looks up Phi-3's SPM specials (<s>, </s>, <unk>) when the name says phi3.
    writer.add_name(f'tiny-{c.tag}'.replace('phi3', 'p-iii'))
    for key, value in meta.items():
        if key == 'rope_scaling_type' and isinstance(value, str):
            writer.add_string(f'{c.arch}.rope.scaling.type', value)  # any name, even unknown
        else:
            getattr(writer, f'add_{key}')(value)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer, vocab, c.arch, **(tokenizer or {}))

    def put(name: str, x: np.ndarray, matrix: bool = True, wtype: str = c.wtype) -> np.ndarray:
        """Store x (as wtype when a matrix); return the values llama.cpp will read."""
        if any(part in name for part in skip):
            return x
        if not matrix or wtype == 'F32':
            data, qtype = x.astype(np.float32), None
        elif wtype == 'F16':
            data, qtype = x.astype(np.float16), None
        elif wtype in RAW_SCALE_FIELDS:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = random_blocks(x.shape[0], x.shape[1], wtype, float(x.std()), rng)
        else:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = gguf.quants.quantize(x, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        if qtype is None:
            return data.astype(np.float32)
        return gguf.quants.dequantize(data, qtype).reshape(x.shape)

    # Types made of random blocks keep the embedding and head in Q8_0 (as Q4_K_M files keep
    # the head in Q6_K): random 6-bit mins give every row a large common offset, which
    # would drown the next-token term below.
    edge_type = 'Q8_0' if c.wtype in RAW_SCALE_FIELDS else c.wtype
    embed = put('token_embd.weight', w['embed'], wtype=edge_type)
    # lfm2's final norm is token_embd_norm (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2).
    put('token_embd_norm.weight' if c.arch == 'lfm2' else 'output_norm.weight',
        w['final_norm'], matrix=False)
    if 'lm_head' in w:
        # A random head plus a strong 'next token' term (row j reads the embedding of token
        # j - 1): like a trained head, the top logit stands clear of the next one, so
        # llama.cpp's own activation rounding (~1% of a logit) makes no near-tie.
        head = w['lm_head'] + c.chain * np.roll(embed, 1, axis=0)
        put('output.weight', head, wtype=edge_type)
    if c.llama3_rope:
        s = LLAMA3_SCALING
        factors = llama3_rope_factors(d.head_dim, d.rope_theta, s['factor'],
                                      s['low_freq_factor'], s['high_freq_factor'],
                                      s['original_max_position_embeddings'])
        put('rope_freqs.weight', np.array(factors, np.float32), matrix=False)
    if c.longrope:
        short, long = longrope_factors(c.rope_dims // 2, c.seed)
        put('rope_factors_long.weight', long, matrix=False)
        put('rope_factors_short.weight', short, matrix=False)
    names = {'q': 'attn_q', 'k': 'attn_k', 'v': 'attn_v', 'o': 'attn_output',
             'gate': 'ffn_gate', 'up': 'ffn_up', 'down': 'ffn_down',
             'in_proj': 'shortconv.in_proj', 'out_proj': 'shortconv.out_proj'}
    for i in range(d.layers):
        p = f'{i}.'
        if c.arch == 'phi3':  # fused q|k|v and gate|up rows, as Phi-3 stores them
            put(f'blk.{i}.attn_qkv.weight', np.concatenate([w[p + r] for r in 'qkv']))
            put(f'blk.{i}.attn_output.weight', w[p + 'o'])
            put(f'blk.{i}.ffn_up.weight', np.concatenate([w[p + 'gate'], w[p + 'up']]))
            put(f'blk.{i}.ffn_down.weight', w[p + 'down'])
        for role, gname in (names.items() if c.arch != 'phi3' else ()):
            if p + role not in w:
                continue   # lfm2: a conv layer has no q/k/v/o, an attention layer no conv
            x = w[p + role]
            if c.arch == 'llama' and role in ('q', 'k'):
                x = llama_cpp_permute(x, d.heads if role == 'q' else d.kv_heads)
            put(f'blk.{i}.{gname}.weight', x)
        if p + 'conv' in w:   # F32, as llama.cpp's ggml_ssm_conv reads it
            put(f'blk.{i}.shortconv.conv.weight', w[p + 'conv'], matrix=False)
        put(f'blk.{i}.attn_norm.weight', w[p + 'attn_norm'], matrix=False)
        put(f'blk.{i}.ffn_norm.weight', w[p + 'ffn_norm'], matrix=False)
        for role, gname in (('post_attn_norm', 'post_attention_norm'),
                            ('post_ffn_norm', 'post_ffw_norm')):
            if p + role in w:
                put(f'blk.{i}.{gname}.weight', w[p + role], matrix=False)
        for role in ('q', 'k', 'v'):
            if p + role + '_bias' in w:
                put(f'blk.{i}.attn_{role}.bias', w[p + role + '_bias'], matrix=False)
        for role in ('q', 'k'):
            if p + role + '_norm' in w:
                put(f'blk.{i}.attn_{role}_norm.weight', w[p + role + '_norm'], matrix=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA3_SCALING = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                  'high_freq_factor': 4.0, 'original_max_position_embeddings': 64}


def write_hf(folder, case: ParityCase) -> pathlib.Path:
    """Write the case's float weights (before any GGUF encoding) as an HF folder (F32)."""
    c, d = case, case.dims
    w = random_weights(c)
    if 'lm_head' in w:
        w['lm_head'] = w['lm_head'] + c.chain * np.roll(w['embed'], 1, axis=0)
    scaling = None
    if c.llama3_rope:
        scaling = dict(LLAMA3_SCALING)
    elif c.linear_rope:
        scaling = {'rope_type': 'linear', 'factor': c.linear_rope}
    if c.longrope:
        short, long = longrope_factors(c.rope_dims // 2, c.seed)
        scaling = {'rope_type': 'longrope', 'short_factor': short.tolist(),
                   'long_factor': long.tolist()}
    config = {
        'model_type': c.arch, 'hidden_size': d.hidden, 'intermediate_size': d.intermediate,
        'num_hidden_layers': d.layers, 'num_attention_heads': d.heads,
        'num_key_value_heads': d.kv_heads, 'head_dim': d.head_dim,
        'max_position_embeddings': d.context, 'rms_norm_eps': d.rms_eps,
        'rope_theta': d.rope_theta, 'rope_scaling': scaling, 'vocab_size': len(tiny_vocab()),
        'tie_word_embeddings': c.tied, 'bos_token_id': BOS_ID, 'eos_token_id': EOS_ID,
        'hidden_act': 'silu'}
    if c.arch == 'phi3':
        config.update(partial_rotary_factor=c.rotary)
        if c.longrope:  # as the GGUF: trained at 256, extended to 4096
            config.update(original_max_position_embeddings=256, max_position_embeddings=4096)
    if c.arch == 'gemma3':
        # HF stores Gemma norms minus 1 (Gemma3RMSNorm computes x * (1 + w)).
        w = {k: v - 1 if k.endswith('norm') else v for k, v in w.items()}
        config.update(model_type='gemma3_text', hidden_activation='gelu_pytorch_tanh',
                      query_pre_attn_scalar=d.head_dim, rope_local_base_freq=c.swa_base or 1e4,
                      sliding_window=c.window or None, final_logit_softcapping=None)
        del config['hidden_act']
        if c.window:
            period = c.swa_pattern or 6
            config['layer_types'] = ['sliding_attention' if i % period < period - 1 else
                                     'full_attention' for i in range(d.layers)]
    if c.arch == 'lfm2':
        # Lfm2Config's keys, as LFM2 releases write them: the FFN width is 2/3 of
        # block_ff_dim rounded up to block_multiple_of, the norms' eps is norm_eps.
        ff_dim = d.intermediate * 3 // 2
        config.update(architectures=['Lfm2ForCausalLM'], intermediate_size=ff_dim,
                      block_ff_dim=ff_dim, block_auto_adjust_ff_dim=True,
                      block_ffn_dim_multiplier=1.0, block_multiple_of=256, norm_eps=d.rms_eps,
                      conv_L_cache=LFM2_CONV_KERNEL, conv_bias=False,
                      layer_types=['conv' if k == 'conv' else 'full_attention'
                                   for k in layer_kinds(c)])
        for key in ('head_dim', 'rms_norm_eps', 'rope_scaling', 'hidden_act'):
            del config[key]
    return write_hf_folder(folder, w, config)


# qwen35 (Qwen3.5 dense): hidden 256, a Gated DeltaNet layer on either side of a gated
# attention layer (full_attention_interval 2), DeltaNet heads of 64 (2 key heads, 4 value
# heads: value head h reads key head h % 2), a conv kernel of 4 (Qwen3.5's), attention heads
# of 64 (4 query, 2 KV) with a quarter of each head rotated (Qwen3.5's partial rotary, as
# llama.cpp's IMROPE sections over text positions).
QWEN35_DIMS = TinyDims(hidden=256, layers=3, heads=4, kv_heads=2, intermediate=512,
                       context=1024, rms_eps=1e-6, key_length=64, rope_theta=1e7)
QWEN35_GDN = {'kernel': 4, 'k_heads': 2, 'v_heads': 4, 'head_dim': 64, 'interval': 2}


def rope_sections(rotary_dims: int) -> list:
    """IMROPE sections as Qwen3.5 writes them: 3 of the rotated pairs' share, the last 0."""
    pairs = rotary_dims // 2
    first = -(-pairs // 3)
    return [first, first, pairs - 2 * first, 0]


def qwen35_case(wtype: str, seed: int = 0, **options) -> ParityCase:
    """Return the qwen35 parity case of `wtype` (QWEN35_DIMS, a quarter of each head rotated)."""
    return ParityCase('qwen35', wtype, seed, **dict({'dims': QWEN35_DIMS, 'rotary': 0.25},
                                                    **options))


# Qwen3.5-0.8B's layer shapes (hidden 1024, FFN 3584; DeltaNet 16 key and 16 value heads of
# 128; attention 8/2 heads of 256, 64 dims rotated, RoPE base 1e7; every 4th layer attends),
# over 4 layers: 3 DeltaNet layers and an attention layer.
QWEN35_08B_DIMS = TinyDims(hidden=1024, layers=4, heads=8, kv_heads=2, intermediate=3584,
                           context=1024, rms_eps=1e-6, key_length=256, rope_theta=1e7)
QWEN35_08B_GDN = {'kernel': 4, 'k_heads': 16, 'v_heads': 16, 'head_dim': 128, 'interval': 4}


def write_qwen35_gguf(path: pathlib.Path, case: ParityCase,
                      gdn: Optional[Dict[str, int]] = None) -> pathlib.Path:
    """Write a random qwen35 GGUF as llama.cpp's converter lays it out (gdn: QWEN35_GDN)."""
    c, d, g = case, case.dims, gdn or QWEN35_GDN
    rng = np.random.default_rng(c.seed)
    qrng = np.random.default_rng(c.seed + 1000)
    vocab = tiny_vocab(c.vision)
    hd, gd = d.head_dim, g['head_dim']
    channels = (2 * g['k_heads'] + g['v_heads']) * gd

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), 'qwen35')
    writer.add_name(f'tiny-{c.tag}')
    for key, value in (('block_count', d.layers), ('context_length', d.context),
                       ('embedding_length', d.hidden), ('feed_forward_length', d.intermediate),
                       ('head_count', d.heads), ('head_count_kv', d.kv_heads),
                       ('key_length', hd), ('value_length', hd),
                       ('rope_freq_base', d.rope_theta), ('layer_norm_rms_eps', d.rms_eps),
                       ('rope_dimension_count', c.rope_dims),
                       ('rope_dimension_sections', rope_sections(c.rope_dims)),
                       ('ssm_conv_kernel', g['kernel']), ('ssm_state_size', gd),
                       ('ssm_group_count', g['k_heads']), ('ssm_time_step_rank', g['v_heads']),
                       ('ssm_inner_size', g['v_heads'] * gd),
                       ('full_attention_interval', g['interval']),
                       ('vocab_size', len(vocab))):
        getattr(writer, f'add_{key}')(value)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer, vocab, 'qwen35', pre='qwen35')

    def put(name: str, x: np.ndarray, matrix: bool = True, wtype: str = c.wtype) -> np.ndarray:
        if not matrix or wtype == 'F32':
            data, qtype = x.astype(np.float32), None
        elif wtype == 'F16':
            data, qtype = x.astype(np.float16), None
        elif wtype in RAW_SCALE_FIELDS:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = random_blocks(x.shape[0], x.shape[1], wtype, float(x.std()), qrng)
        else:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = gguf.quants.quantize(x, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        if qtype is None:
            return data.astype(np.float32)
        return gguf.quants.dequantize(data, qtype).reshape(x.shape)

    edge_type = 'Q8_0' if c.wtype in RAW_SCALE_FIELDS else c.wtype
    embed = put('token_embd.weight', rng.standard_normal((len(vocab), d.hidden))
                .astype(np.float32), wtype=edge_type)
    put('output_norm.weight', norm(d.hidden), matrix=False)
    head = mat(len(vocab), d.hidden, 4.0) + c.chain * np.roll(embed, 1, axis=0)
    put('output.weight', head, wtype=edge_type)
    for i in range(d.layers):
        b = f'blk.{i}.'
        put(b + 'attn_norm.weight', norm(d.hidden), matrix=False)
        put(b + 'post_attention_norm.weight', norm(d.hidden), matrix=False)
        if (i + 1) % g['interval']:
            put(b + 'attn_qkv.weight', mat(channels, d.hidden))
            put(b + 'attn_gate.weight', mat(g['v_heads'] * gd, d.hidden))
            put(b + 'ssm_conv1d.weight', mat(channels, g['kernel'], 2.0), matrix=False)
            put(b + 'ssm_dt.bias', (0.5 * rng.standard_normal(g['v_heads'])).astype(np.float32),
                matrix=False)
            put(b + 'ssm_a', -rng.uniform(0.2, 2.0, g['v_heads']).astype(np.float32),
                matrix=False)
            put(b + 'ssm_beta.weight', mat(g['v_heads'], d.hidden))
            put(b + 'ssm_alpha.weight', mat(g['v_heads'], d.hidden))
            put(b + 'ssm_norm.weight', norm(gd), matrix=False)
            put(b + 'ssm_out.weight', mat(d.hidden, g['v_heads'] * gd))
        else:
            put(b + 'attn_q.weight', mat(2 * d.heads * hd, d.hidden))
            put(b + 'attn_k.weight', mat(d.kv_heads * hd, d.hidden))
            put(b + 'attn_v.weight', mat(d.kv_heads * hd, d.hidden))
            put(b + 'attn_output.weight', mat(d.hidden, d.heads * hd))
            put(b + 'attn_q_norm.weight', norm(hd), matrix=False)
            put(b + 'attn_k_norm.weight', norm(hd), matrix=False)
        put(b + 'ffn_gate.weight', mat(d.intermediate, d.hidden))
        put(b + 'ffn_up.weight', mat(d.intermediate, d.hidden))
        put(b + 'ffn_down.weight', mat(d.hidden, d.intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

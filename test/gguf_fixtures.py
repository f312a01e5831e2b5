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
import json
import pathlib
from typing import Dict, List, Optional, Tuple, Union

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
    # qwen3vl: n_deepstack_layers (the image rows are this many hidden widths wider).
    deepstack: int = 0

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
        if c.arch in ('qwen3', 'qwen3vl', 'gemma3', 'gemma-embedding', 'lfm2'):
            w[p + 'q_norm'], w[p + 'k_norm'] = norm(hd), norm(hd)
        # GGUF values: llama.cpp's converter has added HF's +1.
        if c.arch in ('gemma3', 'gemma-embedding'):
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
               skip: Tuple[str, ...] = (), tokenizer: Optional[Dict[str, object]] = None,
               rank_rows: Tuple[int, ...] = (), dense: int = 0,
               tokens: Tuple[str, ...] = ()) -> pathlib.Path:
    """Write the case's GGUF (all matrices in case.wtype) and return its path.

    header overrides what the header says (keys: head_count, rope_scaling_type, ...; the
    tensors keep the case's shapes) to make contradicting files; skip leaves out tensors
    whose name contains one of its strings; tokenizer: add_tokenizer's pre / template.
    rank_rows: write cls.output.weight as these rows of the head, as llama.cpp's converter
    writes a Qwen3-Reranker's (the 'yes' and 'no' rows of lm_head). dense: write
    EmbeddingGemma's dense_2 [dense, hidden] and dense_3 [hidden, dense] and their keys.
    tokens: plain tokens appended to the vocabulary (no merge makes them: a Qwen3-Reranker's
    'yes' and 'no'), their embedding and head rows drawn after the case's own weights.
    """
    path = pathlib.Path(path)
    if case.arch == 'qwen35':
        return write_qwen35_gguf(path, case)
    if case.arch == 'granitehybrid':
        return write_granite_gguf(path, case)
    c, d = case, case.dims
    w = random_weights(c)
    rng = np.random.default_rng(c.seed + 1000)
    vocab = tiny_vocab(c.vision) + list(tokens)
    if tokens:
        more = np.random.default_rng(c.seed + 2000)
        for key in ('embed', 'lm_head'):
            if key in w:
                rows = more.standard_normal((len(tokens), d.hidden)) * w[key].std()
                w[key] = np.concatenate([w[key], rows.astype(np.float32)])
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
    if c.arch in ('qwen2vl', 'qwen3vl'):
        meta['rope_dimension_sections'] = list(c.rope_sections)
    if c.arch == 'qwen3vl':
        meta['num_deepstack_layers'] = c.deepstack
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
    if rank_rows:
        source = head if 'lm_head' in w else w['embed']
        # A fifth of the rows: P(yes) then spreads over (0, 1) rather than saturating.
        put('cls.output.weight', 0.2 * source[list(rank_rows)], wtype=edge_type)
    if dense:
        writer.add_dense_features_dims('dense_2', d.hidden, dense)
        writer.add_dense_features_dims('dense_3', dense, d.hidden)
        for name, shape in (('dense_2', (dense, d.hidden)), ('dense_3', (d.hidden, dense))):
            put(f'{name}.weight', (rng.standard_normal(shape) / np.sqrt(shape[1])
                                   ).astype(np.float32))
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
            if c.arch in ('llama', 'smollm3') and role in ('q', 'k'):
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
    if c.arch == 'smollm3':   # SmolLM3Config: 1 = the layer rotates
        config['no_rope_layers'] = [int((i + 1) % 4 != 0) for i in range(d.layers)]
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


# smollm3: the llama skeleton with 4 layers, so that the fourth attends without RoPE
# (llama.cpp's n_no_rope_layer_step 4); heads of 64, GQA 4/2.
SMOLLM3_DIMS = TinyDims(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                        rms_eps=1e-6, key_length=64)


def smollm3_case(wtype: str, seed: int = 0, **options) -> ParityCase:
    """Return the smollm3 parity case of `wtype` (SMOLLM3_DIMS)."""
    return ParityCase('smollm3', wtype, seed, **dict({'dims': SMOLLM3_DIMS}, **options))


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


def tensor_writer(writer: gguf.GGUFWriter, wtype: str, qrng: np.random.Generator):
    """Return put(name, x, matrix=True, wtype=wtype): add x to the writer in its type.

    Vectors (matrix=False) stay F32; put returns the values llama.cpp will read.
    """
    default = wtype

    def put(name: str, x: np.ndarray, matrix: bool = True, wtype: str = default) -> np.ndarray:
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
    return put


def put_edges(put, case: ParityCase, rng: np.random.Generator, vocab: int, norm,
              embed_gain: float = 1.0) -> None:
    """Write the embedding, final norm and head (Q8_0 for K-quant cases; a next-token term)."""
    d = case.dims
    edge_type = 'Q8_0' if case.wtype in RAW_SCALE_FIELDS else case.wtype
    rows = rng.standard_normal((vocab, d.hidden))
    embed = put('token_embd.weight', (rows if embed_gain == 1.0 else rows * embed_gain)
                .astype(np.float32), wtype=edge_type)
    put('output_norm.weight', norm(d.hidden), matrix=False)
    head = (rng.standard_normal((vocab, d.hidden)) * 4.0 / np.sqrt(d.hidden)).astype(np.float32)
    chain = case.chain * np.roll(embed if embed_gain == 1.0 else embed / embed_gain, 1, axis=0)
    put('output.weight', head + chain, wtype=edge_type)


def qwen35_weights(case: ParityCase, gdn: Optional[Dict[str, int]] = None
                   ) -> Dict[str, np.ndarray]:
    """Return a random qwen35's float32 tensors under their GGUF names (gdn: QWEN35_GDN).

    output.weight is the head before the next-token term (added on the embedding as stored);
    A_log stands for ssm_a, which is -exp(A_log) (as llama.cpp's converter makes it).
    """
    c, d, g = case, case.dims, gdn or QWEN35_GDN
    rng = np.random.default_rng(c.seed)
    hd, gd = d.head_dim, g['head_dim']
    channels = (2 * g['k_heads'] + g['v_heads']) * gd

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {'token_embd.weight': rng.standard_normal((len(tiny_vocab(c.vision)), d.hidden))
         .astype(np.float32)}
    w['output_norm.weight'] = norm(d.hidden)
    w['output.weight'] = mat(len(tiny_vocab(c.vision)), d.hidden, 4.0)
    for i in range(d.layers):
        b = f'blk.{i}.'
        w[b + 'attn_norm.weight'] = norm(d.hidden)
        w[b + 'post_attention_norm.weight'] = norm(d.hidden)
        if (i + 1) % g['interval']:
            w[b + 'attn_qkv.weight'] = mat(channels, d.hidden)
            w[b + 'attn_gate.weight'] = mat(g['v_heads'] * gd, d.hidden)
            w[b + 'ssm_conv1d.weight'] = mat(channels, g['kernel'], 2.0)
            w[b + 'ssm_dt.bias'] = (0.5 * rng.standard_normal(g['v_heads'])).astype(np.float32)
            w[b + 'A_log'] = np.log(rng.uniform(0.2, 2.0, g['v_heads'])).astype(np.float32)
            w[b + 'ssm_beta.weight'] = mat(g['v_heads'], d.hidden)
            w[b + 'ssm_alpha.weight'] = mat(g['v_heads'], d.hidden)
            w[b + 'ssm_norm.weight'] = norm(gd)
            w[b + 'ssm_out.weight'] = mat(d.hidden, g['v_heads'] * gd)
        else:
            w[b + 'attn_q.weight'] = mat(2 * d.heads * hd, d.hidden)
            w[b + 'attn_k.weight'] = mat(d.kv_heads * hd, d.hidden)
            w[b + 'attn_v.weight'] = mat(d.kv_heads * hd, d.hidden)
            w[b + 'attn_output.weight'] = mat(d.hidden, d.heads * hd)
            w[b + 'attn_q_norm.weight'] = norm(hd)
            w[b + 'attn_k_norm.weight'] = norm(hd)
        w[b + 'ffn_gate.weight'] = mat(d.intermediate, d.hidden)
        w[b + 'ffn_up.weight'] = mat(d.intermediate, d.hidden)
        w[b + 'ffn_down.weight'] = mat(d.hidden, d.intermediate)
    return w


# qwen35 tensors stored as F32 vectors (and the conv kernel, as ggml_ssm_conv reads it).
_QWEN35_VECTORS = ('norm.weight', 'ssm_conv1d.weight', 'ssm_dt.bias', 'ssm_a')


def write_qwen35_gguf(path: pathlib.Path, case: ParityCase,
                      gdn: Optional[Dict[str, int]] = None) -> pathlib.Path:
    """Write a random qwen35 GGUF as llama.cpp's converter lays it out (gdn: QWEN35_GDN)."""
    c, d, g = case, case.dims, gdn or QWEN35_GDN
    w = qwen35_weights(c, g)
    qrng = np.random.default_rng(c.seed + 1000)
    vocab = tiny_vocab(c.vision)
    hd, gd = d.head_dim, g['head_dim']
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

    put = tensor_writer(writer, c.wtype, qrng)
    edge_type = 'Q8_0' if c.wtype in RAW_SCALE_FIELDS else c.wtype
    embed = put('token_embd.weight', w.pop('token_embd.weight'), wtype=edge_type)
    put('output_norm.weight', w.pop('output_norm.weight'), matrix=False)
    put('output.weight', w.pop('output.weight') + c.chain * np.roll(embed, 1, axis=0),
        wtype=edge_type)
    for name, x in w.items():
        if name.endswith('.A_log'):
            name, x = name.replace('A_log', 'ssm_a'), -np.exp(x)
        put(name, x, matrix=not name.endswith(_QWEN35_VECTORS))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# GGUF name in a layer -> Qwen3.5's HF name (Qwen3_5TextModel).
_QWEN35_HF = {'attn_norm.weight': 'input_layernorm.weight',
              'post_attention_norm.weight': 'post_attention_layernorm.weight',
              'attn_q.weight': 'self_attn.q_proj.weight',
              'attn_k.weight': 'self_attn.k_proj.weight',
              'attn_v.weight': 'self_attn.v_proj.weight',
              'attn_output.weight': 'self_attn.o_proj.weight',
              'attn_q_norm.weight': 'self_attn.q_norm.weight',
              'attn_k_norm.weight': 'self_attn.k_norm.weight',
              'ffn_gate.weight': 'mlp.gate_proj.weight', 'ffn_up.weight': 'mlp.up_proj.weight',
              'ffn_down.weight': 'mlp.down_proj.weight',
              'attn_qkv.weight': 'linear_attn.in_proj_qkv.weight',
              'attn_gate.weight': 'linear_attn.in_proj_z.weight',
              'ssm_conv1d.weight': 'linear_attn.conv1d.weight',
              'ssm_dt.bias': 'linear_attn.dt_bias', 'A_log': 'linear_attn.A_log',
              'ssm_beta.weight': 'linear_attn.in_proj_b.weight',
              'ssm_alpha.weight': 'linear_attn.in_proj_a.weight',
              'ssm_norm.weight': 'linear_attn.norm.weight',
              'ssm_out.weight': 'linear_attn.out_proj.weight'}


def write_qwen35_hf(folder, case: ParityCase, multimodal: bool = False,
                    gdn: Optional[Dict[str, int]] = None) -> pathlib.Path:
    """Write the case's float32 weights as a Qwen3.5 HF folder (the F32 GGUF's twin).

    Undoes what llama.cpp's converter does: norms (but the DeltaNet's) stored minus one, the
    conv kernel as Conv1d's [channels, 1, kernel], and the value heads in HF's
    grouped order (value head h reads key head h // (v / k); the GGUF tiles them).
    multimodal: Qwen3_5ForConditionalGeneration's layout (text_config, language_model).
    """
    from safetensors.numpy import save_file
    c, d, g = case, case.dims, gdn or QWEN35_GDN
    w = qwen35_weights(c, g)
    gd, kh, vh = g['head_dim'], g['k_heads'], g['v_heads']
    qk = 2 * kh * gd

    def grouped(x: np.ndarray, size: int, axis: int = 0) -> np.ndarray:
        """Tiled value heads (GGUF) back to HF's grouped order along `axis`."""
        x = np.moveaxis(x, axis, 0)
        rest = x.shape[1:]
        x = x.reshape(vh // kh, kh, size, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
        return np.moveaxis(x.reshape(vh * size, *rest), 0, axis)

    prefix = 'model.language_model.' if multimodal else 'model.'
    embed = w.pop('token_embd.weight')
    out = {prefix + 'embed_tokens.weight': embed,
           prefix + 'norm.weight': w.pop('output_norm.weight') - 1,
           'lm_head.weight': w.pop('output.weight') + c.chain * np.roll(embed, 1, axis=0)}
    for name, x in w.items():
        _, i, role = name.split('.', 2)
        if role.endswith('norm.weight') and role != 'ssm_norm.weight':
            x = x - 1
        if role in ('attn_qkv.weight', 'ssm_conv1d.weight'):
            x = np.concatenate([x[:qk], grouped(x[qk:], gd)])
        elif role == 'attn_gate.weight':
            x = grouped(x, gd)
        elif role in ('ssm_beta.weight', 'ssm_alpha.weight', 'A_log', 'ssm_dt.bias'):
            x = grouped(x, 1)
        elif role == 'ssm_out.weight':
            x = grouped(x, gd, axis=1)
        if role == 'ssm_conv1d.weight':
            x = x[:, None, :]
        out[f'{prefix}layers.{i}.{_QWEN35_HF[role]}'] = x
    folder = write_hf_folder(folder, {'embed': embed, 'final_norm': embed[0]},
                             {'model_type': 'qwen3_5_text', 'num_hidden_layers': 0})
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in out.items()},
              str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    text = {'model_type': 'qwen3_5_text', 'num_hidden_layers': d.layers,
            'hidden_size': d.hidden, 'intermediate_size': d.intermediate,
            'num_attention_heads': d.heads, 'num_key_value_heads': d.kv_heads,
            'head_dim': d.head_dim, 'rms_norm_eps': d.rms_eps,
            'max_position_embeddings': d.context, 'hidden_act': 'silu',
            'attn_output_gate': True, 'tie_word_embeddings': False,
            'vocab_size': len(tiny_vocab(c.vision)), 'linear_conv_kernel_dim': g['kernel'],
            'linear_key_head_dim': gd, 'linear_value_head_dim': gd,
            'linear_num_key_heads': kh, 'linear_num_value_heads': vh,
            'full_attention_interval': g['interval'],
            'layer_types': ['linear_attention' if (i + 1) % g['interval'] else
                            'full_attention' for i in range(d.layers)],
            'rope_parameters': {'rope_type': 'default', 'rope_theta': d.rope_theta,
                                'partial_rotary_factor': c.rotary,
                                'mrope_section': rope_sections(c.rope_dims)[:3],
                                'mrope_interleaved': True}}
    config = ({'model_type': 'qwen3_5', 'architectures': ['Qwen3_5ForConditionalGeneration'],
               'text_config': text, 'vision_config': {'depth': 0}} if multimodal
              else dict(text, architectures=['Qwen3_5ForCausalLM']))
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    return folder


# granitehybrid (Granite 4.0-H dense, Micro's kinds of layers): hidden 256, a Mamba-2 layer on
# either side of an attention layer (4 heads of 64, 2 KV, no RoPE: rope.scaling.finetuned
# false, as Granite 4.0-H writes it), Mamba-2 with d_inner = 2 x hidden (llama.cpp's only
# expansion) in 8 heads of 64, 2 groups of B and C of 64 (Micro: 1 group of 128), a conv
# kernel of 4, and Granite's four multipliers (Micro's embedding and residual scales, an
# attention scale of 1 / head_dim; a logit scale of 2: Micro's 8 squeezes random logits into
# near-ties).
GRANITE_DIMS = TinyDims(hidden=256, layers=3, heads=4, kv_heads=2, intermediate=512,
                        context=1024, rms_eps=1e-5, key_length=64)
GRANITE_SSM = {'kernel': 4, 'heads': 8, 'groups': 2, 'state': 64, 'attention': (1,)}
GRANITE_SSM_OUT_GAIN = 4.0
GRANITE_SCALES = {'embedding_scale': 12.0, 'residual_scale': 0.22,
                  'attention_scale': 1 / 64, 'logit_scale': 2.0}


def granite_case(wtype: str, seed: int = 0, **options) -> ParityCase:
    """Return the granitehybrid parity case of `wtype` (GRANITE_DIMS)."""
    return ParityCase('granitehybrid', wtype, seed, **dict({'dims': GRANITE_DIMS}, **options))


def write_granite_gguf(path: pathlib.Path, case: ParityCase, ssm: Optional[dict] = None,
                       moe: bool = False, rope: bool = False,
                       from_a_log: bool = False) -> pathlib.Path:
    """Write a random granitehybrid GGUF as llama.cpp's converter lays it out.

    ssm: GRANITE_SSM's keys (attention: the attention layers' indices); moe: the FFNs of a
    mixture-of-experts variant (H-Tiny / H-Small: router and expert tensors) instead; rope:
    rope.scaling.finetuned true (Granite's switch on: the attention layers rotate);
    from_a_log: ssm_a = -exp(A_log) of a float32 A_log, as the converter makes it from a
    checkpoint (not every float32 is an exp of one: write_granite_hf needs this).
    """
    c, d, m = case, case.dims, ssm or GRANITE_SSM
    rng = np.random.default_rng(c.seed)
    vocab = tiny_vocab(c.vision)
    hd = d.head_dim
    inner = 2 * d.hidden
    channels = inner + 2 * m['groups'] * m['state']

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), 'granitehybrid')
    writer.add_name(f'tiny-{c.tag}')
    kv = [d.kv_heads if i in m['attention'] else 0 for i in range(d.layers)]
    for key, value in (('block_count', d.layers), ('context_length', d.context),
                       ('embedding_length', d.hidden), ('feed_forward_length', d.intermediate),
                       ('head_count', d.heads), ('head_count_kv', kv),
                       ('key_length', hd), ('value_length', hd),
                       ('rope_freq_base', d.rope_theta), ('layer_norm_rms_eps', d.rms_eps),
                       ('rope_scaling_finetuned', rope),
                       ('ssm_conv_kernel', m['kernel']), ('ssm_state_size', m['state']),
                       ('ssm_group_count', m['groups']), ('ssm_time_step_rank', m['heads']),
                       ('ssm_inner_size', inner), ('vocab_size', len(vocab)),
                       *GRANITE_SCALES.items()):
        getattr(writer, f'add_{key}')(value)
    if moe:
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer, vocab, 'granitehybrid')
    put = tensor_writer(writer, c.wtype, np.random.default_rng(c.seed + 1000))
    # Embedding rows of RMS 1 / embedding_scale, as a trained model's (the scale brings
    # them to 1): the layers' outputs, times residual_scale, then weigh in the logits.
    put_edges(put, case, rng, len(vocab), norm, 1 / GRANITE_SCALES['embedding_scale'])
    for i in range(d.layers):
        b = f'blk.{i}.'
        put(b + 'attn_norm.weight', norm(d.hidden), matrix=False)
        put(b + 'ffn_norm.weight', norm(d.hidden), matrix=False)
        if i in m['attention']:
            # q and k of gain 4: scores of a few units under Granite's 1 / head_dim scale
            # (gain 1 leaves the attention near-uniform, blind to positions and RoPE); their
            # rows permuted for llama.cpp's interleaved RoPE, as its converter writes them.
            put(b + 'attn_q.weight', llama_cpp_permute(mat(d.heads * hd, d.hidden, 4.0),
                                                       d.heads))
            put(b + 'attn_k.weight', llama_cpp_permute(mat(d.kv_heads * hd, d.hidden, 4.0),
                                                       d.kv_heads))
            put(b + 'attn_v.weight', mat(d.kv_heads * hd, d.hidden))
            put(b + 'attn_output.weight', mat(d.hidden, d.heads * hd))
        else:
            put(b + 'ssm_in.weight', mat(inner + channels + m['heads'], d.hidden))
            put(b + 'ssm_conv1d.weight', mat(channels, m['kernel'], 2.0), matrix=False)
            put(b + 'ssm_conv1d.bias', (0.1 * rng.standard_normal(channels)).astype(np.float32),
                matrix=False)
            put(b + 'ssm_dt.bias', (0.5 * rng.standard_normal(m['heads'])).astype(np.float32),
                matrix=False)
            rate = rng.uniform(0.5, 4.0, (m['heads'], 1)).astype(np.float32)
            if from_a_log:
                rate = np.exp(np.log(rate))   # float32 in, float32 out: an exp of a float32
            put(b + 'ssm_a', -rate, matrix=False)
            put(b + 'ssm_d', rng.uniform(0.5, 1.5, (m['heads'], 1)).astype(np.float32),
                matrix=False)
            put(b + 'ssm_norm.weight', norm(inner).reshape(m['groups'], -1), matrix=False)
            put(b + 'ssm_out.weight', mat(d.hidden, inner, GRANITE_SSM_OUT_GAIN))
        if moe:
            put(b + 'ffn_gate_inp.weight', mat(4, d.hidden), matrix=False)
            for name, shape in (('gate', (d.intermediate, d.hidden)),
                                ('up', (d.intermediate, d.hidden)),
                                ('down', (d.hidden, d.intermediate))):
                put(b + f'ffn_{name}_exps.weight',
                    np.stack([mat(*shape) for _ in range(4)]), matrix=False)
            continue
        put(b + 'ffn_gate.weight', mat(d.intermediate, d.hidden))
        put(b + 'ffn_up.weight', mat(d.intermediate, d.hidden))
        put(b + 'ffn_down.weight', mat(d.hidden, d.intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_granite_hf(folder, gguf_path: pathlib.Path, ssm: Optional[dict] = None,
                     moe: bool = False) -> pathlib.Path:
    """Write an F32 granitehybrid GGUF's weights as its GraniteMoeHybrid HF folder (its twin).

    Undoes what llama.cpp's converter does: q / k rows back from the interleaved RoPE pairs,
    gate and up rows fused into shared_mlp.input_linear, ssm_a as A_log (an A_log whose float32
    -exp is ssm_a exactly: a GGUF written with from_a_log), Conv1d's [channels, 1, kernel],
    dt_bias, D and the grouped norm as vectors. moe: num_local_experts 4 in the config
    (H-Tiny's kind), for the refusal.
    """
    from safetensors.numpy import save_file
    m, d = ssm or GRANITE_SSM, GRANITE_DIMS
    reader = gguf.GGUFReader(str(gguf_path))
    w = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}

    def unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
        rows = x.shape[0]
        return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2) \
            .reshape(x.shape)

    out = {'model.embed_tokens.weight': w['token_embd.weight'],
           'model.norm.weight': w['output_norm.weight'],
           'lm_head.weight': w['output.weight']}
    for i in range(d.layers):
        b, h = f'blk.{i}.', f'model.layers.{i}.'
        out[h + 'input_layernorm.weight'] = w[b + 'attn_norm.weight']
        out[h + 'post_attention_layernorm.weight'] = w[b + 'ffn_norm.weight']
        out[h + 'shared_mlp.input_linear.weight'] = np.concatenate(
            [w[b + 'ffn_gate.weight'], w[b + 'ffn_up.weight']])
        out[h + 'shared_mlp.output_linear.weight'] = w[b + 'ffn_down.weight']
        if i in m['attention']:
            out[h + 'self_attn.q_proj.weight'] = unpermute(w[b + 'attn_q.weight'], d.heads)
            out[h + 'self_attn.k_proj.weight'] = unpermute(w[b + 'attn_k.weight'], d.kv_heads)
            out[h + 'self_attn.v_proj.weight'] = w[b + 'attn_v.weight']
            out[h + 'self_attn.o_proj.weight'] = w[b + 'attn_output.weight']
            continue
        out[h + 'mamba.in_proj.weight'] = w[b + 'ssm_in.weight']
        out[h + 'mamba.conv1d.weight'] = w[b + 'ssm_conv1d.weight'][:, None, :]
        out[h + 'mamba.conv1d.bias'] = w[b + 'ssm_conv1d.bias']
        out[h + 'mamba.dt_bias'] = w[b + 'ssm_dt.bias']
        out[h + 'mamba.A_log'] = a_log_of(w[b + 'ssm_a'].reshape(-1))
        out[h + 'mamba.D'] = w[b + 'ssm_d'].reshape(-1)
        out[h + 'mamba.norm.weight'] = w[b + 'ssm_norm.weight'].reshape(-1)
        out[h + 'mamba.out_proj.weight'] = w[b + 'ssm_out.weight']
    folder = write_hf_folder(folder, {'embed': out['model.embed_tokens.weight'],
                                      'final_norm': out['model.norm.weight']},
                             {'model_type': 'granitemoehybrid', 'num_hidden_layers': 0})
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in out.items()},
              str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    config = {'architectures': ['GraniteMoeHybridForCausalLM'],
              'model_type': 'granitemoehybrid', 'hidden_size': d.hidden,
              'num_hidden_layers': d.layers, 'num_attention_heads': d.heads,
              'num_key_value_heads': d.kv_heads, 'intermediate_size': d.intermediate,
              'shared_intermediate_size': d.intermediate, 'hidden_act': 'silu',
              'rms_norm_eps': d.rms_eps, 'rope_theta': d.rope_theta,
              'max_position_embeddings': d.context, 'position_embedding_type': 'nope',
              'tie_word_embeddings': False, 'vocab_size': out['lm_head.weight'].shape[0],
              'layer_types': ['attention' if i in m['attention'] else 'mamba'
                              for i in range(d.layers)],
              'mamba_d_conv': m['kernel'], 'mamba_d_state': m['state'],
              'mamba_n_groups': m['groups'], 'mamba_n_heads': m['heads'],
              'mamba_d_head': 2 * d.hidden // m['heads'], 'mamba_expand': 2,
              'mamba_conv_bias': True, 'mamba_proj_bias': False,
              'num_local_experts': 4 if moe else 0, 'num_experts_per_tok': 2 if moe else 0,
              'embedding_multiplier': GRANITE_SCALES['embedding_scale'],
              'residual_multiplier': GRANITE_SCALES['residual_scale'],
              'attention_multiplier': GRANITE_SCALES['attention_scale'],
              'logits_scaling': GRANITE_SCALES['logit_scale']}
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    return folder


def a_log_of(a: np.ndarray) -> np.ndarray:
    """Return float32 A_log with -exp(A_log) (float32, as the converter takes it) equal to a."""
    a = a.astype(np.float32)
    x = np.log(-a.astype(np.float64)).astype(np.float32)
    found = np.zeros(a.shape, bool)
    best = x.copy()
    for step in range(9):   # x, then its neighbours 1..4 ulps either side
        k = (step + 1) // 2 * (1 if step % 2 else -1)
        cand = (x.view(np.int32) + np.int32(k)).view(np.float32)
        hit = ~found & (-np.exp(cand) == a)
        best[hit], found = cand[hit], found | hit
    assert found.all(), 'no float32 A_log gives these ssm_a values exactly'
    return best


# --- gemma4 -----------------------------------------------------------------------------------
# Four layers: sliding-window, global, then two shared-KV layers (a sliding-window one
# reading layer 0, a global one reading layer 1, as llama.cpp picks them). Global heads of
# 128 with 1 KV head and proportional RoPE (a quarter rotated: the rope_freqs divisors of
# 1e30 stop the rest), sliding-window heads of 64 with 2 KV heads,
# per-layer embeddings of 256, the shared layers' MLPs twice as wide (use_double_wide_mlp).
GEMMA4_PATTERN = (True, False, True, False)


@dataclass(frozen=True)
class Gemma4Case:
    """One tiny gemma4 model: tensor type of the matrices, seed and the family's options."""

    wtype: str = 'Q8_0'
    # Seed, next-token term and a written soft cap of 100 (llama.cpp caps at 30 without the
    # key, where random heads saturate into near-ties) picked on llama.cpp's margins alone.
    seed: int = 3
    hidden: int = 256
    heads: int = 4
    head_dim: int = 128
    kv_heads: int = 1
    local_head_dim: int = 64
    local_kv_heads: int = 2
    intermediate: int = 512
    per_layer: int = 256
    shared: int = 2
    window: int = 6
    softcap: float = 100.0
    chain: float = 0.5
    pattern: Tuple[bool, ...] = GEMMA4_PATTERN
    proportional: bool = True   # rope_freqs stops 3/4 of the global heads' pairs
    out_scale: bool = True      # layer_output_scale tensors
    post_gain: float = 2.0      # the post-norms' weights (8 as gemma3's: near-ties)
    arch: str = 'gemma4'
    vision: bool = False        # Gemma 4's image wrapper tokens in the vocabulary (gemma4v)

    @property
    def tag(self) -> str:
        import hashlib
        # Every option in the name: files (and llama.cpp's cached logits) never collide.
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:8]
        return f'gemma4-{self.wtype.lower()}-s{self.seed}-{digest}'

    @property
    def layers(self) -> int:
        return len(self.pattern)

    def layer_dims(self, i: int) -> Tuple[int, int]:
        """(head size, KV heads) of layer i."""
        if self.pattern[i]:
            return self.local_head_dim, self.local_kv_heads
        return self.head_dim, self.kv_heads

    def layer_ff(self, i: int) -> int:
        return self.intermediate * (2 if i >= self.layers - self.shared else 1)

    def owns_kv(self, i: int) -> bool:
        return i < self.layers - self.shared


def gemma4_weights(case: Gemma4Case) -> Dict[str, np.ndarray]:
    """Float32 weights under GGUF names (NEOX Q/K rows), scaled 1/sqrt(fan_in)."""
    rng = np.random.default_rng(case.seed)
    vocab = len(tiny_vocab('gemma4' if case.vision else False))
    c, h, e = case, case.hidden, case.per_layer

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int, gain: float = 1.0) -> np.ndarray:
        return (gain * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    w = {'token_embd.weight': rng.standard_normal((vocab, h)).astype(np.float32),
         'output_norm.weight': norm(h), 'output.weight': mat(vocab, h, 4.0)}
    if e:
        w.update({'per_layer_token_embd.weight': rng.standard_normal(
                      (vocab, e * c.layers)).astype(np.float32),
                  'per_layer_model_proj.weight': mat(e * c.layers, h),
                  'per_layer_proj_norm.weight': norm(e)})
    rot = c.head_dim // 8 if c.proportional else c.head_dim // 2
    w['rope_freqs.weight'] = np.array([1.0] * rot + [1e30] * (c.head_dim // 2 - rot),
                                      np.float32)
    for i in range(c.layers):
        p = f'blk.{i}.'
        d, kv = c.layer_dims(i)
        ff = c.layer_ff(i)
        w[p + 'attn_norm.weight'], w[p + 'ffn_norm.weight'] = norm(h), norm(h)
        w[p + 'attn_q.weight'] = mat(c.heads * d, h)
        # q/k norm weights of d**-0.25 each: attention scores of 1/sqrt(d) spread under
        # Gemma 4's scale of 1 (ones would make every softmax a near one-hot).
        w[p + 'attn_q_norm.weight'] = norm(d, d ** -0.25)
        if c.owns_kv(i):
            w[p + 'attn_k.weight'] = mat(kv * d, h, 4.0)
            w[p + 'attn_v.weight'] = mat(kv * d, h)
            w[p + 'attn_k_norm.weight'] = norm(d, d ** -0.25)
        w[p + 'attn_output.weight'] = mat(h, c.heads * d)
        w[p + 'ffn_gate.weight'] = mat(ff, h)
        w[p + 'ffn_up.weight'] = mat(ff, h)
        w[p + 'ffn_down.weight'] = mat(h, ff)
        # Large post-norms as trained Gemmas have (see random_weights' gemma3).
        w[p + 'post_attention_norm.weight'] = norm(h, c.post_gain)
        w[p + 'post_ffw_norm.weight'] = norm(h, c.post_gain)
        if e:
            w[p + 'inp_gate.weight'] = mat(e, h)
            w[p + 'proj.weight'] = mat(h, e)
            w[p + 'post_norm.weight'] = norm(h, c.post_gain / 2)
        if c.out_scale:
            w[p + 'layer_output_scale.weight'] = np.array([0.6 + 0.1 * i], np.float32)
    return w


def gemma4_vocab() -> Tuple[List[str], List[int], List[str]]:
    """Return a tiny vocabulary of Gemma 4's kind (tokenizer model 'gemma4').

    Tokens, their types and the merges: its specials and markers, <0xXX> byte pieces, '▁'
    for spaces, letters and newline runs, and merges building a few words; padded with
    unused pieces to tiny_vocab()'s size (the fixture's embedding rows).
    """
    specials = ['<pad>', '<eos>', '<bos>', '<unk>', '<|turn>', '<turn|>', '<|tool_call>',
                '<tool_call|>', '<|"|>', '<|channel>', '<channel|>', '<|think|>']
    merges = ['▁ t', 'h e', '▁t he', 'i n', '▁ a', 'r o', 'b o', 'bo t', '▁ ro', '▁ro bot',
              'a r', 'ar m', '▁ arm', 'é t', '\n \n']
    pieces = ['▁'] + [chr(c) for c in range(ord('a'), ord('z') + 1)] + ['é', '\n']
    pieces += [m.replace(' ', '') for m in merges]
    # Byte pieces for control bytes and UTF-8 sequences (what the texts fall back to): the
    # vocabulary stays within the fixture's embedding rows.
    byte_values = list(range(0x20)) + list(range(0x80, 0x100))
    tokens = specials + [f'<0x{b:02X}>' for b in byte_values] + pieces
    types = ([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.BYTE] * len(byte_values)
             + [gguf.TokenType.NORMAL] * len(pieces))
    types[specials.index('<unk>')] = gguf.TokenType.UNKNOWN
    for t in ('<|tool_call>', '<tool_call|>', '<|"|>', '<|channel>', '<channel|>'):
        types[tokens.index(t)] = gguf.TokenType.USER_DEFINED   # as llama.cpp's converter
    size = len(tiny_vocab())
    assert len(tokens) <= size
    extra = size - len(tokens)
    return (tokens + [f'<unused{i}>' for i in range(extra)],
            [int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * extra, merges)


def add_gemma4_tokenizer(writer: gguf.GGUFWriter) -> None:
    """Write gemma4_vocab() as llama.cpp's converter writes Gemma 4's."""
    tokens, types, merges = gemma4_vocab()
    writer.add_tokenizer_model('gemma4')
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_gemma4_gguf(path, case: Gemma4Case, gemma4_tokenizer: bool = False) -> pathlib.Path:
    """Write the case's gemma4 GGUF (matrices in case.wtype) and return its path.

    gemma4_tokenizer: Gemma 4's own kind of vocabulary (gemma4_vocab) instead of tiny_vocab's
    byte-level BPE.
    """
    path = pathlib.Path(path)
    c = case
    w = gemma4_weights(c)
    rng = np.random.default_rng(c.seed + 1000)
    vocab = tiny_vocab('gemma4' if c.vision else False)
    writer = gguf.GGUFWriter(str(path), 'gemma4')
    writer.add_name(f'tiny-{c.tag}')
    writer.add_block_count(c.layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(c.hidden)
    writer.add_feed_forward_length([c.layer_ff(i) for i in range(c.layers)])
    writer.add_head_count(c.heads)
    writer.add_head_count_kv([c.layer_dims(i)[1] for i in range(c.layers)])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_key_length_swa(c.local_head_dim)
    writer.add_value_length_swa(c.local_head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_dimension_count_swa(c.local_head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_rope_freq_base_swa(1e4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(c.window)
    writer.add_sliding_window_pattern(list(c.pattern))
    writer.add_shared_kv_layers(c.shared)
    writer.add_embedding_length_per_layer_input(c.per_layer)
    if c.softcap:
        writer.add_final_logit_softcapping(c.softcap)
    writer.add_vocab_size(len(vocab))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if gemma4_tokenizer:
        add_gemma4_tokenizer(writer)
    else:
        add_tokenizer(writer, vocab, c.arch)
    edge_type = 'Q8_0' if c.wtype in RAW_SCALE_FIELDS else c.wtype
    embed = None
    for name, x in w.items():
        if x.ndim == 1:
            writer.add_tensor(name, x.astype(np.float32))
            continue
        wtype = edge_type if name in ('token_embd.weight', 'output.weight',
                                      'per_layer_token_embd.weight') else c.wtype
        if name == 'output.weight':
            x = x + c.chain * np.roll(embed, 1, axis=0)   # the next-token term (write_gguf)
        if wtype == 'F32':
            data, qtype = x, None
        elif wtype == 'F16':
            data, qtype = x.astype(np.float16), None
        elif wtype in RAW_SCALE_FIELDS:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = random_blocks(x.shape[0], x.shape[1], wtype, float(x.std()), rng)
        else:
            qtype = gguf.GGMLQuantizationType[wtype]
            data = gguf.quants.quantize(x, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        if name == 'token_embd.weight':
            embed = (data.astype(np.float32) if qtype is None
                     else gguf.quants.dequantize(data, qtype).reshape(x.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_GEMMA4_HF = {'attn_norm': 'input_layernorm', 'ffn_norm': 'pre_feedforward_layernorm',
              'post_attention_norm': 'post_attention_layernorm',
              'post_ffw_norm': 'post_feedforward_layernorm', 'attn_q': 'self_attn.q_proj',
              'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj',
              'attn_output': 'self_attn.o_proj', 'attn_q_norm': 'self_attn.q_norm',
              'attn_k_norm': 'self_attn.k_norm', 'ffn_gate': 'mlp.gate_proj',
              'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj',
              'inp_gate': 'per_layer_input_gate', 'proj': 'per_layer_projection',
              'post_norm': 'post_per_layer_input_norm'}


def write_gemma4_hf(folder, case: Gemma4Case, multimodal: bool = False) -> pathlib.Path:
    """Write the case's float32 weights as a Gemma 4 HF folder (the GGUF's F32 twin).

    multimodal: Gemma4ForConditionalGeneration's layout (text_config, language_model prefix).
    """
    from safetensors.numpy import save_file
    c = case
    w = gemma4_weights(c)
    embed = w['token_embd.weight']
    prefix = 'model.language_model.' if multimodal else 'model.'
    folder = write_hf_folder(folder, {'embed': embed, 'final_norm': w['output_norm.weight']},
                             {'model_type': 'gemma4_text', 'num_hidden_layers': 0})
    (folder / 'model.safetensors').unlink()
    out = {prefix + 'embed_tokens.weight': embed, prefix + 'norm.weight': w['output_norm.weight'],
           'lm_head.weight': w['output.weight'] + c.chain * np.roll(embed, 1, axis=0),
           prefix + 'embed_tokens_per_layer.weight': w['per_layer_token_embd.weight'],
           prefix + 'per_layer_model_projection.weight': w['per_layer_model_proj.weight'],
           prefix + 'per_layer_projection_norm.weight': w['per_layer_proj_norm.weight']}
    for name, x in w.items():
        if not name.startswith('blk.'):
            continue
        _, i, role, _ = name.split('.')
        hname = 'layer_scalar' if role == 'layer_output_scale' else \
            f'{_GEMMA4_HF[role]}.weight'
        out[f'{prefix}layers.{i}.{hname}'] = x
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in out.items()},
              str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    text = {'model_type': 'gemma4_text', 'num_hidden_layers': c.layers,
            'hidden_size': c.hidden, 'intermediate_size': c.intermediate,
            'num_attention_heads': c.heads, 'num_key_value_heads': c.local_kv_heads,
            'num_global_key_value_heads': c.kv_heads, 'head_dim': c.local_head_dim,
            'global_head_dim': c.head_dim, 'rms_norm_eps': 1e-6, 'sliding_window': c.window,
            'layer_types': ['sliding_attention' if p else 'full_attention'
                            for p in c.pattern],
            'num_kv_shared_layers': c.shared, 'use_double_wide_mlp': True,
            'hidden_size_per_layer_input': c.per_layer, 'final_logit_softcapping': c.softcap,
            'max_position_embeddings': 1024, 'tie_word_embeddings': False,
            'hidden_activation': 'gelu_pytorch_tanh', 'vocab_size': len(tiny_vocab()),
            'rope_parameters': {
                'full_attention': {'rope_type': 'proportional', 'rope_theta': 1e6,
                                   'partial_rotary_factor': 0.25 if c.proportional else 1.0},
                'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}}
    config = {'model_type': 'gemma4', 'text_config': text} if multimodal else text
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    return folder

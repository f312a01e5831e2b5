"""Decoder-family GGUFs as embedding / rerank graphs: Qwen3-Embedding / -Reranker, EmbeddingGemma.

Same inputs and outputs as encoder_graph.py's BERT graph: `input_ids` and `attention_mask`
int64 [B, T] (rows right-padded) in, `hidden` float32 [B, T, H] out: the final RMSNorm's states
(llama.cpp's result_norm, which it pools), and with rank pooling `rank_scores` [B, labels]:
the row's last token through cls.output and a softmax, as llama.cpp's build_pooling does for
qwen3 (the reranker's labels are 'yes' and 'no'; its score is the first, P(yes)).

The layers are llama.cpp's src/models/qwen3.cpp without a KV cache: RMSNorm, q/k/v, per-head
RMSNorm of q and k, NEOX RoPE at positions 0..T-1, causal attention over the row's own tokens
(grouped KV heads), the output projection, RMSNorm and a SwiGLU MLP, pre-norm residuals.
llama.cpp keeps k and v in its float16 cache and rounds q and the attention weights to
float16 for its F16 matmuls; the graph rounds them alike. Matrices stay in their GGUF types
(encoder_graph.linear).

EmbeddingGemma (`gemma-embedding`, llama.cpp's src/models/gemma-embedding.cpp) is gemma3
attending both ways: embeddings times sqrt(H), q scaled by 1/sqrt(d) before q.k, a symmetric
sliding window (|i - j| <= window / 2) on its local layers with their own RoPE base,
post-attention and post-FFN RMSNorms, a GELU (tanh, ggml's float16 table) MLP; no KV cache in
llama.cpp, so nothing is rounded to float16 there. Its GGUF's dense projections (dense_2,
dense_3: sentence-transformers' Dense modules) follow the pooling, so that graph also pools:
`pooled` [B, D] is the mean over the row's tokens through dense_2 and dense_3, which
runtime/encoder.py then takes as the vector.

A separate graph, not an output added to the chat graph: the chat graph
(onnx_graph.DecoderGraph) is the decode hot path, with its KV cache I/O, varlen rows and
logits on the last positions only; an embedder needs none of that, only every row's states
in one call, so it gets the plain batched graph the BERT encoders have and is served by the
same runtime (runtime/encoder.py), while the chat graph stays as it is.
"""
from typing import BinaryIO, Optional

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.encoder_graph import (EncoderSource, HIDDEN, IDS, linear, MASK, OPSET,
                                                POOLED, RANK, rope, rope_angles, token_rows)
from edge_llm_ros.convert.onnx_graph import IR_VERSION, KQUANT_DOMAIN
from edge_llm_ros.convert.vision_graph import _f16, _gelu, _Graph
from edge_llm_ros.errors import UnsupportedModelError
from edge_llm_ros.model_format import DATA_FILE

GEMMA = 'gemma-embedding'


def _rms_norm(g: _Graph, m: EncoderSource, x: str, name: str) -> str:
    """Return x / sqrt(mean(x^2) + eps) * weight over the last axis (ggml_rms_norm)."""
    mean = g.node('ReduceMean', [g.node('Mul', [x, x]), g.const([-1])], keepdims=1)
    rstd = g.node('Reciprocal', [g.node('Sqrt', [g.node('Add', [
        mean, g.const(np.float32(m.spec.eps), np.float32)])])])
    return g.node('Mul', [g.node('Mul', [x, rstd]), g.init(name, m.array(name))])


def _mask_bias(g: _Graph, causal: bool, window: int = 0) -> str:
    """[B, 1, 1, T, T] additive mask: 0 where query i may see key j, else -3e38.

    Key j must be a token; causal: j <= i; window: |i - j| <= window / 2 (llama.cpp's
    symmetric sliding window).
    """
    t = g.node('Gather', [g.node('Shape', [IDS]), g.const(1)], axis=0)
    idx = g.node('Range', [g.const(0), t, g.const(1)])
    keys_at, queries_at = (g.node('Unsqueeze', [idx, g.const([0])]),
                           g.node('Unsqueeze', [idx, g.const([1])]))
    allowed = g.node('Unsqueeze', [g.node('Cast', [MASK], to=TensorProto.BOOL), g.const([1])])
    if causal:
        allowed = g.node('And', [g.node('LessOrEqual', [keys_at, queries_at]), allowed])
    if window:
        dist = g.node('Abs', [g.node('Sub', [keys_at, queries_at])])
        near = g.node('LessOrEqual', [dist, g.const(window // 2)])
        allowed = g.node('And', [near, allowed])
    bias = g.node('Where', [allowed, g.const(0.0, np.float32),
                            g.const(np.float32(-3.0e38), np.float32)])
    return g.node('Unsqueeze', [bias, g.const([1, 2])])


def _attention(g: _Graph, m: EncoderSource, x: str, bias: str, rope_cs: tuple, i: int) -> str:
    s = m.spec
    b = f'blk.{i}'
    d, group = s.head_dim, s.heads // s.kv_heads

    gemma = s.arch == GEMMA
    f16 = (lambda t: t) if gemma else (lambda t: _f16(g, t))  # gemma: no F16 KV cache

    def heads_of(role: str, n: int) -> str:
        t = g.node('Reshape', [linear(g, m, x, f'{b}.attn_{role}'), g.const([0, 0, n, d])])
        if role in 'qk':
            t = rope(g, _rms_norm(g, m, t, f'{b}.attn_{role}_norm.weight'), *rope_cs, d // 2)
        if role == 'q' and gemma:  # q / sqrt(d) first, then q.k unscaled (as llama.cpp)
            t = g.node('Mul', [t, g.const(np.float32(1.0 / np.sqrt(d)), np.float32)])
        return g.node('Transpose', [f16(t)], perm=[0, 2, 1, 3])   # [B, n, T, d]

    q = g.node('Reshape', [heads_of('q', s.heads), g.const([0, s.kv_heads, group, -1, d])])
    k = g.node('Unsqueeze', [heads_of('k', s.kv_heads), g.const([2])])   # [B, kv, 1, T, d]
    v = g.node('Unsqueeze', [heads_of('v', s.kv_heads), g.const([2])])
    scores = g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 2, 4, 3])])
    if not gemma:
        scores = g.node('Mul', [scores, g.const(np.float32(1.0 / np.sqrt(d)), np.float32)])
    probs = f16(g.node('Softmax', [g.node('Add', [scores, bias])], axis=-1))
    attn = g.node('Reshape', [g.node('MatMul', [probs, v]), g.const([0, s.heads, -1, d])])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, 0, s.heads * d])])
    return linear(g, m, merged, f'{b}.attn_output')


def _layer(g: _Graph, m: EncoderSource, x: str, bias: str, rope_cs: tuple, i: int) -> str:
    b = f'blk.{i}'
    gemma = m.spec.arch == GEMMA
    attn = _attention(g, m, _rms_norm(g, m, x, f'{b}.attn_norm.weight'), bias, rope_cs, i)
    if gemma:
        attn = _rms_norm(g, m, attn, f'{b}.post_attention_norm.weight')
    h = g.node('Add', [attn, x])
    n = _rms_norm(g, m, h, f'{b}.ffn_norm.weight')
    gate = linear(g, m, n, f'{b}.ffn_gate')
    act = _gelu(g, gate) if gemma else g.node('Mul', [gate, g.node('Sigmoid', [gate])])
    out = linear(g, m, g.node('Mul', [act, linear(g, m, n, f'{b}.ffn_up')]), f'{b}.ffn_down')
    if gemma:
        out = _rms_norm(g, m, out, f'{b}.post_ffw_norm.weight')
    return g.node('Add', [out, h])


def _pooled(g: _Graph, m: EncoderSource) -> str:
    """Return the mean of the row's states [B, H] through dense_2 and dense_3 (gemma)."""
    keep = g.node('Unsqueeze', [g.node('Cast', [MASK], to=TensorProto.FLOAT), g.const([2])])
    total = g.node('ReduceSum', [g.node('Mul', [HIDDEN, keep]), g.const([1])], keepdims=0)
    count = g.node('ReduceSum', [keep, g.const([1])], keepdims=0)                # [B, 1]
    cur = g.node('Div', [total, count])
    for name in ('dense_2', 'dense_3'):
        if m.has(name + '.weight'):
            cur = linear(g, m, cur, name)
    return cur


def _rank_head(g: _Graph, m: EncoderSource) -> str:
    """Return softmax(cls.output @ the row's last state) [B, labels] (llama.cpp's qwen3 rank)."""
    last = g.node('Sub', [g.node('ReduceSum', [MASK, g.const([1])], keepdims=1), g.const(1)])
    idx = g.node('Expand', [g.node('Unsqueeze', [last, g.const([2])]),
                            g.const([1, 1, m.spec.hidden])])                  # [B, 1, H]
    state = g.node('Reshape', [g.node('GatherElements', [HIDDEN, idx], axis=1),
                               g.const([-1, m.spec.hidden])])
    return g.node('Softmax', [linear(g, m, state, 'cls.output')], axis=-1)


def build_decoder_encoder(m: EncoderSource, data: Optional[BinaryIO] = None) -> onnx.ModelProto:
    """Return the embedding / rerank graph of a decoder GGUF (module docstring)."""
    s = m.spec
    if s.heads % s.kv_heads or s.head_dim % 2:
        raise UnsupportedModelError(f'{m.path}: {s.heads} query heads over {s.kv_heads} KV '
                                    f'heads of size {s.head_dim} is not a {s.arch} layout')
    g = _Graph(data, DATA_FILE)
    gemma = s.arch == GEMMA
    bias = _mask_bias(g, causal=not gemma)
    rope_cs = rope_angles(g, s.rope_base, s.head_dim)
    local = (_mask_bias(g, False, s.window), rope_angles(g, s.local_rope_base, s.head_dim)) \
        if any(s.local_layers) else None
    x = token_rows(g, m)
    if gemma:  # ggml_scale by sqrtf(n_embd)
        x = g.node('Mul', [x, g.const(np.float32(np.sqrt(np.float32(s.hidden))), np.float32)])
    for i in range(s.layers):
        on = local if local and s.local_layers[i] else (bias, rope_cs)
        x = _layer(g, m, x, on[0], on[1], i)
    g.nodes.append(helper.make_node('Identity', [_rms_norm(g, m, x, 'output_norm.weight')],
                                    [HIDDEN], name='hidden'))
    outputs = [helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT,
                                             ['batch', 'tokens', s.hidden])]
    if s.pooling == 'rank':
        if not s.labels:
            raise UnsupportedModelError(f'{m.path}: rank pooling without cls.output.weight (the '
                                        'yes/no rows): convert the reranker with llama.cpp')
        g.nodes.append(helper.make_node('Identity', [_rank_head(g, m)], [RANK], name='rank'))
        outputs.append(helper.make_tensor_value_info(RANK, TensorProto.FLOAT,
                                                     ['batch', s.labels]))
    if m.has('dense_2.weight') or m.has('dense_3.weight'):
        if s.pooling != 'mean':
            raise UnsupportedModelError(f'{m.path}: dense projections after {s.pooling} pooling; '
                                        'EmbeddingGemma pools by the mean')
        g.nodes.append(helper.make_node('Identity', [_pooled(g, m)], [POOLED], name='pooled'))
        outputs.append(helper.make_tensor_value_info(POOLED, TensorProto.FLOAT,
                                                     ['batch', s.hidden]))
    inputs = [helper.make_tensor_value_info(IDS, TensorProto.INT64, ['batch', 'tokens']),
              helper.make_tensor_value_info(MASK, TensorProto.INT64, ['batch', 'tokens'])]
    graph = helper.make_graph(g.nodes, 'edge_llm_decoder_encoder', inputs, outputs,
                              list(g.inits.values()))
    opsets = [helper.make_opsetid('', OPSET), helper.make_opsetid(KQUANT_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    return model

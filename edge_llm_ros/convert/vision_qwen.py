"""Qwen2.5-VL's vision encoder and patch merger (mmproj `qwen2.5vl_merger`) as an ONNX graph.

As llama.cpp's clip_graph_qwen2vl (tools/mtmd/models/qwen2vl.cpp) computes it, for one image of
any size whose sides are multiples of patch x merge (28 for Qwen2.5-VL):
- uint8 `pixels` [F, H, W, 3] normalized as every family's ((u8 / 255 - mean) / std), F
  the frames of one temporal patch: 1 for a still image, 2 for a video chunk;
- the temporal patch of two frames: conv(first frame, kernel 0) + conv(last frame, kernel 1)
  (two stride-p convolutions, no bias): a still image is both frames, as mtmd's n_batch 1,
  a video chunk's two frames go through one kernel each, as its n_batch 2 (qwen2vl.cpp's
  build_inp_with_temporal_merge);
- the patches in merge order: 2 x 2 blocks row by row, each block's patches row by row;
- per layer: RMSNorm, biased q/k/v, 2-D RoPE (NEOX halves; the first quarter of each head's
  pairs turn with the patch's row, the second with its column: the `vision_cos` /
  `vision_sin` inputs, runtime/mmproj_qwen.py), softmax(q k^T x scale + mask) where the layer
  is windowed (`window_mask`: 0 inside a patch's window of 112 pixels, float lowest outside)
  and no mask where (i + 1) % n_wa_pattern == 0, biased output, RMSNorm, SwiGLU MLP
  silu(gate) x up, down;
- v.post_ln (RMSNorm), then each merge block's 4 patches side by side (4 C wide) through
  mm.0, GELU (tanh), mm.2.
llama.cpp regroups the patches window by window and back; attention with the mask over the
patches in their own order is the same computation (test/test_vision_qwen.py checks it
against libmtmd). Output `image_embeds` [1, N / 4, n_out], merged tokens row by row.

Qwen3-VL (`qwen3vl_merger`, clip_graph_qwen3vl) shares the patch embedding (plus its bias),
the merge order and the 2-D RoPE, and differs in:
- learned position embeddings, bilinearly interpolated (align corners) from their square grid
  to the image's and added after the patch bias: `pos_index` / `pos_weight` pick and weigh
  each patch's 4 source rows (runtime/mmproj_qwen.py);
- LayerNorm (weight and bias), a fused biased attn_qkv, full attention in every layer, a
  GELU MLP (ggml's fp16 table, as the merger's);
- DeepStack: after each layer in `deepstack`, its 4 merged patches side by side through
  v.deepstack.<i>.norm (LayerNorm over 4 C), fc1, GELU, fc2; those rows follow the main
  merger's (v.post_ln LayerNorm, mm.0, GELU, mm.2) in each token: [1, N / 4, n_out x (1 + D)].
"""
from typing import BinaryIO, Optional

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.mmproj import Mmproj, QWEN3VL
from edge_llm_ros.convert.onnx_graph import MS_DOMAIN
from edge_llm_ros.convert.vision_graph import (_f16, _gelu, _Graph, _layer_norm, _linear,
                                               _normalized, OPSET)
from edge_llm_ros.model_format import (VISION_INPUT as PIXELS, VISION_POS_INPUTS,
                                       VISION_ROPE_INPUTS, VISION_WINDOW_MASK)

COS, SIN = VISION_ROPE_INPUTS
POS_INDEX, POS_WEIGHT = VISION_POS_INPUTS


def _rms_norm(g: _Graph, mm: Mmproj, x: str, prefix: str) -> str:
    """Return x / sqrt(mean(x^2) + eps) * weight (+ bias where the file has one)."""
    mean_sq = g.node('ReduceMean', [g.node('Mul', [x, x]), g.const([-1])], keepdims=1)
    inv = g.node('Reciprocal', [g.node('Sqrt', [g.node('Add', [mean_sq, g.const(
        mm.config.eps, np.float32)])])])
    y = g.node('Mul', [g.node('Mul', [x, inv]),
                       g.init(prefix + '.weight', mm.array(prefix + '.weight'))])
    if prefix + '.bias' in mm.tensors:
        y = g.node('Add', [y, g.init(prefix + '.bias', mm.array(prefix + '.bias'))])
    return y


def _rotated(g: _Graph, x: str, half: int) -> str:
    """Return NEOX RoPE of x [1, H, N, d]: halves (a, b) -> (a cos - b sin, a sin + b cos)."""
    a = g.node('Slice', [x, g.const([0]), g.const([half]), g.const([3])])
    b = g.node('Slice', [x, g.const([half]), g.const([2 * half]), g.const([3])])
    first = g.node('Sub', [g.node('Mul', [a, COS]), g.node('Mul', [b, SIN])])
    second = g.node('Add', [g.node('Mul', [a, SIN]), g.node('Mul', [b, COS])])
    return g.node('Concat', [first, second], axis=3)


def _attention(g: _Graph, mm: Mmproj, h: str, i: int) -> str:
    """Return layer i's attention output (before the residual) of the normed patches h."""
    cfg = mm.config
    heads, d, c = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_embd
    b = f'v.blk.{i}'
    split = g.const([0, -1, heads, d])
    if cfg.projector == QWEN3VL:  # one fused q|k|v matmul
        qkv = _linear(g, mm, h, f'{b}.attn_qkv')
        parts = {n: g.node('Slice', [qkv, g.const([j * c]), g.const([(j + 1) * c]),
                                     g.const([2])])
                 for j, n in enumerate(('attn_q', 'attn_k', 'attn_v'))}
    else:
        parts = {n: _linear(g, mm, h, f'{b}.{n}') for n in ('attn_q', 'attn_k', 'attn_v')}

    def heads_of(name: str) -> str:
        t = g.node('Reshape', [parts[name], split])
        return g.node('Transpose', [t], perm=[0, 2, 1, 3])  # [1, H, N, d]

    q = _rotated(g, heads_of('attn_q'), d // 2)
    k = _rotated(g, heads_of('attn_k'), d // 2)
    v = heads_of('attn_v')
    scores = g.node('Mul', [g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 3, 2])]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    if cfg.wa_pattern and (i + 1) % cfg.wa_pattern:
        scores = g.node('Add', [scores, VISION_WINDOW_MASK])
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), v])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, -1, c])])
    return _linear(g, mm, merged, f'{b}.attn_out')


def _block(g: _Graph, mm: Mmproj, x: str, i: int) -> str:
    """Return Qwen2.5-VL's layer i: RMSNorm, attention, RMSNorm, SwiGLU."""
    b = f'v.blk.{i}'
    x = g.node('Add', [_attention(g, mm, _rms_norm(g, mm, x, f'{b}.ln1'), i), x])
    h = _rms_norm(g, mm, x, f'{b}.ln2')
    gate = _linear(g, mm, h, f'{b}.ffn_gate')
    up = _linear(g, mm, h, f'{b}.ffn_up')
    act = g.node('Mul', [g.node('Mul', [gate, g.node('Sigmoid', [gate])]), up])
    return g.node('Add', [x, _linear(g, mm, act, f'{b}.ffn_down')])


def _block3(g: _Graph, mm: Mmproj, x: str, i: int) -> str:
    """Return Qwen3-VL's layer i: LayerNorm, attention, LayerNorm, GELU MLP."""
    b = f'v.blk.{i}'
    x = g.node('Add', [_attention(g, mm, _layer_norm(g, mm, x, f'{b}.ln1'), i), x])
    h = _gelu(g, _linear(g, mm, _layer_norm(g, mm, x, f'{b}.ln2'), f'{b}.ffn_up'))
    return g.node('Add', [x, _linear(g, mm, h, f'{b}.ffn_down')])


def _merged_mlp(g: _Graph, mm: Mmproj, x: str, first: str, second: str) -> str:
    """Return second(GELU(first(x))) of x [1, N / 4, 4 C]: a merger's MLP."""
    return _linear(g, mm, _gelu(g, _linear(g, mm, x, first)), second)


def _positions(g: _Graph, mm: Mmproj, x: str) -> str:
    """Return x [1, N, C] plus the interpolated learned position embeddings (Qwen3-VL)."""
    table = g.init('v.position_embd.weight', mm.array('v.position_embd.weight'))
    rows = g.node('Gather', [table, POS_INDEX], axis=0)  # [N, 4, C]
    weight = g.node('Unsqueeze', [POS_WEIGHT, g.const([2])])
    pos = g.node('ReduceSum', [g.node('Mul', [rows, weight]), g.const([1])], keepdims=0)
    return g.node('Add', [x, g.node('Unsqueeze', [pos, g.const([0])])])


def build_qwen_encoder(mm: Mmproj, name: Optional[str] = None, data: Optional[BinaryIO] = None,
                       location: str = '') -> onnx.ModelProto:
    """Return the Qwen2.5-VL or Qwen3-VL encoder + merger(s) as ONNX (the module docstring)."""
    cfg = mm.config
    g = _Graph(data, location)
    p, c, s = cfg.patch_size, cfg.n_embd, cfg.scale_factor
    # ggml_conv_2d is im2col in F16 then a matmul: the pixels and the kernel both rounded
    # to fp16, products summed in float32 (exact float32 is 3e-3 off libmtmd's embeddings).
    x = _f16(g, _normalized(g, cfg))  # [F, 3, H, W]
    # Frame 0 through kernel 0, the last frame (frame 0 again for a still image) through 1.
    first = g.node('Slice', [x, g.const([0]), g.const([1]), g.const([0])])
    last = g.node('Slice', [x, g.const([-1]), g.const([np.iinfo(np.int64).max]),
                            g.const([0])])
    frames = [g.node('Conv', [f, g.init(w, mm.array(w).astype(np.float16).astype(np.float32))],
                     kernel_shape=[p, p], strides=[p, p])
              for f, w in ((first, 'v.patch_embd.weight'), (last, 'v.patch_embd.weight.1'))]
    conv = g.node('Add', frames)  # [1, C, Py, Px]
    # Merge order: [1, C, Py/2, 2, Px/2, 2] -> [1, Py/2, Px/2, dy, dx, C] -> [1, N, C].
    shape = g.node('Shape', [conv])
    py = g.node('Div', [g.node('Slice', [shape, g.const([2]), g.const([3])]), g.const([s])])
    px = g.node('Div', [g.node('Slice', [shape, g.const([3]), g.const([4])]), g.const([s])])
    grid = g.node('Concat', [g.const([1, c]), py, g.const([s]), px, g.const([s])], axis=0)
    x = g.node('Transpose', [g.node('Reshape', [conv, grid])], perm=[0, 2, 4, 3, 5, 1])
    x = g.node('Reshape', [x, g.const([1, -1, c])])
    qwen3 = cfg.projector == QWEN3VL
    if qwen3:
        x = _positions(g, mm, g.node('Add', [x, g.init('v.patch_embd.bias',
                                                       mm.array('v.patch_embd.bias'))]))
    if 'v.pre_ln.weight' in mm.tensors:
        x = (_layer_norm if qwen3 else _rms_norm)(g, mm, x, 'v.pre_ln')
    deepstack = []
    for i in range(cfg.n_layer):
        x = (_block3 if qwen3 else _block)(g, mm, x, i)
        if i in cfg.deepstack:
            d = f'v.deepstack.{i}'
            merged = g.node('Reshape', [x, g.const([1, -1, c * s * s])])
            deepstack.append(_merged_mlp(g, mm, _layer_norm(g, mm, merged, f'{d}.norm'),
                                         f'{d}.fc1', f'{d}.fc2'))
    x = (_layer_norm if qwen3 else _rms_norm)(g, mm, x, 'v.post_ln')
    out = _merged_mlp(g, mm, g.node('Reshape', [x, g.const([1, -1, c * s * s])]),
                      'mm.0', 'mm.2')
    if deepstack:  # each token: the main rows, then each DeepStack layer's (as libmtmd's)
        out = g.node('Concat', [out, *deepstack], axis=2)
    g.nodes.append(helper.make_node('Identity', [out], ['image_embeds'], name='image_embeds'))
    half = c // cfg.n_head // 2
    extra = ([helper.make_tensor_value_info(POS_INDEX, TensorProto.INT64, ['patches', 4]),
              helper.make_tensor_value_info(POS_WEIGHT, TensorProto.FLOAT, ['patches', 4])]
             if qwen3 else
             [helper.make_tensor_value_info(VISION_WINDOW_MASK, TensorProto.FLOAT,
                                            ['patches', 'patches'])])
    graph = helper.make_graph(
        g.nodes, name or ('qwen3vl_vision' if qwen3 else 'qwen25vl_vision'),
        [helper.make_tensor_value_info(PIXELS, TensorProto.UINT8,
                                       ['frames', 'height', 'width', 3]),
         helper.make_tensor_value_info(COS, TensorProto.FLOAT, ['patches', half]),
         helper.make_tensor_value_info(SIN, TensorProto.FLOAT, ['patches', half]), *extra],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT,
                                       [1, 'tokens', cfg.row_width])],
        list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 9
    return model

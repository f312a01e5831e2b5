"""Qwen2.5-VL's vision encoder and patch merger (mmproj `qwen2.5vl_merger`) as an ONNX graph.

As llama.cpp's clip_graph_qwen2vl (tools/mtmd/models/qwen2vl.cpp) computes it, for one image of
any size whose sides are multiples of patch x merge (28 for Qwen2.5-VL):
- uint8 `pixels` [1, H, W, 3] normalized as every family's ((u8 / 255 - mean) / std);
- the temporal patch of two frames: a still image is both frames, so conv(x, frame 0) +
  conv(x, frame 1) (two stride-p convolutions, no bias);
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
"""
from typing import BinaryIO, Optional

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.mmproj import Mmproj
from edge_llm_ros.convert.onnx_graph import MS_DOMAIN
from edge_llm_ros.convert.vision_graph import _f16, _gelu, _Graph, _linear, _normalized, OPSET
from edge_llm_ros.model_format import (VISION_INPUT as PIXELS, VISION_ROPE_INPUTS,
                                       VISION_WINDOW_MASK)

COS, SIN = VISION_ROPE_INPUTS


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


def _block(g: _Graph, mm: Mmproj, x: str, i: int) -> str:
    cfg = mm.config
    heads, d = cfg.n_head, cfg.n_embd // cfg.n_head
    b = f'v.blk.{i}'
    h = _rms_norm(g, mm, x, f'{b}.ln1')
    split = g.const([0, -1, heads, d])

    def heads_of(name: str) -> str:
        t = g.node('Reshape', [_linear(g, mm, h, f'{b}.{name}'), split])
        return g.node('Transpose', [t], perm=[0, 2, 1, 3])  # [1, H, N, d]

    q = _rotated(g, heads_of('attn_q'), d // 2)
    k = _rotated(g, heads_of('attn_k'), d // 2)
    v = heads_of('attn_v')
    scores = g.node('Mul', [g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 3, 2])]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    if (i + 1) % cfg.wa_pattern:
        scores = g.node('Add', [scores, VISION_WINDOW_MASK])
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), v])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, -1, cfg.n_embd])])
    x = g.node('Add', [_linear(g, mm, merged, f'{b}.attn_out'), x])
    h = _rms_norm(g, mm, x, f'{b}.ln2')
    gate = _linear(g, mm, h, f'{b}.ffn_gate')
    up = _linear(g, mm, h, f'{b}.ffn_up')
    act = g.node('Mul', [g.node('Mul', [gate, g.node('Sigmoid', [gate])]), up])
    return g.node('Add', [x, _linear(g, mm, act, f'{b}.ffn_down')])


def build_qwen_encoder(mm: Mmproj, name: Optional[str] = None, data: Optional[BinaryIO] = None,
                       location: str = '') -> onnx.ModelProto:
    """Return the Qwen2.5-VL encoder + merger as an ONNX model (see the module docstring)."""
    cfg = mm.config
    g = _Graph(data, location)
    p, c, s = cfg.patch_size, cfg.n_embd, cfg.scale_factor
    # ggml_conv_2d is im2col in F16 then a matmul: the pixels and the kernel both rounded
    # to fp16, products summed in float32 (exact float32 is 3e-3 off libmtmd's embeddings).
    x = _f16(g, _normalized(g, cfg))  # [1, 3, H, W]
    frames = [g.node('Conv', [x, g.init(w, mm.array(w).astype(np.float16).astype(np.float32))],
                     kernel_shape=[p, p], strides=[p, p])
              for w in ('v.patch_embd.weight', 'v.patch_embd.weight.1')]
    conv = g.node('Add', frames)  # [1, C, Py, Px]
    # Merge order: [1, C, Py/2, 2, Px/2, 2] -> [1, Py/2, Px/2, dy, dx, C] -> [1, N, C].
    shape = g.node('Shape', [conv])
    py = g.node('Div', [g.node('Slice', [shape, g.const([2]), g.const([3])]), g.const([s])])
    px = g.node('Div', [g.node('Slice', [shape, g.const([3]), g.const([4])]), g.const([s])])
    grid = g.node('Concat', [g.const([1, c]), py, g.const([s]), px, g.const([s])], axis=0)
    x = g.node('Transpose', [g.node('Reshape', [conv, grid])], perm=[0, 2, 4, 3, 5, 1])
    x = g.node('Reshape', [x, g.const([1, -1, c])])
    if 'v.pre_ln.weight' in mm.tensors:
        x = _rms_norm(g, mm, x, 'v.pre_ln')
    for i in range(cfg.n_layer):
        x = _block(g, mm, x, i)
    x = _rms_norm(g, mm, x, 'v.post_ln')
    x = g.node('Reshape', [x, g.const([1, -1, c * s * s])])
    x = _gelu(g, _linear(g, mm, x, 'mm.0'))
    out = _linear(g, mm, x, 'mm.2')
    g.nodes.append(helper.make_node('Identity', [out], ['image_embeds'], name='image_embeds'))
    half = c // cfg.n_head // 2
    graph = helper.make_graph(
        g.nodes, name or 'qwen25vl_vision',
        [helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, [1, 'height', 'width', 3]),
         helper.make_tensor_value_info(COS, TensorProto.FLOAT, ['patches', half]),
         helper.make_tensor_value_info(SIN, TensorProto.FLOAT, ['patches', half]),
         helper.make_tensor_value_info(VISION_WINDOW_MASK, TensorProto.FLOAT,
                                       ['patches', 'patches'])],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT,
                                       [1, 'tokens', cfg.n_out])],
        list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 9
    return model

"""Gemma 4's vision encoder and projector (mmproj `gemma4v`) as an ONNX graph.

As llama.cpp's clip_graph_gemma4v (tools/mtmd/models/gemma4v.cpp) computes it, for one image
of any size whose sides are multiples of patch x 3 (runtime/mmproj_gemma4.py resizes it):
- uint8 `pixels` [1, H, W, 3] normalized as every family's ((u8 / 255 - mean) / std), then
  x 2 - 1; the stride-p patch convolution without a bias (fp16 im2col, as the others);
- the patches row by row, plus the learned x table's row of the patch's column and the y
  table's row of its row (v.position_embd.weight [2, positions, C]);
- per layer (build_vit with RMSNorm): RMSNorm ln1, q / k / v, q and k normalized per head
  with their weights and V per head without, 2-D RoPE (NEOX halves, base 100: the first
  half of each head turns with the patch's column, the second half with its row: the
  `vision_cos` / `vision_sin` inputs), softmax(q k^T) (scale 1), output, attn_post_norm,
  residual; RMSNorm ln2, the gated MLP act(gate) x up (quick GELU unless clip.use_gelu,
  from ggml's fp16 table), down, ffn_post_norm, residual; times the layer's out_scale;
- every matrix product clamps its input and output where the file has the limits
  (`<name>.input_min` / `.input_max` / `.output_min` / `.output_max`: Gemma4ClippableLinear);
- the patch grid average-pooled k x k (k = projector.scale_factor, 3), times sqrt(C),
  (x - v.std_bias) x v.std_scale where present, RMSNorm without a weight, then
  mm.input_projection ([n_out, C]). Output `image_embeds` [1, (H / p / k) x (W / p / k),
  n_out], pooled tokens row by row.
"""
from typing import BinaryIO, Optional

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.mmproj import Mmproj
from edge_llm_ros.convert.onnx_graph import MS_DOMAIN
from edge_llm_ros.convert.vision_graph import (_gelu, _Graph, _linear, _normalized,
                                               _patch_embedding, _quick_gelu, OPSET)
from edge_llm_ros.model_format import VISION_INPUT as PIXELS, VISION_ROPE_INPUTS

COS, SIN = VISION_ROPE_INPUTS
_CLAMPS = ('input_min', 'input_max', 'output_min', 'output_max')


def _rms(g: _Graph, mm: Mmproj, x: str, weight: Optional[str] = None) -> str:
    """Return ggml_rms_norm(x) over the last axis (times `weight`, a tensor name, if given)."""
    mean_sq = g.node('ReduceMean', [g.node('Mul', [x, x]), g.const([-1])], keepdims=1)
    inv = g.node('Reciprocal', [g.node('Sqrt', [g.node('Add', [mean_sq, g.const(
        mm.config.eps, np.float32)])])])
    y = g.node('Mul', [x, inv])
    if weight is not None:
        y = g.node('Mul', [y, g.init(weight, mm.array(weight).reshape(-1))])
    return y


def _clamped(g: _Graph, mm: Mmproj, x: str, prefix: str) -> str:
    """Return the matrix product of `prefix`, its input and output clamped where the file says.

    clip.cpp reads the limits as float32 scalars, FLT_MAX / -FLT_MAX where absent.
    """
    limits = {k: float(mm.array(f'{prefix}.{k}').reshape(-1)[0]) for k in _CLAMPS
              if f'{prefix}.{k}' in mm.tensors}
    big = float(np.finfo(np.float32).max)

    def clip(y: str, low: str, high: str) -> str:
        if low not in limits and high not in limits:
            return y
        return g.node('Clip', [y, g.const(limits.get(low, -big), np.float32),
                               g.const(limits.get(high, big), np.float32)])
    y = _linear(g, mm, clip(x, 'input_min', 'input_max'), prefix)
    return clip(y, 'output_min', 'output_max')


def _rotated(g: _Graph, x: str, d: int) -> str:
    """Return the 2-D RoPE of x [1, H, N, d]: NEOX pairs within each half of the head.

    The first half's pairs (i, i + d/4) turn by the column angles (the first d/4 columns of
    COS / SIN), the second half's by the row angles (the next d/4).
    """
    q = d // 4

    def part(i: int) -> str:
        return g.node('Slice', [x, g.const([i * q]), g.const([(i + 1) * q]), g.const([3])])
    lo = g.node('Concat', [part(0), part(2)], axis=3)   # each half's first members
    hi = g.node('Concat', [part(1), part(3)], axis=3)   # and their partners
    new_lo = g.node('Sub', [g.node('Mul', [lo, COS]), g.node('Mul', [hi, SIN])])
    new_hi = g.node('Add', [g.node('Mul', [lo, SIN]), g.node('Mul', [hi, COS])])

    def half(y: str, i: int) -> str:
        return g.node('Slice', [y, g.const([i * q]), g.const([(i + 1) * q]), g.const([3])])
    return g.node('Concat', [half(new_lo, 0), half(new_hi, 0), half(new_lo, 1),
                             half(new_hi, 1)], axis=3)


def _attention(g: _Graph, mm: Mmproj, h: str, i: int) -> str:
    cfg = mm.config
    heads, c = cfg.n_head, cfg.n_embd
    d = c // heads
    b = f'v.blk.{i}'
    split = g.const([0, -1, heads, d])

    def heads_of(name: str, norm: Optional[str]) -> str:
        t = g.node('Reshape', [_clamped(g, mm, h, f'{b}.{name}'), split])  # [1, N, H, d]
        t = _rms(g, mm, t, norm)
        return g.node('Transpose', [t], perm=[0, 2, 1, 3])  # [1, H, N, d]

    q = _rotated(g, heads_of('attn_q', f'{b}.attn_q_norm.weight'), d)
    k = _rotated(g, heads_of('attn_k', f'{b}.attn_k_norm.weight'), d)
    v = heads_of('attn_v', None)
    scores = g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 3, 2])])  # scale 1
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), v])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, -1, c])])
    return _clamped(g, mm, merged, f'{b}.attn_out')


def _scaled(g: _Graph, mm: Mmproj, x: str, name: str) -> str:
    """Return x times tensor `name` where the file has it (layer scales)."""
    if name not in mm.tensors:
        return x
    return g.node('Mul', [x, g.init(name, mm.array(name).reshape(-1))])


def _block(g: _Graph, mm: Mmproj, x: str, i: int) -> str:
    b = f'v.blk.{i}'
    o = _attention(g, mm, _rms(g, mm, x, f'{b}.ln1.weight'), i)
    o = _scaled(g, mm, o, f'{b}.ls1.weight')
    if f'{b}.attn_post_norm.weight' in mm.tensors:
        o = _rms(g, mm, o, f'{b}.attn_post_norm.weight')
    x = g.node('Add', [o, x])
    h = _rms(g, mm, x, f'{b}.ln2.weight')
    up = _clamped(g, mm, h, f'{b}.ffn_up')
    gate = _clamped(g, mm, h, f'{b}.ffn_gate')
    act = _gelu(g, gate) if mm.config.activation == 'gelu_tanh' else (
        g.node('Mul', [gate, g.node('Sigmoid', [gate])]) if mm.config.activation == 'silu'
        else _quick_gelu(g, gate))
    y = _clamped(g, mm, g.node('Mul', [act, up]), f'{b}.ffn_down')
    if f'{b}.ffn_post_norm.weight' in mm.tensors:
        y = _rms(g, mm, y, f'{b}.ffn_post_norm.weight')
    y = _scaled(g, mm, y, f'{b}.ls2.weight')
    return _scaled(g, mm, g.node('Add', [x, y]), f'{b}.out_scale.weight')


def build_gemma4_encoder(mm: Mmproj, name: Optional[str] = None,
                         data: Optional[BinaryIO] = None, location: str = ''
                         ) -> onnx.ModelProto:
    """Return the gemma4v encoder + projector as ONNX (the module docstring)."""
    cfg = mm.config
    g = _Graph(data, location)
    c, k = cfg.n_embd, cfg.scale_factor
    x = _normalized(g, cfg)
    x = g.node('Add', [g.node('Mul', [x, g.const(2.0, np.float32)]),
                       g.const(-1.0, np.float32)])
    conv = _patch_embedding(g, mm, x)  # [1, C, Py, Px]
    shape = g.node('Shape', [conv])
    py = g.node('Slice', [shape, g.const([2]), g.const([3])])
    px = g.node('Slice', [shape, g.const([3]), g.const([4])])
    x = g.node('Transpose', [conv], perm=[0, 2, 3, 1])  # [1, Py, Px, C]
    table = mm.array('v.position_embd.weight')  # [2, positions, C]
    tx = g.node('Slice', [g.init('v.position_embd.x', table[0]), g.const([0]), px,
                          g.const([0])])  # [Px, C]
    ty = g.node('Slice', [g.init('v.position_embd.y', table[1]), g.const([0]), py,
                          g.const([0])])  # [Py, C]
    x = g.node('Add', [x, tx])
    x = g.node('Add', [x, g.node('Unsqueeze', [ty, g.const([1])])])
    x = g.node('Reshape', [x, g.const([1, -1, c])])  # patch y * Px + x
    if 'v.pre_ln.weight' in mm.tensors:
        x = _rms(g, mm, x, 'v.pre_ln.weight')
    for i in range(cfg.n_layer):
        x = _block(g, mm, x, i)
    if 'v.post_ln.weight' in mm.tensors:
        x = _rms(g, mm, x, 'v.post_ln.weight')
    grid = g.node('Concat', [g.const([1]), py, px, g.const([c])], axis=0)
    x = g.node('Transpose', [g.node('Reshape', [x, grid])], perm=[0, 3, 1, 2])  # [1, C, Py, Px]
    pooled = g.node('AveragePool', [x], kernel_shape=[k, k], strides=[k, k])
    x = g.node('Transpose', [g.node('Reshape', [pooled, g.const([1, c, -1])])], perm=[0, 2, 1])
    x = g.node('Mul', [x, g.const(np.sqrt(np.float32(c)), np.float32)])
    if 'v.std_bias' in mm.tensors and 'v.std_scale' in mm.tensors:
        x = g.node('Sub', [x, g.init('v.std_bias', mm.array('v.std_bias').reshape(-1))])
        x = g.node('Mul', [x, g.init('v.std_scale', mm.array('v.std_scale').reshape(-1))])
    out = _clamped(g, mm, _rms(g, mm, x), 'mm.input_projection')
    g.nodes.append(helper.make_node('Identity', [out], ['image_embeds'], name='image_embeds'))
    half = c // cfg.n_head // 2
    graph = helper.make_graph(
        g.nodes, name or 'gemma4v_vision',
        [helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, [1, 'height', 'width', 3]),
         helper.make_tensor_value_info(COS, TensorProto.FLOAT, ['patches', half]),
         helper.make_tensor_value_info(SIN, TensorProto.FLOAT, ['patches', half])],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT,
                                       [1, 'tokens', cfg.n_out])],
        list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 9
    return model

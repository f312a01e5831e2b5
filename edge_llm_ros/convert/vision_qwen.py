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
  `vision_sin` inputs, runtime/mmproj_qwen.py), softmax(q k^T x scale) within each window
  of 112 pixels where the layer is windowed (the window layout `window_index`,
  `window_bias`, `window_inverse`) and over all patches where (i + 1) % n_wa_pattern == 0
  (up to FLASH_FROM patches over [N, N] scores as libmtmd, with the window mask; above,
  blocked: per gathered window, and MultiHeadAttention's flash kernel for the full
  layers), biased output, RMSNorm, SwiGLU MLP silu(gate) x up, down;
- v.post_ln (RMSNorm), then each merge block's 4 patches side by side (4 C wide) through
  mm.0, GELU (tanh), mm.2.
llama.cpp regroups the patches window by window and back and masks [N, N]; attention per
gathered window is the same computation (test/test_vision_qwen.py checks it against libmtmd).
Output `image_embeds` [1, N / 4, n_out], merged tokens row by row.

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
                                       VISION_ROPE_INPUTS, VISION_WINDOW_INPUTS)

COS, SIN = VISION_ROPE_INPUTS
# Attention over more patches than this runs blocked (`_attention`): 2,048 patches are
# Qwen3-VL's 512 tokens (a 640x480 frame is 1,200 patches, a capped 1080p one 4,600).
FLASH_FROM = 2048
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
    """Return NEOX RoPE of x [1, N, H, d]: halves (a, b) -> (a cos - b sin, a sin + b cos)."""
    cos, sin = (g.node('Unsqueeze', [t, g.const([1])]) for t in (COS, SIN))  # [N, 1, d / 2]
    a = g.node('Slice', [x, g.const([0]), g.const([half]), g.const([3])])
    b = g.node('Slice', [x, g.const([half]), g.const([2 * half]), g.const([3])])
    first = g.node('Sub', [g.node('Mul', [a, cos]), g.node('Mul', [b, sin])])
    second = g.node('Add', [g.node('Mul', [a, sin]), g.node('Mul', [b, cos])])
    return g.node('Concat', [first, second], axis=3)


def _windowed(g: _Graph, q: str, k: str, v: str, heads: int, d: int) -> str:
    """Return attention within each window of q, k, v [1, N, C] (Qwen2.5-VL's windowed layers).

    The patches are gathered window by window (`window_index`) into [W, S] slots, attention
    runs per window with `window_bias` on the keys (empty slots: float lowest, as the [N, N]
    mask's off-window entries, so the same softmax), and `window_inverse` takes each patch's
    row back: W x S x S scores instead of N x N.
    """
    index, bias, inverse = VISION_WINDOW_INPUTS
    shape = g.node('Concat', [g.node('Shape', [bias]), g.const([heads, d])], axis=0)

    def windows(x: str) -> str:  # [1, N, C] -> [W, H, S, d]
        rows = g.node('Gather', [g.node('Squeeze', [x, g.const([0])]), index], axis=0)
        return g.node('Transpose', [g.node('Reshape', [rows, shape])], perm=[0, 2, 1, 3])

    keys = g.node('Transpose', [windows(k)], perm=[0, 1, 3, 2])
    scores = g.node('Mul', [g.node('MatMul', [windows(q), keys]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    scores = g.node('Add', [scores, g.node('Unsqueeze', [bias, g.const([1, 2])])])
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), windows(v)])
    rows = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                              g.const([-1, heads * d])])  # [W x S, C]
    return g.node('Unsqueeze', [g.node('Gather', [rows, inverse], axis=0), g.const([0])])


def _window_mask(g: _Graph) -> str:
    """Return the windowed layers' additive mask [N, N]: 0 within a window, lowest across."""
    _, bias, inverse = VISION_WINDOW_INPUTS
    size = g.node('Slice', [g.node('Shape', [bias]), g.const([1]), g.const([2])])
    window = g.node('Div', [inverse, size])  # each patch's window
    same = g.node('Equal', [g.node('Unsqueeze', [window, g.const([1])]),
                            g.node('Unsqueeze', [window, g.const([0])])])
    return g.node('Where', [same, g.const(0.0, np.float32),
                            g.const(np.finfo(np.float32).min, np.float32)])


def _plain(g: _Graph, q: str, k: str, v: str, heads: int, d: int,
           mask: Optional[str] = None) -> str:
    """Return softmax(q k^T x scale + mask) v of q, k, v [1, N, C] over [1, H, N, N] scores.

    libmtmd's order of operations (its [N, N] window mask included), so the tiny pairs'
    near-tied greedy paths stay mtmd's.
    """
    def heads_of(x: str) -> str:  # [1, H, N, d]
        return g.node('Transpose', [g.node('Reshape', [x, g.const([0, -1, heads, d])])],
                      perm=[0, 2, 1, 3])
    keys = g.node('Transpose', [heads_of(k)], perm=[0, 1, 3, 2])
    scores = g.node('Mul', [g.node('MatMul', [heads_of(q), keys]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    if mask:
        scores = g.node('Add', [scores, mask])
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), heads_of(v)])
    return g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                              g.const([0, -1, heads * d])])


def _flash(g: _Graph, q: str, k: str, v: str, heads: int, d: int) -> str:
    """Return full attention of q, k, v [1, N, C] as onnxruntime's MultiHeadAttention.

    Its CPU kernel (MLAS flash attention) runs blocks of queries x keys with a running max
    and sum, never the [H, N, N] scores (at 4,600 patches 1.35 GB a layer, written and read
    again by each op of `_plain`).
    """
    return g.node('MultiHeadAttention', [q, k, v], domain=MS_DOMAIN, num_heads=heads,
                  scale=float(1.0 / np.sqrt(d)))


def _by_size(g: _Graph, large, small) -> str:
    """Return an If: large() above FLASH_FROM patches, else small() (each builds a branch)."""
    if 'long' not in g.shared:  # once per graph
        n = g.node('Slice', [g.node('Shape', [COS]), g.const([0]), g.const([1])])
        g.shared['long'] = g.node('Greater', [n, g.const([FLASH_FROM])])
    return g.node('If', [g.shared['long']], then_branch=_branch(g, large),
                  else_branch=_branch(g, small))


def _branch(g: _Graph, build) -> onnx.GraphProto:
    """Return an If branch: the nodes build() adds, its output the one it returns."""
    outer, g.nodes = g.nodes, []
    out = build()
    nodes, g.nodes = g.nodes, outer
    return helper.make_graph(nodes, f'{out}_branch', [],
                             [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])


def _attention(g: _Graph, mm: Mmproj, h: str, i: int) -> str:
    """Return layer i's attention output (before the residual) of the normed patches h.

    Up to FLASH_FROM patches as libmtmd computes it (`_plain`, windowed layers with the
    window mask); above, blocked: `_flash` for full attention, `_windowed` per window.
    """
    cfg = mm.config
    heads, d, c = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_embd
    b = f'v.blk.{i}'
    if cfg.projector == QWEN3VL:  # one fused q|k|v matmul
        qkv = _linear(g, mm, h, f'{b}.attn_qkv')
        parts = {n: g.node('Slice', [qkv, g.const([j * c]), g.const([(j + 1) * c]),
                                     g.const([2])])
                 for j, n in enumerate(('attn_q', 'attn_k', 'attn_v'))}
    else:
        parts = {n: _linear(g, mm, h, f'{b}.{n}') for n in ('attn_q', 'attn_k', 'attn_v')}
    split, join = g.const([0, -1, heads, d]), g.const([0, -1, c])
    q, k = (g.node('Reshape', [_rotated(g, g.node('Reshape', [parts[n], split]), d // 2), join])
            for n in ('attn_q', 'attn_k'))
    qkv = (q, k, parts['attn_v'], heads, d)
    if cfg.wa_pattern and (i + 1) % cfg.wa_pattern:
        attn = _by_size(g, lambda: _windowed(g, *qkv),
                        lambda: _plain(g, *qkv, mask=_window_mask(g)))
    else:
        attn = _by_size(g, lambda: _flash(g, *qkv), lambda: _plain(g, *qkv))
    return _linear(g, mm, attn, f'{b}.attn_out')


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
             [helper.make_tensor_value_info(VISION_WINDOW_INPUTS[0], TensorProto.INT64,
                                            ['window_slots']),
              helper.make_tensor_value_info(VISION_WINDOW_INPUTS[1], TensorProto.FLOAT,
                                            ['windows', 'window_size']),
              helper.make_tensor_value_info(VISION_WINDOW_INPUTS[2], TensorProto.INT64,
                                            ['patches'])])
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

"""The vision encoder and projector of an mmproj as an ONNX graph: one tile in, embeddings out.

`pixel_values` float32 [B, 3, S, S] (normalized as the family's preprocessing does) becomes
`image_embeds` float32 [B, T, n_out], T = VisionConfig.tokens_per_tile, n_out the language
model's hidden size. The encoder is llama.cpp's `build_vit` (clip.cpp) for the SigLIP families:
a valid stride-p convolution, the learned position embeddings, pre-norm blocks (LayerNorm,
attention without a mask, LayerNorm, GELU MLP), a final LayerNorm; then the projector:
- gemma3: k x k average pooling of the patch grid, RMSNorm (soft_emb_norm, +1 already in the
  weight), x @ mm.input_projection (stored [n_embd, n_out]: not transposed);
- idefics3: pixel unshuffle by s (feature (dy * s + dx) * C + c of token Y * (P / s) + X), then
  mm.model.fc (no bias).
Weights are float32 (the F16 / quantized mmproj tensors dequantized exactly). internvl and mlp
are read by convert/mmproj.py but not built here yet.
"""
from typing import Dict, List, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto

from edge_llm_ros.convert.mmproj import Mmproj, MmprojError

OPSET = 20  # Gelu (approximate='tanh') is opset 20
BUILT = ('gemma3', 'idefics3')


class _Graph:
    """A minimal node / initializer builder (names unique by a counter)."""

    def __init__(self) -> None:
        self.nodes: List[onnx.NodeProto] = []
        self.inits: Dict[str, onnx.TensorProto] = {}
        self._n = 0

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits[name] = numpy_helper.from_array(np.ascontiguousarray(value), name)
        return name

    def const(self, value, dtype=np.int64) -> str:
        self._n += 1
        return self.init(f'const_{self._n}', np.asarray(value, dtype=dtype))

    def node(self, op: str, inputs: List[str], **attrs) -> str:
        self._n += 1
        out = f'{op.lower()}_{self._n}'
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def _linear(g: _Graph, mm: Mmproj, x: str, prefix: str, transposed: bool = True) -> str:
    """Add x @ W.T (+ b) for a [out, in] GGUF matrix (x @ W when `transposed` is False)."""
    w = mm.array(prefix + '.weight')
    y = g.node('MatMul', [x, g.init(prefix + '.weight.t', w.T if transposed else w)])
    if prefix + '.bias' in mm.tensors:
        y = g.node('Add', [y, g.init(prefix + '.bias', mm.array(prefix + '.bias'))])
    return y


def _layer_norm(g: _Graph, mm: Mmproj, x: str, prefix: str) -> str:
    weight = g.init(prefix + '.weight', mm.array(prefix + '.weight'))
    bias = g.init(prefix + '.bias', mm.array(prefix + '.bias'))
    return g.node('LayerNormalization', [x, weight, bias], axis=-1, epsilon=mm.config.eps)


def _block(g: _Graph, mm: Mmproj, x: str, i: int) -> str:
    cfg = mm.config
    heads, d = cfg.n_head, cfg.n_embd // cfg.n_head
    b = f'v.blk.{i}'
    h = _layer_norm(g, mm, x, f'{b}.ln1')
    split = g.const([0, -1, heads, d])  # [B, N, H, d]

    def heads_of(name: str) -> str:
        t = g.node('Reshape', [_linear(g, mm, h, f'{b}.{name}'), split])
        return g.node('Transpose', [t], perm=[0, 2, 1, 3])  # [B, H, N, d]

    q, k, v = heads_of('attn_q'), heads_of('attn_k'), heads_of('attn_v')
    scores = g.node('Mul', [g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 3, 2])]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    attn = g.node('MatMul', [g.node('Softmax', [scores], axis=-1), v])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, -1, cfg.n_embd])])
    x = g.node('Add', [x, _linear(g, mm, merged, f'{b}.attn_out')])
    h = _layer_norm(g, mm, x, f'{b}.ln2')
    up = _linear(g, mm, h, f'{b}.ffn_up')
    if cfg.activation == 'gelu_tanh':
        act = g.node('Gelu', [up], approximate='tanh')
    elif cfg.activation == 'silu':
        act = g.node('Mul', [up, g.node('Sigmoid', [up])])
    else:  # quick GELU: x * sigmoid(1.702 x)
        scaled = g.node('Mul', [up, g.const(1.702, np.float32)])
        act = g.node('Mul', [up, g.node('Sigmoid', [scaled])])
    return g.node('Add', [x, _linear(g, mm, act, f'{b}.ffn_down')])


def _gemma3_projector(g: _Graph, mm: Mmproj, x: str) -> str:
    cfg = mm.config
    side, k = cfg.patches_per_side, cfg.scale_factor
    grid = g.node('Transpose', [g.node('Reshape', [x, g.const([0, side, side, cfg.n_embd])])],
                  perm=[0, 3, 1, 2])  # [B, C, P, P]
    pooled = g.node('AveragePool', [grid], kernel_shape=[k, k], strides=[k, k])
    tokens = g.node('Transpose', [g.node('Reshape', [pooled, g.const([0, cfg.n_embd, -1])])],
                    perm=[0, 2, 1])  # [B, T, C], token Y * (P / k) + X
    mean_sq = g.node('ReduceMean', [g.node('Mul', [tokens, tokens]), g.const([-1])], keepdims=1)
    inv = g.node('Reciprocal', [g.node('Sqrt', [g.node('Add', [mean_sq, g.const(
        cfg.eps, np.float32)])])])
    normed = g.node('Mul', [g.node('Mul', [tokens, inv]), g.init(
        'mm.soft_emb_norm.weight', mm.array('mm.soft_emb_norm.weight'))])
    return _linear(g, mm, normed, 'mm.input_projection', transposed=False)


def _idefics3_projector(g: _Graph, mm: Mmproj, x: str) -> str:
    cfg = mm.config
    side, s, c = cfg.patches_per_side, cfg.scale_factor, cfg.n_embd
    # [B, Y, dy, X, dx, C] -> [B, Y, X, dy, dx, C]: token Y * (P / s) + X, feature
    # (dy s + dx) C + c.
    grid = g.node('Reshape', [x, g.const([0, side // s, s, side // s, s, c])])
    merged = g.node('Reshape', [g.node('Transpose', [grid], perm=[0, 1, 3, 2, 4, 5]),
                                g.const([0, (side // s) ** 2, s * s * c])])
    return _linear(g, mm, merged, 'mm.model.fc')


def build_encoder(mm: Mmproj, name: Optional[str] = None) -> onnx.ModelProto:
    """Return the mmproj's encoder + projector as an ONNX model (pixel_values -> image_embeds)."""
    cfg = mm.config
    if cfg.projector not in BUILT:
        raise MmprojError(f'{mm.path}: the {cfg.projector} encoder is not built yet (built: '
                          f'{", ".join(BUILT)})')
    g = _Graph()
    p = cfg.patch_size
    conv = g.node('Conv', ['pixel_values', g.init('v.patch_embd.weight',
                                                  mm.array('v.patch_embd.weight'))]
                  + ([g.init('v.patch_embd.bias', mm.array('v.patch_embd.bias'))]
                     if 'v.patch_embd.bias' in mm.tensors else []),
                  kernel_shape=[p, p], strides=[p, p])  # [B, C, P, P]
    x = g.node('Transpose', [g.node('Reshape', [conv, g.const([0, cfg.n_embd, -1])])],
               perm=[0, 2, 1])  # [B, N, C], patch y * P + x
    x = g.node('Add', [x, g.init('v.position_embd.weight', mm.array('v.position_embd.weight'))])
    for i in range(cfg.n_layer):
        x = _block(g, mm, x, i)
    if 'v.post_ln.weight' in mm.tensors:
        x = _layer_norm(g, mm, x, 'v.post_ln')
    out = (_gemma3_projector if cfg.projector == 'gemma3' else _idefics3_projector)(g, mm, x)
    g.nodes.append(helper.make_node('Identity', [out], ['image_embeds'], name='image_embeds'))
    s = cfg.image_size
    graph = helper.make_graph(
        g.nodes, name or f'{cfg.projector}_vision',
        [helper.make_tensor_value_info('pixel_values', TensorProto.FLOAT, ['batch', 3, s, s])],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT,
                                       ['batch', cfg.tokens_per_tile, cfg.n_out])],
        list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET)])
    model.ir_version = 9
    return model


# Where the image goes in the prompt, as llama.cpp's mtmd places it (research section 3.2), and
# whether its tokens see each other (gemma3: bidirectional within the image).
_LAYOUT = {
    'gemma3': {'preprocess': 'letterbox_bilinear', 'attention': 'bidirectional',
               'wrapper': ['<start_of_image>', '<end_of_image>']},
    'idefics3': {'preprocess': 'idefics3_tiles', 'attention': 'causal',
                 'wrapper': ['<fake_token_around_image>', '<row_{r}_col_{c}>', '<global-img>']},
}


def model_yaml_section(mm: Mmproj, file: str) -> dict:
    """Return model.yaml's `vision` mapping for a converted mmproj."""
    cfg = mm.config
    return {'file': file, 'projector': cfg.projector, 'image_size': cfg.image_size,
            'patch_size': cfg.patch_size, 'tokens_per_tile': cfg.tokens_per_tile,
            'embedding_size': cfg.n_out, 'image_mean': list(cfg.image_mean),
            'image_std': list(cfg.image_std), 'longest_edge': cfg.longest_edge,
            **_LAYOUT[cfg.projector], 'source': mm.path}


def normalize(tile_u8: np.ndarray, mean, std) -> np.ndarray:
    """Return an [S, S, 3] uint8 tile normalized as llama.cpp does it, planar [3, S, S].

    (u8 / 255 - mean) / std in float32: a division by std, not a multiplication by 1 / std.
    """
    f = tile_u8.astype(np.float32) / np.float32(255.0)
    f = (f - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(f.transpose(2, 0, 1))

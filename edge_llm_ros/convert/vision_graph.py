"""The vision encoder and projector of an mmproj as an ONNX graph: one tile in, embeddings out.

`pixels` uint8 [B, S, S, 3] (tiles as the family's preprocessing cuts them, RGB) becomes
`image_embeds` float32 [B, T, n_out], T = VisionConfig.tokens_per_tile, n_out the language
model's hidden size. The graph normalizes the tiles itself, as llama.cpp does it:
(u8 / 255 - mean) / std in float32, each a single IEEE operation (a division by std, not a
multiplication by 1 / std), then planar [B, 3, S, S]. The encoder is llama.cpp's `build_vit`
(clip.cpp) for the SigLIP families: a valid stride-p convolution, the learned position
embeddings, pre-norm blocks (LayerNorm, attention without a mask, LayerNorm, GELU MLP), a final
LayerNorm; then the projector:
- gemma3: k x k average pooling of the patch grid, RMSNorm (soft_emb_norm, +1 already in the
  weight), x @ mm.input_projection (stored [n_embd, n_out]: not transposed);
- idefics3: pixel unshuffle by s (feature (dy * s + dx) * C + c of token Y * (P / s) + X), then
  mm.model.fc (no bias).
- internvl: the CLS token, layer scale where present, then the patches unshuffled by s,
  LayerNorm (eps 1e-5), Linear, GELU, Linear;
- mlp (LLaVA-1.5): the CLS token, the pre-LayerNorm, then rows 1..N through Linear, GELU, Linear.
For internvl and mlp this is llama.cpp's graph, defects included, because llama.cpp is what the
embeddings are checked against: the CLS token is appended after the patches before the
position embeddings are added (so each patch takes its neighbour's, ggml-org/llama.cpp#25814),
and mlp runs one layer fewer than stored (#25817), keeping CLS and dropping patch 0 (CLS_LAST,
MLP_SKIPS_LAST_LAYER; a libmtmd with the fixes needs them flipped, and the parity tests will
say so). Weights are float32 (F16 tensors widened exactly), except Q8_0 matrices, which stay
in their blocks (MatMulNBits, 8 bits, blocks of 32: the file's codes and scales).
Two roundings of llama.cpp's CPU ops are kept, as they move every embedding by about 1e-3 of
its size (docs/vision.md, "Parity with mtmd"):
- the patch embedding: ggml_conv_2d unfolds the pixels into an F16 im2col (unless the kernel
  is BF16), so the normalized pixels and the kernel are rounded to float16 before the
  products (summed in float32);
- GELU (tanh) and quick GELU: ggml looks them up in a float16 table, the input rounded to
  float16 and the result too (GELU passes x >= 10 through and gives 0 for x <= -10);
- an F16 matrix: ggml's matmul rounds the activations to float16 as well.
"""
from typing import BinaryIO, Dict, List, Optional

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.mmproj import (GEMMA4_MAX_TOKENS, GEMMA4_MIN_TOKENS,
                                         GEMMA4_ROPE_BASE, GEMMA4V, Mmproj, MmprojError,
                                         QWEN_MAX_TOKENS, QWEN_MIN_TOKENS, QWEN_PROJECTORS)
from edge_llm_ros.convert.onnx_graph import initializer, MS_DOMAIN
from edge_llm_ros.convert.quant import from_q8_0
from edge_llm_ros.model_format import VISION_INPUT as PIXELS

OPSET = 20  # Gelu (approximate='tanh') is opset 20
INT8_ACTIVATIONS = 4  # MatMulNBits accuracy_level: activations quantized to int8 per block
BUILT = ('gemma3', 'idefics3', 'internvl', 'mlp', 'qwen2.5vl_merger', 'qwen3vl_merger',
         GEMMA4V)
# mtmd_decode_use_non_causal: Gemma 4's images attend both ways, except beside the E2B and
# E4B language models (hidden sizes 1536 and 2560), whose images are causal.
GEMMA4_CAUSAL_WIDTHS = (1536, 2560)
# As the libmtmd this is checked against builds them (test/test_vision_encoder.py): where the
# CLS token goes before the position embeddings are added, and the encoder layers LLaVA's
# `mlp` graph runs (n_layer - 1: the last stored layer is skipped).
CLS_LAST = {'internvl': True, 'mlp': True}
MLP_SKIPS_LAST_LAYER = True


class _Graph:
    """A minimal node / initializer builder (names unique by a counter)."""

    def __init__(self, data: Optional[BinaryIO] = None, location: str = '') -> None:
        """Stream weights into `data`, an open file named `location` beside the model."""
        self.nodes: List[onnx.NodeProto] = []
        self.inits: Dict[str, onnx.TensorProto] = {}
        self._n = 0
        self._data, self._location = data, location
        self.shared: Dict[str, str] = {}  # values a builder computes once per graph

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits[name] = initializer(name, value, self._data, self._location)
        return name

    def const(self, value, dtype=np.int64) -> str:
        self._n += 1
        return self.init(f'const_{self._n}', np.asarray(value, dtype=dtype))

    def node(self, op: str, inputs: List[str], **attrs) -> str:
        self._n += 1
        out = f'{op.lower()}_{self._n}'
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def _normalized(g: _Graph, cfg) -> str:
    """Return the uint8 [B, S, S, 3] tiles as float32 [B, 3, S, S]: (u8 / 255 - mean) / std."""
    x = g.node('Cast', [PIXELS], to=TensorProto.FLOAT)
    x = g.node('Div', [x, g.init('image_scale', np.array(255.0, np.float32))])
    x = g.node('Sub', [x, g.init('image_mean', np.array(cfg.image_mean, np.float32))])
    x = g.node('Div', [x, g.init('image_std', np.array(cfg.image_std, np.float32))])
    return g.node('Transpose', [x], perm=[0, 3, 1, 2])


def _f16(g: _Graph, x: str) -> str:
    """Return x rounded to float16 (to nearest, ties to even) and widened back to float32."""
    return g.node('Cast', [g.node('Cast', [x], to=TensorProto.FLOAT16)], to=TensorProto.FLOAT)


def _patch_embedding(g: _Graph, mm: Mmproj, pixels: str) -> str:
    """Return the stride-p convolution [B, C, P, P] as ggml_conv_2d computes it.

    Its im2col is F16 unless the kernel is BF16: the pixels and the kernel are rounded to
    float16 (exact products, float32 sums), then the bias is added in float32.
    """
    p = mm.config.patch_size
    kernel = mm.array('v.patch_embd.weight')
    if mm.tensors['v.patch_embd.weight'].qtype != 'BF16':
        pixels = _f16(g, pixels)
        kernel = kernel.astype(np.float16).astype(np.float32)
    bias = ([g.init('v.patch_embd.bias', mm.array('v.patch_embd.bias'))]
            if 'v.patch_embd.bias' in mm.tensors else [])
    return g.node('Conv', [pixels, g.init('v.patch_embd.weight', kernel)] + bias,
                  kernel_shape=[p, p], strides=[p, p])


def _gelu(g: _Graph, x: str) -> str:
    """Return ggml's GELU (tanh): its float16 table between -10 and 10, x above, 0 below."""
    table = _f16(g, g.node('Gelu', [_f16(g, x)], approximate='tanh'))
    ten = g.const(10.0, np.float32)
    high = g.node('Where', [g.node('GreaterOrEqual', [x, ten]), x, table])
    low = g.node('LessOrEqual', [x, g.node('Neg', [ten])])
    return g.node('Where', [low, g.const(0.0, np.float32), high])


def _quick_gelu(g: _Graph, x: str) -> str:
    """Return ggml's quick GELU, x * sigmoid(1.702 x), from its float16 table."""
    x = _f16(g, x)
    scaled = g.node('Mul', [x, g.const(1.702, np.float32)])
    return _f16(g, g.node('Mul', [x, g.node('Sigmoid', [scaled])]))


def _linear(g: _Graph, mm: Mmproj, x: str, prefix: str, transposed: bool = True) -> str:
    """Add x @ W.T (+ b) for a [out, in] GGUF matrix (x @ W when `transposed` is False).

    A Q8_0 matrix stays in its 8-bit blocks: MatMulNBits over the file's own codes and
    scales (the LLM's exact repack), int8 activations per block of 32 as llama.cpp's Q8_0
    matmul has them; a quarter of the float32 bytes, and onnxruntime's int8 GEMM.
    """
    source = mm.tensors[prefix + '.weight']
    bias = [g.init(prefix + '.bias', mm.array(prefix + '.bias'))] \
        if prefix + '.bias' in mm.tensors else []
    if transposed and source.qtype == 'Q8_0' and len(source.shape) == 2:
        blocks = from_q8_0(source.data, source.shape[1])
        n, k = source.shape
        inputs = [x, g.init(prefix + '.qweight', blocks.packed),
                  g.init(prefix + '.scales', blocks.scales)]   # zero point 128: the default
        return g.node('MatMulNBits', inputs + (['', ''] + bias if bias else []),
                      domain=MS_DOMAIN, K=k, N=n, bits=8, block_size=32,
                      accuracy_level=INT8_ACTIVATIONS)
    w = mm.array(prefix + '.weight')
    if source.qtype == 'F16':  # ggml's F16 matmul takes the activations as float16 too
        x = _f16(g, x)
    y = g.node('MatMul', [x, g.init(prefix + '.weight.t', w.T if transposed else w)])
    if bias:
        y = g.node('Add', [y] + bias)
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
    o = _linear(g, mm, merged, f'{b}.attn_out')
    if f'{b}.ls1.weight' in mm.tensors:  # InternViT's layer scale
        o = g.node('Mul', [o, g.init(f'{b}.ls1.weight', mm.array(f'{b}.ls1.weight').reshape(-1))])
    x = g.node('Add', [x, o])
    h = _layer_norm(g, mm, x, f'{b}.ln2')
    up = _linear(g, mm, h, f'{b}.ffn_up')
    if cfg.activation == 'gelu_tanh':
        act = _gelu(g, up)
    elif cfg.activation == 'silu':
        act = g.node('Mul', [up, g.node('Sigmoid', [up])])
    else:
        act = _quick_gelu(g, up)
    down = _linear(g, mm, act, f'{b}.ffn_down')
    if f'{b}.ls2.weight' in mm.tensors:
        down = g.node('Mul', [down, g.init(f'{b}.ls2.weight',
                                           mm.array(f'{b}.ls2.weight').reshape(-1))])
    return g.node('Add', [x, down])


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
    return _linear(g, mm, _unshuffle(g, x, side, s, c), 'mm.model.fc')


def _unshuffle(g: _Graph, x: str, side: int, s: int, c: int) -> str:
    """Return pixel unshuffle by s: token Y * (P / s) + X, feature (dy s + dx) C + c."""
    grid = g.node('Reshape', [x, g.const([0, side // s, s, side // s, s, c])])
    return g.node('Reshape', [g.node('Transpose', [grid], perm=[0, 1, 3, 2, 4, 5]),
                              g.const([0, (side // s) ** 2, s * s * c])])


def _patch_rows(g: _Graph, x: str, first: int, count: int) -> str:
    """Return rows first..first + count of [B, rows, C] (the patches, without the CLS row)."""
    return g.node('Slice', [x, g.const([first]), g.const([first + count]), g.const([1])])


def _internvl_projector(g: _Graph, mm: Mmproj, x: str) -> str:
    cfg = mm.config
    n = cfg.patches_per_side ** 2
    patches = _patch_rows(g, x, 0 if CLS_LAST['internvl'] else 1, n)
    y = _unshuffle(g, patches, cfg.patches_per_side, cfg.scale_factor, cfg.n_embd)
    weight = g.init('mm.model.mlp.0.weight', mm.array('mm.model.mlp.0.weight'))
    bias = g.init('mm.model.mlp.0.bias', mm.array('mm.model.mlp.0.bias'))
    # eps 1e-5: llama.cpp's (PyTorch's default), not the encoder's.
    y = g.node('LayerNormalization', [y, weight, bias], axis=-1, epsilon=1e-5)
    y = _gelu(g, _linear(g, mm, y, 'mm.model.mlp.1'))
    return _linear(g, mm, y, 'mm.model.mlp.3')


def _mlp_projector(g: _Graph, mm: Mmproj, x: str) -> str:
    # Rows 1..N: with the CLS token last (llama.cpp), patch 0 is dropped and CLS is kept.
    rows = _patch_rows(g, x, 1, mm.config.patches_per_side ** 2)
    y = _gelu(g, _linear(g, mm, rows, 'mm.0'))
    return _linear(g, mm, y, 'mm.2')


def build_encoder(mm: Mmproj, name: Optional[str] = None, data: Optional[BinaryIO] = None,
                  location: str = '') -> onnx.ModelProto:
    """Return the mmproj's encoder + projector as an ONNX model (pixel_values -> image_embeds).

    data: an open file named `location` beside where the model will be saved; the weights
    are written into it one at a time (converting then holds one tensor, not the encoder).
    """
    cfg = mm.config
    if cfg.projector not in BUILT:  # a projector convert/mmproj.py reads but not built here
        raise MmprojError(f'{mm.path}: the {cfg.projector} encoder is not built (built: '
                          f'{", ".join(BUILT)})')
    if cfg.projector == GEMMA4V:  # one image of any size, its own graph
        from edge_llm_ros.convert.vision_gemma4 import build_gemma4_encoder
        return build_gemma4_encoder(mm, name, data, location)
    if cfg.dynamic:  # Qwen-VL: one image of any size, its own graph
        from edge_llm_ros.convert.vision_qwen import build_qwen_encoder
        return build_qwen_encoder(mm, name, data, location)
    g = _Graph(data, location)
    conv = _patch_embedding(g, mm, _normalized(g, cfg))  # [B, C, P, P]
    x = g.node('Transpose', [g.node('Reshape', [conv, g.const([0, cfg.n_embd, -1])])],
               perm=[0, 2, 1])  # [B, N, C], patch y * P + x
    if 'v.class_embd' in mm.tensors:
        cls = g.init('v.class_embd', mm.array('v.class_embd').reshape(1, 1, cfg.n_embd))
        batch = g.node('Slice', [g.node('Shape', [x]), g.const([0]), g.const([1])])
        shape = g.node('Concat', [batch, g.const([1, cfg.n_embd])], axis=0)
        cls = g.node('Expand', [cls, shape])
        x = g.node('Concat', [x, cls] if CLS_LAST[cfg.projector] else [cls, x], axis=1)
    pos = mm.array('v.position_embd.weight')
    x = g.node('Add', [x, g.init('v.position_embd.weight', pos.reshape(-1, cfg.n_embd))])
    if 'v.pre_ln.weight' in mm.tensors:
        x = _layer_norm(g, mm, x, 'v.pre_ln')
    layers = cfg.n_layer - 1 if cfg.projector == 'mlp' and MLP_SKIPS_LAST_LAYER else cfg.n_layer
    for i in range(layers):
        x = _block(g, mm, x, i)
    if 'v.post_ln.weight' in mm.tensors:
        x = _layer_norm(g, mm, x, 'v.post_ln')
    out = {'gemma3': _gemma3_projector, 'idefics3': _idefics3_projector,
           'internvl': _internvl_projector, 'mlp': _mlp_projector}[cfg.projector](g, mm, x)
    g.nodes.append(helper.make_node('Identity', [out], ['image_embeds'], name='image_embeds'))
    s = cfg.image_size
    graph = helper.make_graph(
        g.nodes, name or f'{cfg.projector}_vision',
        [helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, ['batch', s, s, 3])],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT,
                                       ['batch', cfg.tokens_per_tile, cfg.n_out])],
        list(g.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 9
    return model


# Where the image goes in the prompt, as llama.cpp's mtmd places it (research section 3.2),
# whether its tokens see each other (gemma3: bidirectional within the image), and the recipe
# runtime/mmproj_preprocess.preprocess follows for the image (mlp: letterboxed on libmtmd's grey).
_LAYOUT = {
    'gemma3': {'preprocess': 'letterbox_bilinear', 'attention': 'bidirectional',
               'wrapper': ['<start_of_image>', '<end_of_image>']},
    'idefics3': {'preprocess': 'idefics3_tiles', 'attention': 'causal',
                 'wrapper': ['<fake_token_around_image>', '<row_{r}_col_{c}>', '<global-img>']},
    'internvl': {'preprocess': 'internvl_tiles', 'attention': 'causal',
                 'wrapper': ['<img>', '</img>']},
    'mlp': {'preprocess': 'letterbox_bicubic', 'attention': 'causal', 'wrapper': []},
    'qwen2.5vl_merger': {'preprocess': 'qwen_smart_resize', 'attention': 'causal',
                         'wrapper': ['<|vision_start|>', '<|vision_end|>']},
    'qwen3vl_merger': {'preprocess': 'qwen_smart_resize', 'attention': 'causal',
                       'wrapper': ['<|vision_start|>', '<|vision_end|>']},
    GEMMA4V: {'preprocess': 'gemma4_resize', 'attention': 'bidirectional',
              'wrapper': ['<|image>', '<image|>']},
}


def image_attention(mm: Mmproj) -> str:
    """'bidirectional' when the image's tokens see each other both ways, else 'causal'."""
    if mm.config.projector == GEMMA4V and mm.config.n_out in GEMMA4_CAUSAL_WIDTHS:
        return 'causal'
    return _LAYOUT[mm.config.projector]['attention']


def model_yaml_section(mm: Mmproj, file: str) -> dict:
    """Return model.yaml's `vision` mapping for a converted mmproj."""
    cfg = mm.config
    return {'file': file, 'projector': cfg.projector, 'image_size': cfg.image_size,
            'patch_size': cfg.patch_size, 'tokens_per_tile': cfg.tokens_per_tile,
            'embedding_size': cfg.n_out, 'image_mean': list(cfg.image_mean),
            'image_std': list(cfg.image_std), 'longest_edge': cfg.longest_edge,
            'min_tiles': cfg.min_tiles, 'max_tiles': cfg.max_tiles,
            **_LAYOUT[cfg.projector], 'attention': image_attention(mm), 'source': mm.path,
            **({'head_dim': cfg.n_embd // cfg.n_head, 'merge': cfg.scale_factor,
                'min_tokens': QWEN_MIN_TOKENS, 'max_tokens': QWEN_MAX_TOKENS,
                'positions': 'mrope'} if cfg.projector in QWEN_PROJECTORS else {}),
            # Gemma 4: the encoder's 2-D RoPE tables (runtime/mmproj_gemma4.py); the language
            # model's positions stay plain (no grid).
            **({'head_dim': cfg.n_embd // cfg.n_head, 'merge': cfg.scale_factor,
                'min_tokens': GEMMA4_MIN_TOKENS, 'max_tokens': GEMMA4_MAX_TOKENS,
                'rope_base': GEMMA4_ROPE_BASE, 'positions': 'rope_2d'}
               if cfg.projector == GEMMA4V else {}),
            # Qwen3-VL: the learned positions' square grid, and the DeepStack rows that follow
            # each image row's embedding_size main values (embedding_size x (1 + D) wide).
            **({'position_grid': cfg.patches_per_side, 'deepstack_layers': len(cfg.deepstack)}
               if cfg.projector == 'qwen3vl_merger' else {})}

"""A BERT-style encoder (llama.cpp's `bert` graph) as an ONNX graph: token ids in, states out.

`input_ids` int64 [B, T] and `attention_mask` int64 [B, T] (1 = a token, 0 = padding) become
`hidden` float32 [B, T, H], the last layer's states (llama.cpp's result_embd); pooling and
normalization are the runtime's (runtime/encoder.py), as the folder's model.yaml says. With a
classifier head (a cross-encoder, pooling 'rank') the graph also returns `rank_scores`
[B, n_labels]: the first token through cls (+ bias), tanh, cls.output (+ bias).

nomic-bert (nomic-embed-text) is the same graph with llama.cpp's changes for it: no position
table but NEOX RoPE on q and k, fused q|k|v rows, a SwiGLU MLP, no biases on the matrices.
jina-bert-v2 (jina-embeddings-v2 small/base) is too: no position table but ALiBi (each head's
scores plus slope_h * -|i - j|, max bias 8 as llama.cpp has it), a GEGLU MLP (ffn_up holds the
gate rows then the up rows, or a separate ffn_gate), and where the file has them LayerNorms on
q and k and a second attention LayerNorm (attn_norm_2); only its WPM (BERT) vocabulary is read.
modern-bert (ModernBERT, gte-modernbert, granite-embedding R2) shares the pieces (attention,
RoPE, GLU, LayerNorm) in its own pre-norm layer: LayerNorm (no bias; none before layer 0),
fused q|k|v, NEOX RoPE, no biases anywhere, a GEGLU (or, with hidden_activation silu, SwiGLU)
MLP over ffn_up's two halves, a symmetric sliding window (|i - j| <= window / 2) with its own
RoPE base on all layers but every `sliding_window_pattern`-th (layer 0 global), and a final
LayerNorm.

The graph is llama.cpp's src/models/bert.cpp: token + token-type-0 + position embeddings,
LayerNorm, then per layer Q/K/V with biases, attention both ways over the row's tokens (padding
masked out), the output projection, residual + LayerNorm, a GELU MLP, residual + LayerNorm
(post-norm). Weights stay in their GGUF types: Q4_0..Q8_0 and K-quant matrices are the op
library's KQuantMatMul over the file's blocks (activations quantized per block as ggml does),
an F16 matrix a float32 MatMul of its widened values with the activations rounded to float16
(ggml's F16 matmul does that), F32 a float32 MatMul. GELU is ggml's float16 table
(vision_graph._gelu).
"""
from dataclasses import dataclass
import pathlib
from typing import BinaryIO, Dict, Optional, Tuple

import numpy as np
import onnx
from onnx import helper, TensorProto

from edge_llm_ros.convert.architectures import swa_layers
from edge_llm_ros.convert.checkpoint import gguf_field, gguf_tensor, open_gguf, SourceTensor
from edge_llm_ros.convert.gguf_weights import gguf_weights, KQUANT_TYPES
from edge_llm_ros.convert.onnx_graph import IR_VERSION, KQUANT_DOMAIN
from edge_llm_ros.convert.vision_graph import _f16, _gelu, _Graph
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import DATA_FILE

OPSET = 20  # Gelu (approximate='tanh')
# Decoder families whose GGUF is an embedder or reranker when it names a pooling type
# (Qwen3-Embedding: last, Qwen3-Reranker: rank); their graph is decoder_encoder_graph.py's.
DECODER_EMBEDDERS = ('qwen3', 'gemma-embedding')
# Of those, the ones that are always embedders (EmbeddingGemma: bidirectional gemma3).
EMBEDDING_ONLY = ('gemma-embedding',)
BERT_FAMILY = ('bert', 'nomic-bert', 'jina-bert-v2', 'modern-bert')  # encoder_graph.py's own graph
ENCODER_ARCHITECTURES = BERT_FAMILY + DECODER_EMBEDDERS
JINA_MAX_ALIBI_BIAS = 8.0  # llama.cpp's hparams.f_max_alibi_bias for jina-bert-v2
# llama.cpp's LLAMA_POOLING_TYPE_* values as the GGUF's <arch>.pooling_type holds them.
POOLING_NAMES = {0: 'none', 1: 'mean', 2: 'cls', 3: 'last', 4: 'rank'}
IDS, MASK, HIDDEN, RANK = 'input_ids', 'attention_mask', 'hidden', 'rank_scores'
POOLED = 'pooled'  # [B, D]: pooled in the graph, then dense projections (gemma)


@dataclass(frozen=True)
class EncoderSpec:
    """What an encoder GGUF says about its shape and pooling."""

    arch: str
    hidden: int
    heads: int
    layers: int
    ff: int
    context: int
    eps: float
    pooling: str
    vocab_size: int
    labels: int = 0  # outputs of a classifier head (rank pooling), 0 = none
    # Decoder embedders (DECODER_EMBEDDERS): grouped KV heads, head size and RoPE base.
    kv_heads: int = 0
    head_dim: int = 0
    rope_base: float = 0.0
    # gemma-embedding: sliding-window layers (a symmetric window of `window` positions) with
    # their own RoPE base.
    local_layers: Tuple[bool, ...] = ()
    window: int = 0
    local_rope_base: float = 0.0
    alibi_bias: float = 0.0  # jina-bert-v2: ALiBi's max bias (0 = no ALiBi)
    glu: str = ''  # modern-bert's MLP activation: 'gelu' (GEGLU) or 'silu' (SwiGLU)


class EncoderSource:
    """What the graph builders read of an encoder: `path`, `spec` and `tensors`.

    `tensors` are SourceTensor under llama.cpp's GGUF names ('token_embd.weight',
    'blk.0.attn_q.weight', ...), in llama.cpp's layouts, whatever the source file: the GGUF
    reader below, or an HF folder reader (convert/encoder.py ENCODER_FOLDER_READERS) that maps
    its names and layouts as llama.cpp's convert_hf_to_gguf.py does.
    """

    path: pathlib.Path
    spec: 'EncoderSpec'
    tensors: Dict[str, SourceTensor]

    def display_name(self) -> str:
        """Return the model's name for model.yaml."""
        raise NotImplementedError

    def rerank_template(self) -> Optional[str]:
        """Return the rerank prompt ({query}, {document}) of a yes/no reranker, else None."""
        raise NotImplementedError

    def write_tokenizer(self, out_dir: pathlib.Path) -> Dict[str, object]:
        """Write tokenizer.json (+ files) into out_dir; return the special-token facts."""
        raise NotImplementedError

    def required(self):
        """Tensor names llama.cpp's loader of the architecture requires."""
        if self.spec.arch in DECODER_EMBEDDERS:
            names = ['token_embd.weight', 'output_norm.weight']
            for i in range(self.spec.layers):
                names += [f'blk.{i}.{r}.weight' for r in (
                    'attn_norm', 'attn_q', 'attn_k', 'attn_v', 'attn_output', 'attn_q_norm',
                    'attn_k_norm', 'ffn_norm', 'ffn_gate', 'ffn_up', 'ffn_down')]
                if self.spec.arch == 'gemma-embedding':
                    names += [f'blk.{i}.{r}.weight' for r in ('post_attention_norm',
                                                              'post_ffw_norm')]
            return names
        if self.spec.arch == 'modern-bert':
            names = ['token_embd.weight', 'token_embd_norm.weight', 'output_norm.weight']
            for i in range(self.spec.layers):
                names += [f'blk.{i}.{r}.weight' for r in ('attn_qkv', 'attn_output', 'ffn_up',
                                                          'ffn_down', 'ffn_norm')]
                names += [f'blk.{i}.attn_norm.weight'] if i else []
            return names
        nomic = self.spec.arch == 'nomic-bert'
        names = ['token_embd.weight', 'token_embd_norm.weight', 'token_embd_norm.bias']
        names += ['position_embd.weight'] if self.spec.arch == 'bert' else []
        names += ['token_types.weight'] if self.spec.alibi_bias else []
        for i in range(self.spec.layers):
            names += [f'blk.{i}.{r}.weight' for r in ('attn_output', 'attn_output_norm',
                                                      'ffn_up', 'ffn_down', 'layer_output_norm')]
            names += [f'blk.{i}.{r}.bias' for r in ('attn_output_norm', 'layer_output_norm')]
            names += [f'blk.{i}.ffn_gate.weight'] if nomic else []
            if f'blk.{i}.attn_qkv.weight' not in self.tensors:
                names += [f'blk.{i}.attn_{r}.weight' for r in 'qkv']
        return names

    def array(self, name: str) -> np.ndarray:
        """Return a tensor as float32 in its logical shape."""
        return self.tensors[name].dequantize()

    def has(self, name: str) -> bool:
        return name in self.tensors


class EncoderGguf(EncoderSource):
    """An opened encoder GGUF: its spec and tensors (bytes mapped, not copied)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.reader = open_gguf(path)
        arch = gguf_field(self.reader, 'general.architecture', required=True)
        if arch not in ENCODER_ARCHITECTURES:
            raise UnsupportedModelError(
                f'{path}: {arch!r} is not an encoder architecture this converter builds '
                f'({", ".join(ENCODER_ARCHITECTURES)})')
        self.tensors: Dict[str, SourceTensor] = {t.name: gguf_tensor(path, t)
                                                 for t in self.reader.tensors}

        def key(name: str, default=None):
            return gguf_field(self.reader, f'{arch}.{name}', default=default,
                              required=default is None)

        decoder = arch in DECODER_EMBEDDERS
        pooling = int(key('pooling_type', 0))
        if pooling not in POOLING_NAMES:
            raise UnsupportedModelError(f'{path}: pooling_type {pooling} is not one of '
                                        f'{POOLING_NAMES}')
        if decoder and not pooling and arch not in EMBEDDING_ONLY:
            raise UnsupportedModelError(f'{path}: this {arch} GGUF names no pooling type: it is '
                                        'a chat model; convert it as one (no embedding kind)')
        if not decoder and bool(key('attention.causal', False)):
            raise UnsupportedModelError(f'{path}: a causal bert is not an encoder; convert a '
                                        'bidirectional embedding model')
        labels = self.tensors['cls.output.weight'].shape[0] \
            if 'cls.output.weight' in self.tensors else 0
        tokens = gguf_field(self.reader, 'tokenizer.ggml.tokens', required=True)
        heads = int(key('attention.head_count'))
        hidden = int(key('embedding_length'))
        extra = {}
        if decoder:
            extra = {'kv_heads': int(key('attention.head_count_kv', heads)),
                     'head_dim': int(key('attention.key_length', hidden // heads)),
                     'rope_base': float(key('rope.freq_base', 10000.0))}
        if arch == 'gemma-embedding':
            layers = int(key('block_count'))
            pattern = key('attention.sliding_window_pattern', 6)  # a period or per-layer flags
            local = (tuple(bool(x) for x in pattern) if isinstance(pattern, (list, tuple))
                     else swa_layers(int(pattern), layers))
            extra.update(local_layers=local,
                         window=int(key('attention.sliding_window')),
                         local_rope_base=float(key('rope.freq_base_swa',
                                                   extra['rope_base'])))
        if arch == 'nomic-bert':  # rotary positions instead of a position table
            extra = {'head_dim': hidden // heads,
                     'rope_base': float(key('rope.freq_base', 10000.0))}
        if arch == 'jina-bert-v2':  # ALiBi instead of a position table
            vocab = gguf_field(self.reader, 'tokenizer.ggml.model', required=True)
            if vocab != 'bert':
                raise UnsupportedModelError(
                    f'{path}: this jina-bert-v2 GGUF has a {vocab!r} vocabulary; only the '
                    "WordPiece ('bert') one of jina-embeddings-v2-small/base-en is read: use "
                    'one of those, or a bert / nomic-bert embedder')
            extra = {'alibi_bias': JINA_MAX_ALIBI_BIAS}
        if arch == 'modern-bert':
            extra = modern_bert_fields(path, key, int(key('block_count')), hidden // heads,
                                       pooling)
        eps = key('attention.layer_norm_rms_epsilon' if decoder else
                  'attention.layer_norm_epsilon')
        self.spec = EncoderSpec(arch, hidden, heads, int(key('block_count')),
                                int(key('feed_forward_length')), int(key('context_length')),
                                float(eps), POOLING_NAMES[pooling], len(tokens), labels, **extra)
        missing = [n for n in self.required() if n not in self.tensors]
        if missing:
            raise ModelLoadError(f'{path}: the {arch} GGUF lacks {", ".join(missing[:5])}; the '
                                 'file is incomplete, convert it again with llama.cpp')

    def display_name(self) -> str:
        return str(gguf_field(self.reader, 'general.name') or self.path.stem)

    def rerank_template(self) -> Optional[str]:
        template = gguf_field(self.reader, 'tokenizer.chat_template.rerank')
        return str(template) if template else None

    def write_tokenizer(self, out_dir: pathlib.Path) -> Dict[str, object]:
        from edge_llm_ros.convert.gguf_tokenizer import write_tokenizer_files
        return write_tokenizer_files(self.reader, out_dir)


def modern_bert_fields(path: pathlib.Path, key, layers: int, head_dim: int,
                       pooling: int) -> dict:
    """Return ModernBERT's spec fields (llama.cpp's modern-bert.cpp load_arch_hparams).

    key(name, default) reads the `modern-bert.` keys of a GGUF, or their HF config values.
    """
    act = str(key('hidden_activation', 'gelu'))
    glu = {'gelu': 'gelu', 'geglu': 'gelu', 'silu': 'silu', 'swish': 'silu',
           'swiglu': 'silu'}.get(act)
    if glu is None:
        raise UnsupportedModelError(f'{path}: modern-bert hidden_activation {act!r} '
                                    'is not gelu/geglu or silu/swiglu; this converter '
                                    'builds those two MLPs only')
    if POOLING_NAMES[pooling] == 'rank':
        raise UnsupportedModelError(f'{path}: a modern-bert reranker (its cls / '
                                    'cls_norm head) is not built; convert an embedding '
                                    'model, or use a bert cross-encoder')
    window = int(key('attention.sliding_window', 0))
    local = (False,) * layers
    if window > 0:  # every n-th layer global, layer 0 first (dense_first)
        pattern = key('attention.sliding_window_pattern', 3)
        local = (tuple(bool(x) for x in pattern) if isinstance(pattern, (list, tuple))
                 else tuple(int(pattern) == 0 or i % int(pattern) != 0
                            for i in range(layers)))
    # llama.cpp's rope_freq_base_train_swa is 10000 unless the file says otherwise
    return {'head_dim': head_dim, 'rope_base': float(key('rope.freq_base', 10000.0)),
            'local_layers': local, 'window': window, 'glu': glu,
            'local_rope_base': float(key('rope.freq_base_swa', 10000.0))}


def linear(g: _Graph, m: EncoderSource, x: str, prefix: str) -> str:
    """Add x @ W.T (+ b) for an [out, in] GGUF matrix, in the file's type (module docstring)."""
    source = m.tensors[prefix + '.weight']
    bias = m.array(prefix + '.bias') if m.has(prefix + '.bias') else None
    blocks = gguf_weights(source)
    if blocks is not None:
        inputs = [x, g.init(prefix + '.gguf_blocks', blocks.raw)]
        if bias is not None:
            inputs.append(g.init(prefix + '.bias', bias))
        g._n += 1
        out = f'kquant_{g._n}'
        g.nodes.append(helper.make_node('KQuantMatMul', inputs, [out], name=prefix,
                                        domain=KQUANT_DOMAIN, quant_type=blocks.type_id,
                                        K=blocks.k, N=blocks.shape[0]))
        y = out
    else:
        if source.qtype not in ('F32', 'F16'):
            raise UnsupportedModelError(
                f'{m.path}: {prefix}.weight is {source.qtype}; encoder matrices are read as '
                f'F32, F16 or {"/".join(KQUANT_TYPES)}: re-quantize the GGUF with llama-quantize')
        w = m.array(prefix + '.weight')
        if source.qtype == 'F16':
            x = _f16(g, x)
        y = g.node('MatMul', [x, g.init(prefix + '.weight.t', np.ascontiguousarray(w.T))])
        if bias is not None:
            y = g.node('Add', [y, g.init(prefix + '.bias', bias)])
    return y


def _layer_norm(g: _Graph, m: EncoderSource, x: str, prefix: str) -> str:
    weight = g.init(prefix + '.weight', m.array(prefix + '.weight'))
    bias = [g.init(prefix + '.bias', m.array(prefix + '.bias'))] \
        if m.has(prefix + '.bias') else []  # modern-bert: no biases
    return g.node('LayerNormalization', [x, weight] + bias, axis=-1, epsilon=m.spec.eps)


def token_rows(g: _Graph, m: EncoderSource) -> str:
    """Return the token table's rows of input_ids [B, T, H] (a KQuantGather over its blocks)."""
    table = m.tensors['token_embd.weight']
    blocks = gguf_weights(table)
    if blocks is not None:
        g._n += 1
        rows = f'kquant_gather_{g._n}'
        g.nodes.append(helper.make_node('KQuantGather', [g.init('token_embd.gguf_blocks',
                                                                blocks.raw), IDS],
                                        [rows], name='token_embd', domain=KQUANT_DOMAIN,
                                        quant_type=blocks.type_id, K=m.spec.hidden))
    else:
        rows = g.node('Gather', [g.init('token_embd.weight', m.array('token_embd.weight')), IDS],
                      axis=0)
    return rows


def _embeddings(g: _Graph, m: EncoderSource) -> str:
    """Token rows + token type 0 + position rows, then the embedding LayerNorm."""
    rows = token_rows(g, m)
    if m.has('token_types.weight'):  # llama.cpp adds row 0 ("sentence A") to every token
        rows = g.node('Add', [rows, g.init('token_type0', m.array('token_types.weight')[0])])
    if m.has('position_embd.weight'):  # bert (nomic-bert rotates q and k instead)
        ones = g.node('ConstantOfShape', [g.node('Shape', [IDS])],
                      value=helper.make_tensor('one', TensorProto.INT64, [1], [1]))
        positions = g.node('Sub', [g.node('CumSum', [ones, g.const(1)]), ones])  # 0..T-1
        pos = g.node('Gather', [g.init('position_embd.weight',
                                       m.array('position_embd.weight')), positions], axis=0)
        rows = g.node('Add', [pos, rows])
    return _layer_norm(g, m, rows, 'token_embd_norm')


def rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    """Rotate x [B, T, heads, d] NEOX-style: pairs (i, i + d/2) by the position's angles."""
    x1 = g.node('Slice', [x, g.const([0]), g.const([half]), g.const([-1])])
    x2 = g.node('Slice', [x, g.const([half]), g.const([2 * half]), g.const([-1])])
    a = g.node('Sub', [g.node('Mul', [x1, cos]), g.node('Mul', [x2, sin])])
    b = g.node('Add', [g.node('Mul', [x2, cos]), g.node('Mul', [x1, sin])])
    return g.node('Concat', [a, b], axis=-1)


def rope_angles(g: _Graph, base: float, head_dim: int) -> tuple:
    """Return cos and sin [B, T, 1, d/2] of positions 0..T-1 (theta = p * base^(-2i/d))."""
    half = head_dim // 2
    inv_freq = (1.0 / base ** (np.arange(half, dtype=np.float64) * 2
                               / head_dim)).astype(np.float32)
    ones = g.node('ConstantOfShape', [g.node('Shape', [IDS])],
                  value=helper.make_tensor('one', TensorProto.FLOAT, [1], [1.0]))
    pos = g.node('Sub', [g.node('CumSum', [ones, g.const(1)]), ones])      # [B, T]
    ang = g.node('Mul', [g.node('Unsqueeze', [pos, g.const([2, 3])]),
                         g.init(f'rope_inv_freq_{base:g}', inv_freq)])     # [B, T, 1, d/2]
    return g.node('Cos', [ang]), g.node('Sin', [ang])


def _attention(g: _Graph, m: EncoderSource, x: str, bias: str, i: int,
               rope_cs: Optional[tuple] = None) -> str:
    s = m.spec
    b = f'blk.{i}'
    d = s.hidden // s.heads
    split = g.const([0, 0, s.heads, d])
    if m.has(f'{b}.attn_qkv.weight'):  # fused q|k|v rows (nomic-bert's Wqkv)
        qkv = linear(g, m, x, f'{b}.attn_qkv')
        projected = {r: g.node('Slice', [qkv, g.const([j * s.hidden]),
                                         g.const([(j + 1) * s.hidden]), g.const([-1])])
                     for j, r in enumerate('qkv')}
    else:
        projected = {r: linear(g, m, x, f'{b}.attn_{r}') for r in 'qkv'}

    for r in 'qk':  # jina-bert-v2 (where present): LayerNorm over all heads' q, k
        if m.has(f'{b}.attn_{r}_norm.weight'):
            projected[r] = _layer_norm(g, m, projected[r], f'{b}.attn_{r}_norm')

    def heads_of(role: str) -> str:
        t = g.node('Reshape', [projected[role], split])
        if rope_cs is not None and role in 'qk':
            t = rope(g, t, *rope_cs, d // 2)
        return g.node('Transpose', [t], perm=[0, 2, 1, 3])  # [B, H, T, d]

    q, k, v = heads_of('q'), heads_of('k'), heads_of('v')
    scores = g.node('Mul', [g.node('MatMul', [q, g.node('Transpose', [k], perm=[0, 1, 3, 2])]),
                            g.const(1.0 / np.sqrt(d), np.float32)])
    probs = g.node('Softmax', [g.node('Add', [scores, bias])], axis=-1)
    attn = g.node('MatMul', [probs, v])
    merged = g.node('Reshape', [g.node('Transpose', [attn], perm=[0, 2, 1, 3]),
                                g.const([0, 0, s.hidden])])
    return linear(g, m, merged, f'{b}.attn_output')


def _layer(g: _Graph, m: EncoderSource, x: str, bias: str, i: int,
           rope_cs: Optional[tuple] = None) -> str:
    b = f'blk.{i}'
    h = _layer_norm(g, m, g.node('Add', [_attention(g, m, x, bias, i, rope_cs), x]),
                    f'{b}.attn_output_norm')
    if m.has(f'{b}.attn_norm_2.weight'):  # jina-bert-v2: the layer input again, LayerNorm
        h = _layer_norm(g, m, g.node('Add', [h, x]), f'{b}.attn_norm_2')
    fused_glu = m.tensors[f'{b}.ffn_up.weight'].shape[0] == 2 * m.spec.ff
    if m.spec.arch == 'jina-bert-v2' and (fused_glu or m.has(f'{b}.ffn_gate.weight')):
        act = _glu(g, m, h, b, 'gelu')  # else llama.cpp's plain GELU MLP (below)
    elif m.has(f'{b}.ffn_gate.weight'):  # nomic-bert: SwiGLU
        act = _glu(g, m, h, b, 'silu')
    else:
        act = _gelu(g, linear(g, m, h, f'{b}.ffn_up'))
    out = g.node('Add', [linear(g, m, act, f'{b}.ffn_down'), h])
    return _layer_norm(g, m, out, f'{b}.layer_output_norm')


def _glu(g: _Graph, m: EncoderSource, x: str, b: str, act: str) -> str:
    """Return act(gate) * up: gate and up from ffn_gate and ffn_up, or ffn_up's two halves.

    act 'gelu' is ggml's GEGLU (its float16 GELU table), 'silu' its SwiGLU; a single ffn_up
    of 2 * ff rows holds the gate's rows first (ggml_geglu / ggml_swiglu, not swapped).
    """
    ff = m.spec.ff
    if m.has(f'{b}.ffn_gate.weight'):
        gate, up = linear(g, m, x, f'{b}.ffn_gate'), linear(g, m, x, f'{b}.ffn_up')
    else:
        both = linear(g, m, x, f'{b}.ffn_up')
        gate, up = (g.node('Slice', [both, g.const([j * ff]), g.const([(j + 1) * ff]),
                                     g.const([-1])]) for j in (0, 1))
    gated = _gelu(g, gate) if act == 'gelu' else g.node('Mul', [gate,
                                                                g.node('Sigmoid', [gate])])
    return g.node('Mul', [gated, up])


def _modern_layer(g: _Graph, m: EncoderSource, x: str, bias: str, i: int,
                  rope_cs: tuple) -> str:
    """Return ModernBERT's pre-norm layer (llama.cpp's modern-bert.cpp), bert's pieces."""
    b = f'blk.{i}'
    h = _layer_norm(g, m, x, f'{b}.attn_norm') if m.has(f'{b}.attn_norm.weight') else x
    h = g.node('Add', [_attention(g, m, h, bias, i, rope_cs), x])
    act = _glu(g, m, _layer_norm(g, m, h, f'{b}.ffn_norm'), b, m.spec.glu)
    return g.node('Add', [linear(g, m, act, f'{b}.ffn_down'), h])


def mask_bias(g: _Graph) -> str:
    """[B, 1, 1, T] additive mask: 0 for tokens, -inf-like for padding (keys only)."""
    keep = g.node('Cast', [MASK], to=TensorProto.FLOAT)
    neg = g.node('Mul', [g.node('Sub', [keep, g.const(1.0, np.float32)]),
                         g.const(np.float32(3.0e38), np.float32)])
    return g.node('Unsqueeze', [neg, g.const([1, 2])])


def window_bias(g: _Graph, bias: str, window: int) -> str:
    """[B, 1, T, T]: `bias` where |i - j| <= window / 2 (llama.cpp's symmetric window)."""
    t = g.node('Gather', [g.node('Shape', [IDS]), g.const(1)], axis=0)
    idx = g.node('Range', [g.const(0), t, g.const(1)])
    dist = g.node('Abs', [g.node('Sub', [g.node('Unsqueeze', [idx, g.const([1])]),
                                         g.node('Unsqueeze', [idx, g.const([0])])])])
    near = g.node('LessOrEqual', [dist, g.const(window // 2)])
    return g.node('Where', [near, bias, g.const(np.float32(-3.0e38), np.float32)])


def alibi_slopes(heads: int, max_bias: float) -> np.ndarray:
    """Return ggml_soft_max_ext's ALiBi slope per head (float32, as ggml computes them)."""
    n_log2 = 1 << int(np.floor(np.log2(heads)))
    m0 = np.float32(2.0) ** np.float32(-max_bias / n_log2)
    m1 = np.float32(2.0) ** np.float32(-(max_bias / 2.0) / n_log2)
    return np.array([m0 ** np.float32(h + 1) if h < n_log2
                     else m1 ** np.float32(2 * (h - n_log2) + 1) for h in range(heads)],
                    np.float32)


def alibi_bias(g: _Graph, heads: int, max_bias: float) -> str:
    """[1, heads, T, T] ALiBi term: slope_h * -|i - j| (llama.cpp's mask holds -|i - j|)."""
    t = g.node('Gather', [g.node('Shape', [IDS]), g.const(1)], axis=0)
    pos = g.node('Cast', [g.node('Range', [g.const(0), t, g.const(1)])], to=TensorProto.FLOAT)
    rel = g.node('Sub', [g.node('Unsqueeze', [pos, g.const([1])]),
                         g.node('Unsqueeze', [pos, g.const([0])])])
    dist = g.node('Neg', [g.node('Abs', [rel])])
    slopes = g.init(f'alibi_slopes_{heads}', alibi_slopes(heads, max_bias).reshape(1, -1, 1, 1))
    return g.node('Mul', [slopes, dist])


def _rank_head(g: _Graph, m: EncoderSource, hidden: str) -> str:
    """Return the classifier of a cross-encoder on the first token ([CLS]), as llama.cpp's rank."""
    first = g.node('Gather', [hidden, g.const(0)], axis=1)  # [B, H]
    cur = first
    if m.has('cls.weight'):
        cur = g.node('Tanh', [linear(g, m, cur, 'cls')])
    out = linear(g, m, cur, 'cls.output')
    return g.node('Reshape', [out, g.const([-1, m.spec.labels])])


def build_encoder(m: EncoderSource, data: Optional[BinaryIO] = None) -> onnx.ModelProto:
    """Return the encoder graph; with `data` (an open DATA_FILE) big weights go there."""
    g = _Graph(data, DATA_FILE)
    bias = mask_bias(g)
    if m.spec.alibi_bias:  # jina-bert-v2: positions enter as ALiBi
        bias = g.node('Add', [bias, alibi_bias(g, m.spec.heads, m.spec.alibi_bias)])
    x = _embeddings(g, m)
    s = m.spec
    rope_cs = rope_angles(g, s.rope_base, s.head_dim) \
        if s.arch in ('nomic-bert', 'modern-bert') else None
    if s.arch == 'modern-bert':
        local = (window_bias(g, bias, s.window),
                 rope_angles(g, s.local_rope_base, s.head_dim)) if any(s.local_layers) else None
        for i in range(s.layers):
            layer_bias, layer_rope = local if s.local_layers[i] else (bias, rope_cs)
            x = _modern_layer(g, m, x, layer_bias, i, layer_rope)
        x = _layer_norm(g, m, x, 'output_norm')
    else:
        for i in range(s.layers):
            x = _layer(g, m, x, bias, i, rope_cs)
    g.nodes.append(helper.make_node('Identity', [x], [HIDDEN], name='hidden'))
    outputs = [helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT,
                                             ['batch', 'tokens', m.spec.hidden])]
    if m.spec.pooling == 'rank':
        if not m.spec.labels:
            raise UnsupportedModelError(f'{m.path}: rank pooling without a classifier head '
                                        '(cls.output.weight): not a cross-encoder')
        g.nodes.append(helper.make_node('Identity', [_rank_head(g, m, HIDDEN)], [RANK],
                                        name='rank'))
        outputs.append(helper.make_tensor_value_info(RANK, TensorProto.FLOAT,
                                                     ['batch', m.spec.labels]))
    inputs = [helper.make_tensor_value_info(IDS, TensorProto.INT64, ['batch', 'tokens']),
              helper.make_tensor_value_info(MASK, TensorProto.INT64, ['batch', 'tokens'])]
    graph = helper.make_graph(g.nodes, 'edge_llm_encoder', inputs, outputs,
                              list(g.inits.values()))
    opsets = [helper.make_opsetid('', OPSET), helper.make_opsetid(KQUANT_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    return model

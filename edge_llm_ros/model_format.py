"""The model-folder contract: what the converter writes and the runtime reads.

A model folder holds ``model.onnx`` (+ ``model.onnx.data``), ``tokenizer.json``,
``chat_template.jinja`` and ``model.yaml``. This module names those files, the converter
version that wrote them, the architectures and precisions the format knows, and reads
model.yaml into a typed ModelInfo. Both ``convert/`` (the writer) and ``runtime/`` (the
reader) import it; it imports neither, and nothing heavier than yaml.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import os
import pathlib
from typing import Dict, Optional, Tuple

import yaml

from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

MODEL_FILE = 'model.onnx'
# model.onnx over int8 KV buffers and their scales (kv.dtype int8; convert/kv_int8_graph.py).
KV_INT8_MODEL_FILE = 'model_kv_int8.onnx'
DATA_FILE = 'model.onnx.data'
TOKENIZER_FILE = 'tokenizer.json'
CHAT_TEMPLATE_FILE = 'chat_template.jinja'
MODEL_YAML = 'model.yaml'
# Bumped whenever a folder written before cannot run as it is (the runtime then asks for a
# reconversion). 4: symbolic batch dimension (parallel sequence slots). 5: GGUF blocks kept
# for the edge_llm_ros ops (weights: kquant, model.yaml op_domains). 6: a `logits_count` input
# (logits for the last n positions: speculative verify passes) and, in kquant folders, the
# op library's row-exact CausalAttention (model.yaml `attention`). 7: vision.onnx takes uint8
# tiles and normalizes them (VISION_INPUT); kquant folders' gate|up ops apply the MLP
# activation (`glu`) and CausalAttention the q/k head norms, which an older library lacks.
# 8: model.yaml `name` is the display name (family, size, architecture, weight types: see
# display_name), `gguf_name` the source's own name (GGUF general.name) and `parameters` the
# parameter count. An older folder still runs (showing its raw name); the bump makes
# scripts/setup.sh and the benches reconvert their cached folders so that they show it.
# 9: graphs with the op library's attention are varlen (VARLEN_INPUTS: one call runs the rows
# of a step, each over its own slot). An older folder still runs, a call per row length
# (runtime/decoder.py), except a hybrid's, whose conv states need the row table.
# 10: qwen35's GatedDeltaNet runs the chunked form (its `chunk` attribute, a larger state); the
# op refuses an older qwen35 graph, asking for a reconversion.
CONVERTER_VERSION = '10'
# The decoder families a folder may hold (the converter's registry, convert/architectures.py,
# has exactly these keys: test_model_format checks it).
ARCHITECTURES: Tuple[str, ...] = ('llama', 'qwen2', 'qwen3', 'gemma3', 'phi3', 'lfm2',
                                  'qwen2vl', 'qwen35', 'granitehybrid', 'gemma4', 'qwen3vl',
                                  'smollm3')
# The encoder-only families an embedding / rerank folder may hold beside the decoder ones it
# shares (qwen3: Qwen3-Embedding); config/models families may name them for their prefixes.
EMBEDDING_ARCHITECTURES: Tuple[str, ...] = ('bert', 'nomic-bert', 'jina-bert-v2', 'modern-bert',
                                            'gemma-embedding')
# What each layer keeps per sequence slot (model.yaml `layer_states`, one entry per layer):
# 'kv': attention keys and values per position (past_key_values.{i}.key/value [slots,
# kv_heads, L, head_dim]; `window` > 0: a sliding-window layer, which reads only its last
# `window` positions); 'conv': a gated short convolution's state, B * x of the last
# kernel - 1 positions (past_conv.{i} [slots, *shape], shape [kernel - 1, hidden]), bound as
# both input and output and updated in place. A conv state holds no positions, so it cannot
# be rewound by position: a folder with one is not `rewindable` (ModelInfo.rewindable), and
# the engine refuses what would need that (docs/architectures.md, lfm2). A folder without
# the key (before lfm2) has 'kv' layers only. 'recurrent': a Gated DeltaNet layer's state
# (qwen35), its conv inputs then its delta-rule state in one float32 vector per slot (shape
# [floats], the op library's GatedDeltaNet layout; granitehybrid's Mamba-2 layers: its conv
# inputs then its SSM state, the Mamba2 layout), bound as past_conv.{i} / present_conv.{i}
# like a conv state and kept, snapshotted and undone by the same machinery (FIXED_STATES).
# A 'kv' entry may give its own `head_dim` and `kv_heads` (gemma4: its sliding-window and
# global layers differ; 0 or absent: the model's). 'shared': the layer keeps nothing and
# reads layer `owner`'s KV (gemma4's shared-KV layers: the graph feeds it present.{owner}.*,
# so the buffers and the KV budget count it once).
STATE_KINDS: Tuple[str, ...] = ('kv', 'conv', 'recurrent', 'shared')
# The kinds of fixed-size state (no positions): the runtime treats them alike.
FIXED_STATES: Tuple[str, ...] = ('conv', 'recurrent')
CONV_STATE_PAST = 'past_conv.{}'
CONV_STATE_PRESENT = 'present_conv.{}'
# Weight precisions of a conversion: 'source' keeps GGUF's own types, 'int4' requantizes.
PRECISIONS = ('source', 'int4')
# How a folder holds its matrices: 'kquant' keeps GGUF blocks byte for byte for the project's
# op library (native/, the edge_llm_ros op domain), 'matmulnbits' repacks them for ONNX
# Runtime's MatMulNBits. model.yaml's `op_domains` lists the custom domains a folder needs.
WEIGHT_FORMATS = ('kquant', 'matmulnbits')
# The int32 [1] graph input of a VLM whose image tokens attend both ways (gemma3): 1 makes
# every position of that forward see all of its keys (default 0, causal).
BIDIRECTIONAL_INPUT = 'bidirectional'
# A varlen graph's inputs (converter 9; runtime/rows.py): the rows' tokens packed one after
# the other, embeddings and their packed positions, the row table (slot, start, length,
# bidirectional) the op library's attention and conv ops read, and the positions that get
# logits. A graph without ROWS_INPUT takes the batched inputs (GroupQueryAttention).
ROWS_INPUT = 'rows'
VARLEN_INPUTS: Tuple[str, ...] = ('input_ids', 'inputs_embeds', 'embeds_at', ROWS_INPUT,
                                  'logits_at')
# M-RoPE graphs (qwen2vl) also take each packed token's (t, h, w) rotary position.
ROPE_POSITIONS_INPUT = 'rope_positions'
BATCHED_INPUTS: Tuple[str, ...] = ('input_ids', 'seqlens_k', 'total_sequence_length',
                                   'logits_count')
# vision.onnx's input: uint8 image tiles [B, S, S, 3] (RGB, cut as the family's preprocessing
# cuts them); the graph normalizes them itself.
VISION_INPUT = 'pixels'
# A Qwen-VL vision.onnx (any image size) also takes the 2-D rotary tables of its patches and
# (Qwen2.5-VL) its windowed layers' window layout, which depend on the image's size only
# (runtime/mmproj_qwen.py computes them): float32 [N, head_dim / 2] twice, then each window's
# patches (int64 [W x S]), their additive key bias (float32 [W, S]: 0 on a patch, lowest on an
# empty slot) and each patch's slot (int64 [N]), so no [N, N] mask.
VISION_ROPE_INPUTS = ('vision_cos', 'vision_sin')
VISION_WINDOW_INPUTS = ('window_index', 'window_bias', 'window_inverse')
# A Qwen3-VL vision.onnx takes, instead of the window layout, its learned position embeddings'
# bilinear interpolation to the image's grid: per patch (merge order) the 4 source rows
# (int64 [N, 4]) and their weights (float32 [N, 4]).
VISION_POS_INPUTS = ('pos_index', 'pos_weight')
REGENERATE_HINT = ('regenerate it with `edge-llm-convert` (or run scripts/setup.sh for the '
                   'embedded model)')
# The embedded default model (SmolLM2-135M-Instruct, converted by scripts/setup.sh).
EMBEDDED_MODEL_NAME = 'smollm2-135m-instruct-int4'
_REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LayerState:
    """What one layer keeps per sequence slot (model.yaml `layer_states`: STATE_KINDS)."""

    kind: str = 'kv'
    window: int = 0              # 'kv': a sliding window of this many positions (0: all)
    shape: Tuple[int, ...] = ()  # 'conv': the state's shape per slot, [kernel - 1, hidden]
    head_dim: int = 0            # 'kv': this layer's head size (0: the model's head_dim)
    kv_heads: int = 0            # 'kv': this layer's KV heads (0: the model's num_kv_heads)
    owner: int = -1              # 'shared': the layer whose KV this one reads

    def as_yaml(self) -> dict:
        """Return the model.yaml entry."""
        if self.kind in FIXED_STATES:
            return {'kind': self.kind, 'shape': list(self.shape)}
        if self.kind == 'shared':
            return {'kind': self.kind, 'owner': int(self.owner)}
        out = {'kind': self.kind, 'window': int(self.window)}
        if self.head_dim or self.kv_heads:
            out.update(head_dim=int(self.head_dim), kv_heads=int(self.kv_heads))
        return out


@dataclass(frozen=True)
class ModelInfo:
    """The model.yaml written by the converter (only what the runtime needs is typed)."""

    name: str  # the display name (display_name); a folder before converter 8: the raw name
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: Optional[int]
    eos_token_ids: Tuple[int, ...]
    add_bos_token: bool
    activation_dtype: str = 'float32'
    kv_max_context: Optional[int] = None
    op_domains: Tuple[str, ...] = ()  # custom op domains beyond ONNX and com.microsoft
    # 'causal': the op library's CausalAttention (each position computed alone, so a verify
    # pass over k+1 positions gives the bits of k+1 decode steps); 'gqa': onnxruntime's.
    attention: str = 'gqa'
    # The source's own name, as it said it (GGUF general.name, an HF folder's name).
    gguf_name: str = ''
    parameters: int = 0  # parameter count of the decoder (0: a folder before converter 8)
    # One per layer (empty: every layer 'kv', a folder from before the key existed).
    layer_states: Tuple[LayerState, ...] = ()
    extra: Dict = field(default_factory=dict)  # every other key, kept for reports

    def state_of(self, layer: int) -> LayerState:
        """Return what `layer` keeps per slot."""
        return self.layer_states[layer] if self.layer_states else LayerState()

    @property
    def kv_layers(self) -> Tuple[int, ...]:
        """Return the layers that keep attention KV, in order."""
        return tuple(i for i in range(self.num_layers) if self.state_of(i).kind == 'kv')

    @property
    def conv_layers(self) -> Tuple[int, ...]:
        """Return the layers that keep a fixed-size state (conv or recurrent), in order."""
        return tuple(i for i in range(self.num_layers)
                     if self.state_of(i).kind in FIXED_STATES)

    def kv_dims(self, layer: int) -> Tuple[int, int]:
        """Return (kv_heads, head_dim) of a 'kv' layer's buffers."""
        state = self.state_of(layer)
        return (state.kv_heads or self.num_kv_heads, state.head_dim or self.head_dim)

    @property
    def kv_values_per_position(self) -> int:
        """Return the K and V values one position keeps over every 'kv' layer."""
        return sum(2 * h * d for h, d in (self.kv_dims(i) for i in self.kv_layers))

    @property
    def embed_width(self) -> int:
        """Return an inputs_embeds row's width: hidden_size x (1 + DeepStack layers)."""
        return self.hidden_size * (1 + int(self.extra.get('deepstack_layers', 0) or 0))

    @property
    def rewindable(self) -> bool:
        """Tell whether every state is kept per position (so a slot can rewind and share)."""
        return not self.conv_layers


_REQUIRED_INT = ('num_layers', 'num_heads', 'num_kv_heads', 'head_dim', 'hidden_size',
                 'vocab_size', 'max_position_embeddings')


def load_model_info(model_dir: str) -> ModelInfo:
    """Read and check <model_dir>/model.yaml; ModelLoadError says which file and what to do."""
    path = os.path.join(model_dir, MODEL_YAML)
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f'model folder {model_dir} does not exist: give a folder written by '
                             'edge-llm-convert (or leave model_dir empty for the embedded model)')
    try:
        with open(path, encoding='utf-8') as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ModelLoadError(f'{path} is missing: {REGENERATE_HINT}') from None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ModelLoadError(f'{path} is unreadable ({e}): {REGENERATE_HINT}') from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f'{path} is not a mapping of keys: {REGENERATE_HINT}')
    missing = [k for k in _REQUIRED_INT + ('architecture', 'eos_token_ids') if k not in raw]
    if missing:
        raise ModelLoadError(f'{path} lacks {", ".join(missing)}: {REGENERATE_HINT}')
    try:
        ints = {k: int(raw[k]) for k in _REQUIRED_INT}
        eos = raw['eos_token_ids']
        eos = tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
        bos = raw.get('bos_token_id')
        kv_max = raw.get('kv_max_context')
        name = str(raw.get('name') or os.path.basename(os.path.normpath(model_dir)))
        spec = ModelInfo(
            name=name,
            # Before converter 8 `name` was the source's name itself.
            gguf_name=str(raw['gguf_name'] if 'gguf_name' in raw else name),
            parameters=int(raw.get('parameters') or 0),
            architecture=str(raw['architecture']),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            add_bos_token=bool(raw.get('add_bos_token', False)),
            activation_dtype=str(raw.get('activation_dtype', 'float32')),
            kv_max_context=None if kv_max is None else int(kv_max),
            op_domains=tuple(str(d) for d in raw.get('op_domains') or ()),
            attention=str(raw.get('attention', 'gqa')),
            layer_states=_layer_states(raw.get('layer_states'), ints['num_layers'], path),
            extra={k: v for k, v in raw.items() if k not in _REQUIRED_INT},
            **ints)
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f'{path} has a malformed value ({e!r}): '
                             f'{REGENERATE_HINT}') from None
    if spec.architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f'{path}: architecture {spec.architecture!r} is not supported (supported: '
            f'{", ".join(ARCHITECTURES)})')
    if spec.activation_dtype not in ('float32', 'float16'):
        raise UnsupportedModelError(f'{path}: activation_dtype {spec.activation_dtype!r} is not '
                                    'float32 or float16: reconvert the model')
    if min(ints.values()) < 1:
        raise ModelLoadError(f'{path} has a non-positive size: {REGENERATE_HINT}')
    return spec


def _layer_states(raw, layers: int, path: str) -> Tuple[LayerState, ...]:
    """Read model.yaml's layer_states (None: a folder from before it, every layer 'kv')."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) != layers:
        raise ValueError(f'layer_states is not a list of {layers} entries')
    out = []
    for entry in raw:
        kind = str(entry['kind'])
        if kind not in STATE_KINDS:
            raise UnsupportedModelError(
                f'{path}: a layer keeps a {kind!r} state, which this runtime does not know '
                f'(it knows {", ".join(STATE_KINDS)}): update edge_llm_ros')
        shape = tuple(int(d) for d in entry.get('shape') or ())
        if kind == 'conv' and (len(shape) != 2 or min(shape) < 1):
            raise ValueError(f'a conv layer state of shape {list(shape)}')
        if kind == 'recurrent' and (len(shape) != 1 or shape[0] < 1):
            raise ValueError(f'a recurrent layer state of shape {list(shape)}')
        owner = int(entry.get('owner', -1))
        if kind == 'shared' and not 0 <= owner < len(out):
            raise ValueError(f'a shared layer reads layer {owner}, not an earlier layer')
        if kind == 'shared' and out[owner].kind != 'kv':
            raise ValueError(f'a shared layer reads layer {owner}, which keeps no KV')
        out.append(LayerState(kind, int(entry.get('window') or 0), shape,
                              int(entry.get('head_dim') or 0), int(entry.get('kv_heads') or 0),
                              owner))
    return tuple(out)


def size_label(parameters: int) -> str:
    """Round a parameter count as GGUF's general.size_label does: 135M, 1.5B, 8.0B, 14B.

    gguf-py's model_weight_count_rounded_notation: K/M/B/T, with at least two digits.
    """
    count = int(parameters)
    for scale, suffix in ((1e12, 'T'), (1e9, 'B'), (1e6, 'M')):
        if count > scale:
            break
    else:
        scale, suffix = 1e3, 'K'
    scaled = count / scale
    decimals = max(2 - len(str(round(scaled)).lstrip('0')), 0)
    return f'{scaled:.{decimals}f}{suffix}'


def weight_types_text(quantization: object) -> str:
    """Return the weight types of model.yaml's quantization: 'Q4_1 + Q8_0', or 'int4'."""
    if not isinstance(quantization, dict):
        return ''
    if quantization.get('precision') == 'int4':
        return 'int4'
    return ' + '.join(str(t) for t in quantization.get('source_types') or ())


def display_name(family_label: str, architecture: str, parameters: int,
                 weight_types: str) -> str:
    """Return a model's name for people: 'SmolLM2 135M (llama, Q4_1 + Q8_0)'.

    family_label: the family config's display_name (or the architecture's label, see
    runtime.model_config.family_label); parameters: the decoder's parameter count.
    """
    size = f' {size_label(parameters)}' if parameters > 0 else ''
    detail = ', '.join(p for p in (architecture, weight_types) if p)
    return f'{family_label}{size}' + (f' ({detail})' if detail else '')


def cache_root() -> pathlib.Path:
    """$EDGE_LLM_CACHE, else <repo>/.cache in a source checkout, else ~/.cache/edge_llm_ros."""
    env = os.environ.get('EDGE_LLM_CACHE')
    if env:
        return pathlib.Path(env).expanduser()
    if (_REPO / 'package.xml').is_file():
        return _REPO / '.cache'
    return pathlib.Path.home() / '.cache' / 'edge_llm_ros'


def embedded_model_dir() -> pathlib.Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_root() / 'models' / EMBEDDED_MODEL_NAME


def is_current(folder: pathlib.Path) -> bool:
    """Tell whether folder is a complete conversion by this converter version (cheap)."""
    try:
        meta = yaml.safe_load((folder / MODEL_YAML).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return (isinstance(meta, dict) and meta.get('converter_version') == CONVERTER_VERSION
            and (folder / MODEL_FILE).is_file() and (folder / DATA_FILE).is_file())


def embedded_model() -> pathlib.Path:
    """Return the converted embedded model folder, or raise ModelLoadError saying how to make it.

    The runtime never converts: scripts/setup.sh (or ``python -m
    edge_llm_ros.convert.default_model --ensure``) writes this folder once.
    """
    folder = embedded_model_dir()
    if not is_current(folder):
        state = 'is missing' if not folder.exists() else \
            f'was not written by converter version {CONVERTER_VERSION}'
        raise ModelLoadError(
            f'the embedded model {folder} {state}: run scripts/setup.sh (or `python -m '
            'edge_llm_ros.convert.default_model --ensure`) to convert it, or give a model '
            'folder')
    return folder

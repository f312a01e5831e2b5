"""Convert a GGUF file or an HF safetensors folder into the engine's ONNX model folder.

    edge-llm-convert model.gguf out_dir [--weights kquant|matmulnbits] [--dtype float32]

The folder (model.onnx + model.onnx.data, tokenizer.json, chat_template.jinja, model.yaml) is
written into a temporary sibling folder and renamed into place only when complete, so a
failure (bad input, disk full, Ctrl-C) never leaves a half-written model behind.
"""
import argparse
import collections
import dataclasses
from dataclasses import dataclass
import errno
import hashlib
import os
import pathlib
import secrets
import shutil
import sys
from typing import List, Optional, Sequence

import numpy as np

from edge_llm_ros.convert.checkpoint import Checkpoint, load_checkpoint
from edge_llm_ros.convert.encoder import encoder_architecture, write_encoder_folder
from edge_llm_ros.convert.gguf_weights import fuse_rows, gguf_weights, GgufWeights, keeps_blocks
from edge_llm_ros.convert.kv_int8_graph import int8_kv_graph
from edge_llm_ros.convert.lora import lora_targets
from edge_llm_ros.convert.onnx_graph import (ConvLayerWeights, DecoderGraph, Gemma4LayerWeights,
                                             GraphOptions, LayerWeights,
                                             MambaLayerWeights, OPSET, RecurrentLayerWeights,
                                             Weight)
from edge_llm_ros.convert.quant import concat_rows, to_blocks
from edge_llm_ros.errors import ConversionError, EngineError
from edge_llm_ros.model_format import (CONVERTER_VERSION, DATA_FILE, display_name,
                                       KV_INT8_MODEL_FILE, LayerState, MODEL_FILE, MODEL_YAML,
                                       PRECISIONS, WEIGHT_FORMATS, weight_types_text)
from edge_llm_ros.runtime import native_ops

_TMP_MARK = '.tmp-'
VISION_FILE = 'vision.onnx'  # an mmproj's encoder and projector (--mmproj)
VISION_DATA_FILE = 'vision.onnx.data'  # its weights
# A write that failed while less than this was free is taken for a full disk: numpy's short
# writes (ndarray.tofile) raise an OSError without errno, so ENOSPC alone misses them.
_FULL_BELOW = 1 << 20


@dataclass(frozen=True)
class ConvertOptions:
    """What the converter produces; defaults give the fast CPU model."""

    block_size: int = 32
    activation_dtype: str = 'float32'
    max_context: Optional[int] = None
    accuracy_level: int = 4
    exact_q4_1: bool = True
    precision: str = 'source'
    # Q4_1 offsets (see GraphOptions.offset_levels); None: folded into 2 extra 4-bit levels
    # when activations are rounded to int8 anyway (accuracy_level 4), exact otherwise.
    offset_levels: Optional[int] = None
    # 'kquant' (GGUF blocks for the project's ops), 'matmulnbits', or None: kquant when the
    # op library is built and the options are ones it computes (int8 activations at
    # accuracy level 4, float32, source precision), else matmulnbits (default_weights).
    weights: Optional[str] = None

    @property
    def weight_format(self) -> str:
        """Return the weight format the folder is written in."""
        return self.weights or default_weights(self.accuracy_level, self.activation_dtype,
                                               self.precision)

    @property
    def graph_offset_levels(self) -> int:
        """Return the offset_levels the graph is built with."""
        if self.offset_levels is not None:
            return self.offset_levels
        return 2 if self.accuracy_level == 4 else 0

    def check(self, ckpt: Checkpoint) -> None:
        """Raise ConversionError for options the checkpoint cannot take."""
        s = ckpt.spec
        bs = self.block_size
        if bs < 16 or bs & (bs - 1):
            raise ConversionError(f'block size {bs} is not a power of two >= 16 (use 32)')
        for dim, what in ((s.hidden_size, 'hidden size'),
                          (s.intermediate_size, 'intermediate size'),
                          (s.num_heads * s.head_dim, 'attention width'),
                          (s.num_heads * (s.local_head_dim or s.head_dim),
                           'sliding-window attention width'),
                          (s.per_layer_embed or bs, 'per-layer embedding width')):
            if dim % bs:
                raise ConversionError(f'{what} {dim} is not a multiple of block size {bs}; '
                                      'use --block-size 32')
        if self.activation_dtype not in ('float32', 'float16'):
            raise ConversionError(f'activation dtype {self.activation_dtype!r} is not '
                                  'float32 or float16')
        if self.max_context is not None and not 0 < self.max_context <= \
                s.max_position_embeddings:
            raise ConversionError(f'max_context {self.max_context} must be in 1..'
                                  f'{s.max_position_embeddings} (the context of the model)')
        if self.max_context is not None and s.rope_factors_max_context and \
                self.max_context > s.rope_factors_max_context:
            raise ConversionError(
                f'max_context {self.max_context} exceeds {s.rope_factors_max_context}, the '
                'original context of its LongRoPE short factors; beyond it llama.cpp switches '
                'to the long factors, which the converter does not build: use --max-context '
                f'{s.rope_factors_max_context} or less')
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConversionError(f'accuracy level {self.accuracy_level} is not 0..4')
        if self.precision not in PRECISIONS:
            raise ConversionError(f'precision {self.precision!r} is not one of {PRECISIONS}')
        if self.offset_levels is not None and self.offset_levels not in range(4):
            raise ConversionError(f'offset levels {self.offset_levels} is not 0..3 (0 = exact)')
        if self.weights is not None and self.weights not in WEIGHT_FORMATS:
            raise ConversionError(f'weights {self.weights!r} is not one of {WEIGHT_FORMATS}')
        if s.layer_kinds or _native_layers(s):
            # Conv layers run the op library's ShortConv whatever the weight format, gemma4
            # layers its CausalAttention (per-layer head sizes, shared KV).
            layers = 'attention layers' if _native_layers(s) else 'conv layers'
            if self.activation_dtype != 'float32':
                raise ConversionError(f'{s.architecture} {layers} run in float32: convert '
                                      'it with --dtype float32')
            try:
                native_ops.require_library(f'a {s.architecture} model (its {layers})')
            except native_ops.NativeLibraryMissingError as exc:
                raise ConversionError(str(exc)) from None
        if self.weights == 'kquant':
            wrong = kquant_conflicts(self.accuracy_level, self.activation_dtype, self.precision)
            if wrong:
                raise ConversionError(f'--weights kquant cannot be used with {wrong}: the op '
                                      'quantizes activations to 8 bits per block as llama.cpp '
                                      'does; use --weights matmulnbits for that')
            try:
                native_ops.require_library('--weights kquant')
            except native_ops.NativeLibraryMissingError as exc:
                raise ConversionError(str(exc)) from None


def kquant_conflicts(accuracy_level: int, activation_dtype: str, precision: str) -> str:
    """Name the options the kquant op cannot compute ('' when there is none)."""
    wrong = [f'accuracy level {accuracy_level}' if accuracy_level != 4 else '',
             f'--dtype {activation_dtype}' if activation_dtype != 'float32' else '',
             f'--precision {precision}' if precision != 'source' else '']
    return ', '.join(w for w in wrong if w)


def default_weights(accuracy_level: int = 4, activation_dtype: str = 'float32',
                    precision: str = 'source') -> str:
    """Return kquant when the op library is built and can compute these options."""
    if kquant_conflicts(accuracy_level, activation_dtype, precision):
        return 'matmulnbits'
    return 'kquant' if native_ops.library_path() is not None else 'matmulnbits'


def convert(source: str, out_dir: str, *, block_size: int = 32,
            activation_dtype: str = 'float32', max_context: Optional[int] = None,
            progress: bool = True, accuracy_level: int = 4, exact_q4_1: bool = True,
            precision: str = 'source', overwrite: bool = False,
            verify: bool = True, offset_levels: Optional[int] = None,
            weights: Optional[str] = None, mmproj: Optional[str] = None,
            mmproj_vision_only: bool = False) -> pathlib.Path:
    """Convert `source` (GGUF file or HF folder) into the model folder `out_dir`.

    Returns the folder. Raises ModelLoadError / UnsupportedModelError for bad sources and
    ConversionError when the output cannot be written. precision='source' repacks every
    supported GGUF block type without requantization (4-bit codes for Q4_0/Q4_1/Q2_K/Q3_K/
    Q4_K, 8-bit for Q5_*/Q6_K/Q8_0/IQ4_*; Q4_1 needs exact_q4_1) and float weights at 8 bits;
    'int4' makes every matrix 4-bit (docs/quantization.md). An existing `out_dir` is replaced
    only with overwrite=True. verify=True opens the result with onnxruntime before it is moved
    into place. offset_levels: how Q4_1 / Q4_K / Q2_K offsets are computed (None: folded into
    the matmul at accuracy_level 4, exact otherwise; see GraphOptions). weights: 'kquant'
    keeps the matrices of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K in their GGUF blocks for
    the project's op library (other types stay MatMulNBits), 'matmulnbits' repacks them all;
    None picks kquant where the library is built (ConvertOptions.weights). mmproj: a
    llama.cpp mmproj GGUF of the same model; its vision encoder and projector go into the
    folder as vision.onnx (model.yaml `vision`). A projector that is not the language model's
    width, or an unknown projector type, is refused before anything is written; so is an
    mmproj that also holds an audio tower (Gemma 4's gemma4a), unless mmproj_vision_only,
    which converts its vision tower and leaves the audio out with a warning.
    """
    opts = ConvertOptions(block_size, activation_dtype, max_context, accuracy_level, exact_q4_1,
                          precision, offset_levels, weights)
    out = pathlib.Path(out_dir).expanduser().resolve()
    if out.parent.is_dir():
        _remove_stale_temps(out)
    if out.exists() and not overwrite:
        raise ConversionError(f'{out} already exists; remove it or pass overwrite=True '
                              '(--force)')
    encoder = encoder_architecture(source) if mmproj is None else None
    if encoder is None:
        ckpt = load_checkpoint(source)
        vision = preflight(ckpt, opts, mmproj, source, mmproj_vision_only)
        opts = dataclasses.replace(opts, weights=opts.weight_format)  # decided once
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(f'cannot create {out.parent}: {exc}') from exc
    tmp = out.parent / f'.{out.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}'
    try:
        tmp.mkdir()
        if encoder is not None:  # an embedding / rerank model (convert/encoder.py)
            src = pathlib.Path(source).resolve()
            write_encoder_folder(src, tmp, source_sha256(src))
            if verify:
                _verify(tmp, 'kquant' if native_ops.library_path() else 'none')
        else:
            _write_folder(ckpt, tmp, opts, progress, vision)
        if verify and encoder is None:
            # Conv layers (lfm2) run the op library's ShortConv in either weight format.
            native = (opts.weight_format == 'kquant' or bool(ckpt.spec.layer_kinds)
                      or _native_layers(ckpt.spec))
            _verify(tmp, 'kquant' if native else opts.weight_format, vision is not None)
        _replace(tmp, out)
    except BaseException as exc:
        # Measured before the cleanup, which gives the space back.
        free = _free_bytes(out.parent) if isinstance(exc, OSError) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            if exc.errno == errno.ENOSPC or (exc.errno is None and free is not None and
                                             free < _FULL_BELOW):
                shown = 'unknown' if free is None else f'{free / (1 << 20):.1f} MiB'
                hint = (f'the disk is full ({shown} free on {out.parent}); free space and '
                        'convert again')
            else:
                hint = 'check the path and permissions'
            raise ConversionError(f'writing {out} failed ({exc}); {hint}') from exc
        if isinstance(exc, (EngineError, KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise ConversionError(f'converting {source} failed: {exc!r}') from exc
    return out


def preflight(ckpt: Checkpoint, opts: ConvertOptions, mmproj: Optional[str], source: str,
              vision_only: bool = False):
    """Refuse what cannot be converted before any work; return the mmproj's vision (or None).

    Raises ConversionError / ModelLoadError / UnsupportedModelError saying what to change
    (mmproj.AudioTowerError for an audio tower, unless vision_only).
    """
    opts.check(ckpt)
    if mmproj and ckpt.spec.layer_kinds:
        raise ConversionError(f'{ckpt.spec.architecture} VLMs (--mmproj) are not converted yet: '
                              'convert the language model alone')
    vision = _read_vision(mmproj, ckpt, source, vision_only) if mmproj else None
    if _bidirectional(vision) and opts.activation_dtype != 'float32':
        raise ConversionError(
            f'a {vision.config.projector} VLM needs the op library attention over its '
            'images, which runs in float32: convert it with --dtype float32')
    return vision


def _free_bytes(folder: pathlib.Path) -> Optional[int]:
    """Bytes an unprivileged writer can still use in `folder`'s file system (None: unknown)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _read_vision(path: str, ckpt: Checkpoint, source: str, vision_only: bool = False):
    """Read and check the mmproj against the language model; nothing is written yet."""
    from edge_llm_ros.convert.mmproj import check_pair, read_mmproj
    mm = read_mmproj(path, vision_only)
    check_pair(mm, ckpt.spec.hidden_size, source, ckpt.spec.deepstack_layers)
    return mm


def _write_folder(ckpt: Checkpoint, tmp: pathlib.Path, opts: ConvertOptions,
                  progress: bool, vision=None) -> None:
    from tqdm import tqdm
    import onnx
    import yaml
    s = ckpt.spec
    specials = ckpt.write_tokenizer(tmp)
    steps = s.num_layers + 2
    bar = tqdm(total=steps, desc='converting layers', unit='step', disable=not progress)
    # Weights stream into model.onnx.data as each layer is converted.
    with open(tmp / DATA_FILE, 'wb') as data:
        graph = DecoderGraph(s, GraphOptions(opts.activation_dtype, opts.max_context,
                                             opts.accuracy_level, opts.graph_offset_levels,
                                             attention=_attention(ckpt, opts, vision),
                                             bidirectional_images=_bidirectional(vision)),
                             data)
        graph.add_embedding(_blocks(ckpt, 'embed', opts))
        if s.per_layer_embed:
            graph.add_per_layer_inputs(_blocks(ckpt, 'ple_embed', opts),
                                       _blocks(ckpt, 'ple_model_proj', opts),
                                       ckpt.tensor('ple_proj_norm').dequantize())
        bar.update()
        ckpt.release()
        for i in range(s.num_layers):
            if s.architecture == 'gemma4':
                graph.add_gemma4_layer(i, _gemma4_layer(ckpt, i, opts))
            elif s.is_recurrent(i) and s.mamba_heads:
                graph.add_mamba_layer(i, _mamba_layer(ckpt, i, opts))
            elif s.is_recurrent(i):
                graph.add_recurrent_layer(i, _recurrent_layer(ckpt, i, opts))
            elif s.is_conv(i):
                graph.add_conv_layer(i, _conv_layer(ckpt, i, opts))
            else:
                graph.add_layer(i, _layer(ckpt, i, opts))
            # The layer's source pages are read: give them back, so that converting holds
            # one layer at a time, not the whole mapped file.
            ckpt.release()
            bar.update()
        lm_head = None if s.tied_embeddings else _blocks(ckpt, 'lm_head', opts)
        model = graph.finish(ckpt.tensor('final_norm').dequantize(), lm_head)
        del lm_head
        ckpt.release()
    ops = collections.Counter(n.op_type for n in model.graph.node
                              if n.op_type in ('KQuantMatMul', 'MatMulNBits', 'KQuantGather',
                                               'GatherBlockQuantized'))
    bar.set_description('writing model.onnx')
    onnx.save_model(model, str(tmp / MODEL_FILE))
    # The op library's attention: kv.dtype int8 loads this graph instead (not built for
    # gemma4's shared-KV layers: such a folder keeps float32 live KV, and says so).
    if graph.varlen and not any(s.kv_owner(i) >= 0 for i in range(s.num_layers)):
        onnx.save_model(int8_kv_graph(model), str(tmp / KV_INT8_MODEL_FILE))
    bar.update()
    bar.close()
    quantization = {'bits': 4, 'block_size': opts.block_size,
                    'source_types': ckpt.source_types(),
                    'accuracy_level': opts.accuracy_level,
                    'exact_q4_1': opts.exact_q4_1, 'precision': opts.precision,
                    'offset_levels': opts.graph_offset_levels,
                    'weight_bytes_per_token': int(graph.weight_bytes),
                    'weights': opts.weight_format, 'ops': dict(sorted(ops.items()))}
    meta = {
        'name': model_display_name(ckpt, quantization), 'gguf_name': s.name,
        'parameters': parameter_count(ckpt), 'architecture': s.architecture,
        'num_layers': s.num_layers,
        'num_heads': s.num_heads, 'num_kv_heads': s.num_kv_heads, 'head_dim': s.head_dim,
        'hidden_size': s.hidden_size, 'vocab_size': s.vocab_size,
        'max_position_embeddings': s.max_position_embeddings,
        'rope_theta': float(s.rope_theta), 'rms_norm_eps': float(s.rms_norm_eps),
        'rope_scaling': {'scale': float(s.rope_scale),
                         'freq_factors': s.rope_freq_factors is not None,
                         'rotary_dims': s.rotary_dims,
                         'attn_factor': float(s.rope_attn_factor),
                         # LongRoPE short factors: valid up to this KV length (0: any)
                         'max_context': int(s.rope_factors_max_context),
                         # M-RoPE (qwen2vl): rotary pairs of the t, h, w sections
                         **({'sections': list(s.rope_sections)} if s.rope_sections else {}),
                         # qwen3vl: the sections interleaved pair by pair (ggml's IMROPE)
                         **({'interleaved': True} if s.mrope_interleaved else {}),
                         # smollm3: layers that attend without RoPE
                         **({'no_rope_layers': [i for i in range(s.num_layers) if s.is_nope(i)]}
                            if s.nope_layers else {})},
        # qwen3vl: image rows carry this many hidden-size rows more (added after layers 0..)
        **({'deepstack_layers': int(s.deepstack_layers)} if s.deepstack_layers else {}),
        'qk_norm': bool(s.qk_norm),
        'post_norms': bool(s.post_norms), 'activation': s.activation,
        'embed_scale': float(s.embed_scale),
        'attention_scale': float(s.attention_scale or 1.0 / np.sqrt(s.head_dim)),
        'sliding_window': {'window': int(s.sliding_window),
                           'local_layers': [i for i in range(s.num_layers) if s.is_local(i)],
                           'local_rope_theta': float(s.local_rope_theta)},
        'final_logit_softcap': float(s.final_logit_softcap),
        'activation_dtype': opts.activation_dtype,
        'bos_token_id': specials.get('bos_token_id'),
        'eos_token_ids': list(specials.get('eos_token_ids', [])),
        'add_bos_token': bool(specials.get('add_bos_token', False)),
        'quantization': quantization,
        'op_domains': sorted(graph.ops_used),
        'attention': _attention(ckpt, opts, vision),
        'source': {'path': str(ckpt.source_path), 'sha256': source_sha256(ckpt.source_path)},
        'converter_version': CONVERTER_VERSION, 'opset': OPSET,
        'kv_max_context': opts.max_context,
        'layer_states': [layer_state(s, i).as_yaml() for i in range(s.num_layers)],
        # Where LoRA adapters go: [layer, role, KQuantMatMul node, first column] each.
        'lora_targets': lora_targets(model, s.num_layers, s.num_heads * s.head_dim,
                                     s.num_kv_heads * s.head_dim, native_ops.DOMAIN),
    }
    if vision is not None:
        from edge_llm_ros.convert.vision_graph import build_encoder, model_yaml_section
        # The weights stream into vision.onnx.data as the graph is built (one tensor held).
        with open(tmp / VISION_DATA_FILE, 'wb') as vision_data:
            encoder = build_encoder(vision, data=vision_data, location=VISION_DATA_FILE)
        onnx.save_model(encoder, str(tmp / VISION_FILE))
        meta['vision'] = model_yaml_section(vision, VISION_FILE)
    (tmp / MODEL_YAML).write_text(yaml.safe_dump(meta, sort_keys=False))
    for f in tmp.iterdir():
        os.chmod(f, 0o644)  # onnx writes the data file 0600; the model is meant to be shared
        with open(f, 'rb') as fh:
            os.fsync(fh.fileno())


def layer_state(spec, layer: int) -> LayerState:
    """Return what `layer` keeps per sequence slot (model.yaml `layer_states`)."""
    if spec.is_conv(layer):
        return LayerState('conv', shape=(spec.conv_kernel - 1, spec.hidden_size))
    if spec.is_recurrent(layer):
        return LayerState('recurrent', shape=(spec.recurrent_state_floats,))
    if spec.kv_owner(layer) >= 0:
        return LayerState('shared', owner=spec.kv_owner(layer))
    window = spec.sliding_window if spec.is_local(layer) else 0
    if spec.layer_head_dim(layer) != spec.head_dim or \
            spec.layer_kv_heads(layer) != spec.num_kv_heads:
        return LayerState('kv', window=window, head_dim=spec.layer_head_dim(layer),
                          kv_heads=spec.layer_kv_heads(layer))
    return LayerState('kv', window=window)


def parameter_count(ckpt: Checkpoint) -> int:
    """Count the decoder's parameters: every tensor it reads (a tied head counted once)."""
    return sum(int(np.prod(t.shape, dtype=np.int64)) for t in ckpt.tensors.values())


def model_display_name(ckpt: Checkpoint, quantization: dict) -> str:
    """Return 'SmolLM2 135M (llama, Q4_1 + Q8_0)': family, size, architecture, weight types.

    The source's own name (GGUF general.name, e.g. "Smollm2 135M 8k Lc100K Mix1 Ep2") picks
    the family and is kept as model.yaml's gguf_name.
    """
    from edge_llm_ros.runtime.model_config import family_label
    s = ckpt.spec
    label = family_label({'gguf_name': s.name, 'architecture': s.architecture})
    return display_name(label, s.architecture, parameter_count(ckpt),
                        weight_types_text(quantization))


def _bidirectional(vision) -> bool:
    """Whether the mmproj's image tokens attend to each other both ways (gemma3)."""
    if vision is None:
        return False
    from edge_llm_ros.convert.vision_graph import image_attention
    return image_attention(vision) == 'bidirectional'


def _attention(ckpt: Checkpoint, opts: ConvertOptions, vision=None) -> str:
    """Return the attention op: the library's row-exact one where every matmul is the op's.

    Only then is the whole graph row-exact (a verify pass gives a position decode's bits:
    docs/speculative.md); a MatMulNBits fallback matrix (Q2_K, F16, ...) makes it not so,
    and GroupQueryAttention, faster at prefill, is kept. A VLM whose image tokens attend
    both ways always gets the library's op: GroupQueryAttention is causal only. So does a
    hybrid (lfm2): its ShortConv needs the row table of the library's varlen graph, and an
    M-RoPE model (qwen2vl): its rotary positions are not the KV index after an image.
    """
    if (_bidirectional(vision) or ckpt.spec.layer_kinds or ckpt.spec.rope_sections
            or _native_layers(ckpt.spec)):
        # A hybrid's conv states need the row table only the library's graphs have.
        return 'causal'
    if opts.weight_format != 'kquant':
        return 'gqa'
    return 'causal' if all(keeps_blocks(t) for t in ckpt.matrices()) else 'gqa'


def _blocks(ckpt: Checkpoint, key: str, opts: ConvertOptions) -> Weight:
    t = ckpt.tensor(key)
    if opts.weight_format == 'kquant':
        kept = gguf_weights(t)
        if kept is not None:
            return kept
    return to_blocks(t, opts.block_size, opts.precision, opts.exact_q4_1)


def _fused(parts: List[Weight]) -> List[Weight]:
    """Fuse Q/K/V or gate/up into one matmul where their formats agree."""
    if all(isinstance(p, GgufWeights) for p in parts):
        return fuse_rows(parts)
    if any(isinstance(p, GgufWeights) for p in parts):
        return list(parts)
    return list(concat_rows(parts))


def _layer(ckpt: Checkpoint, i: int, opts: ConvertOptions) -> LayerWeights:
    p = f'{i}.'
    bias: Optional[np.ndarray] = None
    if ckpt.spec.attention_bias:
        bias = np.concatenate([ckpt.tensor(p + r).dequantize()
                               for r in ('q_bias', 'k_bias', 'v_bias')])
    return LayerWeights(
        attn_norm=ckpt.tensor(p + 'attn_norm').dequantize(),
        ffn_norm=ckpt.tensor(p + 'ffn_norm').dequantize(),
        qkv=_fused([_blocks(ckpt, p + r, opts) for r in ('q', 'k', 'v')]),
        qkv_bias=bias,
        o=_blocks(ckpt, p + 'o', opts),
        gate_up=_fused([_blocks(ckpt, p + r, opts) for r in ('gate', 'up')]),
        down=_blocks(ckpt, p + 'down', opts),
        q_norm=ckpt.tensor(p + 'q_norm').dequantize() if ckpt.spec.qk_norm else None,
        k_norm=ckpt.tensor(p + 'k_norm').dequantize() if ckpt.spec.qk_norm else None,
        post_attn_norm=_vector(ckpt, p + 'post_attn_norm', ckpt.spec.post_norms),
        post_ffn_norm=_vector(ckpt, p + 'post_ffn_norm', ckpt.spec.post_norms),
        attn_gate=(_blocks(ckpt, p + 'attn_gate', opts) if ckpt.spec.gated_attention
                   else None))


def _recurrent_layer(ckpt: Checkpoint, i: int, opts: ConvertOptions) -> RecurrentLayerWeights:
    p = f'{i}.'

    def vector(role: str) -> np.ndarray:
        return ckpt.tensor(p + role).dequantize()

    return RecurrentLayerWeights(
        attn_norm=vector('attn_norm'), ffn_norm=vector('ffn_norm'),
        qkv=_blocks(ckpt, p + 'gdn_qkv', opts), z=_blocks(ckpt, p + 'gdn_z', opts),
        alpha=_blocks(ckpt, p + 'ssm_alpha', opts), beta=_blocks(ckpt, p + 'ssm_beta', opts),
        conv=vector('ssm_conv'), dt_bias=vector('ssm_dt'), a=vector('ssm_a'),
        norm=vector('ssm_norm'), out=_blocks(ckpt, p + 'ssm_out', opts),
        gate_up=_fused([_blocks(ckpt, p + r, opts) for r in ('gate', 'up')]),
        down=_blocks(ckpt, p + 'down', opts))


def _mamba_layer(ckpt: Checkpoint, i: int, opts: ConvertOptions) -> MambaLayerWeights:
    p = f'{i}.'

    def vector(role: str) -> np.ndarray:
        return ckpt.tensor(p + role).dequantize()

    conv = vector('ssm_conv')
    bias = vector('ssm_conv_bias') if ckpt.has(p + 'ssm_conv_bias') else \
        np.zeros(conv.shape[0], np.float32)
    return MambaLayerWeights(
        attn_norm=vector('attn_norm'), ffn_norm=vector('ffn_norm'),
        z=_blocks(ckpt, p + 'ssm_z', opts), xbc=_blocks(ckpt, p + 'ssm_xbc', opts),
        dt=_blocks(ckpt, p + 'ssm_dtp', opts), conv=conv, conv_bias=bias,
        dt_bias=vector('ssm_dt'), a=vector('ssm_a'), d=vector('ssm_d'),
        norm=vector('ssm_norm'), out=_blocks(ckpt, p + 'ssm_out', opts),
        gate_up=_fused([_blocks(ckpt, p + r, opts) for r in ('gate', 'up')]),
        down=_blocks(ckpt, p + 'down', opts))


def _native_layers(spec) -> bool:
    """Whether the family's layers exist only with the op library's attention (gemma4)."""
    return spec.architecture == 'gemma4'


def _gemma4_layer(ckpt: Checkpoint, i: int, opts: ConvertOptions) -> Gemma4LayerWeights:
    p = f'{i}.'
    own = ckpt.spec.kv_owner(i) < 0
    ple = bool(ckpt.spec.per_layer_embed)
    scale = ckpt.tensors.get(p + 'out_scale')
    return Gemma4LayerWeights(
        attn_norm=ckpt.tensor(p + 'attn_norm').dequantize(),
        ffn_norm=ckpt.tensor(p + 'ffn_norm').dequantize(),
        q=_blocks(ckpt, p + 'q', opts),
        k=_blocks(ckpt, p + 'k', opts) if own else None,
        v=_blocks(ckpt, p + 'v', opts) if own else None,
        o=_blocks(ckpt, p + 'o', opts),
        gate_up=_fused([_blocks(ckpt, p + r, opts) for r in ('gate', 'up')]),
        down=_blocks(ckpt, p + 'down', opts),
        q_norm=ckpt.tensor(p + 'q_norm').dequantize(),
        k_norm=ckpt.tensor(p + 'k_norm').dequantize() if own else None,
        post_attn_norm=ckpt.tensor(p + 'post_attn_norm').dequantize(),
        post_ffn_norm=ckpt.tensor(p + 'post_ffn_norm').dequantize(),
        ple_gate=_blocks(ckpt, p + 'ple_gate', opts) if ple else None,
        ple_proj=_blocks(ckpt, p + 'ple_proj', opts) if ple else None,
        ple_post_norm=ckpt.tensor(p + 'ple_post_norm').dequantize() if ple else None,
        out_scale=None if scale is None else float(scale.dequantize().reshape(-1)[0]))


def _conv_layer(ckpt: Checkpoint, i: int, opts: ConvertOptions) -> ConvLayerWeights:
    p = f'{i}.'
    return ConvLayerWeights(
        attn_norm=ckpt.tensor(p + 'attn_norm').dequantize(),
        ffn_norm=ckpt.tensor(p + 'ffn_norm').dequantize(),
        in_proj=_blocks(ckpt, p + 'in_proj', opts),
        conv=ckpt.tensor(p + 'conv').dequantize(),
        out_proj=_blocks(ckpt, p + 'out_proj', opts),
        gate_up=_fused([_blocks(ckpt, p + r, opts) for r in ('gate', 'up')]),
        down=_blocks(ckpt, p + 'down', opts))


def _vector(ckpt: Checkpoint, key: str, wanted: bool) -> Optional[np.ndarray]:
    return ckpt.tensor(key).dequantize() if wanted else None


def _verify(folder: pathlib.Path, weights: str, vision: bool = False) -> None:
    """Open the graph with onnxruntime: every node must have a kernel that takes its inputs.

    Without graph optimizations and weight pre-packing, onnxruntime maps model.onnx.data and
    never touches it: opening a 7B model then costs ~60 MB, where the default session would
    copy every weight into its own packed buffers (~2x the model in RSS).
    """
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry('session.disable_prepacking', '1')
    if weights == 'kquant':
        native_ops.register(so, f'verifying {folder.name}')
    try:
        ort.InferenceSession(str(folder / MODEL_FILE), so,
                             providers=['CPUExecutionProvider'])
        if vision:
            ort.InferenceSession(str(folder / VISION_FILE), so,
                                 providers=['CPUExecutionProvider'])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ConversionError(f'onnxruntime rejected the converted graph: {exc}') from exc


def _replace(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Move tmp to out; an existing out is swapped away first and removed afterwards."""
    old = None
    if out.exists():
        old = out.parent / f'.{out.name}{_TMP_MARK}old-{os.getpid()}-{secrets.token_hex(4)}'
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(out: pathlib.Path) -> None:
    """Clean up after earlier conversions to `out` whose process is gone.

    Their half-written temp folders are deleted; a previous model they had moved aside
    (killed between the two renames of _replace) is put back if `out` is missing.
    """
    prefix = f'.{out.name}{_TMP_MARK}'
    for cand in sorted(out.parent.glob(prefix + '*')):
        parts = cand.name[len(prefix):].split('-')
        moved_aside = parts[0] == 'old'
        try:
            pid = int(parts[1] if moved_aside else parts[0])
        except (ValueError, IndexError):
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if moved_aside and not out.exists():
            os.rename(cand, out)
        else:
            shutil.rmtree(cand, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def source_sha256(path: pathlib.Path) -> str:
    """sha256 of a GGUF file, or of an HF folder's config + safetensors files in name order."""
    return sha256_files([path] if path.is_file() else sorted(
        list(path.glob('*.safetensors')) + [path / 'config.json']))


def sha256_files(files: Sequence[pathlib.Path]) -> str:
    """sha256 of the files' bytes one after the other."""
    h = hashlib.sha256()
    for f in files:
        with open(f, 'rb') as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b''):
                h.update(chunk)
    return h.hexdigest()


def build_arg_parser() -> argparse.ArgumentParser:
    """CLI of edge-llm-convert."""
    p = argparse.ArgumentParser(
        prog='edge-llm-convert',
        description='Convert a GGUF file or an HF safetensors folder (llama, qwen2, qwen3, '
                    'gemma3, phi3, lfm2, gemma4) '
                    'into an ONNX Runtime INT4 model folder for edge_llm_ros.')
    p.add_argument('source', help='a .gguf file or an HF folder (config.json + *.safetensors)')
    p.add_argument('out_dir', nargs='?', help='model folder to create (not with --check)')
    p.add_argument('--check', action='store_true',
                   help='only say whether the source (and --mmproj) would convert with these '
                        'options, how each tensor type is stored, and what would be refused; '
                        'writes nothing (exit 0: would convert, 1: would refuse)')
    p.add_argument('--block-size', type=int, default=32, help='INT4 block size (default 32)')
    p.add_argument('--dtype', default='float32', choices=('float32', 'float16'),
                   help='activation and KV dtype (default float32)')
    p.add_argument('--max-context', type=int, default=None,
                   help='build the graph for a fixed KV length (default: dynamic)')
    p.add_argument('--accuracy-level', type=int, default=4, choices=(0, 1, 2, 3, 4),
                   help='MatMulNBits accuracy level: 4 = int8 activations (fast CPU path), '
                        '0 = compute in the activation dtype')
    p.add_argument('--requantize-q4-1', action='store_true',
                   help='re-quantize Q4_1 blocks to integer zero points instead of keeping '
                        'them exact with per-block offsets (~6%% smaller, ~10%% faster decode, '
                        'but lossy: on SmolLM2 logits move by up to ~12)')
    p.add_argument('--precision', default='source', choices=PRECISIONS,
                   help='source (default): GGUF blocks repacked exactly (4 or 8 bits, see '
                        'docs/quantization.md), float weights at 8 bits; int4: every matrix '
                        '4-bit (smaller, faster, lossy)')
    p.add_argument('--offset-levels', type=int, default=None, choices=(0, 1, 2, 3),
                   help='exact Q4_1 offsets: 0 = a separate exact float term; 1-3 = folded '
                        'into the matmul as that many 4-bit levels (default: 2 at accuracy '
                        'level 4, where activations are rounded to int8 anyway; else 0)')
    p.add_argument('--weights', default=None, choices=WEIGHT_FORMATS,
                   help='kquant: keep Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices in '
                        'their GGUF blocks for the edge_llm_ros ops (native/, built by '
                        'scripts/setup.sh); matmulnbits: repack every matrix for ONNX '
                        "Runtime's MatMulNBits (default: kquant when the op library is built "
                        'and the options allow it, else matmulnbits)')
    p.add_argument('--mmproj', default=None,
                   help="the model's llama.cpp mmproj GGUF: its vision encoder goes in as "
                        'vision.onnx (gemma3, idefics3, internvl, mlp, qwen2.5vl_merger, '
                        'qwen3vl_merger, gemma4v)')
    p.add_argument('--mmproj-vision-only', action='store_true',
                   help='with an mmproj that also holds an audio tower (Gemma 4: gemma4a), '
                        'convert its vision tower and leave the audio out (a warning); '
                        'without this flag such an mmproj is refused')
    p.add_argument('--force', action='store_true', help='replace an existing out_dir')
    p.add_argument('--no-verify', action='store_true',
                   help='skip opening the result with onnxruntime')
    p.add_argument('--quiet', action='store_true', help='no progress bar')
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: 0 on success, 1 for a bad/unsupported model, 2 for usage errors."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.check:
        return _check(args)
    if args.out_dir is None:
        parser.error('the model folder to create (out_dir) is required, unless --check')
    try:
        out = convert(args.source, args.out_dir, block_size=args.block_size,
                      activation_dtype=args.dtype, max_context=args.max_context,
                      progress=not args.quiet, accuracy_level=args.accuracy_level,
                      exact_q4_1=not args.requantize_q4_1, precision=args.precision,
                      overwrite=args.force,
                      verify=not args.no_verify, offset_levels=args.offset_levels,
                      weights=args.weights, mmproj=args.mmproj,
                      mmproj_vision_only=args.mmproj_vision_only)
    except EngineError as exc:
        print(f'edge-llm-convert: error: {exc}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('edge-llm-convert: interrupted; nothing was written', file=sys.stderr)
        return 130
    print(out)
    return 0


def _check(args: argparse.Namespace) -> int:
    from edge_llm_ros.convert.check import check_source
    opts = ConvertOptions(args.block_size, args.dtype, args.max_context, args.accuracy_level,
                          not args.requantize_q4_1, args.precision, args.offset_levels,
                          args.weights)
    report = check_source(args.source, args.mmproj, opts, args.mmproj_vision_only)
    print(report.render())
    return 0 if report.ok else 1


if __name__ == '__main__':
    sys.exit(main())

"""`edge-llm-convert --check`: whether a GGUF (or HF folder) will convert, before any work.

The check runs the converter's own refusals (`load_checkpoint`, then `preflight`: options,
the mmproj pair) and says, per tensor type, how the matrices would be stored: kept in their
GGUF blocks for the op library, repacked exactly, or requantized (lossy). It reads only the
header and one row per tensor type (to prove the type can be read), so it takes a moment on a
multi-GB file and writes nothing.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from edge_llm_ros.convert.checkpoint import Checkpoint, load_checkpoint, SourceTensor
from edge_llm_ros.convert.converter import ConvertOptions, preflight
from edge_llm_ros.convert.encoder import encoder_architecture
from edge_llm_ros.convert.gguf_weights import keeps_blocks, KQUANT_TYPES
from edge_llm_ros.convert.quant import repack_plan
from edge_llm_ros.errors import EngineError

_FLOATS = ('F32', 'F16', 'BF16')


@dataclass(frozen=True)
class TypeGroup:
    """The matrices of one GGUF type and how the conversion stores them."""

    qtype: str
    count: int
    storage: str


@dataclass
class CheckReport:
    """What `check_source` found; `ok` when nothing would be refused."""

    source: str
    architecture: str = ''
    summary: str = ''
    weights: str = ''
    groups: List[TypeGroup] = field(default_factory=list)
    vision: str = ''
    refusals: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refusals

    def render(self) -> str:
        """Return the report as the lines the CLI prints."""
        lines = [f'{self.source}:']
        if self.architecture:
            lines.append(f'  architecture: {self.architecture} ({self.summary})')
        if self.weights:
            lines.append(f'  matrices ({self.weights}):')
            lines += [f'    {g.qtype}: {g.count} -> {g.storage}' for g in self.groups]
        if self.vision:
            lines.append(f'  vision: {self.vision}')
        if self.ok:
            lines.append('  will convert')
        else:
            lines.append('  would refuse:')
            lines += [f'    - {why}' for why in self.refusals]
        return '\n'.join(lines)


def check_source(source: str, mmproj: Optional[str] = None,
                 options: Optional[ConvertOptions] = None,
                 mmproj_vision_only: bool = False) -> CheckReport:
    """Say whether `source` (and `mmproj`) would convert with `options`, and how."""
    opts = options or ConvertOptions()
    report = CheckReport(source)
    try:
        if mmproj is None and encoder_architecture(source):
            return _check_encoder(source, report)
        ckpt = load_checkpoint(source)
    except EngineError as exc:
        report.refusals.append(str(exc))
        return report
    s = ckpt.spec
    report.architecture = s.architecture
    report.summary = (f'{s.num_layers} layers, hidden {s.hidden_size}, '
                      f'context {s.max_position_embeddings}')
    try:
        vision = preflight(ckpt, opts, mmproj, source, mmproj_vision_only)
    except EngineError as exc:
        report.refusals.append(str(exc))
        vision = None
    else:
        opts = dataclasses.replace(opts, weights=opts.weight_format)
    if vision is not None:
        report.vision = f'{vision.config.projector} encoder, converted with the model'
    report.weights = opts.weights or opts.weight_format
    _type_groups(ckpt, opts, report)
    return report


def _check_encoder(source: str, report: CheckReport) -> CheckReport:
    """Say how an embedding / rerank GGUF or HF folder converts (convert/encoder.py)."""
    import pathlib
    from edge_llm_ros.convert.encoder import open_encoder
    m = open_encoder(pathlib.Path(source).expanduser().resolve())
    s = m.spec
    report.architecture = s.arch
    report.summary = (f'{"rerank" if s.pooling == "rank" else "embedding"} model, pooling '
                      f'{s.pooling}, {s.layers} layers, hidden {s.hidden}, context {s.context}')
    report.weights = 'encoder graph'
    by_type = collections.Counter(t.qtype for t in m.tensors.values() if len(t.shape) == 2)
    for qtype, count in sorted(by_type.items()):
        storage = ('float32 MatMul' if qtype == 'F32' else
                   'float32 MatMul of the widened values, activations rounded to float16'
                   if qtype == 'F16' else 'kept in its GGUF blocks (op library)'
                   if qtype in KQUANT_TYPES else 'unreadable')
        if storage == 'unreadable':
            report.refusals.append(f'{count} matrices are {qtype}; encoder matrices are read '
                                   f'as F32, F16 or {"/".join(KQUANT_TYPES)}: re-quantize the '
                                   'GGUF with llama-quantize')
        report.groups.append(TypeGroup(qtype, count, storage))
    return report


def _type_groups(ckpt: Checkpoint, opts: ConvertOptions, report: CheckReport) -> None:
    by_type = collections.defaultdict(list)
    for t in ckpt.matrices():
        by_type[t.qtype].append(t)
    for qtype, tensors in sorted(by_type.items()):
        unreadable = _unreadable(tensors[0])
        if unreadable:
            report.refusals.append(f'{len(tensors)} matrices are {qtype}, which cannot be read '
                                   f'({unreadable}); requantize the model to Q4_K_M or Q8_0 '
                                   'with llama-quantize')
            report.groups.append(TypeGroup(qtype, len(tensors), 'unreadable'))
            continue
        kept = sum(1 for t in tensors if opts.weights == 'kquant' and keeps_blocks(t))
        if kept:
            report.groups.append(TypeGroup(qtype, kept, 'kept in its GGUF blocks (op library)'))
        if kept < len(tensors):
            how, bits = repack_plan(qtype, opts.block_size, opts.precision, opts.exact_q4_1)
            storage = (f'repacked exactly at {bits} bits' if how == 'exact' else
                       f'quantized to {bits} bits' if qtype in _FLOATS else
                       f'dequantized and requantized to {bits} bits (lossy)')
            report.groups.append(TypeGroup(qtype, len(tensors) - kept, storage + ' (MatMulNBits)'))


def _unreadable(t: SourceTensor) -> str:
    """Return why the type of `t` cannot be dequantized ('' when one row can be)."""
    try:
        t.rows(0, 1).dequantize()
    except (NotImplementedError, KeyError, ValueError) as exc:
        return f'{type(exc).__name__}: {exc}'
    return ''

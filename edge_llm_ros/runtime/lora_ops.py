"""The op library's LoRA registry for one decoder (native/include/edge_llm_kquant/lora.h).

An adapter's pairs are registered on the graph's KQuantMatMul nodes by name, each as a segment
of the node's output columns, as model.yaml's `lora_targets` (written by the converter) says:
`layers.{i}.attn.q_proj` (or the fused `attn.qkv_proj`: q, k, v one after the other),
`attn.o_proj`, `mlp.gate_proj` / `mlp.up_proj` (or the fused
`mlp.gate_up_proj`, its glu applied after the adapter), `mlp.down_proj`. Before a call whose
rows name adapters, `set_rows` hands the op each packed position's (adapter id, scale) list;
`clear` after it. A call with no adapter never sets a table: the op's base path runs as is.

One registry and one table per process (the op reads them during the session run): adapter
ids are unique in the process, and decoder calls that use adapters must not overlap (the
engine runs one call at a time).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
import itertools
import pathlib
from typing import Dict, List, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import AdapterMismatchError, LoraTargetsMissingError
from edge_llm_ros.model_format import ModelInfo
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.lora_adapter import LoraAdapter

Use = Tuple[int, float]   # (adapter id, the goal's scale)
_F32P = ctypes.POINTER(ctypes.c_float)
_I64P = ctypes.POINTER(ctypes.c_int64)
# LoraPair.dtype -> lora.h's ELK_LORA_* (the op library widens F16 / BF16 as it reads).
_TYPES = {'f32': 0, 'f16': 1, 'bf16': 2}
# Adapter ids are unique in the process: the op library's registry is one per process, and two
# models' nodes share names (a draft model's layers.0.attn.q_proj is the target's name too).
_IDS = itertools.count(1)


@dataclass(frozen=True)
class Segment:
    """Where a projection's outputs are: op node `node`, W rows col.. of it."""

    node: str
    col: int


def node_layout(info: ModelInfo) -> Dict[Tuple[int, str], Segment]:
    """Map (layer, role) to its KQuantMatMul segment, as model.yaml's lora_targets says.

    The converter writes lora_targets (convert/lora.py); a folder converted before has none:
    LoraTargetsMissingError asks for a reconversion.
    """
    targets = info.extra.get('lora_targets')
    if not isinstance(targets, list):
        raise LoraTargetsMissingError(
            f'the model {info.name} was converted before model.yaml recorded where LoRA '
            'adapters go (lora_targets): convert it again with a current edge-llm-convert '
            'to use adapters (it still runs without them)')
    layout: Dict[Tuple[int, str], Segment] = {}
    for entry in targets:
        try:
            layer, role, node, col = entry
            layout[(int(layer), str(role))] = Segment(str(node), int(col))
        except (TypeError, ValueError):
            raise LoraTargetsMissingError(
                f'model.yaml of {info.name}: lora_targets entry {entry!r} is not [layer, role, '
                'node, column]: convert the model again') from None
    return layout


def _lib(path: pathlib.Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))   # the handle onnxruntime loaded: the same registry
    lib.elk_lora_add_typed.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                       ctypes.c_int]
    lib.elk_lora_remove.argtypes = [ctypes.c_int64]
    lib.elk_lora_remove.restype = ctypes.c_int64
    lib.elk_lora_pairs.restype = ctypes.c_int64
    lib.elk_lora_set_rows.argtypes = [ctypes.c_int64, _I64P, _I64P, _F32P]
    return lib


def _f32(array: np.ndarray):
    return array.ctypes.data_as(_F32P)


class LoraOps:
    """Adapters registered on one decoder's op nodes, and the per-call row table."""

    def __init__(self, info: ModelInfo) -> None:
        self.layout = node_layout(info)
        self._lib = _lib(native_ops.require_library('LoRA adapters'))
        self.ids: List[int] = []   # adapters registered through this decoder
        self.active = False   # a row table is set (clear() after the call)

    def add(self, adapter: LoraAdapter) -> int:
        """Register an adapter checked against this base (check_base); return its id."""
        missing = sorted({k for k in adapter.pairs if k not in self.layout})
        if missing:
            layer, role = missing[0]
            raise AdapterMismatchError(
                f'LoRA adapter {adapter.name} adapts layer {layer} {role}, which this model runs '
                "without the op library's KQuantMatMul (MatMulNBits weights): convert the model "
                'from a GGUF to use adapters')
        adapter_id = next(_IDS)
        for key, pair in sorted(adapter.pairs.items()):
            seg = self.layout[key]
            a_t = np.ascontiguousarray(pair.a.T)   # [k, r], in the pair's storage type
            b_t = np.ascontiguousarray(pair.b.T)   # [r, n]
            rc = self._lib.elk_lora_add_typed(seg.node.encode(), adapter_id, a_t.shape[0],
                                              a_t.shape[1], a_t.ctypes.data, b_t.shape[1],
                                              b_t.ctypes.data, seg.col, float(adapter.alpha),
                                              _TYPES[pair.dtype])
            if rc != 0:
                self._lib.elk_lora_remove(adapter_id)
                raise AdapterMismatchError(f'LoRA adapter {adapter.name}: the op library '
                                           f'refused its pair on {seg.node}')
        self.ids.append(adapter_id)
        return adapter_id

    def remove(self, adapter_id: int) -> int:
        """Drop an adapter's pairs; return how many."""
        if adapter_id in self.ids:
            self.ids.remove(adapter_id)
        return int(self._lib.elk_lora_remove(adapter_id))

    def close(self) -> None:
        """Drop every adapter of this decoder from the op library."""
        for adapter_id in list(self.ids):
            self.remove(adapter_id)

    def set_rows(self, uses: Sequence[Sequence[Use]], lengths: Sequence[int]) -> None:
        """Give the next call's packed positions their adapters: row r's uses on its lengths[r]."""
        offsets: List[int] = [0]
        ids: List[int] = []
        scales: List[float] = []
        for row_uses, length in zip(uses, lengths):
            for _ in range(length):
                for adapter_id, scale in row_uses:
                    ids.append(adapter_id)
                    scales.append(scale)
                offsets.append(len(ids))
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._ids = np.asarray(ids or [0], dtype=np.int64)
        self._scales = np.asarray(scales or [0.0], dtype=np.float32)
        rc = self._lib.elk_lora_set_rows(len(offsets) - 1, self._offsets.ctypes.data_as(_I64P),
                                         self._ids.ctypes.data_as(_I64P), _f32(self._scales))
        if rc != 0:
            raise ValueError('the op library refused the LoRA row table')
        self.active = True

    def clear(self) -> None:
        """Clear the row table: the next calls run the base model untouched."""
        self._lib.elk_lora_set_rows(0, None, None, None)
        self.active = False

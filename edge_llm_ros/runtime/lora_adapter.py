"""LoRA adapters in the engine's numpy form (written by convert/lora.py), read with numpy only.

An adapter is a set of low-rank pairs per (layer, projection): y = W·x + s·B·(A·x), with
A [rank, in] and B [out, rank] in the layout of the engine's weights, kept in the narrowest of
float32, F16 and BF16 that holds the file's values exactly (an F16 or BF16 adapter file: half
the bytes; the op library widens them as it reads, so the sums see the same float32 values). The
effective scale of a pair is llama.cpp's: `scale * alpha / rank`, or `scale` when the adapter
has no alpha.

Adapters as users have them (llama.cpp's LoRA GGUF, PEFT safetensors folders) are converted
once for a base model by the converter (convert/lora.py: fused projections split, llama's Q/K
rows back in NEOX order, checked against the base): a folder holding ADAPTER_MANIFEST (what it
was converted from, for which base model: its source sha256, as model.yaml says) and
ADAPTER_PAIRS (an .npz of `{layer}.{role}.a` / `.b`). `load_converted` reads that folder and
refuses one converted for another base, naming both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import os
from typing import Dict, Optional, Tuple
import zipfile

import numpy as np

from edge_llm_ros.errors import AdapterFileError, AdapterMismatchError
from edge_llm_ros.model_format import ModelInfo

# Projections an adapter may name (the engine's weight roles).
ROLES = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
# The numpy form (convert/lora.py writes it): a folder of these two files.
ADAPTER_MANIFEST = 'lora_adapter.json'
ADAPTER_PAIRS = 'lora_pairs.npz'
ADAPTER_FORMAT = 'edge_llm_ros-lora'
# 2: pairs stored as F16 / BF16 (uint16 bits) when exact; 1 (float32 only) is converted again.
ADAPTER_FORMAT_VERSION = 2
# A pair's storage type (the manifest's name) and its numpy dtype (BF16: its bits as uint16).
STORAGE_DTYPES = {'f32': np.float32, 'f16': np.float16, 'bf16': np.uint16}


@dataclass(frozen=True, eq=False)
class LoraPair:
    """One projection's low-rank pair: A [rank, in], B [out, rank] of storage type `dtype`.

    dtype: 'f32' (float32 arrays), 'f16' (float16) or 'bf16' (uint16: float32's upper halves).
    """

    a: np.ndarray
    b: np.ndarray
    dtype: str = 'f32'

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def widened(self) -> 'LoraPair':
        """Return the pair in float32 (exact: the values the op library computes with)."""
        return LoraPair(widen(self.a, self.dtype), widen(self.b, self.dtype))


def widen(array: np.ndarray, dtype: str) -> np.ndarray:
    """Return a stored array (STORAGE_DTYPES) as float32, exactly."""
    if dtype == 'bf16':
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(array, dtype=np.float32)


def narrowest_storage(pair: LoraPair) -> LoraPair:
    """Return a float32 pair in the narrowest storage type holding its values exactly.

    F16 first (a value of an F16 file), then BF16 (its float32 bits' low half zero), else
    float32 (a Q8_0 file's products, a PEFT folder's float32 weights).
    """
    a = np.ascontiguousarray(pair.a, dtype=np.float32)
    b = np.ascontiguousarray(pair.b, dtype=np.float32)
    halves = [x.astype(np.float16) for x in (a, b)]
    if all(np.array_equal(h.astype(np.float32).view(np.uint32), x.view(np.uint32))
           for h, x in zip(halves, (a, b))):
        return LoraPair(halves[0], halves[1], 'f16')
    if not any((x.view(np.uint32) & 0xFFFF).any() for x in (a, b)):
        return LoraPair(*((x.view(np.uint32) >> 16).astype(np.uint16) for x in (a, b)),
                        dtype='bf16')
    return LoraPair(a, b)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """An adapter's pairs per (layer, role), and what it says of its base model."""

    name: str
    path: str
    architecture: str
    alpha: float      # 0: the user's scale is used as is (llama.cpp's rule)
    pairs: Dict[Tuple[int, str], LoraPair] = field(default_factory=dict)
    vocab_rows: Dict[str, int] = field(default_factory=dict)  # token_embd / output: vocab size
    qk_permuted: bool = False   # B rows of q / k in llama.cpp's interleaved order (converter)

    def effective_scale(self, scale: float, pair: LoraPair) -> float:
        """Return llama.cpp's scale of `pair`: scale * alpha / rank (alpha 0: scale)."""
        return scale * self.alpha / pair.rank if self.alpha else scale

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def describe(adapter: LoraAdapter) -> str:
    """Return how errors name an adapter: 'LoRA adapter NAME (PATH)'."""
    return f'LoRA adapter {adapter.name} ({adapter.path})'


def describe_base(info: ModelInfo) -> str:
    """Return how errors name the loaded base model."""
    return f'the loaded model {info.name} ({info.architecture}, {info.num_layers} layers)'


def base_sha256(info: ModelInfo) -> str:
    """Return the sha256 of the model's source (model.yaml source.sha256; '' when unknown)."""
    source = info.extra.get('source')
    return str(source.get('sha256') or '') if isinstance(source, dict) else ''


def check_shapes(adapter: LoraAdapter, info: ModelInfo,
                 intermediate: Optional[int] = None) -> None:
    """Check every pair's layer and (in, out) against `info`; AdapterMismatchError names both.

    The pairs are in the engine's roles (ROLES). intermediate: the base's n_ff when known (else
    gate / up / down only need to agree with each other).
    """
    where, base = describe(adapter), describe_base(info)
    if adapter.architecture and adapter.architecture != info.architecture:
        raise AdapterMismatchError(f'{where} is for architecture {adapter.architecture}, but '
                                   f'{base} is {info.architecture}: use an adapter trained on '
                                   'this base model')
    q_out = info.num_heads * info.head_dim
    kv_out = info.num_kv_heads * info.head_dim
    ffn = intermediate
    for (layer, role), pair in sorted(adapter.pairs.items()):
        if not 0 <= layer < info.num_layers:
            raise AdapterMismatchError(f'{where} adapts layer {layer}, but {base} has layers '
                                       f'0..{info.num_layers - 1}')
        if role not in ROLES:
            raise AdapterFileError(f'{where}: layer {layer} names projection {role!r}, not one '
                                   f'of {", ".join(ROLES)}: convert the adapter again')
        if role in ('gate', 'up', 'down') and ffn is None:
            ffn = int(pair.b.shape[0] if role != 'down' else pair.a.shape[1])
        want = {'q': (info.hidden_size, q_out), 'k': (info.hidden_size, kv_out),
                'v': (info.hidden_size, kv_out), 'o': (q_out, info.hidden_size),
                'gate': (info.hidden_size, ffn), 'up': (info.hidden_size, ffn),
                'down': (ffn, info.hidden_size)}[role]
        got = (int(pair.a.shape[1]), int(pair.b.shape[0]))
        if got != want or pair.a.shape[0] != pair.b.shape[1]:
            raise AdapterMismatchError(
                f'{where}: layer {layer} {role} maps {got[0]} -> {got[1]}, but in {base} that '
                f'projection maps {want[0]} -> {want[1]}: use an adapter trained on this base '
                'model')


def is_converted(path: str) -> bool:
    """Tell whether `path` is an adapter folder in the engine's numpy form."""
    return os.path.isfile(os.path.join(path, ADAPTER_MANIFEST))


def read_manifest(folder: str) -> dict:
    """Return a converted adapter's manifest; AdapterFileError when it is unreadable."""
    path = os.path.join(folder, ADAPTER_MANIFEST)
    try:
        with open(path, encoding='utf-8') as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterFileError(f'{path} is not readable JSON ({exc}): convert the adapter '
                               'again (load its .gguf or PEFT folder)') from None
    if isinstance(manifest, dict) and manifest.get('format') == ADAPTER_FORMAT and \
            manifest.get('format_version') != ADAPTER_FORMAT_VERSION:
        raise AdapterFileError(f'{path} was converted by another edge_llm_ros (format version '
                               f'{manifest.get("format_version")}, this one reads '
                               f'{ADAPTER_FORMAT_VERSION}): load the adapter from its .gguf or '
                               'PEFT folder to convert it again (a cached conversion is redone '
                               'by itself)')
    if not isinstance(manifest, dict) or manifest.get('format') != ADAPTER_FORMAT:
        raise AdapterFileError(f'{path} is not a LoRA adapter of format {ADAPTER_FORMAT} '
                               f'{ADAPTER_FORMAT_VERSION}: convert the adapter again (load its '
                               '.gguf or PEFT folder)')
    return manifest


def load_converted(folder: str, info: ModelInfo, name: str = '') -> LoraAdapter:
    """Read a converted adapter folder for the base `info`; typed errors say what to do."""
    if not is_converted(folder):
        raise AdapterFileError(
            f'{folder} is no converted LoRA adapter (no {ADAPTER_MANIFEST}): a LoRA GGUF or '
            "PEFT folder is converted once when llm_node's lora.adapters / ~/load_adapter or "
            '`edge-llm generate --lora` names it, or by `python -m edge_llm_ros.convert.lora '
            'ADAPTER MODEL_DIR`')
    manifest = read_manifest(folder)
    name = name or str(manifest.get('name') or os.path.basename(os.path.normpath(folder)))
    want, got = base_sha256(info), str((manifest.get('base') or {}).get('sha256') or '')
    if want and got != want:
        base = manifest.get('base') or {}
        raise AdapterMismatchError(
            f'LoRA adapter {name} ({folder}) was converted for {base.get("name", "?")} '
            f'(source sha256 {got[:12]}), but {describe_base(info)} has source sha256 '
            f'{want[:12]}: load the adapter from its .gguf or PEFT folder to convert it for this '
            'model')
    path = os.path.join(folder, ADAPTER_PAIRS)
    pairs: Dict[Tuple[int, str], LoraPair] = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for layer, role, _, dtype in (tuple(e[:4]) for e in manifest.get('pairs') or ()):
                want = STORAGE_DTYPES[dtype]
                a, b = data[f'{layer}.{role}.a'], data[f'{layer}.{role}.b']
                if a.dtype != want or b.dtype != want:
                    raise ValueError(f'pair {layer}.{role} is {a.dtype} / {b.dtype}, the '
                                     f'manifest says {dtype}')
                pairs[(int(layer), str(role))] = LoraPair(
                    np.ascontiguousarray(a), np.ascontiguousarray(b), dtype)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise AdapterFileError(f'{path} cannot be read ({exc}): the converted adapter is '
                               'truncated or corrupt; delete its folder and load the adapter '
                               'again') from None
    if not pairs:
        raise AdapterFileError(f'{folder} holds no LoRA pairs: convert the adapter again')
    adapter = LoraAdapter(name, folder, str(manifest.get('architecture') or ''),
                          float(manifest.get('alpha') or 0.0), pairs)
    check_shapes(adapter, info)
    return adapter

"""LoRA adapters as users have them: llama.cpp's LoRA GGUF and PEFT safetensors folders.

An adapter is a set of low-rank pairs per (layer, projection): y = W·x + s·B·(A·x), with
A [rank, in] and B [out, rank] in float32, in the layout of the engine's weights (a llama
GGUF stores Q/K rows permuted for interleaved RoPE; the converter reads them back as NEOX
halves, so an adapter's Q/K B rows are read back the same way). The effective scale of a
pair is llama.cpp's: `scale * alpha / rank`, or `scale` when the adapter has no alpha.

Fused projections are split into their parts, sharing A: a GGUF `attn_qkv` (or PEFT
`qkv_proj`) into q, k, v and a `gate_up_proj` (phi3's GGUF `ffn_up` of 2 * n_ff rows) into
gate and up, the way the converter splits the weights. `check_base` refuses an adapter of
another base (architecture, layer count, a projection's shape, vocabulary) naming both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import os
import pathlib
from typing import Dict, Optional, Tuple

import numpy as np

from edge_llm_ros.errors import AdapterFileError, AdapterMismatchError, ModelLoadError
from edge_llm_ros.gguf_file import open_gguf, unpermute_llama_rows
from edge_llm_ros.model_format import ModelInfo

# Projections an adapter may name (the engine's weight roles).
ROLES = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
_GGUF_ROLES = {'attn_q': 'q', 'attn_k': 'k', 'attn_v': 'v', 'attn_output': 'o',
               'ffn_gate': 'gate', 'ffn_up': 'up', 'ffn_down': 'down', 'attn_qkv': 'qkv'}
_PEFT_ROLES = {'q_proj': 'q', 'k_proj': 'k', 'v_proj': 'v', 'o_proj': 'o', 'gate_proj': 'gate',
               'up_proj': 'up', 'down_proj': 'down', 'qkv_proj': 'qkv', 'gate_up_proj': 'gate_up'}
# Tensors of the vocabulary (llama.cpp applies their adapters; the engine does not yet).
_VOCAB_TENSORS = ('token_embd', 'output')
# Families whose GGUF stores Q/K rows permuted (convert/architectures.py gguf_permuted_qk).
_PERMUTED_QK = ('llama',)
PEFT_CONFIG = 'adapter_config.json'
PEFT_WEIGHTS = 'adapter_model.safetensors'


@dataclass(frozen=True, eq=False)
class LoraPair:
    """One projection's low-rank pair: A float32 [rank, in], B float32 [out, rank]."""

    a: np.ndarray
    b: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """An adapter's pairs per (layer, role), and what it says of its base model."""

    name: str
    path: str
    architecture: str
    alpha: float      # 0: the user's scale is used as is (llama.cpp's rule)
    pairs: Dict[Tuple[int, str], LoraPair] = field(default_factory=dict)
    vocab_rows: Dict[str, int] = field(default_factory=dict)  # token_embd / output: vocab size
    qk_permuted: bool = False   # B rows of q / k in llama.cpp's interleaved order (check_base)

    def effective_scale(self, scale: float, pair: LoraPair) -> float:
        """Return llama.cpp's scale of `pair`: scale * alpha / rank (alpha 0: scale)."""
        return scale * self.alpha / pair.rank if self.alpha else scale

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def load_adapter(path: str, name: str = '') -> LoraAdapter:
    """Read a LoRA GGUF file or a PEFT folder; AdapterFileError says what is wrong with it."""
    name = name or pathlib.Path(path).stem
    if os.path.isdir(path):
        return _load_peft(path, name)
    if not os.path.isfile(path):
        raise AdapterFileError(f'LoRA adapter {path} does not exist: give a LoRA GGUF '
                               '(convert_lora_to_gguf.py) or a PEFT folder '
                               f'({PEFT_CONFIG} + {PEFT_WEIGHTS})')
    return _load_gguf(path, name)


# --- GGUF -----------------------------------------------------------------------------------

def _field(reader, key: str, path: str):
    f = reader.fields.get(key)
    if f is None:
        raise AdapterFileError(f'{path}: no {key} in the GGUF header; this is not a LoRA '
                               'adapter made by convert_lora_to_gguf.py')
    return f.contents()


def _load_gguf(path: str, name: str) -> LoraAdapter:
    import gguf
    try:
        reader = open_gguf(pathlib.Path(path))
    except ModelLoadError as exc:
        raise AdapterFileError(f'LoRA adapter {exc}') from None
    if _field(reader, 'general.type', path) != 'adapter':
        raise AdapterFileError(f'{path}: general.type is {_field(reader, "general.type", path)!r}'
                               ", not 'adapter': give a LoRA adapter, not a model")
    if _field(reader, 'adapter.type', path) != 'lora':
        raise AdapterFileError(f'{path}: adapter.type is {_field(reader, "adapter.type", path)!r}'
                               ", not 'lora': only LoRA adapters are supported")
    arch = str(_field(reader, 'general.architecture', path))
    alpha_field = reader.fields.get('adapter.lora.alpha')
    alpha = float(alpha_field.contents()) if alpha_field is not None else 0.0
    halves: Dict[str, Dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        base, _, half = t.name.rpartition('.')
        if half not in ('lora_a', 'lora_b'):
            raise AdapterFileError(f'{path}: tensor {t.name} is neither a .lora_a nor a .lora_b: '
                                   'not a LoRA adapter of convert_lora_to_gguf.py')
        try:
            data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise AdapterFileError(f'{path}: tensor {t.name} of type {t.tensor_type.name} cannot '
                                   f'be read ({exc}); convert the adapter with --outtype f16, '
                                   'bf16, f32 or q8_0') from None
        halves.setdefault(base, {})[half] = data.reshape(
            [int(n) for n in reversed(t.shape.tolist())])
    return _assemble(path, name, arch, alpha, halves, _gguf_key, permuted=arch in _PERMUTED_QK)


def _gguf_key(path: str, base: str, arch: str) -> Tuple[int, str]:
    parts = base.split('.')
    if base.endswith('.weight') and parts[0] in _VOCAB_TENSORS and len(parts) == 2:
        return -1, parts[0]
    if len(parts) == 4 and parts[0] == 'blk' and parts[1].isdigit() and parts[3] == 'weight' \
            and parts[2] in _GGUF_ROLES:
        role = _GGUF_ROLES[parts[2]]
        if arch == 'phi3' and role == 'up':
            role = 'gate_up'   # phi3's GGUF ffn_up holds gate and up (converter's split)
        return int(parts[1]), role
    raise AdapterFileError(f'{path}: the adapter names {base}, which is no projection this '
                           f'engine runs (it adapts {", ".join(sorted(_GGUF_ROLES))})')


# --- PEFT -----------------------------------------------------------------------------------

def _load_peft(folder: str, name: str) -> LoraAdapter:
    config_path = os.path.join(folder, PEFT_CONFIG)
    weights_path = os.path.join(folder, PEFT_WEIGHTS)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise AdapterFileError(f'{folder} has no {os.path.basename(p)}: a PEFT adapter '
                                   f'folder holds {PEFT_CONFIG} and {PEFT_WEIGHTS}')
    try:
        with open(config_path, encoding='utf-8') as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterFileError(f'{config_path} is not readable JSON ({exc})') from None
    if str(config.get('peft_type', 'LORA')).upper() != 'LORA':
        raise AdapterFileError(f'{config_path}: peft_type {config.get("peft_type")!r} is not '
                               'LORA: only LoRA adapters are supported')
    for flag in ('use_dora', 'use_rslora'):
        if config.get(flag):
            raise AdapterFileError(f'{config_path}: {flag} is set, which llama.cpp does not '
                                   'apply either: train the adapter as plain LoRA')
    rank = int(config.get('r', 0) or 0)
    alpha = float(config.get('lora_alpha', 0) or 0)
    arch = _peft_architecture(folder, config)
    try:
        from safetensors.numpy import load_file
        tensors = load_file(weights_path)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise AdapterFileError(f'{weights_path} is not a readable safetensors file ({exc}): '
                               'the file is truncated or corrupt') from None
    halves: Dict[str, Dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        stem, _, rest = key.partition('.lora_')
        half = {'A.weight': 'lora_a', 'B.weight': 'lora_b'}.get(rest)
        if half is None:
            raise AdapterFileError(f'{weights_path}: tensor {key} is no lora_A / lora_B weight '
                                   '(modules_to_save and embedding adapters are not supported)')
        halves.setdefault(stem, {})[half] = np.asarray(value, dtype=np.float32)
    adapter = _assemble(weights_path, name, arch, alpha, halves, _peft_key, permuted=False)
    bad = [k for k, p in adapter.pairs.items() if rank and p.rank != rank]
    if bad:
        raise AdapterFileError(f'{weights_path}: pairs of rank {adapter.pairs[bad[0]].rank}, but '
                               f'{PEFT_CONFIG} says r = {rank}')
    return adapter


def _peft_architecture(folder: str, config: dict) -> str:
    """Return the GGUF architecture of the base the config names ('' when it names none)."""
    base = config.get('base_model_name_or_path') or ''
    model_type = ''
    base_config = os.path.join(base, 'config.json') if base else ''
    if base_config and os.path.isfile(base_config):
        with open(base_config, encoding='utf-8') as f:
            model_type = json.load(f).get('model_type', '')
    model_type = config.get('model_type', model_type)   # written by some trainers
    return {'mistral': 'llama', 'qwen2_vl': 'qwen2vl', 'gemma3_text': 'gemma3'}.get(
        model_type, model_type)


def _peft_key(path: str, stem: str, arch: str) -> Tuple[int, str]:
    parts = stem.split('.')
    if 'layers' in parts:
        i = parts.index('layers')
        if i + 3 <= len(parts) - 0 and parts[i + 1].isdigit() and parts[-1] in _PEFT_ROLES:
            return int(parts[i + 1]), _PEFT_ROLES[parts[-1]]
    if parts[-1] in ('embed_tokens', 'lm_head'):
        return -1, 'token_embd' if parts[-1] == 'embed_tokens' else 'output'
    raise AdapterFileError(f'{path}: the adapter names {stem}, which is no projection this '
                           f'engine runs (it adapts {", ".join(sorted(_PEFT_ROLES))})')


# --- both -----------------------------------------------------------------------------------

def _assemble(path: str, name: str, arch: str, alpha: float,
              halves: Dict[str, Dict[str, np.ndarray]], key_of, permuted: bool) -> LoraAdapter:
    pairs: Dict[Tuple[int, str], LoraPair] = {}
    vocab_rows: Dict[str, int] = {}
    for base, pair in halves.items():
        if set(pair) != {'lora_a', 'lora_b'}:
            missing = ({'lora_a', 'lora_b'} - set(pair)).pop()
            raise AdapterFileError(f'{path}: {base} has no {missing}: the adapter is incomplete')
        a, b = pair['lora_a'], pair['lora_b']
        layer, role = key_of(path, base, arch)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterFileError(
                f'{path}: {base} has lora_a {list(a.shape)} and lora_b {list(b.shape)}; a pair '
                'needs A [rank, in] and B [out, rank] (an adapter of the old finetune example '
                'is not supported)')
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterFileError(f'{path}: {base} holds NaN or infinite values: the adapter '
                                   'is corrupt')
        if layer < 0:
            # token_embd's A is [rank, vocab] transposed in llama.cpp; output's B is [vocab, r]
            vocab_rows[role] = int(a.shape[1] if role == 'token_embd' else b.shape[0])
            continue
        for part, part_b in _split(role, b):
            pairs[(layer, part)] = LoraPair(np.ascontiguousarray(a), part_b)
    if not pairs and not vocab_rows:
        raise AdapterFileError(f'{path} holds no LoRA pairs: the adapter is empty')
    return LoraAdapter(name, path, arch, alpha, pairs, vocab_rows, qk_permuted=permuted)


def _split(role: str, b: np.ndarray):
    """Yield (role, B rows) of a projection, a fused one as its parts (B rows split, A shared)."""
    if role == 'gate_up':
        if b.shape[0] % 2:
            raise AdapterFileError(f'a gate_up pair of {b.shape[0]} rows cannot be split in two')
        half = b.shape[0] // 2
        yield 'gate', np.ascontiguousarray(b[:half])
        yield 'up', np.ascontiguousarray(b[half:])
    else:
        yield role, np.ascontiguousarray(b)


def check_base(adapter: LoraAdapter, info: ModelInfo,
               intermediate: Optional[int] = None) -> LoraAdapter:
    """Return the adapter laid out for `info`'s weights; AdapterMismatchError names both sides.

    A fused qkv pair is split here (its parts' sizes are the base's). intermediate: the base's
    n_ff when known (else gate / up / down only need to agree with each other).
    """
    where = f'LoRA adapter {adapter.name} ({adapter.path})'
    base = f'the loaded model {info.name} ({info.architecture}, {info.num_layers} layers)'
    if adapter.architecture and adapter.architecture != info.architecture:
        raise AdapterMismatchError(f'{where} is for architecture {adapter.architecture}, but '
                                   f'{base} is {info.architecture}: use an adapter trained on '
                                   'this base model')
    for role, rows in adapter.vocab_rows.items():
        if rows != info.vocab_size:
            raise AdapterMismatchError(f'{where} adapts {role} for a vocabulary of {rows} tokens, '
                                       f'but {base} has {info.vocab_size}: use an adapter '
                                       'trained on this base model')
    if adapter.vocab_rows:
        raise AdapterFileError(f'{where} adapts {", ".join(adapter.vocab_rows)}: adapters of the '
                               'embeddings or the output head are not supported yet')
    q_out = info.num_heads * info.head_dim
    kv_out = info.num_kv_heads * info.head_dim
    pairs: Dict[Tuple[int, str], LoraPair] = {}
    for (layer, role), pair in adapter.pairs.items():
        if layer >= info.num_layers:
            raise AdapterMismatchError(f'{where} adapts layer {layer}, but {base} has layers '
                                       f'0..{info.num_layers - 1}')
        if role == 'qkv':
            if pair.b.shape[0] != q_out + 2 * kv_out:
                raise AdapterMismatchError(
                    f'{where}: layer {layer} qkv has {pair.b.shape[0]} output rows, but {base} '
                    f'needs {q_out} + 2 * {kv_out}')
            for part, lo, hi in (('q', 0, q_out), ('k', q_out, q_out + kv_out),
                                 ('v', q_out + kv_out, q_out + 2 * kv_out)):
                pairs[(layer, part)] = LoraPair(pair.a, np.ascontiguousarray(pair.b[lo:hi]))
        else:
            pairs[(layer, role)] = pair
    if adapter.qk_permuted:
        for (layer, role), pair in list(pairs.items()):
            heads = {'q': info.num_heads, 'k': info.num_kv_heads}.get(role)
            if heads and pair.b.shape[0] % (2 * heads) == 0:
                pairs[(layer, role)] = LoraPair(
                    pair.a, np.ascontiguousarray(unpermute_llama_rows(pair.b, heads)))
    ffn = intermediate
    for (layer, role), pair in sorted(pairs.items()):
        if role in ('gate', 'up', 'down') and ffn is None:
            ffn = int(pair.b.shape[0] if role != 'down' else pair.a.shape[1])
        want = {'q': (info.hidden_size, q_out), 'k': (info.hidden_size, kv_out),
                'v': (info.hidden_size, kv_out), 'o': (q_out, info.hidden_size),
                'gate': (info.hidden_size, ffn), 'up': (info.hidden_size, ffn),
                'down': (ffn, info.hidden_size)}[role]
        got = (int(pair.a.shape[1]), int(pair.b.shape[0]))
        if got != want:
            raise AdapterMismatchError(
                f'{where}: layer {layer} {role} maps {got[0]} -> {got[1]}, but in {base} that '
                f'projection maps {want[0]} -> {want[1]}: use an adapter trained on this base '
                'model')
    return LoraAdapter(adapter.name, adapter.path, adapter.architecture or info.architecture,
                       adapter.alpha, pairs, {})

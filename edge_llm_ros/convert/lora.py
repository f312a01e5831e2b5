"""LoRA adapters as users have them, converted once into the engine's numpy form.

    python -m edge_llm_ros.convert.lora ADAPTER MODEL_DIR [--out DIR] [--name NAME]

Reads llama.cpp's LoRA GGUF (convert_lora_to_gguf.py: `general.type = adapter`, `*.lora_a` /
`*.lora_b` in F32, F16, BF16 or Q8_0) or a PEFT folder (adapter_config.json +
adapter_model.safetensors), lays it out for a converted base model and writes the folder the
runtime reads with numpy only (runtime/lora_adapter.py: ADAPTER_MANIFEST + ADAPTER_PAIRS).

Fused projections are split into their parts, sharing A: a GGUF `attn_qkv` (or PEFT
`qkv_proj`) into q, k, v and a `gate_up_proj` (phi3's GGUF `ffn_up` of 2 * n_ff rows) into
gate and up, the way the converter splits the weights; a llama GGUF's Q/K B rows (permuted for
interleaved RoPE) are read back as NEOX halves, as the converter reads the weights.
`check_base` refuses an adapter of another base (architecture, layer count, a projection's
shape, vocabulary) naming both sides.

`ensure_converted` converts into a cache beside the model folder (`<model>.adapters/`, or a
given folder), keyed by the adapter's and the base's sha256: llm_node's lora.adapters and
~/load_adapter and `edge-llm generate --lora` call it, so users keep naming their files.

Importing this module loads no converter library (gguf, onnx, safetensors): a node imports it
and pays for them only when an adapter is converted.

`lora_targets` is model.yaml's map of each (layer, projection) to its KQuantMatMul node and
first output column, written at conversion (convert/converter.py) for the op library's
registry (runtime/lora_ops.py).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.convert.gguf_file import open_gguf, unpermute_llama_rows
from edge_llm_ros.errors import (AdapterError, AdapterFileError, AdapterMismatchError,
                                 ModelLoadError)
from edge_llm_ros.model_format import (CONVERTER_VERSION, embedded_model, load_model_info,
                                       ModelInfo)
from edge_llm_ros.runtime.lora_adapter import (ADAPTER_FORMAT, ADAPTER_FORMAT_VERSION,
                                               ADAPTER_MANIFEST, ADAPTER_PAIRS, base_sha256,
                                               check_shapes, describe, describe_base,
                                               is_converted, LoraAdapter, LoraPair,
                                               narrowest_storage, read_manifest)

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
KQUANT_MATMUL = 'KQuantMatMul'


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
        if i + 3 <= len(parts) and parts[i + 1].isdigit() and parts[-1] in _PEFT_ROLES:
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

    A fused qkv pair is split here (its parts' sizes are the base's), llama's permuted Q/K B
    rows are put back in NEOX order; runtime/lora_adapter.check_shapes checks the rest.
    intermediate: the base's n_ff when known.
    """
    where, base = describe(adapter), describe_base(info)
    if adapter.architecture and adapter.architecture != info.architecture:
        check_shapes(adapter, info)   # names both architectures
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
    laid_out = LoraAdapter(adapter.name, adapter.path, adapter.architecture or info.architecture,
                           adapter.alpha, pairs, {})
    check_shapes(laid_out, info, intermediate)
    return laid_out


# --- the numpy form -------------------------------------------------------------------------

def adapter_sha256(path: str) -> str:
    """Return the sha256 of an adapter file, or of a PEFT folder's config + weights."""
    from edge_llm_ros.convert.converter import sha256_files   # onnx: only when converting
    p = pathlib.Path(path)
    return sha256_files([p] if p.is_file() else [p / PEFT_CONFIG, p / PEFT_WEIGHTS])


def write_converted(adapter: LoraAdapter, info: ModelInfo, out_dir: str,
                    source_sha: str = '') -> pathlib.Path:
    """Write a laid-out adapter (check_base) as the runtime's numpy form into out_dir."""
    out = pathlib.Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
    try:
        arrays = {}
        stored = {key: narrowest_storage(pair) for key, pair in adapter.pairs.items()}
        for (layer, role), pair in sorted(stored.items()):
            arrays[f'{layer}.{role}.a'] = pair.a
            arrays[f'{layer}.{role}.b'] = pair.b
        np.savez(tmp / ADAPTER_PAIRS, **arrays)
        manifest = {
            'format': ADAPTER_FORMAT, 'format_version': ADAPTER_FORMAT_VERSION,
            'converter_version': CONVERTER_VERSION, 'name': adapter.name,
            'architecture': adapter.architecture, 'alpha': float(adapter.alpha),
            'source': {'path': str(adapter.path), 'sha256': source_sha},
            'base': {'name': info.name, 'architecture': info.architecture,
                     'sha256': base_sha256(info)},
            'pairs': [[layer, role, pair.rank, pair.dtype] for (layer, role), pair
                      in sorted(stored.items())]}
        (tmp / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_cache_dir(model_dir: str) -> pathlib.Path:
    """Return where a model's converted adapters go: `<model folder>.adapters` beside it."""
    folder = pathlib.Path(model_dir).resolve()
    return folder.parent / f'{folder.name}.adapters'


def ensure_converted(path: str, model_dir: str, cache_dir: Optional[str] = None,
                     name: str = '') -> str:
    """Return the numpy form of the adapter at `path` for the model in model_dir.

    A converted folder is returned as it is; a LoRA GGUF or PEFT folder is converted once into
    cache_dir (default_cache_dir), keyed by its sha256 and the base's: a later call with the
    same files finds it there.
    """
    if is_converted(path):
        return path
    info = load_model_info(model_dir)
    if not os.path.exists(path):
        load_adapter(path, name)   # the typed error: does not exist
    src_sha, base_sha = adapter_sha256(path), base_sha256(info)
    stem = pathlib.Path(os.path.normpath(path)).stem or 'adapter'
    cache = pathlib.Path(cache_dir) if cache_dir else default_cache_dir(model_dir)
    out = cache / f'{stem}-{src_sha[:12]}-{(base_sha or "nobase")[:12]}'
    if is_converted(str(out)):
        try:
            manifest = read_manifest(str(out))
            if (manifest.get('source') or {}).get('sha256') == src_sha and \
                    (manifest.get('base') or {}).get('sha256') == base_sha:
                return str(out)
        except AdapterFileError:
            pass   # written by another format: convert again
    adapter = check_base(load_adapter(path, name or stem), info)
    try:
        return str(write_converted(adapter, info, str(out), src_sha))
    except OSError as exc:
        raise AdapterFileError(f'cannot write the converted LoRA adapter to {out} ({exc}): '
                               'make that folder writable') from None


def convert_adapters(adapters: Sequence[Tuple[str, str, float]], model_dir: str,
                     cache_dir: Optional[str] = None) -> Tuple[Tuple[str, str, float], ...]:
    """Return (name, path, scale) items with each path in the numpy form (ensure_converted).

    model_dir '' is the embedded model (as EngineConfig reads it).
    """
    if not adapters:
        return tuple(adapters)
    model_dir = model_dir or str(embedded_model())
    return tuple((name, ensure_converted(path, model_dir, cache_dir, name), scale)
                 for name, path, scale in adapters)


# --- model.yaml lora_targets ----------------------------------------------------------------

def lora_targets(model, num_layers: int, q_out: int, kv_out: int, domain: str) -> List[list]:
    """Return model.yaml's lora_targets: [layer, role, node, first column] per projection.

    model: the ONNX graph just built; only its KQuantMatMul nodes of `domain` (the op
    library's) take adapters, by name: `layers.{i}.attn.q_proj` (or the fused
    `attn.qkv_proj`: q, k, v one after the other), `attn.o_proj`, `mlp.gate_proj` /
    `mlp.up_proj` (or the fused `mlp.gate_up_proj`), `mlp.down_proj`.
    """
    n_attr = {}
    for node in model.graph.node:
        if node.op_type == KQUANT_MATMUL and node.domain == domain:
            n_attr[node.name] = next(int(a.i) for a in node.attribute if a.name == 'N')
    out: List[list] = []
    for i in range(num_layers):
        p = f'layers.{i}'
        for role in ('q', 'k', 'v'):
            if f'{p}.attn.{role}_proj' in n_attr:
                out.append([i, role, f'{p}.attn.{role}_proj', 0])
        if f'{p}.attn.qkv_proj' in n_attr:
            for role, col in (('q', 0), ('k', q_out), ('v', q_out + kv_out)):
                out.append([i, role, f'{p}.attn.qkv_proj', col])
        for role, name in (('o', 'attn.o_proj'), ('gate', 'mlp.gate_proj'),
                           ('up', 'mlp.up_proj'), ('down', 'mlp.down_proj')):
            if f'{p}.{name}' in n_attr:
                out.append([i, role, f'{p}.{name}', 0])
        fused = f'{p}.mlp.gate_up_proj'
        if fused in n_attr:
            out.append([i, 'gate', fused, 0])
            out.append([i, 'up', fused, n_attr[fused] // 2])
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Convert one adapter for a model folder; print the converted folder."""
    p = argparse.ArgumentParser(prog='python -m edge_llm_ros.convert.lora',
                                description='Convert a LoRA GGUF or PEFT folder once for a '
                                            'converted model folder (numpy form).')
    p.add_argument('adapter', help='a LoRA GGUF (convert_lora_to_gguf.py) or a PEFT folder')
    p.add_argument('model_dir', help='the converted base model folder')
    p.add_argument('--out', default=None,
                   help='cache folder (default: <model folder>.adapters beside it)')
    p.add_argument('--name', default='', help="the adapter's name (default: its file's)")
    args = p.parse_args(argv)
    try:
        print(ensure_converted(args.adapter, args.model_dir, args.out, args.name))
    except (AdapterError, ModelLoadError) as exc:
        print(f'edge_llm_ros.convert.lora: {exc}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())

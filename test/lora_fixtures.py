"""Tiny random LoRA adapters, written as llama.cpp's convert_lora_to_gguf.py and PEFT do.

GGUF: general.type 'adapter', adapter.type 'lora', adapter.lora.alpha, and per projection
`blk.{i}.{name}.weight.lora_a` (numpy [rank, in]: ggml ne [in, rank]) and `.lora_b` (numpy
[out, rank]), Q/K B rows of a llama permuted for interleaved RoPE as the converter does.
PEFT: adapter_config.json + adapter_model.safetensors with HF names and HF (NEOX) row order.
"""
import json
import pathlib
from typing import Dict, Iterable, Tuple

import gguf
import numpy as np
from tiny_model import llama_cpp_permute, TinyDims

GGUF_NAMES = {'q': 'attn_q', 'k': 'attn_k', 'v': 'attn_v', 'o': 'attn_output',
              'gate': 'ffn_gate', 'up': 'ffn_up', 'down': 'ffn_down',
              'qkv': 'attn_qkv', 'gate_up': 'ffn_up'}   # phi3's fused tensors
FUSED_ROLES = ('qkv', 'o', 'gate_up', 'down')   # phi3's projections
PEFT_NAMES = {'q': 'self_attn.q_proj', 'k': 'self_attn.k_proj', 'v': 'self_attn.v_proj',
              'o': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj',
              'down': 'mlp.down_proj'}
ALL_ROLES = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')


def role_shape(dims: TinyDims, role: str) -> Tuple[int, int]:
    """Return (in, out) of a projection of the tiny model."""
    q, kv, h, f = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.hidden, \
        dims.intermediate
    return {'q': (h, q), 'k': (h, kv), 'v': (h, kv), 'o': (q, h), 'gate': (h, f), 'up': (h, f),
            'down': (f, h), 'qkv': (h, q + 2 * kv), 'gate_up': (h, 2 * f)}[role]


def random_pairs(dims: TinyDims, rank: int = 4, seed: int = 1, roles: Iterable[str] = ALL_ROLES,
                 std: float = 0.05) -> Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray]]:
    """Return {(layer, role): (A [rank, in], B [out, rank])} in HF (NEOX) row order."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in range(dims.layers):
        for role in roles:
            n_in, n_out = role_shape(dims, role)
            pairs[(i, role)] = (rng.normal(0, std, (rank, n_in)).astype(np.float32),
                                rng.normal(0, std, (n_out, rank)).astype(np.float32))
    return pairs


def write_lora_gguf(path, arch: str, dims: TinyDims, pairs, alpha: float = 8.0,
                    wtype: str = 'F32') -> pathlib.Path:
    """Write `pairs` as convert_lora_to_gguf.py would (tensors in `wtype`)."""
    qtype = gguf.GGMLQuantizationType[wtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, 'lora')
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for (i, role), (a, b) in sorted(pairs.items()):
        if arch == 'llama' and role in ('q', 'k'):
            b = llama_cpp_permute(b, dims.heads if role == 'q' else dims.kv_heads)
        for half, t in (('lora_a', a), ('lora_b', b)):
            name = f'blk.{i}.{GGUF_NAMES[role]}.weight.{half}'
            if wtype == 'F32':
                writer.add_tensor(name, t)
            else:
                writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype),
                                  raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


def write_peft(folder, model_type: str, pairs, rank: int, alpha: float = 8.0) -> pathlib.Path:
    """Write `pairs` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.numpy import save_file
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    roles = sorted({role for _, role in pairs})
    (folder / 'adapter_config.json').write_text(json.dumps({
        'peft_type': 'LORA', 'r': rank, 'lora_alpha': alpha, 'model_type': model_type,
        'target_modules': [PEFT_NAMES[r].split('.')[1] for r in roles]}))
    tensors = {}
    for (i, role), (a, b) in pairs.items():
        stem = f'base_model.model.model.layers.{i}.{PEFT_NAMES[role]}'
        tensors[f'{stem}.lora_A.weight'] = a
        tensors[f'{stem}.lora_B.weight'] = b
    save_file(tensors, str(folder / 'adapter_model.safetensors'))
    return folder

"""Read GGUF files and HF safetensors folders into one in-memory form for the converter.

Both readers expose the decoder as `ModelSpec` (hyper-parameters) plus `SourceTensor`s under
canonical keys ('embed', 'final_norm', 'lm_head', '{layer}.q', '{layer}.attn_norm', ...).
Weights are [out_features, in_features] with Q/K rows in NEOX order (HF's rotate_half
layout): llama.cpp permutes llama Q/K rows for its interleaved RoPE, so the GGUF reader undoes
that permutation (a row permutation, exact on quantized rows too).
"""
from dataclasses import dataclass, field
import json
import pathlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .architectures import (architecture, llama3_rope_factors, ROPE_SCALING_TYPES,
                            SUPPORTED_ARCHITECTURES)
from .errors import ModelLoadError, UnsupportedModelError

# GGML tensor types the converter accepts (each checked against llama.cpp in
# test_llama_cpp_parity); others are refused by name.
SUPPORTED_GGML_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0',
                        'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K', 'IQ4_NL', 'IQ4_XS')
LAYER_ROLES = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
_GGUF_LAYER = {'attn_norm': 'attn_norm.weight', 'ffn_norm': 'ffn_norm.weight',
               'q': 'attn_q.weight', 'k': 'attn_k.weight', 'v': 'attn_v.weight',
               'o': 'attn_output.weight', 'gate': 'ffn_gate.weight', 'up': 'ffn_up.weight',
               'down': 'ffn_down.weight', 'q_bias': 'attn_q.bias', 'k_bias': 'attn_k.bias',
               'v_bias': 'attn_v.bias', 'q_norm': 'attn_q_norm.weight',
               'k_norm': 'attn_k_norm.weight'}
_HF_LAYER = {'attn_norm': 'input_layernorm.weight', 'ffn_norm': 'post_attention_layernorm.weight',
             'q': 'self_attn.q_proj.weight', 'k': 'self_attn.k_proj.weight',
             'v': 'self_attn.v_proj.weight', 'o': 'self_attn.o_proj.weight',
             'gate': 'mlp.gate_proj.weight', 'up': 'mlp.up_proj.weight',
             'down': 'mlp.down_proj.weight', 'q_bias': 'self_attn.q_proj.bias',
             'k_bias': 'self_attn.k_proj.bias', 'v_bias': 'self_attn.v_proj.bias',
             'q_norm': 'self_attn.q_norm.weight', 'k_norm': 'self_attn.k_norm.weight'}


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a llama-family decoder."""

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tied_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3)
    # RoPE angle of frequency i at position p: p * rope_scale * theta**(-2i/d) / factors[i]
    # (llama.cpp's freq_scale and rope_freqs; Llama 3.1 scaling is the factors).
    rope_scale: float = 1.0
    rope_freq_factors: Optional[Tuple[float, ...]] = None


@dataclass
class SourceTensor:
    """One tensor as stored in the source: raw GGML blocks or a float array.

    `shape` is the logical numpy shape ([out, in] for matrices). For block types `data` is
    uint8 [rows, row_bytes]; for float types it is the array itself.
    """

    name: str
    qtype: str
    shape: Tuple[int, ...]
    data: np.ndarray

    def rows(self, start: int, stop: int) -> 'SourceTensor':
        """Rows [start, stop) of a matrix (blocks run along rows, so this is exact)."""
        return SourceTensor(self.name, self.qtype, (stop - start,) + tuple(self.shape[1:]),
                            self.data[start:stop])

    def dequantize(self) -> np.ndarray:
        """Return the tensor as float32 in its logical shape."""
        if self.qtype == 'F32':
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        if self.qtype == 'F16':
            return np.asarray(self.data).astype(np.float32).reshape(self.shape)
        if self.qtype == 'BF16' and self.data.dtype == np.uint16:
            return (self.data.astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        import gguf
        qtype = gguf.GGMLQuantizationType[self.qtype]
        return gguf.quants.dequantize(np.asarray(self.data), qtype).reshape(self.shape)


@dataclass
class Checkpoint:
    """A decoder checkpoint: spec, tensors by canonical key, and how to write its tokenizer."""

    spec: ModelSpec
    source_path: pathlib.Path
    tensors: Dict[str, SourceTensor]
    # write_tokenizer(out_dir) -> {'bos_token_id', 'eos_token_ids', 'add_bos_token'}
    write_tokenizer: Callable[[pathlib.Path], dict] = field(repr=False, default=None)

    def tensor(self, key: str) -> SourceTensor:
        """Return a tensor by canonical key; a missing one is a corrupt checkpoint."""
        try:
            return self.tensors[key]
        except KeyError:
            raise ModelLoadError(
                f'{self.source_path}: tensor {key!r} is missing; the checkpoint is incomplete '
                f'or not a {self.spec.architecture} decoder') from None

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds a tensor under `key`."""
        return key in self.tensors

    def source_types(self) -> List[str]:
        """Sorted tensor types of the matrices (what the quantization came from)."""
        return sorted({t.qtype for t in self.tensors.values() if len(t.shape) == 2})


def load_checkpoint(source: str) -> Checkpoint:
    """Open a GGUF file or an HF folder; raise ModelLoadError/UnsupportedModelError."""
    path = pathlib.Path(source).expanduser().resolve()
    if not path.exists():
        raise ModelLoadError(f'{path}: no such file or folder; give a .gguf file or an HF '
                             'folder with config.json and *.safetensors')
    try:
        return _load_hf(path) if path.is_dir() else _load_gguf(path)
    except (TypeError, ValueError, KeyError) as exc:
        # Metadata of an unexpected form (e.g. per-layer head counts) or a malformed header.
        raise UnsupportedModelError(f'{path}: cannot read the model description ({exc!r}); '
                                    'it is not a plain '
                                    f'{"/".join(SUPPORTED_ARCHITECTURES)} checkpoint') from exc


def unpermute_llama_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K permutation: interleaved pairs back to NEOX halves (axis 0)."""
    n = rows.shape[0]
    return (rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


# --- GGUF -----------------------------------------------------------------------------------

def _open_gguf(path: pathlib.Path):
    import gguf
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
        raise ModelLoadError(
            f'{path}: not a readable GGUF file ({exc}); the file is truncated or corrupt, '
            'download it again') from exc


def _field(reader, key: str, default=None, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelLoadError(f'GGUF metadata key {key!r} is missing; the file is not a '
                                 'complete llama.cpp model')
        return default
    value = f.contents()
    return value


def _load_gguf(path: pathlib.Path) -> Checkpoint:
    reader = _open_gguf(path)
    arch = _field(reader, 'general.architecture', required=True)
    family = architecture(arch, str(path))

    def key(k: str, default=None, required: bool = False):
        return _field(reader, f'{arch}.{k}', default, required)

    scaling = key('rope.scaling.type', 'none') or 'none'
    if scaling not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(
            f'{path}: RoPE scaling type {scaling!r} is not supported (supported: '
            f'{", ".join(ROPE_SCALING_TYPES)}, and Llama 3 rope_freqs); use a GGUF of the '
            'model without long-context scaling or one converted for its base context')
    # As llama.cpp: the factor applies whatever the type says (0 or absent: none).
    factor = float(key('rope.scaling.factor', 0.0) or key('rope.scale_linear', 0.0) or 0.0)
    hidden = int(key('embedding_length', required=True))
    heads = int(key('attention.head_count', required=True))
    kv_heads = int(key('attention.head_count_kv', heads))
    head_dim = int(key('attention.key_length', hidden // heads))
    rope_dims = int(key('rope.dimension_count', head_dim))
    if rope_dims != head_dim:
        raise UnsupportedModelError(f'{path}: partial rotary ({rope_dims} of {head_dim} dims) '
                                    'is not supported')
    tensors: Dict[str, SourceTensor] = {}
    names = {}
    for t in reader.tensors:
        names[t.name] = t
    layers = int(key('block_count', required=True))
    wanted = {'embed': 'token_embd.weight', 'final_norm': 'output_norm.weight',
              'lm_head': 'output.weight'}
    for i in range(layers):
        for role, suffix in _GGUF_LAYER.items():
            wanted[f'{i}.{role}'] = f'blk.{i}.{suffix}'
    for ckey, gname in wanted.items():
        t = names.get(gname)
        if t is None:
            continue
        tensors[ckey] = _gguf_tensor(path, t)
    if family.gguf_permuted_qk:
        # llama.cpp stored Q/K with interleaved RoPE pairs; bring them back to NEOX halves.
        for i in range(layers):
            for role, n in (('q', heads), ('k', kv_heads)):
                for k in (f'{i}.{role}', f'{i}.{role}_bias'):
                    if k in tensors:
                        st = tensors[k]
                        st.data = unpermute_llama_rows(np.asarray(st.data), n)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{path}: token_embd.weight is missing; the GGUF is incomplete')
    vocab = tensors['embed'].shape[0]
    spec = ModelSpec(
        architecture=arch,
        name=str(_field(reader, 'general.name', path.stem)),
        num_layers=layers, hidden_size=hidden,
        intermediate_size=int(key('feed_forward_length', required=True)),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        max_position_embeddings=int(key('context_length', 2048)),
        rope_theta=_f32(key('rope.freq_base', 10000.0)),
        rms_norm_eps=_f32(key('attention.layer_norm_rms_epsilon', 1e-5)),
        tied_embeddings='lm_head' not in tensors,
        attention_bias='0.q_bias' in tensors, qk_norm=family.qk_norm,
        rope_scale=1.0 / factor if factor else 1.0,
        rope_freq_factors=_rope_freqs(path, names.get('rope_freqs.weight'), head_dim))

    def write_tokenizer(out_dir: pathlib.Path) -> dict:
        return _write_gguf_tokenizer(reader, out_dir)

    ckpt = Checkpoint(spec, path, tensors, write_tokenizer)
    _check_shapes(ckpt)
    return ckpt


def _rope_freqs(path: pathlib.Path, t, head_dim: int) -> Optional[Tuple[float, ...]]:
    """Read a GGUF's rope_freqs tensor (per-frequency RoPE divisors), if it has one."""
    if t is None:
        return None
    factors = _gguf_tensor(path, t).dequantize().reshape(-1)
    if factors.shape[0] != head_dim // 2 or not (np.isfinite(factors).all() and
                                                 (factors > 0).all()):
        raise ModelLoadError(f'{path}: tensor rope_freqs.weight has {factors.shape[0]} '
                             f'values, expected {head_dim // 2} positive ones (head_dim / 2); '
                             'the GGUF contradicts its own header: convert the model again')
    return tuple(float(f) for f in factors)


def _f32(value) -> float:
    """Return a GGUF float32 as its shortest round-trip decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _gguf_tensor(path: pathlib.Path, t) -> SourceTensor:
    qname = t.tensor_type.name
    if qname not in SUPPORTED_GGML_TYPES:
        raise UnsupportedModelError(
            f'{path}: tensor {t.name} has type {qname}, which the converter does not read '
            f'(supported: {", ".join(SUPPORTED_GGML_TYPES)}); pick a GGUF quantized as '
            'Q4_0/Q4_1/Q4_K_M/Q8_0 or re-quantize it with llama-quantize')
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = t.data
    expected = t.n_bytes
    if data.nbytes != expected:
        raise ModelLoadError(f'{path}: tensor {t.name} is truncated ({data.nbytes} of '
                             f'{expected} bytes); download the file again')
    if qname == 'BF16':
        data = data.view(np.uint16)
    return SourceTensor(t.name, qname, shape, data)


def _write_gguf_tokenizer(reader, out_dir: pathlib.Path) -> dict:
    from .gguf_tokenizer import write_tokenizer_files
    specials = write_tokenizer_files(reader, out_dir) or {}
    bos = specials.get('bos_token_id', _field(reader, 'tokenizer.ggml.bos_token_id'))
    eos_ids: List[int] = list(specials.get('eos_token_ids', []))
    for k in ('tokenizer.ggml.eos_token_id', 'tokenizer.ggml.eot_token_id',
              'tokenizer.ggml.eom_token_id'):
        v = _field(reader, k)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    add_bos = specials.get('add_bos_token', _field(reader, 'tokenizer.ggml.add_bos_token', False))
    return {'bos_token_id': None if bos is None else int(bos),
            'eos_token_ids': [int(e) for e in eos_ids], 'add_bos_token': bool(add_bos)}


# --- HF safetensors ---------------------------------------------------------------------------

def _load_hf(folder: pathlib.Path) -> Checkpoint:
    cfg_path = folder / 'config.json'
    if not cfg_path.is_file():
        raise ModelLoadError(f'{folder}: config.json is missing; an HF checkpoint folder needs '
                             'config.json, *.safetensors and tokenizer.json')
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f'{cfg_path}: not valid JSON ({exc})') from exc
    arch = cfg.get('model_type')
    family = architecture(arch, f'{folder} (model_type)')
    if cfg.get('hidden_act', 'silu') != 'silu':
        raise UnsupportedModelError(f'{folder}: activation {cfg["hidden_act"]!r} is not '
                                    'supported (only SiLU/SwiGLU)')
    files = sorted(folder.glob('*.safetensors'))
    if not files:
        raise ModelLoadError(f'{folder}: no *.safetensors files; PyTorch .bin checkpoints are '
                             'not read (convert them to safetensors first)')
    raw = _read_safetensors(files)
    heads = int(cfg['num_attention_heads'])
    hidden = int(cfg['hidden_size'])
    head_dim = int(cfg.get('head_dim') or hidden // heads)
    theta = float(cfg.get('rope_theta', 10000.0))
    rope_scale, factors = _hf_rope_scaling(folder, cfg.get('rope_scaling'), head_dim, theta)
    wanted = {'embed': 'model.embed_tokens.weight', 'final_norm': 'model.norm.weight',
              'lm_head': 'lm_head.weight'}
    layers = int(cfg['num_hidden_layers'])
    for i in range(layers):
        for role, suffix in _HF_LAYER.items():
            wanted[f'{i}.{role}'] = f'model.layers.{i}.{suffix}'
    tensors = {k: raw[n] for k, n in wanted.items() if n in raw}
    tied = bool(cfg.get('tie_word_embeddings', False)) or 'lm_head' not in tensors
    if tied:
        tensors.pop('lm_head', None)
    if 'embed' not in tensors:
        raise ModelLoadError(f'{folder}: model.embed_tokens.weight is missing')
    spec = ModelSpec(
        architecture=arch, name=folder.name, num_layers=layers, hidden_size=hidden,
        intermediate_size=int(cfg['intermediate_size']), num_heads=heads,
        num_kv_heads=int(cfg.get('num_key_value_heads', heads)), head_dim=head_dim,
        vocab_size=tensors['embed'].shape[0],
        max_position_embeddings=int(cfg.get('max_position_embeddings', 2048)),
        rope_theta=theta, rms_norm_eps=float(cfg.get('rms_norm_eps', 1e-6)),
        tied_embeddings=tied, attention_bias='0.q_bias' in tensors, qk_norm=family.qk_norm,
        rope_scale=rope_scale, rope_freq_factors=factors)

    def write_tokenizer(out_dir: pathlib.Path) -> dict:
        return _write_hf_tokenizer(folder, cfg, out_dir)

    ckpt = Checkpoint(spec, folder, tensors, write_tokenizer)
    _check_shapes(ckpt)
    return ckpt


def _hf_rope_scaling(folder: pathlib.Path, scaling: Optional[dict], head_dim: int,
                     theta: float) -> Tuple[float, Optional[Tuple[float, ...]]]:
    """Return (rope_scale, freq factors) for an HF config's rope_scaling.

    As llama.cpp's converter turns it into GGUF metadata (linear: freq_scale; llama3:
    rope_freqs).
    """
    kind = (scaling or {}).get('rope_type', (scaling or {}).get('type')) or 'default'
    if kind == 'default':
        return 1.0, None
    if kind == 'linear':
        return 1.0 / float(scaling['factor']), None
    if kind == 'llama3':
        return 1.0, llama3_rope_factors(
            head_dim, theta, float(scaling['factor']), float(scaling['low_freq_factor']),
            float(scaling['high_freq_factor']),
            int(scaling['original_max_position_embeddings']))
    raise UnsupportedModelError(f'{folder}: rope_scaling type {kind!r} is not supported '
                                '(supported: default, linear, llama3); use a checkpoint '
                                'without it')


def _read_safetensors(files: List[pathlib.Path]) -> Dict[str, SourceTensor]:
    try:
        from safetensors import deserialize, safe_open
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelLoadError('reading HF checkpoints needs the `safetensors` package: '
                             'pip install safetensors') from exc
    out: Dict[str, SourceTensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework='numpy') as sf:
                keys = list(sf.keys())
                dtypes = {k: sf.get_slice(k).get_dtype() for k in keys}
                for k in keys:
                    if dtypes[k] in ('F32', 'F16'):
                        arr = sf.get_tensor(k)
                        out[k] = SourceTensor(k, dtypes[k], tuple(arr.shape), arr)
            if any(d == 'BF16' for d in dtypes.values()):
                # numpy has no bfloat16: take the raw bytes from the library and widen them.
                for name, info in deserialize(f.read_bytes()):
                    if info['dtype'] == 'BF16':
                        arr = np.frombuffer(info['data'], dtype=np.uint16)
                        out[name] = SourceTensor(name, 'BF16', tuple(info['shape']),
                                                 arr.reshape(info['shape']))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f'{f}: not a readable safetensors file ({exc}); download it '
                                 'again') from exc
        unsupported = {k: d for k, d in dtypes.items() if d not in ('F32', 'F16', 'BF16')}
        if unsupported:
            name, dtype = next(iter(unsupported.items()))
            raise UnsupportedModelError(f'{f}: tensor {name} has dtype {dtype}; only F32/F16/'
                                        'BF16 safetensors are converted')
    return out


def _write_hf_tokenizer(folder: pathlib.Path, cfg: dict, out_dir: pathlib.Path) -> dict:
    import shutil
    tok_json = folder / 'tokenizer.json'
    if not tok_json.is_file():
        raise ModelLoadError(f'{folder}: tokenizer.json is missing (a fast HF tokenizer is '
                             'needed; save it with transformers: tokenizer.save_pretrained)')
    shutil.copyfile(tok_json, out_dir / 'tokenizer.json')
    tcfg = {}
    if (folder / 'tokenizer_config.json').is_file():
        tcfg = json.loads((folder / 'tokenizer_config.json').read_text())
    template = tcfg.get('chat_template')
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
        by_name = {t.get('name'): t.get('template') for t in template}
        template = by_name.get('default') or next(iter(by_name.values()), None)
    if template is None and (folder / 'chat_template.jinja').is_file():
        template = (folder / 'chat_template.jinja').read_text()
    if template is None:
        raise ModelLoadError(f'{folder}: no chat template (tokenizer_config.json has no '
                             'chat_template); use an instruct checkpoint')
    (out_dir / 'chat_template.jinja').write_text(template)
    vocab = _hf_token_ids(tok_json)
    gen = {}
    if (folder / 'generation_config.json').is_file():
        gen = json.loads((folder / 'generation_config.json').read_text())

    def token_id(value):
        if isinstance(value, dict):
            value = value.get('content')
        return vocab.get(value) if isinstance(value, str) else value

    bos = gen.get('bos_token_id', cfg.get('bos_token_id', token_id(tcfg.get('bos_token'))))
    eos = gen.get('eos_token_id', cfg.get('eos_token_id'))
    eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    tok_eos = token_id(tcfg.get('eos_token'))
    if tok_eos is not None and tok_eos not in eos_ids:
        eos_ids.append(tok_eos)
    return {'bos_token_id': None if bos is None else int(bos),
            'eos_token_ids': [int(e) for e in eos_ids],
            'add_bos_token': bool(tcfg.get('add_bos_token', False))}


def _hf_token_ids(tok_json: pathlib.Path) -> Dict[str, int]:
    data = json.loads(tok_json.read_text())
    ids = dict(data.get('model', {}).get('vocab', {}) or {})
    for t in data.get('added_tokens', []):
        ids[t['content']] = t['id']
    return ids


# --- checks ------------------------------------------------------------------------------------

def _check_shapes(ckpt: Checkpoint) -> None:
    s = ckpt.spec
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    expect = {'embed': (s.vocab_size, s.hidden_size), 'final_norm': (s.hidden_size,)}
    if not s.tied_embeddings:
        expect['lm_head'] = (s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        expect.update({
            f'{i}.attn_norm': (s.hidden_size,), f'{i}.ffn_norm': (s.hidden_size,),
            f'{i}.q': (q_out, s.hidden_size), f'{i}.k': (kv_out, s.hidden_size),
            f'{i}.v': (kv_out, s.hidden_size), f'{i}.o': (s.hidden_size, q_out),
            f'{i}.gate': (s.intermediate_size, s.hidden_size),
            f'{i}.up': (s.intermediate_size, s.hidden_size),
            f'{i}.down': (s.hidden_size, s.intermediate_size)})
        if s.attention_bias:
            expect.update({f'{i}.q_bias': (q_out,), f'{i}.k_bias': (kv_out,),
                           f'{i}.v_bias': (kv_out,)})
        if s.qk_norm:
            expect.update({f'{i}.q_norm': (s.head_dim,), f'{i}.k_norm': (s.head_dim,)})
    for k, shape in expect.items():
        t = ckpt.tensor(k)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f'{ckpt.source_path}: tensor {t.name} has shape {t.shape}, '
                                 f"but the header's hyper-parameters need {shape}: the file "
                                 'contradicts itself; convert the model again')
        if len(shape) == 1 and t.qtype not in ('F32', 'F16', 'BF16'):
            raise UnsupportedModelError(f'{ckpt.source_path}: vector {t.name} is stored as '
                                        f'{t.qtype}; only float vectors are supported')

"""A readable NumPy forward pass of the llama/qwen2 decoder, used to check the ONNX graph.

Independent of the converter on purpose: it reads the GGUF with gguf's own reader and
dequantizer, keeps llama Q/K rows as llama.cpp stored them and applies RoPE the way llama.cpp
does for that architecture (interleaved pairs for llama, NEOX halves for qwen2); an HF folder
is read with safetensors and uses NEOX. Float32 throughout, one sequence, a growing KV cache.

    ref = ReferenceModel.from_gguf('model.gguf')
    cache = ref.new_cache()
    logits = ref.forward([1, 2, 3], cache)      # [3, vocab]
    logits = ref.forward([4], cache)            # [1, vocab], position 3
"""
from dataclasses import dataclass, field
import json
import pathlib
from typing import Dict, List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class ReferenceConfig:
    """Hyper-parameters the forward pass needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    rope_interleaved: bool  # True: rotate pairs (2i, 2i+1); False: halves (i, i + d/2)


@dataclass
class KVCache:
    """Per-layer keys/values, each [kv_heads, T, head_dim]."""

    keys: List[np.ndarray] = field(default_factory=list)
    values: List[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[1]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [S, C] -> x / rms(x) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool) -> np.ndarray:
    """Rotate x: [heads, S, D] by position-dependent angles."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)    # [D/2]
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]     # [S, D/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]                            # [H, S, D/2] each
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x1 * cos + x0 * sin
        return out
    x0, x1 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    """Return x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


class ReferenceModel:
    """Dense float32 decoder built from a dict of weights in [out, in] layout.

    Weight keys: embed, final_norm, lm_head (optional: tied), and per layer
    'L.attn_norm', 'L.ffn_norm', 'L.q', 'L.k', 'L.v', 'L.o', 'L.gate', 'L.up', 'L.down',
    optionally 'L.q_bias', 'L.k_bias', 'L.v_bias'.
    """

    def __init__(self, weights: Dict[str, np.ndarray], config: ReferenceConfig) -> None:
        self.w = weights
        self.cfg = config
        self.lm_head = weights.get('lm_head', weights['embed'])

    def new_cache(self) -> KVCache:
        """Return an empty KV cache."""
        return KVCache()

    def forward(self, ids: Sequence[int], cache: Optional[KVCache] = None,
                embeds: Optional[np.ndarray] = None) -> np.ndarray:
        """Run new tokens (embeds [E, C] first, then ids) and return logits [E + S, vocab]."""
        c, w = self.cfg, self.w
        cache = cache if cache is not None else self.new_cache()
        x = w['embed'][np.asarray(ids, dtype=np.int64)]                  # [S, C]
        if embeds is not None and len(embeds):
            x = np.concatenate([np.asarray(embeds, np.float32), x], axis=0)
        s = x.shape[0]
        past = cache.length
        positions = np.arange(past, past + s)
        group = c.num_heads // c.num_kv_heads
        # causal mask over [new queries, past + new keys]
        mask = np.triu(np.full((s, past + s), -np.inf, np.float32), k=past + 1)
        for i in range(c.num_layers):
            p = f'{i}.'
            h = rms_norm(x, w[p + 'attn_norm'], c.rms_norm_eps)
            q = h @ w[p + 'q'].T + w.get(p + 'q_bias', 0)                # [S, H*D]
            k = h @ w[p + 'k'].T + w.get(p + 'k_bias', 0)                # [S, KV*D]
            v = h @ w[p + 'v'].T + w.get(p + 'v_bias', 0)
            q = q.reshape(s, c.num_heads, c.head_dim).transpose(1, 0, 2)    # [H, S, D]
            k = k.reshape(s, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)  # [KV, S, D]
            v = v.reshape(s, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
            q = rope(q, positions, c.rope_theta, c.rope_interleaved)
            k = rope(k, positions, c.rope_theta, c.rope_interleaved)
            if len(cache.keys) <= i:
                cache.keys.append(k)
                cache.values.append(v)
            else:
                cache.keys[i] = np.concatenate([cache.keys[i], k], axis=1)
                cache.values[i] = np.concatenate([cache.values[i], v], axis=1)
            keys = np.repeat(cache.keys[i], group, axis=0)               # [H, T, D]
            values = np.repeat(cache.values[i], group, axis=0)
            att = q @ keys.transpose(0, 2, 1) / np.sqrt(c.head_dim)      # [H, S, T]
            att = att + mask
            att = np.exp(att - att.max(axis=-1, keepdims=True))
            att = att / att.sum(axis=-1, keepdims=True)
            y = (att @ values).transpose(1, 0, 2).reshape(s, -1)        # [S, H*D]
            x = x + y @ w[p + 'o'].T
            h = rms_norm(x, w[p + 'ffn_norm'], c.rms_norm_eps)
            x = x + (silu(h @ w[p + 'gate'].T) * (h @ w[p + 'up'].T)) @ w[p + 'down'].T
        x = rms_norm(x, w['final_norm'], c.rms_norm_eps)
        return x @ self.lm_head.T                                        # [S, vocab]

    def greedy(self, ids: Sequence[int], n: int, stop_ids: Sequence[int] = ()) -> List[int]:
        """Greedy-decode up to n tokens after the prompt ids."""
        cache = self.new_cache()
        logits = self.forward(ids, cache)[-1]
        out: List[int] = []
        for _ in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop_ids:
                break
            logits = self.forward([tok], cache)[-1]
        return out

    # --- loaders -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path) -> 'ReferenceModel':
        """Dequantize every tensor of a llama/qwen2 GGUF with gguf's dequantizer."""
        import gguf
        reader = gguf.GGUFReader(str(path))
        arch = reader.fields['general.architecture'].contents()

        def meta(key, default=None):
            f = reader.fields.get(f'{arch}.{key}')
            return default if f is None else f.contents()

        names = {'token_embd.weight': 'embed', 'output_norm.weight': 'final_norm',
                 'output.weight': 'lm_head'}
        layer = {'attn_norm.weight': 'attn_norm', 'ffn_norm.weight': 'ffn_norm',
                 'attn_q.weight': 'q', 'attn_k.weight': 'k', 'attn_v.weight': 'v',
                 'attn_output.weight': 'o', 'ffn_gate.weight': 'gate', 'ffn_up.weight': 'up',
                 'ffn_down.weight': 'down', 'attn_q.bias': 'q_bias', 'attn_k.bias': 'k_bias',
                 'attn_v.bias': 'v_bias'}
        weights = {}
        for t in reader.tensors:
            if t.name in names:
                key = names[t.name]
            else:
                _, idx, rest = t.name.split('.', 2)
                key = f'{idx}.{layer[rest]}'
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            weights[key] = np.asarray(arr, np.float32).reshape(shape)
        heads = int(meta('attention.head_count'))
        cfg = ReferenceConfig(
            num_layers=int(meta('block_count')), num_heads=heads,
            num_kv_heads=int(meta('attention.head_count_kv', heads)),
            head_dim=int(meta('embedding_length')) // heads,
            rope_theta=float(meta('rope.freq_base', 10000.0)),
            rms_norm_eps=float(meta('attention.layer_norm_rms_epsilon', 1e-5)),
            # llama.cpp ropes llama in interleaved pairs (and permuted Q/K rows to match);
            # qwen2 uses NEOX halves.
            rope_interleaved=(arch == 'llama'))
        return cls(weights, cfg)

    @classmethod
    def from_hf(cls, folder) -> 'ReferenceModel':
        """Read an HF llama/qwen2 folder (F32/F16 safetensors); NEOX RoPE."""
        from safetensors.numpy import load_file
        folder = pathlib.Path(folder)
        cfg = json.loads((folder / 'config.json').read_text())
        raw: Dict[str, np.ndarray] = {}
        for f in sorted(folder.glob('*.safetensors')):
            raw.update(load_file(str(f)))
        names = {'model.embed_tokens.weight': 'embed', 'model.norm.weight': 'final_norm',
                 'lm_head.weight': 'lm_head'}
        layer = {'input_layernorm.weight': 'attn_norm',
                 'post_attention_layernorm.weight': 'ffn_norm',
                 'self_attn.q_proj.weight': 'q', 'self_attn.k_proj.weight': 'k',
                 'self_attn.v_proj.weight': 'v', 'self_attn.o_proj.weight': 'o',
                 'mlp.gate_proj.weight': 'gate', 'mlp.up_proj.weight': 'up',
                 'mlp.down_proj.weight': 'down', 'self_attn.q_proj.bias': 'q_bias',
                 'self_attn.k_proj.bias': 'k_bias', 'self_attn.v_proj.bias': 'v_bias'}
        weights = {}
        for name, arr in raw.items():
            if name in names:
                key = names[name]
            else:
                idx, rest = name[len('model.layers.'):].split('.', 1)
                key = f'{idx}.{layer[rest]}'
            weights[key] = arr.astype(np.float32)
        if cfg.get('tie_word_embeddings'):
            weights.pop('lm_head', None)
        heads = int(cfg['num_attention_heads'])
        conf = ReferenceConfig(
            num_layers=int(cfg['num_hidden_layers']), num_heads=heads,
            num_kv_heads=int(cfg.get('num_key_value_heads', heads)),
            head_dim=int(cfg.get('head_dim') or cfg['hidden_size'] // heads),
            rope_theta=float(cfg.get('rope_theta', 10000.0)),
            rms_norm_eps=float(cfg.get('rms_norm_eps', 1e-6)), rope_interleaved=False)
        return cls(weights, conf)


def main(argv: Optional[List[str]] = None) -> int:
    """Greedy-decode prompts with the reference and print JSON (tests run it in a subprocess).

    Run it with OPENBLAS_NUM_THREADS=1: on a busy 2-core machine OpenBLAS's thread hand-offs
    make each mid-sized matvec ~15 ms instead of ~0.05 ms.
    """
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument('model', help='a .gguf file or an HF folder')
    p.add_argument('--prompt', action='append', default=[], metavar='ID,ID,...',
                   help='prompt token ids (repeatable)')
    p.add_argument('--tokens', type=int, default=32, help='tokens to generate per prompt')
    p.add_argument('--stop', default='', metavar='ID,ID,...', help='stop token ids')
    p.add_argument('--logits-out', default='', help='save the logits of every step (.npz)')
    args = p.parse_args(argv)
    path = pathlib.Path(args.model)
    ref = ReferenceModel.from_hf(path) if path.is_dir() else ReferenceModel.from_gguf(path)
    stop = [int(t) for t in args.stop.split(',') if t]
    results, saved = [], {}
    for n, text in enumerate(args.prompt):
        ids = [int(t) for t in text.split(',') if t]
        cache = ref.new_cache()
        logits = ref.forward(ids, cache)[-1]
        steps, out = [logits], []
        for _ in range(args.tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop or len(out) == args.tokens:
                break
            logits = ref.forward([tok], cache)[-1]
            steps.append(logits)
        results.append(out)
        saved[f'prompt{n}'] = np.stack(steps)
    if args.logits_out:
        np.savez(args.logits_out, **saved)
    print(json.dumps({'tokens': results}))
    return 0


if __name__ == '__main__':
    import sys
    sys.exit(main())

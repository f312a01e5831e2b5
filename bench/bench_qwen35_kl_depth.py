"""How the KL between llama.cpp and this engine grows with depth on random-weight qwen35 layers.

    .venv/bin/python bench/bench_qwen35_kl_depth.py --layers 4,8,16,24 --wtype Q4_K \
        --json-out bench/results/bench_qwen35_kl_depth.json

Qwen3.5-0.8B's layer shapes (test_qwen35's QWEN35_08B_DIMS / _GDN: DeltaNet, DeltaNet,
DeltaNet, attention, repeated) with random weights of --wtype, the tiny vocabulary, 1 thread.
Per depth, over the prompt's last position and 8 teacher-forced steps of llama.cpp's greedy
path, KL (nats, mean and max) of:
- `llama_ours`: llama.cpp (float32 KV cache, as the parity tests) against ours (kquant);
- `exact_llama`, `exact_ours`: the float64 transcription of llama.cpp's graph
  (test_qwen35.Reference, without activation rounding) against each side;
and three llama.cpp-against-itself controls, none of which changes the model:
- `llama_ulp`: blk.0.attn_norm.weight scaled by 1 + 2^-22 (a 1-2 ulp change of one vector);
- `llama_tokenwise`: the prompt fed one token at a time (DeltaNet's recurrent form instead of
  its chunked one; the ids are the same);
- `llama_f16kv`: llama.cpp's default float16 KV cache (what bench_models' peer runs).
Each row of llama.cpp's and our logits feeds its matmuls' activations to Q8_K (8-bit)
rounding; a float difference of a few ulps flips one rounding now and then, the flip moves
its row by ~1e-3 and the recurrent state and later layers carry it on. The controls measure
how far that alone takes llama.cpp from itself at each depth (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 8


def _llama(peer: str, runner: pathlib.Path, path: pathlib.Path, out: pathlib.Path,
           prompt: List[int], follow: List[int], kv: str = 'f32') -> np.ndarray:
    """Run llama.cpp on prompt, then follow one id at a time; return its logits rows."""
    subprocess.run([peer, str(runner), str(path), str(out), '--prompt',
                    ','.join(map(str, prompt)), '--tokens', str(len(follow)), '--follow',
                    ','.join(map(str, follow)), '--kv', kv], check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS='1'))
    return np.load(out)['logits']


def _perturbed(path: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    """Copy path with blk.0.attn_norm.weight scaled by 1 + 2^-22."""
    import gguf
    out = work / f'{path.stem}-ulp.gguf'
    shutil.copy(path, out)
    reader = gguf.GGUFReader(str(out), 'r+')
    t = next(t for t in reader.tensors if t.name == 'blk.0.attn_norm.weight')
    t.data[:] = (t.data * np.float32(1 + 2 ** -22)).astype(np.float32)
    reader.data.flush()
    return out


def measure(layers: int, wtype: str, work: pathlib.Path) -> Dict[str, object]:
    """Return the KLs of one depth (mean, max) and the logits' peak."""
    from gguf_fixtures import QWEN35_08B_DIMS, QWEN35_08B_GDN, qwen35_case, write_qwen35_gguf
    from llama_cpp_parity import (converted, engine_logits, kl_divergence, llama_cpp_greedy,
                                  peer_python, PROMPT, RUNNER)
    from test_qwen35 import Reference
    dims = dataclasses.replace(QWEN35_08B_DIMS, layers=layers)
    path = write_qwen35_gguf(work / f'qwen35-{wtype}-{layers}.gguf',
                             qwen35_case(wtype, dims=dims, chain=0.0), QWEN35_08B_GDN)
    ref, tokens = llama_cpp_greedy(path, work / f'{path.stem}.npz', tokens=STEPS)
    follow = tokens[:STEPS]
    exact = Reference(path, dims, QWEN35_08B_GDN).logits(
        list(PROMPT) + follow)[len(PROMPT) - 1:]
    ours = engine_logits(converted(path, work, accuracy_level=4, weights='kquant'),
                         PROMPT, follow)
    peer = peer_python()
    controls = {
        'llama_ulp': _llama(peer, RUNNER, _perturbed(path, work), work / 'ulp.npz',
                            list(PROMPT), follow),
        'llama_tokenwise': _llama(peer, RUNNER, path, work / 'tok.npz', [PROMPT[0]],
                                  list(PROMPT[1:]) + follow)[len(PROMPT) - 1:],
        'llama_f16kv': _llama(peer, RUNNER, path, work / 'f16.npz', list(PROMPT), follow,
                              kv='f16')}
    pairs = {'llama_ours': (ref, ours), 'exact_llama': (exact, ref), 'exact_ours': (exact, ours),
             **{k: (ref, v) for k, v in controls.items()}}
    row: Dict[str, object] = {'layers': layers, 'wtype': wtype,
                              'peak_logit': float(np.abs(exact).max())}
    for name, (p, q) in pairs.items():
        kl = kl_divergence(p, q)
        row[name] = {'mean': float(kl.mean()), 'max': float(kl.max())}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--layers', default='4,8,16,24',
                   help='comma-separated depths (multiples of 4: each needs an attention layer)')
    p.add_argument('--wtype', default='Q4_K', help="the matrices' GGUF type")
    p.add_argument('--json-out', help='write the rows here')
    args = p.parse_args(argv)
    depths = [int(x) for x in args.layers.split(',')]
    if any(d % 4 for d in depths):
        raise SystemExit('--layers: use multiples of 4 (llama.cpp needs an attention layer)')
    sys.path.insert(0, str(ROOT / 'test'))
    rows = []
    with tempfile.TemporaryDirectory(prefix='qwen35-kl-') as tmp:
        for layers in depths:
            row = measure(layers, args.wtype, pathlib.Path(tmp))
            rows.append(row)
            print(' | '.join([str(layers)] + [f"{k} {v['mean']:.1e}/{v['max']:.1e}"
                                              for k, v in row.items()
                                              if isinstance(v, dict)]), flush=True)
    if args.json_out:
        pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json_out).write_text(json.dumps(rows, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())

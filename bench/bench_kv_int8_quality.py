"""Issue 39: what kv.dtype int8 costs in accuracy, against our float32 KV and llama.cpp's q8_0.

    .venv/bin/python bench/bench_kv_int8_quality.py [--prompt-tokens 256] [--tokens 64]
        [--json-out bench/results/bench_kv_int8_quality.json]

On the embedded SmolLM2-135M (its GGUF for llama.cpp, the converted folder for us): four
runs over the same prompt ids (bench_models.prompt_ids), each greedy for --tokens tokens:
ours with float32 KV, ours with int8 KV (model_kv_int8.onnx, in a hard-linked copy of the
folder), llama.cpp with an f32 KV cache (flash attention off) and with a q8_0 one (flash
attention on), through test/llama_cpp_runner.py in bench/llama_peer.py's venv. Reported:
- greedy agreement: the tokens each run generates, the length of the common prefix with our
  float32 run and the share of equal positions;
- mean KL (nats) per position with every run fed our float32 run's tokens (teacher forcing,
  so the rows compare): ours int8 against ours float32, against llama.cpp q8_0 and f32, and
  for scale ours float32 against llama.cpp f32 and llama.cpp q8_0 against its f32.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import subprocess
import sys
import tempfile
from typing import Dict, List, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
RUNNER = ROOT / 'test' / 'llama_cpp_runner.py'
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_kv_int8_quality.json'


def ours(model_dir: str, kv_dtype: str, prompt: Sequence[int], tokens: int,
         follow: Sequence[int] = ()) -> Dict:
    """Our decoder: logits after the prompt and after each next id (greedy, or `follow`)."""
    from edge_llm_ros.model_format import load_model_info
    from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
    from edge_llm_ros.runtime.rows import decode_row, Row
    decoder = OnnxDecoder(model_dir, load_model_info(model_dir), SessionConfig(
        intra_op_threads=2, max_context=len(prompt) + tokens + 1, kv_dtype=kv_dtype))
    rows = [decoder.run([Row(0, 0, np.asarray(prompt, np.int64))])[0].copy()]
    out: List[int] = []
    while len(out) < tokens:
        out.append(int(follow[len(out)]) if follow else int(rows[-1].argmax()))
        rows.append(decoder.run([decode_row(0, out[-1], len(prompt) + len(out) - 1)])[0].copy())
    return {'logits': np.stack(rows), 'tokens': out}


def llama_cpp(python: str, gguf: str, kv: str, prompt: Sequence[int], tokens: int,
              work: pathlib.Path, follow: Sequence[int] = ()) -> Dict:
    """llama.cpp through test/llama_cpp_runner.py (f32 or q8_0 KV cache)."""
    out = work / f'llama-{kv}-{"forced" if follow else "greedy"}.npz'
    cmd = [python, str(RUNNER), gguf, str(out), '--prompt', ','.join(map(str, prompt)),
           '--tokens', str(tokens), '--kv', kv, '--threads', '2',
           '--ctx', str(len(prompt) + tokens + 8)]
    if follow:
        cmd += ['--follow', ','.join(map(str, follow))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f'llama.cpp ({kv}) failed: {proc.stderr[-2000:]}')
    data = np.load(out)
    return {'logits': data['logits'], 'tokens': [int(t) for t in data['tokens']]}


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over rows of KL(softmax(p) || softmax(q)), in nats."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


def agreement(a: Sequence[int], b: Sequence[int]) -> Dict:
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {'common_prefix': prefix,
            'equal_share': float(np.mean([x == y for x, y in zip(a, b)]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--prompt-tokens', type=int, default=256)
    p.add_argument('--tokens', type=int, default=64)
    p.add_argument('--json-out', default=str(DEFAULT_JSON))
    args = p.parse_args(argv)
    from edge_llm_ros.convert import default_model
    from edge_llm_ros.convert.kv_int8_graph import linked_folder
    model_dir = default_model.ensure_default_model()
    gguf = str(default_model.ensure_default_gguf())
    prompt = importlib.import_module('bench_models').prompt_ids(str(model_dir),
                                                                args.prompt_tokens)
    prompt = prompt[:args.prompt_tokens]
    python = importlib.import_module('llama_peer').ensure_peer(install=True)['python']
    with tempfile.TemporaryDirectory(prefix='kv_int8_quality_') as tmp:
        work = pathlib.Path(tmp)
        int8_dir = str(linked_folder(model_dir, work / 'model'))
        greedy = {'ours float32': ours(str(model_dir), 'float32', prompt, args.tokens),
                  'ours int8': ours(int8_dir, 'int8', prompt, args.tokens),
                  'llama.cpp f32': llama_cpp(python, gguf, 'f32', prompt, args.tokens, work),
                  'llama.cpp q8_0': llama_cpp(python, gguf, 'q8_0', prompt, args.tokens, work)}
        ref = greedy['ours float32']['tokens']
        forced = {'ours float32': greedy['ours float32'],
                  'ours int8': ours(int8_dir, 'int8', prompt, args.tokens, ref),
                  'llama.cpp f32': llama_cpp(python, gguf, 'f32', prompt, args.tokens, work,
                                             ref),
                  'llama.cpp q8_0': llama_cpp(python, gguf, 'q8_0', prompt, args.tokens,
                                              work, ref)}
    logits = {k: v['logits'] for k, v in forced.items()}
    pairs = [('ours float32', 'ours int8'), ('llama.cpp q8_0', 'ours int8'),
             ('llama.cpp f32', 'ours int8'), ('llama.cpp f32', 'ours float32'),
             ('llama.cpp f32', 'llama.cpp q8_0')]
    result = {'bench': 'bench_kv_int8_quality', 'model': str(model_dir), 'gguf': gguf,
              'prompt_tokens': len(prompt), 'tokens': args.tokens,
              'greedy': {k: {'tokens': v['tokens'], **agreement(ref, v['tokens'])}
                         for k, v in greedy.items()},
              'mean_kl_nats': {f'KL({a} || {b})': kl(logits[a], logits[b]) for a, b in pairs}}
    out = pathlib.Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f'SmolLM2-135M, {len(prompt)} prompt tokens, {args.tokens} greedy tokens')
    print('| run | common prefix with ours float32 | equal positions |')
    print('|---|---|---|')
    for name, row in result['greedy'].items():
        print(f"| {name} | {row['common_prefix']} | {row['equal_share']:.0%} |")
    print('\n| teacher-forced on ours float32 | mean KL (nats) |\n|---|---|')
    for name, value in result['mean_kl_nats'].items():
        print(f'| {name} | {value:.2e} |')
    return 0


if __name__ == '__main__':
    sys.exit(main())

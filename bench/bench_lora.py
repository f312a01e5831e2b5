"""LoRA adapters per goal (issue 43): decode cost against the base model and llama.cpp.

    .venv/bin/python bench/bench_lora.py [--threads 2] [--tokens 64] [--repeats 3]
        [--shape smollm2|qwen2-1.5b] [--json-out bench/results/bench_lora.json]

One run, same files, same threads, on the real SmolLM2 GGUF (converted with weights='kquant'),
or with --shape qwen2-1.5b on bench/make_random_gguf.py's random-weight Qwen2.5-1.5B GGUF at
its real shape (llama.cpp's Q4_K_M mix, converted with weights='kquant'; results in
bench/results/bench_lora_qwen2-1.5b.json unless --json-out says otherwise):

- single goal: decode tok/s with a rank-16 adapter on every projection (q, k, v, o, gate, up,
  down of every layer; random, F16, written as convert_lora_to_gguf.py does) against the
  base model: OnnxDecoder rows, one decode step a call, after a 32-token prompt; base and
  adapter take turns, best of --repeats;
- 4 goals at once: 4 rows a call, each with its own adapter, against 4 rows on the base;
- llama.cpp (the portable peer, bench/llama_peer.py) on the same GGUF and adapter file,
  greedy, same threads, through the C API (llama_decode one token a call, as
  test/llama_cpp_runner.py drives it): decode tok/s with and without the adapter;
- adapter conversion time (once per adapter and base: GGUF read, laid out, numpy form
  written; convert/lora.py), load time (numpy form read, checked, registered) and resident
  memory per adapter.

Targets (judged here, never in tests): adapter >= 0.9x base; 4 adapters >= 0.85x 4 base;
ours with the adapter >= 1.0x llama.cpp with it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'bench'))
sys.path.insert(0, str(ROOT / 'test'))
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_lora.json'
WORK = ROOT / '.cache' / 'bench_lora'
RANK = 16
SMOLLM2_FFN = 1536   # SmolLM2-135M's feed_forward_length (model.yaml does not keep it)
SHAPES = ('smollm2', 'qwen2-1.5b')   # the real SmolLM2, make_random_gguf's Qwen2.5-1.5B
PROMPT = [1, 504, 3101, 314, 253, 4264, 30, 1551, 284, 9009, 22, 3049, 28, 260, 2114, 282,
          253, 1124, 2151, 30, 1551, 284, 9009, 22, 3049, 28, 260, 2114, 282, 253, 1124, 30]

PEER_CHILD = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec['test_dir'])
from llama_cpp_runner import load_model, set_adapters   # the parity tests' C-API helpers
model = load_model(spec['gguf'])
vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
out = {}
for label, lora in (('base', ''), ('lora', spec['lora'])):
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 256
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = spec['threads']
    best = 0.0
    for _ in range(spec['repeats']):
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if lora and not set_adapters(model, ctx, [lora + ':1.0']):
            sys.exit(2)
        ids = list(spec['prompt'])
        def step(ids):
            arr = (llama_cpp.llama_token * len(ids))(*ids)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids))) == 0
            ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))
        tok = step(ids)
        t0 = time.perf_counter()
        for _ in range(spec['tokens']):
            tok = step([tok])
        best = max(best, spec['tokens'] / (time.perf_counter() - t0))
        llama_cpp.llama_free(ctx)
    out[label] = {'tok_s': best}
print(json.dumps(out))
"""


def rss_kib() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))


def model_files(shape: str = 'smollm2') -> Tuple[pathlib.Path, pathlib.Path, int]:
    """Return the shape's GGUF, its kquant conversion (made once) and its n_ff."""
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.model_format import is_current, load_model_info
    if shape == 'smollm2':
        from edge_llm_ros.convert.default_model import ensure_default_gguf
        gguf, ffn = pathlib.Path(ensure_default_gguf()), SMOLLM2_FFN
    else:
        import make_random_gguf
        gguf = ROOT / '.cache' / 'random_gguf' / f'{shape}.gguf'   # bench_kquant's too
        if not gguf.is_file():
            print(f'bench_lora: writing {gguf}', file=sys.stderr, flush=True)
            make_random_gguf.write_random_gguf(gguf, shape)
        ffn = make_random_gguf.SHAPES[shape].ff
    folder = WORK / f'{shape}-kquant'
    # lora_targets: where adapters go (a folder converted before it lacks it)
    if not is_current(folder) or 'lora_targets' not in load_model_info(str(folder)).extra:
        print(f'bench_lora: converting {gguf} -> {folder}', file=sys.stderr, flush=True)
        convert(str(gguf), str(folder), weights='kquant', progress=False, overwrite=True)
    return gguf, folder, ffn


def write_adapters(info, n: int, ffn: int = SMOLLM2_FFN,
                   shape: str = 'smollm2') -> List[pathlib.Path]:
    from lora_fixtures import random_pairs, write_lora_gguf
    from tiny_model import TinyDims
    dims = TinyDims(hidden=info.hidden_size, layers=info.num_layers, heads=info.num_heads,
                    kv_heads=info.num_kv_heads, intermediate=ffn,
                    key_length=info.head_dim)
    paths = []
    for seed in range(1, n + 1):
        path = WORK / f'{shape}-r{RANK}-s{seed}.gguf'
        if not path.is_file():
            write_lora_gguf(path, info.architecture, dims,
                            random_pairs(dims, RANK, seed=seed, std=0.02), alpha=RANK,
                            wtype='F16')
        paths.append(path)
    return paths


def decode_tok_s(dec, uses: Sequence[tuple], tokens: int) -> float:
    """Decode tokens/s of len(uses) rows a call (row i with uses[i]) after the prompt."""
    import numpy as np

    from edge_llm_ros.runtime.rows import Row
    rows = [Row(s, 0, np.array(PROMPT, dtype=np.int64), lora=u) for s, u in enumerate(uses)]
    logits = dec.run(rows)
    t0 = time.perf_counter()
    for _ in range(tokens):
        rows = [Row(r.slot, r.start + r.length, np.array([int(np.argmax(logits[i]))]),
                    lora=r.lora) for i, r in enumerate(rows)]
        logits = dec.run(rows)
    return len(uses) * tokens / (time.perf_counter() - t0)


def ours(folder: pathlib.Path, adapters: List[pathlib.Path], threads: int, tokens: int,
         repeats: int) -> Dict:
    import tempfile

    from edge_llm_ros.convert.lora import ensure_converted
    from edge_llm_ros.model_format import load_model_info
    from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
    from edge_llm_ros.serving.adapters import Adapters
    info = load_model_info(str(folder))
    dec = OnnxDecoder(str(folder), info, SessionConfig(max_context=256, slots=4,
                                                       intra_op_threads=threads))
    store = Adapters(dec.enable_lora, info)
    loads = []
    cache = tempfile.mkdtemp(prefix='bench_lora_')   # a fresh cache: each adapter converts
    for i, path in enumerate(adapters):
        t0 = time.perf_counter()
        converted = ensure_converted(str(path), str(folder), cache)
        convert_s = time.perf_counter() - t0
        before = rss_kib()
        loaded = store.load(f'a{i}', converted)
        loads.append({'convert_seconds': round(convert_s, 3),
                      'seconds': round(loaded.load_seconds, 3),
                      'rss_mib': round((rss_kib() - before) / 1024, 1),
                      'pairs_mib': round(loaded.nbytes / 2 ** 20, 1),
                      'file_mib': round(path.stat().st_size / 2 ** 20, 1)})
    ids = [a.adapter_id for a in store.loaded()]
    cases = {'base_1': [()], 'lora_1': [((ids[0], 1.0),)],
             'base_4': [()] * 4, 'lora_4': [((i, 1.0),) for i in ids[:4]]}
    best = dict.fromkeys(cases, 0.0)
    for _ in range(repeats):
        for name, uses in cases.items():   # take turns: load drifts hit all alike
            best[name] = max(best[name], decode_tok_s(dec, uses, tokens))
    return {'tok_s': {k: round(v, 2) for k, v in best.items()}, 'loads': loads,
            'kernel': dec.kernel, 'max_rss_mib': round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def llama_cpp(gguf: pathlib.Path, adapter: pathlib.Path, threads: int, tokens: int,
              repeats: int) -> Dict:
    from llama_peer import ensure_peer
    peer = ensure_peer(install=True)
    spec = {'gguf': str(gguf), 'lora': str(adapter), 'threads': threads, 'tokens': tokens,
            'repeats': repeats, 'prompt': PROMPT, 'test_dir': str(ROOT / 'test')}
    done = subprocess.run([peer['python'], '-c', PEER_CHILD, json.dumps(spec)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        return {'error': done.stderr.strip().splitlines()[-1] if done.stderr else 'failed'}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--tokens', type=int, default=64)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--shape', choices=SHAPES, default='smollm2')
    p.add_argument('--json-out', default=None,
                   help=f'default {DEFAULT_JSON.relative_to(ROOT)} (SmolLM2), '
                   'bench/results/bench_lora_SHAPE.json (another shape)')
    args = p.parse_args(argv)
    if args.json_out is None:
        args.json_out = str(DEFAULT_JSON if args.shape == 'smollm2' else
                            DEFAULT_JSON.with_name(f'bench_lora_{args.shape}.json'))
    WORK.mkdir(parents=True, exist_ok=True)
    from edge_llm_ros.model_format import load_model_info
    gguf, folder, ffn = model_files(args.shape)
    adapters = write_adapters(load_model_info(str(folder)), 4, ffn, args.shape)
    model = ('SmolLM2-135M-Instruct Q4_1 (kquant)' if args.shape == 'smollm2' else
             f'{args.shape} random weights, Q4_K_M mix (make_random_gguf, kquant)')
    res = {'model': model, 'shape': args.shape, 'rank': RANK,
           'threads': args.threads, 'tokens': args.tokens, 'repeats': args.repeats,
           'ours': ours(folder, adapters, args.threads, args.tokens, args.repeats),
           'llama_cpp': llama_cpp(gguf, adapters[0], args.threads, args.tokens, args.repeats)}
    t, peer = res['ours']['tok_s'], res['llama_cpp']
    res['ratios'] = {'lora_vs_base': round(t['lora_1'] / t['base_1'], 3),
                     'lora4_vs_base4': round(t['lora_4'] / t['base_4'], 3)}
    if 'lora' in peer:
        res['ratios']['lora_vs_llama_cpp_lora'] = round(t['lora_1'] / peer['lora']['tok_s'], 3)
        res['ratios']['base_vs_llama_cpp_base'] = round(t['base_1'] / peer['base']['tok_s'], 3)
    print(json.dumps(res, indent=1))
    pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())

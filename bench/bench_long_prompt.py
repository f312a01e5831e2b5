"""Issue 39: cold prefill of long prompts, our engine vs llama.cpp on the same GGUF.

    .venv/bin/python bench/bench_long_prompt.py [--runs default=1024,2048,4096]
        [--runs qwen2-1.5b=1024,4096] [--threads 2] [--repeats 1] [--new-tokens 16]
        [--chunk 256] [--peer-batch 512] [--library LABEL=PATH ...] [--kv-dtype int8]
        [--json-out bench/results/bench_long_prompt.json]

Shapes (--runs SHAPE=LENGTHS, repeatable; default: default and qwen2-1.5b at 1k/2k/4k):
`default` is the embedded SmolLM2-135M (its real GGUF), the others bench/make_random_gguf.py's
random-weight GGUFs at real shapes (bench_batching.model_files writes and converts them once).

For each shape and prompt length, in one run so the ratios compare runs taken minutes apart:
our decoder (OnnxDecoder as the Engine loads it) prefills the prompt from position 0 into a
fresh slot in chunks of --chunk positions (the Engine's prefill_chunk), then takes
--new-tokens - 1 greedy decode steps at the prompt's end; llama.cpp (bench/llama_peer.py's
portable llama-cpp-python, C API) does the same on the same ids with the same threads, its
prompt in batches of --peer-batch (n_batch = n_ubatch), f16 KV cache as it defaults. With
--kv-dtype int8 our decoder keeps its KV in int8 (kv.dtype int8: model_kv_int8.onnx, written
into the model folder when missing) and llama.cpp its KV in q8_0 with flash attention. Each
side runs in its own process per repeat (a warm-up of 8 tokens first: "cold" is the prompt,
not the process). --library LABEL=PATH runs our side once per op library (EDGE_LLM_NATIVE_LIB,
e.g. a base commit's build next to this one): the rows say which; the sides alternate, the
order reversed every other repeat. The prompt is bench_models' (bench_engine's text repeated).

Prints markdown tables (prefill and decode tok/s, ours / llama.cpp: the medians, and with
--repeats > 1 the best runs, the least disturbed on a shared machine) and writes the JSON
after every shape. Timings are this shared machine's: read the ratios and the load averages.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
DEFAULT_RUNS = ('default=1024,2048,4096', 'qwen2-1.5b=1024,2048,4096')
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_long_prompt.json'
WARMUP_TOKENS = 8


class BenchFailed(RuntimeError):
    """A child (our side or llama.cpp) gave no result: the run stops, loudly."""


# --- the two sides, each in its own process ----------------------------------------------------
def ours_main(args) -> Dict:
    """Our decoder on one folder: a warm-up, then each prompt length cold (fresh positions)."""
    import numpy as np

    from edge_llm_ros.model_format import load_model_info
    from edge_llm_ros.runtime import native_ops
    from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
    from edge_llm_ros.runtime.rows import decode_row, Row
    ids = json.loads(args.prompt_ids)
    lengths = [int(n) for n in args.lengths.split(',')]
    info = load_model_info(args.model)
    decoder = OnnxDecoder(args.model, info, SessionConfig(
        intra_op_threads=args.threads, max_context=max(lengths) + args.new_tokens,
        kv_dtype=args.kv_dtype))

    def prefill(prompt: Sequence[int]) -> int:
        logits = None
        for start in range(0, len(prompt), args.chunk):
            chunk = np.asarray(prompt[start:start + args.chunk], np.int64)
            logits = decoder.run([Row(0, start, chunk)])
        return int(logits[0].argmax())

    prefill(ids[:WARMUP_TOKENS])
    out = []
    for n in lengths:
        t0 = time.perf_counter()
        tok = prefill(ids[:n])
        t1 = time.perf_counter()
        for i in range(args.new_tokens - 1):
            tok = int(decoder.run([decode_row(0, tok, n + i)])[0].argmax())
        t2 = time.perf_counter()
        out.append({'prompt_tokens': n, 'prefill_tok_s': n / (t1 - t0),
                    'decode_tok_s': (args.new_tokens - 1) / (t2 - t1)})
    path = native_ops.library_path()
    return {'engine': 'ours', 'library': str(path), 'kernel': decoder.kernel,
            'kv_dtype': args.kv_dtype, 'runs': out}


def peer_main(args) -> Dict:
    """llama.cpp on the GGUF (the C API, as bench_models.peer_main), each length cold."""
    import llama_cpp
    ids = json.loads(args.prompt_ids)
    lengths = [int(n) for n in args.lengths.split(',')]
    from bench_models import open_peer
    kv_type = 'q8_0' if args.kv_dtype == 'int8' else 'f16'
    model, ctx, n_vocab = open_peer(args.gguf, max(lengths) + args.new_tokens, args.peer_batch,
                                    args.threads, kv_type)
    memory = llama_cpp.llama_get_memory(ctx)

    def step(batch: List[int]) -> int:
        arr = (llama_cpp.llama_token * len(batch))(*batch)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(batch)))
        if rc != 0:
            raise SystemExit(f'llama_decode returned {rc}')
        row = llama_cpp.llama_get_logits_ith(ctx, -1)
        return _argmax(row, n_vocab)

    def prefill(prompt: Sequence[int]) -> int:
        tok = -1
        for start in range(0, len(prompt), args.peer_batch):
            tok = step(list(prompt[start:start + args.peer_batch]))
        return tok

    prefill(ids[:WARMUP_TOKENS])
    out = []
    for n in lengths:
        llama_cpp.llama_memory_clear(memory, True)
        t0 = time.perf_counter()
        tok = prefill(ids[:n])
        t1 = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            tok = step([tok])
        t2 = time.perf_counter()
        out.append({'prompt_tokens': n, 'prefill_tok_s': n / (t1 - t0),
                    'decode_tok_s': (args.new_tokens - 1) / (t2 - t1)})
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {'engine': f'llama-cpp-python {llama_cpp.__version__} (C API)', 'kv_type': kv_type,
            'runs': out}


def _argmax(row, n: int) -> int:
    import numpy as np
    return int(np.ctypeslib.as_array(row, shape=(n,)).argmax())


def run_child(python: str, side: str, argv: List[str], env: Optional[Dict] = None) -> Dict:
    """One side's measurement in its own process; BenchFailed when it gives no result."""
    proc = subprocess.run([python, __file__, '--child', side] + argv, capture_output=True,
                          text=True, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = '\n'.join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
    raise BenchFailed(f'{side} exited with {proc.returncode}:\n{tail}')


# --- one shape ---------------------------------------------------------------------------------
def measure_shape(shape: str, lengths: List[int], libraries: Dict[str, str], peer_python: str,
                  args) -> Dict:
    bench_batching = importlib.import_module('bench_batching')
    bench_models = importlib.import_module('bench_models')
    files = bench_batching.model_files(shape)
    ids = bench_models.prompt_ids(files['dir'], max(lengths))
    if len(ids) < max(lengths):
        raise BenchFailed(f'{shape}: the prompt has {len(ids)} ids, not {max(lengths)}')
    if args.kv_dtype == 'int8':   # a folder with the graph over int8 KV (cache left as is)
        from edge_llm_ros.convert.kv_int8_graph import linked_folder
        from edge_llm_ros.model_format import KV_INT8_MODEL_FILE
        if not (pathlib.Path(files['dir']) / KV_INT8_MODEL_FILE).exists():
            scratch = pathlib.Path(tempfile.mkdtemp(prefix='bench_long_prompt_'))
            atexit.register(shutil.rmtree, scratch, True)
            files = dict(files, dir=str(linked_folder(pathlib.Path(files['dir']),
                                                      scratch / shape)))
    common = ['--prompt-ids', json.dumps(ids), '--lengths', ','.join(map(str, lengths)),
              '--threads', str(args.threads), '--new-tokens', str(args.new_tokens),
              '--kv-dtype', args.kv_dtype]
    sides = list(libraries) + ['llama.cpp']
    runs: Dict[str, List[Dict]] = {side: [] for side in sides}
    load = {'start': os.getloadavg()}
    for i in range(args.repeats):
        for side in (sides if i % 2 == 0 else list(reversed(sides))):
            if side == 'llama.cpp':
                result = run_child(peer_python, 'peer', common + [
                    '--gguf', files['gguf'], '--peer-batch', str(args.peer_batch)])
            else:
                env = dict(os.environ)
                if libraries[side]:
                    env['EDGE_LLM_NATIVE_LIB'] = libraries[side]
                result = run_child(sys.executable, 'ours', common + [
                    '--model', files['dir'], '--chunk', str(args.chunk)], env)
            runs[side].append(result)
            print(f'bench_long_prompt: {shape} {side} repeat {i}: '
                  + ', '.join(f"{r['prompt_tokens']}: {r['prefill_tok_s']:.1f} / "
                              f"{r['decode_tok_s']:.1f} tok/s" for r in result['runs']),
                  file=sys.stderr, flush=True)
    load['end'] = os.getloadavg()
    rows = []
    for k, n in enumerate(lengths):
        row = {'prompt_tokens': n}
        for side in sides:
            for kind in ('prefill_tok_s', 'decode_tok_s'):
                row.setdefault(side, {})[kind] = [r['runs'][k][kind] for r in runs[side]]
        rows.append(summarize(row, libraries))
    return {'shape': shape, 'gguf': files['gguf'], 'model_dir': files['dir'],
            'libraries': {s: runs[s][0].get('library') for s in libraries},
            'kernel': runs[sides[0]][0].get('kernel'),
            'llama_cpp': runs['llama.cpp'][0]['engine'],
            'llama_cpp_kv': runs['llama.cpp'][0].get('kv_type', 'f16'), 'loadavg': load,
            'rows': rows}


def summarize(row: Dict, libraries: Sequence[str]) -> Dict:
    """Add each side's median and best tok/s and ours / llama.cpp of both to `row`."""
    for side in list(libraries) + ['llama.cpp']:
        for kind in ('prefill_tok_s', 'decode_tok_s'):
            row[side][kind + '_median'] = statistics.median(row[side][kind])
            row[side][kind + '_best'] = max(row[side][kind])
    for side in libraries:
        for kind in ('prefill', 'decode'):
            for stat in ('median', 'best'):
                row[side][f'{kind}_vs_llama_cpp_{stat}'] = (
                    row[side][f'{kind}_tok_s_{stat}'] / row['llama.cpp'][f'{kind}_tok_s_{stat}'])
    return row


def table(result: Dict, stat: str = 'median') -> str:
    """Markdown: one line per shape, prompt length and our library ('median' or 'best')."""
    lines = [f'| shape | prompt | ours | prefill tok/s ({stat}) ours / llama.cpp (ratio) | '
             f'decode tok/s after it ({stat}) ours / llama.cpp (ratio) |',
             '|---|---|---|---|---|']
    for shape in result['shapes']:
        for row in shape['rows']:
            peer = row['llama.cpp']
            for side in result['libraries']:
                ours = row[side]
                cells = []
                for kind in ('prefill', 'decode'):
                    cells.append(f"{ours[f'{kind}_tok_s_{stat}']:.1f} / "
                                 f"{peer[f'{kind}_tok_s_{stat}']:.1f} "
                                 f"({ours[f'{kind}_vs_llama_cpp_{stat}']:.2f}x)")
                lines.append(f"| {shape['shape']} | {row['prompt_tokens']} | {side} | "
                             + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def cpu_model() -> str:
    try:
        for line in pathlib.Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_runs(specs: Sequence[str]) -> Dict[str, List[int]]:
    out = {}
    for spec in specs:
        shape, _, lengths = spec.partition('=')
        if not shape or not lengths:
            raise SystemExit(f'--runs takes SHAPE=LENGTH,LENGTH,...: not {spec!r}')
        out[shape] = [int(n) for n in lengths.split(',')]
    return out


def parse_libraries(specs: Sequence[str]) -> Dict[str, str]:
    out = {}
    for spec in specs:
        label, _, path = spec.partition('=')
        if not label or not path or not pathlib.Path(path).is_file():
            raise SystemExit(f'--library takes LABEL=PATH of a built op library: not {spec!r}')
        out[label] = str(pathlib.Path(path).resolve())
    return out or {'ours': ''}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', action='append', default=[],
                   help='SHAPE=LENGTH,... (repeatable; default: ' + ' '.join(DEFAULT_RUNS) + ')')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=1)
    p.add_argument('--new-tokens', type=int, default=16)
    p.add_argument('--chunk', type=int, default=256, help="our prefill chunk (the Engine's)")
    p.add_argument('--peer-batch', type=int, default=512, help="llama.cpp's n_batch")
    p.add_argument('--library', action='append', default=[],
                   help='LABEL=PATH of an op library to run our side with (repeatable)')
    p.add_argument('--kv-dtype', choices=('float32', 'int8'), default='float32',
                   help='our KV (kv.dtype); int8 also gives llama.cpp a q8_0 KV cache')
    p.add_argument('--json-out', default=str(DEFAULT_JSON))
    p.add_argument('--child', choices=('ours', 'peer'), help=argparse.SUPPRESS)
    p.add_argument('--prompt-ids', help=argparse.SUPPRESS)
    p.add_argument('--lengths', help=argparse.SUPPRESS)
    p.add_argument('--model', help=argparse.SUPPRESS)
    p.add_argument('--gguf', help=argparse.SUPPRESS)
    p.add_argument('--table-from', default='',
                   help="print the tables of a saved JSON (this bench's) and exit")
    args = p.parse_args(argv)
    if args.table_from:
        result = json.loads(pathlib.Path(args.table_from).read_text())
        for shape in result['shapes']:
            shape['rows'] = [summarize(row, result['libraries']) for row in shape['rows']]
        print(f"CPU: {result['cpu']} ({result['cores']} cores), {result['threads']} threads")
        print(table(result))
        print(table(result, 'best'))
        return 0
    if args.child:
        print(json.dumps(ours_main(args) if args.child == 'ours' else peer_main(args)))
        return 0
    llama_peer = importlib.import_module('llama_peer')
    peer_python = llama_peer.ensure_peer(install=True)['python']
    libraries = parse_libraries(args.library)
    json_out = pathlib.Path(args.json_out)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    result = {'bench': 'bench_long_prompt', 'cpu': cpu_model(), 'cores': os.cpu_count(),
              'threads': args.threads, 'repeats': args.repeats, 'new_tokens': args.new_tokens,
              'chunk': args.chunk, 'peer_batch': args.peer_batch, 'libraries': libraries,
              'kv_dtype': args.kv_dtype,
              'shapes': []}
    for shape, lengths in parse_runs(args.runs or DEFAULT_RUNS).items():
        result['shapes'].append(measure_shape(shape, lengths, libraries, peer_python, args))
        json_out.write_text(json.dumps(result, indent=1))
    print(f"CPU: {result['cpu']} ({result['cores']} cores), {args.threads} threads")
    print(table(result))
    if args.repeats > 1:  # a shared machine: the best run is the least disturbed one
        print(table(result, 'best'))
    print(f'bench_long_prompt: JSON in {json_out}', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

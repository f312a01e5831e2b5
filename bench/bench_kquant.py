"""Issue 21's benchmark: GGUF blocks through KQuantMatMul vs MatMulNBits vs llama.cpp.

    .venv/bin/python bench/bench_kquant.py [--shapes smollm2,qwen2-1.5b,...] [--threads 2]
        [--repeats 2] [--prompt-tokens 64] [--new-tokens 32] [--no-node] [--fresh-convert]
        [--json-out bench/results/bench_kquant.json]
    .venv/bin/python bench/bench_kquant.py --quick      # SmolLM2 + qwen3-0.6b, few tokens

Shapes: `smollm2` is the embedded SmolLM2-135M's real GGUF (Q4_1 layers, Q8_0 tied head);
the others are bench/make_random_gguf.py's random-weight GGUFs at real shapes with llama.cpp's
Q4_K_M mix (written once into .cache/random_gguf/). The default set is smollm2, qwen2-1.5b,
llama3-1b, qwen3-0.6b and gemma3-1b; qwen2-7b (a 4.7 GB file, slow) and the other
make_random_gguf shapes run when named in --shapes.

Everything is measured in one run, so the ratios compare runs taken minutes apart at most:
1. the machine's streaming bandwidth on --threads threads: native/tests/bandwidth.cpp's STREAM
   triad (build/native/bandwidth, or --bandwidth-bin), before every shape and after the last;
   the highest triad median is the machine's figure. Not built: the JSON says so and the
   bandwidth target is left unmarked (no stand-in number);
2. per shape, the GGUF converted twice, `--weights kquant` and `--weights matmulnbits`, each in
   its own process with its peak RSS recorded (make_random_gguf.convert_peak_rss). The folders
   are cached in .cache/bench_kquant/ and reused while the GGUF (size, mtime, sha256), the
   weight format and the converter version are the same (--fresh-convert: convert anyway);
3. per shape, bench_models.py --interleave in a child process: both folders' decoders and
   llama.cpp (same GGUF, same threads, same prompt ids) take turns, one row per folder (prefill
   and decode tok/s, bytes read per token, KL, RSS). Both folders are loaded at once: the
   qwen2-7b shape needs ~19 GB (two folders and llama.cpp's process);
4. per shape, unless --no-node, the kquant folder served by a real llm_node
   (bench_models.py --through-node auto): the node process's RSS vs llama.cpp's with the same
   n_ctx. Without it, RSS is the bench process's growth from loading the decoder (stated so).

Targets (TARGETS; each marked met / missed per shape, misses kept, nothing dropped):
decode >= 1.3x llama.cpp; decode bandwidth (bytes per token x decode tok/s) >= 85 % of the
triad; prefill >= 1.0x llama.cpp; kquant's bytes per token within 3 % of the GGUF tensors'
llama.cpp reads; node RSS <= 1.05x llama.cpp's; conversion peak RSS <= 1.3x the GGUF (judged
on the largest shape run). Prints a markdown table (docs/benchmarks.md takes it as is) and
writes the JSON after every shape. Timings are this shared machine's: read the ratios.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
# bench/ is a script folder, not a package.
bench_models = importlib.import_module('bench_models')
make_random_gguf = importlib.import_module('make_random_gguf')

REAL = 'smollm2'
DEFAULT_SHAPES = (REAL, 'qwen2-1.5b', 'llama3-1b', 'qwen3-0.6b', 'gemma3-1b')
QUICK_SHAPES = (REAL, 'qwen3-0.6b')
WEIGHTS = ('kquant', 'matmulnbits')
CACHE = ROOT / '.cache' / 'bench_kquant'
RANDOM_GGUF = ROOT / '.cache' / 'random_gguf'
BANDWIDTH_BIN = ROOT / 'build' / 'native' / 'bandwidth'
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_kquant.json'
# name: (bound, 'min' = at least, 'max' = at most, 'within' = |value - 1| at most)
TARGETS = {'decode_vs_llama_cpp': (1.3, 'min'),
           'bandwidth_fraction': (0.85, 'min'),
           'prefill_vs_llama_cpp': (1.0, 'min'),
           'bytes_vs_gguf': (0.03, 'within'),
           'node_rss_vs_llama_cpp': (1.05, 'max'),
           'convert_rss_vs_gguf': (1.3, 'max')}
QUICK = {'prompt_tokens': 16, 'new_tokens': 8, 'repeats': 1, 'kl_steps': 1}


class BenchFailed(RuntimeError):
    """A child (converter, bench_models, llama.cpp) failed: the run stops, loudly."""


# --- targets -----------------------------------------------------------------------------------
def mark_targets(values: Dict[str, Optional[float]]) -> Dict[str, bool]:
    """Met (True) / missed (False) for every target whose value was measured."""
    met = {}
    for name, (bound, kind) in TARGETS.items():
        value = values.get(name)
        if value is None:
            continue
        if kind == 'min':
            met[name] = value >= bound
        elif kind == 'max':
            met[name] = value <= bound
        else:  # 1e-12: 1.03 - 1.0 is 0.030000000000000027 in floats
            met[name] = abs(value - 1.0) <= bound + 1e-12
    return met


# --- bytes per token ---------------------------------------------------------------------------
def gguf_matrix_bytes(gguf_path: str) -> int:
    """Bytes of the GGUF's matrices llama.cpp reads per token (gathered tables left out)."""
    from gguf import GGUFReader
    tensors = GGUFReader(gguf_path).tensors
    tied = not any(t.name == 'output.weight' for t in tensors)
    gathered = ('per_layer_token_embd.weight',) + (() if tied else ('token_embd.weight',))
    return sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2 and t.name not in gathered)


def bytes_summary(kquant_dir: str, matmulnbits_dir: Optional[str], gguf_path: str) -> Dict:
    """Bytes read per decode step by each folder, against the GGUF's (bench_models' counts).

    `kquant_vs_gguf` is the target's ratio: every initializer a step reads over every GGUF
    tensor llama.cpp reads. `kernel_vs_gguf_matrices` is the kernels' part alone: the
    `*.gguf_blocks` KQuantMatMul reads over the GGUF's matrices (1.0 when every matrix kept
    its blocks).
    """
    gguf = bench_models.gguf_bytes_per_token(gguf_path)
    kq = bench_models.onnx_bytes_per_token(kquant_dir)
    matrices = gguf_matrix_bytes(gguf_path)
    out = {'gguf': gguf['per_token'], 'gguf_matrices': matrices, 'tied_head': gguf['tied_head'],
           'kquant': kq['per_token'], 'kquant_gguf_blocks': kq['gguf_blocks'],
           'kquant_vs_gguf': kq['per_token'] / gguf['per_token'],
           'kernel_vs_gguf_matrices': kq['gguf_blocks'] / matrices if matrices else None,
           'converter_reported': _converter_bytes(kquant_dir)}
    if matmulnbits_dir:
        mnb = bench_models.onnx_bytes_per_token(matmulnbits_dir)
        out['matmulnbits'] = mnb['per_token']
        out['matmulnbits_vs_gguf'] = mnb['per_token'] / gguf['per_token']
    return out


def _converter_bytes(model_dir: str) -> Optional[int]:
    import yaml
    meta = yaml.safe_load(pathlib.Path(model_dir, 'model.yaml').read_text())
    return (meta.get('quantization') or {}).get('weight_bytes_per_token')


# --- bandwidth ---------------------------------------------------------------------------------
def stream_bandwidth(threads: int, binary: pathlib.Path = BANDWIDTH_BIN,
                     mb: int = 256) -> Dict:
    """Run native/tests/bandwidth.cpp's tool; {'status': 'not built'} when it is absent."""
    binary = pathlib.Path(binary)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return {'status': 'not built', 'binary': str(binary),
                'hint': 'cmake --build build/native --target bandwidth (native/tests/'
                        'bandwidth.cpp); no stand-in figure is used'}
    proc = subprocess.run([str(binary), str(threads), str(mb)], capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {'status': 'failed', 'binary': str(binary), 'returncode': proc.returncode,
                'stderr': proc.stderr[-1000:]}
    got = json.loads(lines[-1])
    return {'status': 'measured', 'binary': str(binary), **got}


def best_bandwidth(measurements: Sequence[Dict]) -> Optional[float]:
    """Return the highest triad median (GB/s) among the measured runs, None if none."""
    triads = [m['triad_gb_s'] for m in measurements if m.get('status') == 'measured']
    return max(triads) if triads else None


# --- GGUFs and conversions -----------------------------------------------------------------------
def gguf_for(shape: str) -> pathlib.Path:
    """Return a shape's GGUF: SmolLM2's real one, or make_random_gguf's (written once)."""
    if shape == REAL:
        from edge_llm_ros.convert.default_model import ensure_default_gguf
        return pathlib.Path(ensure_default_gguf())
    if shape not in make_random_gguf.SHAPES:
        raise SystemExit(f'unknown shape {shape!r}: {REAL} or one of '
                         f'{", ".join(sorted(make_random_gguf.SHAPES))}')
    path = RANDOM_GGUF / f'{shape}.gguf'
    if not path.is_file():
        print(f'bench_kquant: writing {path}', file=sys.stderr, flush=True)
        make_random_gguf.write_random_gguf(path, shape)
    return path


def gguf_identity(path: pathlib.Path, cache: pathlib.Path = CACHE) -> Dict:
    """Path, size, mtime and sha256 of a GGUF (the sha remembered while size and mtime hold)."""
    from edge_llm_ros.convert.converter import source_sha256
    st = path.stat()
    ident = {'path': str(path), 'bytes': st.st_size, 'mtime_ns': st.st_mtime_ns}
    memo = cache / 'sha256.json'
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    entry = known.get(str(path))
    if entry and entry['bytes'] == st.st_size and entry['mtime_ns'] == st.st_mtime_ns:
        return {**ident, 'sha256': entry['sha256']}
    ident['sha256'] = source_sha256(path)
    known[str(path)] = ident
    cache.mkdir(parents=True, exist_ok=True)
    memo.write_text(json.dumps(known, indent=1))
    return ident


def conversion_current(model_dir: pathlib.Path, ident: Dict, weights: str) -> bool:
    """Whether a cached folder is this GGUF's conversion, in `weights`, by this converter."""
    import yaml

    from edge_llm_ros.model_format import CONVERTER_VERSION
    meta_file = model_dir / 'model.yaml'
    if not meta_file.is_file():
        return False
    meta = yaml.safe_load(meta_file.read_text()) or {}
    return (str(meta.get('converter_version')) == CONVERTER_VERSION
            and (meta.get('source') or {}).get('sha256') == ident['sha256']
            and (meta.get('quantization') or {}).get('weights') == weights)


def converted(shape: str, gguf: pathlib.Path, ident: Dict, weights: str,
              fresh: bool = False, cache: pathlib.Path = CACHE) -> Dict:
    """Return the cached conversion of `gguf` in `weights` (converted when stale / `fresh`).

    Returns {'dir', 'converted_now', 'convert': convert_peak_rss's record}; the record is
    kept beside the folder, so a reused folder still reports the conversion's peak RSS.
    """
    out = cache / f'{shape}-{weights}'
    record = cache / f'{shape}-{weights}.convert.json'
    if not fresh and conversion_current(out, ident, weights) and record.is_file():
        return {'dir': str(out), 'converted_now': False,
                'convert': json.loads(record.read_text())}
    print(f'bench_kquant: converting {gguf} --weights {weights} into {out}', file=sys.stderr,
          flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        stats = make_random_gguf.convert_peak_rss(gguf, out, weights)
    except RuntimeError as exc:
        raise BenchFailed(f'converting {gguf} --weights {weights}: {exc}') from exc
    stats['measured_at'] = time.strftime('%Y-%m-%dT%H:%M:%S')
    record.write_text(json.dumps(stats, indent=1))
    return {'dir': str(out), 'converted_now': True, 'convert': stats}


# --- measuring (children: bench_models.py) -------------------------------------------------------
def _child(args: List[str], what: str) -> Dict:
    """Run bench_models.py with `args` + --json-out; return what it wrote."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in env.get(
        'PYTHONPATH', '').split(os.pathsep) if p])
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, 'out.json')
        cmd = [sys.executable, str(ROOT / 'bench' / 'bench_models.py'), *args,
               '--json-out', str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            tail = '\n'.join(proc.stderr.strip().splitlines()[-25:])
            raise BenchFailed(f'{what} exited with {proc.returncode}:\n{tail}')
        return json.loads(out.read_text())


def _row_args(config) -> List[str]:
    return ['--threads', str(config.threads), '--repeats', str(config.repeats),
            '--prompt-tokens', str(config.prompt_tokens), '--new-tokens',
            str(config.new_tokens), '--kl-steps', str(config.kl_steps),
            '--max-context', str(config.max_context)]


def measure_shape(dirs: Dict[str, str], gguf: str, config, node: bool) -> Dict:
    """Rows of both folders (interleaved with llama.cpp) and, if asked, the kquant node row."""
    args = ['--interleave']
    for weights in WEIGHTS:
        args += ['--model', dirs[weights], '--gguf', gguf]
    got = _child(args + _row_args(config), f'bench_models on {gguf}')
    rows = dict(zip(WEIGHTS, got['rows']))
    node_row, node_error = None, None
    if node:
        try:
            node_row = _child(['--through-node', 'auto', '--model', dirs['kquant'], '--gguf',
                               gguf] + _row_args(config),
                              f'llm_node on {dirs["kquant"]}')['node']
        except BenchFailed as exc:  # the engine rows stand; RSS falls back, stated so
            node_error = str(exc)
    return {'rows': rows, 'node': node_row, 'node_error': node_error}


# --- one shape's figures -----------------------------------------------------------------------
def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def summarize(shape: str, measured: Dict, bytes_info: Dict, triad_gb_s: Optional[float],
              conversions: Dict[str, Dict]) -> Dict:
    """Return one shape's figures, ratios and met / missed from its measurements."""
    kq, mnb = measured['rows']['kquant'], measured['rows']['matmulnbits']
    llama = kq['llama_cpp']
    speed, ratios = {}, {}
    for kind in ('decode', 'prefill'):
        key = f'{kind}_tok_s'
        speed[key] = {'kquant': _median(kq['ours'][key]), 'matmulnbits': _median(mnb['ours'][key]),
                      'llama_cpp': _median(llama[key])}
        ratios[f'{kind}_vs_llama_cpp'] = speed[key]['kquant'] / speed[key]['llama_cpp']
        ratios[f'{kind}_vs_llama_cpp_paired'] = _paired(kq['ours'][key], llama[key])
        ratios[f'{kind}_vs_matmulnbits'] = speed[key]['kquant'] / speed[key]['matmulnbits']
        ratios[f'{kind}_vs_matmulnbits_paired'] = _paired(kq['ours'][key], mnb['ours'][key])
        ratios[f'matmulnbits_{kind}_vs_llama_cpp'] = \
            speed[key]['matmulnbits'] / speed[key]['llama_cpp']
    ratios['bytes_vs_gguf'] = bytes_info['kquant_vs_gguf']
    decode = speed['decode_tok_s']
    achieved = {'kquant': bytes_info['kquant'] * decode['kquant'] / 1e9,
                'llama_cpp': bytes_info['gguf'] * decode['llama_cpp'] / 1e9}
    if 'matmulnbits' in bytes_info:
        achieved['matmulnbits'] = bytes_info['matmulnbits'] * decode['matmulnbits'] / 1e9
    bandwidth = {'achieved_gb_s': achieved, 'stream_triad_gb_s': triad_gb_s,
                 'fraction': ({k: v / triad_gb_s for k, v in achieved.items()}
                              if triad_gb_s else None),
                 'note': 'weights only (the KV cache a step reads is left out)'}
    ratios['bandwidth_fraction'] = bandwidth['fraction']['kquant'] if triad_gb_s else None
    node = measured.get('node')
    if node:
        rss = {'kind': 'llm_node process vs llama.cpp process, same n_ctx',
               'ours_mb': node['node_rss_mb'], 'llama_cpp_mb': node['llama_cpp_rss_mb'],
               'node_decode_vs_llama_cpp': node['ratios']['decode_vs_llama_cpp'],
               'node_prefill_vs_llama_cpp': node['ratios']['prefill_vs_llama_cpp']}
    else:
        rss = {'kind': 'decoder growth in the bench process (no node) vs llama.cpp process',
               'ours_mb': kq['ours']['rss_mb'], 'llama_cpp_mb': llama['rss_mb'],
               'node_error': measured.get('node_error')}
    ratios['node_rss_vs_llama_cpp'] = rss['ours_mb'] / rss['llama_cpp_mb']
    convert = conversions['kquant']
    ratios['convert_rss_vs_gguf'] = convert['rss_over_gguf']
    out = {'shape': shape, 'model': kq['model'], 'architecture': kq['architecture'],
           'covers': (make_random_gguf.SHAPES[shape].covers
                      if shape in make_random_gguf.SHAPES else 'SmolLM2-135M-Instruct (real)'),
           'random_weights': shape != REAL, 'gguf': kq['gguf'], 'gguf_bytes': kq['gguf_bytes'],
           'kernel': kq.get('kernel'), 'speed': speed, 'ratios': ratios, 'bytes': bytes_info,
           'bandwidth': bandwidth, 'rss': rss,
           'max_kl': {'kquant': kq['max_kl'], 'matmulnbits': mnb['max_kl']},
           'greedy_prefix_equal': {'kquant': kq['greedy_prefix_equal'],
                                   'matmulnbits': mnb['greedy_prefix_equal']},
           'conversions': conversions, 'loadavg': kq['loadavg']}
    # The conversion target is judged on the largest shape of the run (judge_conversion).
    out['targets_met'] = mark_targets({k: v for k, v in ratios.items()
                                       if k != 'convert_rss_vs_gguf'})
    return out


def judge_conversion(shapes: List[Dict]) -> Optional[Dict]:
    """Return the conversion RSS verdict on the largest GGUF of the run (kquant's conversion)."""
    if not shapes:
        return None
    big = max(shapes, key=lambda s: s['gguf_bytes'])
    record = big['conversions']['kquant']
    value = record['rss_over_gguf']
    other = big['conversions'].get('matmulnbits', {})
    return {'shape': big['shape'], 'gguf_bytes': record['gguf_bytes'],
            'peak_rss_bytes': record['peak_rss_bytes'], 'rss_over_gguf': value,
            'matmulnbits_rss_over_gguf': other.get('rss_over_gguf'),
            'measured_at': record.get('measured_at'),
            'met': mark_targets({'convert_rss_vs_gguf': value})['convert_rss_vs_gguf']}


# --- table -------------------------------------------------------------------------------------
def _verdict(met: Dict[str, bool], name: str) -> str:
    if name not in met:
        return 'n/a'
    return 'met' if met[name] else '**missed**'


def table(result: Dict) -> str:
    """Markdown: one line per shape, every target marked, bandwidth and conversion below."""
    head = ('| shape | decode tok/s kquant / matmulnbits / llama.cpp | decode kquant vs '
            'llama.cpp (≥ 1.3×) | vs matmulnbits | prefill tok/s kquant / matmulnbits / '
            'llama.cpp | prefill vs llama.cpp (≥ 1.0×) | MB/token kquant / GGUF (± 3 %) | '
            'decode GB/s, of triad (≥ 85 %) | RSS MB ours / llama.cpp (≤ 1.05×) | load |')
    lines = [head, '|' + '---|' * 10]
    for s in result['shapes']:
        d, p = s['speed']['decode_tok_s'], s['speed']['prefill_tok_s']
        x, met, b, bw = s['ratios'], s['targets_met'], s['bytes'], s['bandwidth']
        frac = bw['fraction']['kquant'] if bw['fraction'] else None
        frac_text = (f"{frac:.0%} {_verdict(met, 'bandwidth_fraction')}" if frac is not None
                     else 'triad not measured')
        rss_label = '' if s['rss']['kind'].startswith('llm_node') else ' (decoder)'
        lines.append(
            f"| {s['shape']}{'' if s['random_weights'] else ' (real)'} | "
            f"{d['kquant']:.1f} / {d['matmulnbits']:.1f} / {d['llama_cpp']:.1f} | "
            f"{x['decode_vs_llama_cpp']:.2f}× {_verdict(met, 'decode_vs_llama_cpp')} | "
            f"{x['decode_vs_matmulnbits']:.2f}× | "
            f"{p['kquant']:.1f} / {p['matmulnbits']:.1f} / {p['llama_cpp']:.1f} | "
            f"{x['prefill_vs_llama_cpp']:.2f}× {_verdict(met, 'prefill_vs_llama_cpp')} | "
            f"{b['kquant'] / 1e6:.1f} / {b['gguf'] / 1e6:.1f} = {b['kquant_vs_gguf']:.3f}× "
            f"{_verdict(met, 'bytes_vs_gguf')} | "
            f"{bw['achieved_gb_s']['kquant']:.1f}, {frac_text} | "
            f"{s['rss']['ours_mb']:.0f} / {s['rss']['llama_cpp_mb']:.0f}{rss_label} = "
            f"{x['node_rss_vs_llama_cpp']:.2f}× {_verdict(met, 'node_rss_vs_llama_cpp')} | "
            f"{s['loadavg']['start'][0]:.1f} |")
    bw = result['bandwidth']
    triad = best_bandwidth(bw)
    if triad is None:
        first = bw[0] if bw else {}
        lines.append(f"\nStreaming bandwidth: {first.get('status', 'not measured')} "
                     f"({first.get('binary', '')}): the bandwidth target is not judged.")
    else:
        reads = [m['read_gb_s'] for m in bw if m.get('status') == 'measured']
        lines.append(f"\nStreaming bandwidth, {result['config']['threads']} threads: triad "
                     f'{triad:.1f} GB/s (read-only {max(reads):.1f} GB/s), best of '
                     f'{len(reads)} runs in this run.')
    kernels = sorted({s['kernel'] for s in result['shapes'] if s.get('kernel')})
    if kernels:
        lines.append(f"kquant kernels: {', '.join(kernels)}.")
    conv = result.get('conversion')
    if conv:
        mnb = conv.get('matmulnbits_rss_over_gguf')
        lines.append(f"Conversion peak RSS, {conv['shape']} (largest shape run): "
                     f"{conv['peak_rss_bytes'] / 1e9:.2f} GB for a {conv['gguf_bytes'] / 1e9:.2f}"
                     f" GB GGUF = {conv['rss_over_gguf']:.2f}× (≤ 1.3×) "
                     f"{'met' if conv['met'] else '**missed**'}"
                     + (f'; matmulnbits {mnb:.2f}×' if mnb is not None else '') + '.')
    return '\n'.join(lines)


# --- main --------------------------------------------------------------------------------------
def run(shapes: Sequence[str], config, node: bool, fresh: bool, bandwidth_bin: pathlib.Path,
        json_out: pathlib.Path) -> Dict:
    """Measure every shape in one run; write the JSON after each; return the result."""
    result = {'config': {**asdict(config), 'node': node}, 'targets': TARGETS,
              'started': time.strftime('%Y-%m-%dT%H:%M:%S'), 'shapes': [], 'bandwidth': []}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        gguf = gguf_for(shape)
        ident = gguf_identity(gguf)
        conv = {w: converted(shape, gguf, ident, w, fresh) for w in WEIGHTS}
        dirs = {w: c['dir'] for w, c in conv.items()}
        print(f'bench_kquant: measuring {shape}', file=sys.stderr, flush=True)
        result['bandwidth'].append({**stream_bandwidth(config.threads, bandwidth_bin),
                                    'before': shape})
        measured = measure_shape(dirs, str(gguf), config, node)
        records = {w: {**c['convert'], 'converted_now': c['converted_now'], 'dir': c['dir']}
                   for w, c in conv.items()}
        summary = summarize(shape, measured, bytes_summary(dirs['kquant'], dirs['matmulnbits'],
                                                           str(gguf)),
                            best_bandwidth(result['bandwidth']), records)
        summary['raw'] = measured
        result['shapes'].append(summary)
        json_out.write_text(json.dumps(result, indent=1))
    result['bandwidth'].append({**stream_bandwidth(config.threads, bandwidth_bin),
                                'before': 'the end'})
    triad = best_bandwidth(result['bandwidth'])
    for s in result['shapes']:  # the fraction against the best triad of the whole run
        redo = summarize(s['shape'], s['raw'], s['bytes'], triad, s['conversions'])
        s.update({k: v for k, v in redo.items() if k != 'raw'})
    result['conversion'] = judge_conversion(result['shapes'])
    result['finished'] = time.strftime('%Y-%m-%dT%H:%M:%S')
    result['table'] = table(result)
    json_out.write_text(json.dumps(result, indent=1))
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: 0 when every shape was measured (targets missed or not), 3 on a failure."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shapes', default='',
                   help=f"comma-separated (default {','.join(DEFAULT_SHAPES)}; also qwen2-7b "
                        'and the other make_random_gguf shapes)')
    p.add_argument('--quick', action='store_true',
                   help=f"smoke test: {', '.join(QUICK_SHAPES)}, {QUICK['prompt_tokens']}-id "
                        f"prompt, {QUICK['new_tokens']} tokens, 1 repeat")
    p.add_argument('--threads', type=int, default=bench_models.RowConfig.threads)
    p.add_argument('--repeats', type=int, default=None)
    p.add_argument('--prompt-tokens', type=int, default=None)
    p.add_argument('--new-tokens', type=int, default=None)
    p.add_argument('--kl-steps', type=int, default=None)
    p.add_argument('--max-context', type=int, default=bench_models.RowConfig.max_context)
    p.add_argument('--no-node', action='store_true',
                   help='skip llm_node (RSS is then the decoder growth, stated so)')
    p.add_argument('--fresh-convert', action='store_true',
                   help='convert again even when the cached folders are current')
    p.add_argument('--bandwidth-bin', default=str(BANDWIDTH_BIN),
                   help='the STREAM-like tool of native/tests/bandwidth.cpp')
    p.add_argument('--json-out', default='')
    args = p.parse_args(argv)
    base = QUICK if args.quick else {}
    defaults = bench_models.RowConfig()
    config = bench_models.RowConfig(
        threads=args.threads, max_context=args.max_context,
        **{k: getattr(args, k) if getattr(args, k) is not None else base.get(
            k, getattr(defaults, k)) for k in ('repeats', 'prompt_tokens', 'new_tokens',
                                               'kl_steps')})
    shapes = [s for s in args.shapes.split(',') if s] or list(
        QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    json_out = pathlib.Path(args.json_out) if args.json_out else (
        DEFAULT_JSON.with_name('bench_kquant_quick.json') if args.quick else DEFAULT_JSON)
    try:
        result = run(shapes, config, not args.no_node, args.fresh_convert,
                     pathlib.Path(args.bandwidth_bin), json_out)
    except BenchFailed as exc:
        print(f'bench_kquant: FAILED: {exc}', file=sys.stderr)
        return bench_models.PEER_FAILED
    print(result['table'])
    print(f'bench_kquant: JSON in {json_out}', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""The Python half of scripts/gpu_check.sh: cases in, verdicts and the report out.

    python -m edge_llm_ros.bringup.gpu_check --harness build/gpu_check --out gpu_check/

scripts/gpu_check.sh builds native/tests/gpu_check.cu (nvcc for the GPU it finds, or C++
against native/tests/cuda_emulation.h with --emulate) and calls this module, which:
  - writes the older kernels' cases (cuda_runner.cases(): int4_gemv, rmsnorm, rope, kv_int8)
    as a manifest and raw arrays for the harness to launch, and compares what comes back with
    kernel_reference.py's values within cuda_runner's tolerances (cuda_runner.compare);
  - writes the weight shapes to time: the matrices of one Qwen2.5-1.5B Q4_K_M layer and its
    head, with their types and how often the whole model holds each (bench/make_random_gguf.py's
    plan, llama.cpp's Q4_K_M recipe);
  - runs the harness (its own checks: kquant.cu against ref.cpp, bit for bit), streaming its
    progress lines, and turns its timings into GB/s, the fraction of the device-to-device copy
    roof and the tokens/s they imply for the whole model's matmuls;
  - writes OUT/gpu_check.json and OUT/gpu_check.txt (the table, also printed).
Exit 0 when every check passed, 1 on any mismatch (or a harness that failed).
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import pathlib
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.bringup import cuda_runner

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = 'qwen2-1.5b'                  # bench/make_random_gguf.py's name for the shape
MODEL_NAME = 'Qwen2.5-1.5B-Instruct Q4_K_M'
PREFILL_ROWS = 512                    # prompt tokens of the prefill GEMM timing
QUICK_PREFILL_ROWS = 5                # --quick: still the GEMM path (M > 4)
HARNESS_TIMEOUT_S = 240.0             # the whole check has 5 minutes, the build too


# ---- the shapes to time ---------------------------------------------------------------------

def model_shapes(quick: bool = False) -> List[Dict[str, Any]]:
    """Each distinct (N, K, type) matrix of the model, named by its roles, with its count.

    The head (the tied token_embd, or output.weight) counts once; a layer's matrices count as
    often as the model's layers hold them. --quick shrinks N and K (N / 512 rounded up, K one
    super-block) so that the CPU emulation runs the same list in moments.
    """
    sys.path.insert(0, str(ROOT / 'bench'))
    try:
        plan_module = importlib.import_module('make_random_gguf')
    finally:
        sys.path.pop(0)
    shape = plan_module.SHAPES[MODEL]
    roles: Dict[Tuple[int, int, str], List[str]] = collections.OrderedDict()
    counts: Dict[Tuple[int, int, str], int] = collections.Counter()
    for name, dims, qtype in plan_module.gguf_plan(shape):
        if len(dims) != 2:
            continue
        if name.startswith('blk.'):
            role = name.split('.')[2]
        elif name == 'output.weight' or (name == 'token_embd.weight' and shape.tied):
            role = 'head'
        else:
            continue  # an untied embedding is a lookup of one row a token, not a matmul
        key = (dims[0], dims[1], qtype)
        roles.setdefault(key, [])
        if role not in roles[key]:
            roles[key].append(role)
        counts[key] += 1
    out = []
    for (n, k, qtype), names in roles.items():
        count = counts[(n, k, qtype)]
        if quick:
            n, k = max(1, math.ceil(n / 512)), 256
        out.append({'name': '+'.join(names), 'type': qtype, 'n': n, 'k': k, 'count': count})
    out.sort(key=lambda s: s['name'] == 'head')  # one layer's matrices, then the head
    return out


def write_shapes(shapes: Sequence[Dict[str, Any]], path: pathlib.Path) -> None:
    """Write the harness's --shapes file: `name type N K` a line."""
    path.write_text(''.join('%s %s %d %d\n' % (s['name'], s['type'], s['n'], s['k'])
                            for s in shapes))


# ---- the older kernels' cases ---------------------------------------------------------------

def write_cases(cases: Sequence[cuda_runner.KernelCase], folder: pathlib.Path) -> pathlib.Path:
    """Write the manifest and each array argument for the harness; return the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for number, case in enumerate(cases):
        lines.append('case %d %s %d %d %d %d %d %d %d' % (
            number, case.entry, *case.grid, *case.block, len(case.args)))
        for index, arg in enumerate(case.args):
            if arg.kind in ('in', 'out', 'inout'):
                data = np.ascontiguousarray(arg.value)
                path = folder / ('case%d_arg%d.bin' % (number, index))
                path.write_bytes(data.tobytes())
                lines.append('%s %s %d' % (arg.kind, path.resolve(), data.nbytes))
            elif arg.kind == 'null':
                lines.append('null')
            elif arg.kind == 'int':
                lines.append('int %d' % (int(arg.value) & 0xffffffff))
            else:
                bits = int(np.array(arg.value, np.float32).view(np.uint32))
                lines.append('float %d' % bits)
    manifest = folder / 'manifest.txt'
    manifest.write_text('\n'.join(lines) + '\n')
    return manifest


def read_outputs(case: cuda_runner.KernelCase, number: int,
                 folder: pathlib.Path) -> Optional[Dict[int, np.ndarray]]:
    """Read what the harness wrote back for a case's out/inout arguments (None: nothing)."""
    outputs = {}
    for index, arg in enumerate(case.args):
        if arg.kind not in ('out', 'inout'):
            continue
        path = folder / ('case%d_arg%d.bin.got' % (number, index))
        if not path.is_file():
            return None
        value = np.asarray(arg.value)
        outputs[index] = np.frombuffer(path.read_bytes(), value.dtype).reshape(value.shape)
    return outputs


def check_cases(cases: Sequence[cuda_runner.KernelCase],
                folder: pathlib.Path) -> List[Dict[str, Any]]:
    """cuda_runner.compare on each case's outputs; a case with none is a failure."""
    results = []
    for number, case in enumerate(cases):
        outputs = read_outputs(case, number, folder)
        if outputs is None:
            results.append({'label': case.label, 'entry': case.entry, 'max_abs_err': None,
                            'tolerance': None, 'passed': False, 'error': 'no output'})
        else:
            results.append(cuda_runner.compare(case, outputs).as_dict())
    return results


# ---- the report -----------------------------------------------------------------------------

def model_totals(shapes: Sequence[Dict[str, Any]], timings: Sequence[Dict[str, Any]],
                 roof_gb_s: float, prefill_rows: int) -> Dict[str, Any]:
    """Whole-model matmul time a token (decode) and a prompt (prefill), from the timings."""
    by_key = {(t['name'], t['type'], t['m']): t for t in timings}
    decode_ms = prefill_ms = 0.0
    weight_bytes = 0
    for s in shapes:
        decode = by_key[(s['name'], s['type'], 1)]
        prefill = by_key[(s['name'], s['type'], prefill_rows)]
        decode_ms += s['count'] * decode['ms']
        prefill_ms += s['count'] * prefill['ms']
        weight_bytes += s['count'] * decode['weight_bytes']
    gb_s = weight_bytes / (decode_ms * 1e-3) / 1e9
    return {
        'model': MODEL_NAME,
        'matmul_weight_bytes': weight_bytes,
        'decode_ms_per_token': decode_ms,
        'decode_tokens_per_s': 1e3 / decode_ms,
        'decode_gb_s': gb_s,
        'decode_fraction_of_roof': gb_s / roof_gb_s,
        'roof_tokens_per_s': roof_gb_s * 1e9 / weight_bytes,
        'prefill_rows': prefill_rows,
        'prefill_ms': prefill_ms,
        'prefill_tokens_per_s': prefill_rows * 1e3 / prefill_ms,
        'note': 'the matmuls alone (quantizer included): no attention, norms, launches between '
                'them or the CPU; an upper bound on what the model can reach with these kernels',
    }


def build_report(harness: Dict[str, Any], kernels: List[Dict[str, Any]],
                 shapes: Sequence[Dict[str, Any]], prefill_rows: int,
                 arch: str) -> Dict[str, Any]:
    """Put the harness's JSON and the older kernels' verdicts into one report."""
    roof = harness.get('roof') or {}
    timings = []
    for t in harness.get('timings', []):
        # GEMM speed as multiply-adds of the int8 dot products: 2 M N K operations.
        tops = 2.0 * t['m'] * t['n'] * t['k'] / (t['ms'] * 1e-3) / 1e12
        timings.append(dict(t, fraction_of_roof=t['gb_s'] / roof['gb_s'] if roof else None,
                            tops=tops))
    kquant_passed = bool(harness.get('passed')) and all(c['passed'] for c in harness['checks'])
    report = {
        'what': 'scripts/gpu_check.sh: kernels/ against their CPU references, and the kquant '
                'matmul at %s shapes' % MODEL_NAME,
        'arch': arch,
        'device': harness.get('device'),
        'quick': bool(harness.get('quick')),
        'passed': kquant_passed and all(k['passed'] for k in kernels) and bool(kernels),
        'kquant': {'passed': kquant_passed, 'reference': 'native/src/ref.cpp (bit for bit)',
                   'checks': harness.get('checks', [])},
        'kernels': {'passed': all(k['passed'] for k in kernels) and bool(kernels),
                    'reference': 'edge_llm_ros/bringup/kernel_reference.py (tolerances of '
                                 'cuda_runner.cases())', 'checks': kernels},
        'roof': roof or None,
        'shapes': list(shapes),
        'timings': timings,
        'model': model_totals(shapes, timings, roof['gb_s'], prefill_rows)
        if roof and timings else None,
    }
    return report


def table(report: Dict[str, Any]) -> str:
    """Format the short table: verdicts, then the timings and the whole-model numbers."""
    device = report.get('device') or {}
    kquant = report['kquant']['checks']
    failed = [c for c in kquant if not c['passed']]
    old = report['kernels']['checks']
    quick = " [quick: shrunk shapes; the timings are not a GPU's]" if report['quick'] else ''
    lines = ['GPU check on %s (%s)%s: %s' % (
        device.get('name', '?'), report['arch'], quick,
        'PASSED' if report['passed'] else 'FAILED'),
        'kquant (ref.cpp, bit for bit): %d checks, %d different' % (len(kquant), len(failed)),
        'older kernels (kernel_reference.py): %d checks, %d failed' % (
            len(old), len([k for k in old if not k['passed']]))]
    for k in old:
        if not k['passed']:
            lines.append('  FAILED %s (%s): max |err| %s, tolerance %s' % (
                k['label'], k['entry'], k['max_abs_err'], k['tolerance']))
    roof = report.get('roof')
    if roof:
        lines.append('roof: device-to-device copy %.1f GB/s' % roof['gb_s'])
        prefill = report['model']['prefill_rows'] if report.get('model') else None
        lines.append('%-22s %-5s %7s %5s %5s | %9s %8s %6s | %10s %9s' % (
            'matrix', 'type', 'N', 'K', 'count', 'decode us', 'GB/s', 'roof',
            'M=%s ms' % prefill, 'int8 TOPS'))
        by_key = {(t['name'], t['type'], t['m']): t for t in report['timings']}
        for s in report['shapes']:
            d = by_key.get((s['name'], s['type'], 1))
            p = by_key.get((s['name'], s['type'], prefill))
            if d is None or p is None:
                continue
            lines.append('%-22s %-5s %7d %5d %5d | %9.1f %8.1f %5.0f%% | %10.3f %9.2f' % (
                s['name'], s['type'], s['n'], s['k'], s['count'], 1e3 * d['ms'], d['gb_s'],
                100 * d['fraction_of_roof'], p['ms'], p['tops']))
    model = report.get('model')
    if model:
        lines.append('%s, matmuls only: decode %.1f tokens/s (%.1f GB/s, %.0f%% of the roof; '
                     'the roof allows %.1f), prefill of %d: %.0f tokens/s' % (
                         model['model'], model['decode_tokens_per_s'], model['decode_gb_s'],
                         100 * model['decode_fraction_of_roof'], model['roof_tokens_per_s'],
                         model['prefill_rows'], model['prefill_tokens_per_s']))
    return '\n'.join(lines)


# ---- the run --------------------------------------------------------------------------------

def run_harness(command: Sequence[str], out: Callable[[str], None],
                timeout: float = HARNESS_TIMEOUT_S) -> int:
    """Run the harness, passing its progress lines on; return its exit status.

    A harness still running after `timeout` seconds (a kernel that never returns) is killed:
    a GPU lent for minutes must not wait on it.
    """
    with subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out(line.rstrip('\n'))
            status = proc.wait()
        finally:
            timer.cancel()
        if status < 0:
            out('gpu_check: the harness was killed after %.0f s' % timeout)
        return status


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    """CLI entry point (scripts/gpu_check.sh calls it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--harness', required=True, help='the built gpu_check program')
    parser.add_argument('--out', required=True, help='folder for the JSON and the table')
    parser.add_argument('--arch', default='', help='what the harness was built for')
    parser.add_argument('--quick', action='store_true',
                        help='the reduced case list and shapes (the CPU emulation)')
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.out)
    work = folder / 'build' / 'run'
    work.mkdir(parents=True, exist_ok=True)
    cases = cuda_runner.cases()
    manifest = write_cases(cases, work / 'cases')
    shapes = model_shapes(args.quick)
    write_shapes(shapes, work / 'shapes.txt')
    prefill = QUICK_PREFILL_ROWS if args.quick else PREFILL_ROWS
    harness_json = work / 'harness.json'
    if harness_json.exists():
        harness_json.unlink()
    command = [args.harness, '--json', str(harness_json), '--cases', str(manifest),
               '--shapes', str(work / 'shapes.txt'), '--prefill', str(prefill)]
    if args.quick:
        command.append('--quick')
    out('gpu_check: running %s' % ' '.join(command))
    status = run_harness(command, out)
    if not harness_json.is_file():
        out('gpu_check: the harness failed (exit %d) before writing its JSON' % status)
        return 1
    harness = json.loads(harness_json.read_text())
    kernels = check_cases(cases, work / 'cases')
    report = build_report(harness, kernels, shapes, prefill, args.arch)
    if status != 0 and report['passed']:
        report['passed'] = False  # the harness saw something the JSON does not say
    text = table(report)
    (folder / 'gpu_check.json').write_text(json.dumps(report, indent=1) + '\n')
    (folder / 'gpu_check.txt').write_text(text + '\n')
    out(text)
    out('gpu_check: wrote %s and %s' % (folder / 'gpu_check.json', folder / 'gpu_check.txt'))
    return 0 if report['passed'] else 1


if __name__ == '__main__':
    sys.exit(main())

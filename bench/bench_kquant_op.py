"""Benchmark edge_llm_ros.KQuantMatMul against MatMulNBits and the machine's bandwidth.

Issue 21's benchmark: random Q4_K / Q6_K blocks at a 7B FFN shape (K 3584, N 18944: 38 MB
of Q4_K, 56 MB of Q6_K, more than this machine's L3) for decode (M = 1) and prefill
(M = 128, 512 by default), timed in the same run as MatMulNBits at accuracy level 4 (int8
activations, as ours) in the layouts the converter emits today: 4-bit blocks of 32 for Q4_K,
8-bit blocks of 32 for Q6_K. native/tests/bandwidth (built with the op) measures a read-only
stream and a STREAM-like triad on the same threads between the rounds; a GEMV reads its
weights once, so its GB/s is set against the read stream.

The machine is shared and noisy: every round times every op once (in a shuffled order) and
the bandwidth once, and the report gives medians over the rounds and ratios taken within the
same run. Before each timed call a 96 MB array is read (--flush-mb), so no call finds the
last call's weights in the L3 (as in a model's decode, where every layer's weights come from
DRAM). JSON on stdout (--json PATH writes it too), then a Markdown table.
    python bench/bench_kquant_op.py [--threads 2] [--rounds 9] [--m 1,128,512]
"""
import argparse
import importlib
import json
import pathlib
import random
import subprocess
import sys
import time

import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort

from edge_llm_ros.runtime import native_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'test'))
# test/'s helpers, imported after sys.path names test/.
native_build = importlib.import_module('native_build').native_build
_ref = importlib.import_module('test_native_ref')
random_blocks, TYPES = _ref.random_blocks, _ref.TYPES

# The MatMulNBits layout the converter emits for each GGUF type (bits, block size).
NBITS_FOR = {'Q4_K': (4, 32), 'Q5_K': (8, 32), 'Q6_K': (8, 32), 'Q4_0': (4, 32),
             'Q4_1': (4, 32), 'Q5_0': (8, 32), 'Q5_1': (8, 32), 'Q8_0': (8, 32)}


def session(node, initializers, k, n, threads, custom=False):
    """Return a session running one node on A [M, K] (M symbolic) to Y [M, N]."""
    graph = helper.make_graph(
        [node], 'g', [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', n])], initializers)
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid('', 17), helper.make_opsetid('edge_llm_ros', 1),
        helper.make_opsetid('com.microsoft', 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if custom:
        options.register_custom_ops_library(str(native_build() / 'libedge_llm_ort_ops.so'))
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=['CPUExecutionProvider'])


def kquant(rng, name, k, n, threads):
    """Return (session, weight bytes) of KQuantMatMul on random `name` blocks."""
    weights = random_blocks(rng, name, n * k // TYPES[name][2]).reshape(n, -1)
    node = helper.make_node('KQuantMatMul', ['A', 'W'], ['Y'], domain='edge_llm_ros',
                            quant_type=TYPES[name][0], K=k, N=n)
    return (session(node, [numpy_helper.from_array(weights, 'W')], k, n, threads, custom=True),
            weights.nbytes)


def nbits(rng, bits, block, k, n, threads):
    """Return (session, bytes held) of MatMulNBits, accuracy level 4, random codes."""
    codes = rng.integers(0, 256, size=(n, k // block, block * bits // 8), dtype=np.uint8)
    scales = rng.random(n * k // block).astype(np.float32) * 0.01
    node = helper.make_node('MatMulNBits', ['A', 'B', 'scales'], ['Y'], domain='com.microsoft',
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    run = session(node, [numpy_helper.from_array(codes, 'B'),
                         numpy_helper.from_array(scales, 'scales')], k, n, threads)
    return run, codes.nbytes + scales.nbytes


def kernel_pin():
    """Return a function pinning the kernels of the op library the sessions loaded."""
    library = native_build() / 'libedge_llm_ort_ops.so'
    return lambda kernel: native_ops.pin_kernel(kernel, library)


def bandwidth(threads):
    """Return the bandwidth tool's JSON: median read and triad GB/s over a few passes."""
    tool = native_build() / 'bandwidth'
    proc = subprocess.run([str(tool), str(threads), '128', '5'], capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout)


def call_seconds(run, a, calls, warmup, flush=None):
    """Return the median seconds of `calls` calls after `warmup` calls.

    The warm-up also outlasts the previous session's spinning pool threads. `flush`, an
    array larger than the L3, is read before each timed call (untimed): every call then reads
    its weights from DRAM, as a model's decode does, not partly from the last call's L3 lines.
    """
    for _ in range(warmup):
        run.run(None, {'A': a})
    times = []
    for _ in range(calls):
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        run.run(None, {'A': a})
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> int:
    """Run the rounds, print the JSON and the table; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--k', type=int, default=3584)
    parser.add_argument('--n', type=int, default=18944)
    parser.add_argument('--m', default='1,128,512', help='activation rows, comma-separated')
    parser.add_argument('--types', default='Q4_K,Q6_K')
    parser.add_argument('--kernels', default='auto',
                        help='kernel sets to time in turn, comma-separated (e.g. avx2,avx512_vnni;'
                             ' auto: the best this CPU has); the first is the baseline')
    parser.add_argument('--json', type=pathlib.Path)
    parser.add_argument('--flush-mb', type=int, default=96,
                        help='read this much memory before each timed call (0: none)')
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    k, n = args.k, args.n
    ms = [int(m) for m in args.m.split(',')]
    kernels = args.kernels.split(',')
    pin = kernel_pin()
    ops = {}  # name -> (session, weight bytes, the names it is compared with, kernel set)
    for name in args.types.split(','):
        bits, block = NBITS_FOR[name]
        base = f'MatMulNBits {bits}-bit/{block}'
        if base not in ops:
            ops[base] = (*nbits(rng, bits, block, k, n, args.threads), (), None)
        run, held = kquant(rng, name, k, n, args.threads)
        first = f'KQuantMatMul {name} ({kernels[0]})'
        for kernel in kernels:
            pin(kernel)  # refuses, naming the CPU's features, a set this CPU lacks
            ops[f'KQuantMatMul {name} ({kernel})'] = (
                run, held, (base,) if kernel == kernels[0] else (base, first), kernel)
    inputs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in ms}
    flush = np.ones(args.flush_mb << 18, np.float32) if args.flush_mb else None
    times = {(op, m): [] for op in ops for m in ms}
    reads, triads = [], []
    order = list(times)
    for _ in range(args.rounds):
        random.shuffle(order)
        for op, m in order:
            calls, warmup = (15, 5) if m == 1 else (3, 1)
            if ops[op][3] is not None:
                pin(ops[op][3])
            times[op, m].append(call_seconds(ops[op][0], inputs[m], calls, warmup, flush))
        bw = bandwidth(args.threads)
        reads.append(bw['read_gb_s'])
        triads.append(bw['triad_gb_s'])
    read, triad = float(np.median(reads)), float(np.median(triads))
    rows = []
    for (op, m), seconds in times.items():
        run, held, bases, _ = ops[op]
        ms_call = float(np.median(seconds)) * 1e3
        row = {'op': op, 'm': m, 'ms': ms_call, 'ms_min': min(seconds) * 1e3,
               'weight_mb': held / 1e6, 'gb_s': held / ms_call / 1e6,
               'gflops': 2.0 * m * k * n / ms_call / 1e6}
        if m == 1:
            row['of_read_bandwidth'] = row['gb_s'] / read
        for base in bases:
            # The same round's ratio, then its median: the noise of the two cancels.
            ratios = [b / s for b, s in zip(times[base, m], seconds)]
            row['speedup_vs_' + base.replace(' ', '_')] = float(np.median(ratios))
        rows.append(row)
    rows.sort(key=lambda r: (r['m'], r['op']))
    pin('auto')
    report = {'k': k, 'n': n, 'threads': args.threads, 'rounds': args.rounds,
              'cpu_features': native_ops.cpu_features(native_build() / 'libedge_llm_ort_ops.so'),
              'kernels': kernels,
              'flush_mb': args.flush_mb,
              'read_gb_s': read, 'triad_gb_s': triad, 'read_gb_s_rounds': reads, 'rows': rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + '\n')
    print(f'\nbandwidth, {args.threads} threads: read {read:.1f} GB/s, triad {triad:.1f} GB/s'
          ' (medians over the rounds)\n')
    print('| op | M | ms (median) | weight MB | GB/s | of read bw | GFLOP/s | speedup |')
    print('|---|---|---|---|---|---|---|---|')
    for r in rows:
        bw = f"{r['of_read_bandwidth']:.0%}" if 'of_read_bandwidth' in r else ''
        speed = [f'{v:.2f}x' for key, v in r.items() if key.startswith('speedup_vs_')]
        speed = speed[:1] + [f' ({v} vs the first kernel set)' for v in speed[1:]]
        print(f"| {r['op']} | {r['m']} | {r['ms']:.2f} | {r['weight_mb']:.1f} | "
              f"{r['gb_s']:.1f} | {bw} | {r['gflops']:.0f} | {''.join(speed)} |")
    return 0


if __name__ == '__main__':
    sys.exit(main())

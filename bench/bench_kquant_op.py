"""GEMV (decode) of edge_llm_ros.KQuantMatMul against MatMulNBits on the same shape and threads.

A first probe for issue 21, not yet the issue's benchmark: random Q4_K / Q6_K blocks at a
7B FFN shape (K 3584, N 18944: 38 MB of Q4_K, more than this machine's L3), timed in the same
run as MatMulNBits 4-bit blocks of 32 (what the converter emits today for Q4_K) at accuracy
level 4. Reports ms per call and GB/s of the bytes each op's weights hold.
    python bench/bench_kquant_op.py [--threads 2] [--repeats 30]
"""
import argparse
import json
import pathlib
import sys
import time

import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'test'))
from native_build import native_build  # noqa: E402
from test_native_ref import random_blocks, TYPES  # noqa: E402


def session(node, initializers, k, n, threads, custom=False):
    graph = helper.make_graph(
        [node], 'g', [helper.make_tensor_value_info('A', TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, [1, n])], initializers)
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid('', 17), helper.make_opsetid('edge_llm_ros', 1),
        helper.make_opsetid('com.microsoft', 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if custom:
        options.register_custom_ops_library(str(native_build() / 'libedge_llm_ort_ops.so'))
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=['CPUExecutionProvider'])


def time_calls(run, a, repeats):
    for _ in range(5):
        run.run(None, {'A': a})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run.run(None, {'A': a})
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=30)
    parser.add_argument('--k', type=int, default=3584)
    parser.add_argument('--n', type=int, default=18944)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    k, n = args.k, args.n
    a = rng.standard_normal((1, k)).astype(np.float32)
    rows = []
    for name in ('Q4_K', 'Q6_K'):
        type_id = TYPES[name][0]
        weights = random_blocks(rng, name, n * k // 256).reshape(n, -1)
        node = helper.make_node('KQuantMatMul', ['A', 'W'], ['Y'], domain='edge_llm_ros',
                                quant_type=type_id, K=k, N=n)
        seconds = time_calls(session(node, [numpy_helper.from_array(weights, 'W')], k, n,
                                     args.threads, custom=True), a, args.repeats)
        rows.append({'op': f'KQuantMatMul {name}', 'ms': seconds * 1e3,
                     'weight_mb': weights.nbytes / 1e6, 'gb_s': weights.nbytes / seconds / 1e9})
    codes = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    scales = (rng.random(n * k // 32).astype(np.float32) * 0.01)
    node = helper.make_node('MatMulNBits', ['A', 'B', 'scales'], ['Y'], domain='com.microsoft',
                            K=k, N=n, bits=4, block_size=32, accuracy_level=4)
    seconds = time_calls(session(node, [numpy_helper.from_array(codes, 'B'),
                                        numpy_helper.from_array(scales, 'scales')], k, n,
                                 args.threads), a, args.repeats)
    held = codes.nbytes + scales.nbytes
    rows.append({'op': 'MatMulNBits 4-bit/32 (today\'s Q4_K repack)', 'ms': seconds * 1e3,
                 'weight_mb': held / 1e6, 'gb_s': held / seconds / 1e9})
    print(json.dumps({'k': k, 'n': n, 'threads': args.threads, 'rows': rows}, indent=1))
    print('| op | ms | weight MB | GB/s of its weights |\n|---|---|---|---|')
    for row in rows:
        print(f"| {row['op']} | {row['ms']:.2f} | {row['weight_mb']:.1f} | {row['gb_s']:.1f} |")
    return 0


if __name__ == '__main__':
    sys.exit(main())

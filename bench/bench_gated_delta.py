"""Time the op library's GatedDeltaNet alone at a Qwen3.5 layer's shape: prefill and decode.

One op (conv, delta rule, gated norm) over one slot, through ONNX Runtime as the engine runs
it: a prompt of --prompt-tokens in one call, then --decode-steps calls of one token. Each
library given is timed in turn within every repeat (the least time of the repeats), so a
second library (--baseline-lib: a build of the recurrent form, whose graphs have no `chunk`
attribute and whose state is the d x d matrix alone) is compared in the same run:

    .venv/bin/python bench/bench_gated_delta.py \
        --baseline-lib /tmp/oldlib/build/libedge_llm_ort_ops.so \
        --json-out bench/results/bench_gated_delta.json
"""
import argparse
import json
import pathlib
import sys
import time
from typing import Dict, List, Optional

import numpy as np
from onnx import helper, TensorProto
import onnxruntime as ort

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_llm_ros.convert.checkpoint import DELTA_CHUNK  # noqa: E402

# Qwen3.5-2B's DeltaNet layers (make_random_gguf.py qwen35-2b): 16 key and 16 value heads of
# 128, a 4-position conv.
K_HEADS, V_HEADS, D, KERNEL, EPS = 16, 16, 128, 4, 1e-6


def state_floats(chunk: int) -> int:
    """Return a slot's floats: the conv inputs, then per head S (and the chunk's tokens)."""
    head = D * D + (chunk * (2 * D + 1) if chunk else 0)
    return (KERNEL - 1) * (2 * K_HEADS + V_HEADS) * D + V_HEADS * head


def make_session(lib: str, chunk: int, threads: int) -> ort.InferenceSession:
    """One GatedDeltaNet node over rows; chunk 0 writes no attribute (the recurrent form)."""
    channels = (2 * K_HEADS + V_HEADS) * D
    rng = np.random.default_rng(0)
    consts = {'W': (0.5 * rng.standard_normal((channels, KERNEL))).astype(np.float32),
              'dt_bias': (0.5 * rng.standard_normal(V_HEADS)).astype(np.float32),
              'a': -rng.uniform(0.2, 2.0, V_HEADS).astype(np.float32),
              'norm': (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    names = ['qkv', 'z', 'alpha', 'beta', 'W', 'dt_bias', 'a', 'norm', 'past', '', 'rows']
    attrs = {'k_heads': K_HEADS, 'v_heads': V_HEADS, 'head_dim': D, 'epsilon': EPS}
    if chunk:
        attrs['chunk'] = chunk
    node = helper.make_node('GatedDeltaNet', names, ['Y', 'present'], domain='edge_llm_ros',
                            **attrs)
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [1, 'T', None])
              for n in ('qkv', 'z', 'alpha', 'beta')]
    inputs += [helper.make_tensor_value_info('past', f, ['N', None]),
               helper.make_tensor_value_info('rows', TensorProto.INT32, ['R', 4])]
    graph = helper.make_graph(
        [node], 'gdn', inputs,
        [helper.make_tensor_value_info('Y', f, [1, 'T', V_HEADS * D]),
         helper.make_tensor_value_info('present', f, ['N', None])],
        [helper.make_tensor(k, f, v.shape, v.ravel()) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17),
                                                    helper.make_opsetid('edge_llm_ros', 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(lib)
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=['CPUExecutionProvider'])


def inputs(n: int, seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = (2 * K_HEADS + V_HEADS) * D
    return {'qkv': rng.standard_normal((1, n, channels)).astype(np.float32),
            'z': rng.standard_normal((1, n, V_HEADS * D)).astype(np.float32),
            'alpha': rng.standard_normal((1, n, V_HEADS)).astype(np.float32),
            'beta': rng.standard_normal((1, n, V_HEADS)).astype(np.float32)}


def run_call(sess, x: Dict[str, np.ndarray], state: ort.OrtValue, start: int) -> np.ndarray:
    io = sess.io_binding()
    for k, v in x.items():
        io.bind_cpu_input(k, v)
    n = x['qkv'].shape[1]
    io.bind_cpu_input('rows', np.array([[0, start, n, 0]], np.int32))
    io.bind_ortvalue_input('past', state)
    io.bind_output('Y')
    io.bind_ortvalue_output('present', state)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0][0]


def time_once(sess, chunk: int, prompt: List[Dict], decode: List[Dict]) -> Dict[str, float]:
    """Seconds of thread CPU time for the prompt call and per decode call (1 thread)."""
    state = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, state_floats(chunk)), np.float32))
    t0 = time.thread_time()
    run_call(sess, prompt[0], state, 0)
    t1 = time.thread_time()
    start = prompt[0]['qkv'].shape[1]
    for i, x in enumerate(decode):
        run_call(sess, x, state, start + i)
    t2 = time.thread_time()
    return {'prefill_s': t1 - t0, 'decode_s': (t2 - t1) / max(1, len(decode))}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--lib', default=str(ROOT / 'build' / 'native' / 'libedge_llm_ort_ops.so'),
                    help="the op library of the chunked form (default: this checkout's build)")
    ap.add_argument('--baseline-lib', help='a recurrent-form build to compare in the same run')
    ap.add_argument('--chunk', type=int, default=DELTA_CHUNK,
                    help="the chunked form's chunk (default: the converter's)")
    ap.add_argument('--prompt-tokens', type=int, default=128)
    ap.add_argument('--decode-steps', type=int, default=64)
    ap.add_argument('--repeats', type=int, default=5)
    ap.add_argument('--json-out', type=pathlib.Path)
    args = ap.parse_args(argv)
    libs = {'chunked': (args.lib, args.chunk)}
    if args.baseline_lib:
        libs['recurrent'] = (args.baseline_lib, 0)
    # One thread: the op's own cost, measured as the calling thread's CPU time.
    sessions = {name: make_session(lib, chunk, 1) for name, (lib, chunk) in libs.items()}
    prompt = [inputs(args.prompt_tokens, 1)]
    decode = [inputs(1, 100 + i) for i in range(args.decode_steps)]
    for name, sess in sessions.items():   # warm-up
        time_once(sess, libs[name][1], prompt, decode[:2])
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in sessions}
    for _ in range(args.repeats):
        for name, sess in sessions.items():
            runs[name].append(time_once(sess, libs[name][1], prompt, decode))
    result = {'shape': {'k_heads': K_HEADS, 'v_heads': V_HEADS, 'head_dim': D,
                        'kernel': KERNEL, 'chunk': args.chunk},
              'prompt_tokens': args.prompt_tokens, 'decode_steps': args.decode_steps,
              'repeats': args.repeats, 'libraries': {}}
    print(f"GatedDeltaNet, one layer at Qwen3.5-2B's shape, 1 thread, thread CPU time "
          f'(the least of {args.repeats} repeats: the run least disturbed by other work):')
    print('| form | prefill us/token | decode us/token | state KiB/slot |')
    print('|---|---|---|---|')
    for name, rows in runs.items():
        pre = min(r['prefill_s'] for r in rows) / args.prompt_tokens * 1e6
        dec = min(r['decode_s'] for r in rows) * 1e6
        kib = state_floats(libs[name][1]) * 4 / 1024
        result['libraries'][name] = {'lib': libs[name][0], 'prefill_us_per_token': pre,
                                     'decode_us_per_token': dec, 'state_kib': kib}
        print(f'| {name} | {pre:.1f} | {dec:.1f} | {kib:.0f} |')
    if 'recurrent' in runs:
        c, r = result['libraries']['chunked'], result['libraries']['recurrent']
        result['prefill_speedup'] = r['prefill_us_per_token'] / c['prefill_us_per_token']
        result['decode_speedup'] = r['decode_us_per_token'] / c['decode_us_per_token']
        print(f'chunked / recurrent speed: prefill {result["prefill_speedup"]:.2f}x, '
              f'decode {result["decode_speedup"]:.2f}x')
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())

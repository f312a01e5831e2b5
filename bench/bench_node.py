"""llm_node benchmark: what the ROS layer costs on top of the engine.

    .venv/bin/python bench/bench_node.py [--model-path DIR] [--runs 5] [--soak 200]

Measures, on the embedded SmolLM2-135M (or --model-path), with the same prompt, greedy
decoding and prefix reuse off on both sides (every run prefills the whole prompt):
- decode tokens/s seen by an action client (feedback arrival times) vs the engine alone
  in this process (token event times); runs alternate so machine drift hits both alike;
- added latency to the first feedback: client send -> first token feedback, minus the
  engine-alone TTFT (medians), and minus the TTFT the node measured for the same goal
  (that difference is pure ROS + queue + DDS cost, free of CPU noise);
- the node's resident memory after the runs, and its growth over `--soak` sequential goals.
Prints one JSON object (also to --json) and a short table; targets are checked here, never
in tests. The machine is shared and noisy: compare the ratios, not the absolute numbers. The
engine's own decode rate (Timings) counts only its step time, so under CPU contention it
reads higher than any wall-clock rate; the interleaved wall-clock ratio is the target's.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Dict, List

import psutil
import rclpy
from rclpy.executors import MultiThreadedExecutor

from edge_llm_ros.client import LLMClient
from edge_llm_ros.engine.engine import Engine, EngineConfig
from edge_llm_ros.engine.types import GenerationRequest
from edge_llm_ros.node_process import NodeProcess

TARGETS = {'client_vs_engine_tokps': 0.95, 'added_first_feedback_ms': 5.0, 'rss_mb': 450.0,
           'soak_rss_growth': 0.05}
PROMPT = ('A mobile robot in a warehouse must move ten boxes to shelf B7 and avoid a forklift '
          'in aisle four. Write a step-by-step plan for its shift, with the checks it should '
          'make and how it recovers when something goes wrong.')
NODE_NAME = f'llm_node_bench_{os.getpid()}'


def start_node(model_path: str, threads: int) -> NodeProcess:
    return NodeProcess('llm_node', name=NODE_NAME, params={
        'autostart': True, 'kv.prefix_reuse': False, 'engine.intra_op_threads': threads,
        'model.path': model_path})


def engine_run(engine: Engine, max_tokens: int) -> Dict[str, float]:
    """One generation in this process; times of the first and last token event."""
    t_call = time.perf_counter()
    times: List[float] = []
    generation = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=max_tokens))
    for _ in generation:
        times.append(time.perf_counter())
    result = generation.result
    n = len(times)
    return {'tokens': n, 'ttft_s': times[0] - t_call,
            'tokps': (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
            'engine_decode_tokps': result.timings.decode_tokens_per_second}


def node_run(client: LLMClient, max_tokens: int) -> Dict[str, float]:
    """One goal; client-side arrival times of token feedback."""
    arrivals: List[tuple] = []

    def on_feedback(feedback) -> None:
        if feedback.token_ids:
            arrivals.append((time.perf_counter(), feedback.completion_tokens))
    t_send = time.perf_counter()
    handle = client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0,
                             on_feedback=on_feedback)
    outcome = handle.result(timeout=600)
    for _ in handle.stream(timeout=10):   # make sure the last feedback arrived
        pass
    assert outcome.ok, outcome
    first_t, first_n = arrivals[0]
    last_t, last_n = arrivals[-1]
    return {'tokens': outcome.completion_tokens,
            'first_feedback_s': first_t - t_send,
            'node_ttft_s': outcome.timings.time_to_first_token_s,
            'tokps': (last_n - first_n) / (last_t - first_t) if last_t > first_t else 0.0,
            'node_engine_decode_tokps': outcome.timings.decode_tokens_per_second}


def soak(client: LLMClient, pid: int, goals: int) -> Dict[str, float]:
    process = psutil.Process(pid)
    warm = max(1, min(20, goals // 10))
    samples = {}
    for i in range(1, goals + 1):
        outcome = client.generate('Name one color.', max_tokens=8).result(timeout=600)
        assert outcome.ok, outcome
        if i in (1, warm, goals):
            samples[i] = process.memory_info().rss
    base, end = samples[warm], samples[goals]
    return {'goals': goals, 'rss_after_first_mb': samples[1] / 2**20,
            'rss_after_warmup_mb': base / 2**20, 'warmup_goals': warm,
            'rss_end_mb': end / 2**20, 'growth': (end - base) / base}


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float('nan')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model-path', default='', help="converted model ('' = SmolLM2)")
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--max-tokens', type=int, default=96)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--soak', type=int, default=200, help='sequential goals (0 = skip)')
    parser.add_argument('--json', type=pathlib.Path, help='also write the JSON here')
    args = parser.parse_args()

    engine = Engine(EngineConfig(model_dir=args.model_path, prefix_reuse=False,
                                 intra_op_threads=args.threads))
    node = start_node(engine.model_dir, args.threads)
    rclpy.init()
    client_node = rclpy.create_node(f'bench_node_client_{os.getpid()}')
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(client_node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    client = LLMClient(client_node, node.fqn)
    try:
        node.wait_until_active(client, timeout=600)
        if not client.wait_for_server(timeout=120):
            raise SystemExit(f'{node.fqn}/generate did not appear')
        node_run(client, 4)
        engine_run(engine, 4)
        alone, served = [], []
        for _ in range(args.runs):   # alternate: drift of this shared machine hits both
            alone.append(engine_run(engine, args.max_tokens))
            served.append(node_run(client, args.max_tokens))
        rss = psutil.Process(node.pid).memory_info().rss
        soaked = soak(client, node.pid, args.soak) if args.soak else {}
    finally:
        engine.close()
        # rclpy down in order (client, executor and its thread, node, context) before the
        # process exits: a context shut down under a spinning executor aborts the process.
        client.destroy()
        executor.shutdown(timeout_sec=5)
        spinner.join(timeout=10)
        client_node.destroy_node()
        rclpy.try_shutdown()
        node_exit_code = node.stop()
        if node_exit_code != 0:
            print(f'bench_node: {node.fqn} exited with code {node_exit_code} on SIGINT; its '
                  f'last output:\n{node.tail()}', file=sys.stderr)

    engine_tokps = median([r['tokps'] for r in alone])
    client_tokps = median([r['tokps'] for r in served])
    first_fb = median([r['first_feedback_s'] for r in served])
    engine_ttft = median([r['ttft_s'] for r in alone])
    overhead = median([r['first_feedback_s'] - r['node_ttft_s'] for r in served])
    # Same goal, same process: what the client sees vs the engine's own decode rate inside
    # the node (which leaves out the per-token feedback work and any preemption there).
    in_node = median([r['tokps'] / r['node_engine_decode_tokps'] for r in served])
    report = {
        'model': engine.model_name, 'runs': args.runs, 'max_tokens': args.max_tokens,
        'threads': args.threads, 'machine_load_1min': os.getloadavg()[0],
        'engine_alone_tokps': engine_tokps, 'client_tokps': client_tokps,
        'client_vs_engine_tokps': client_tokps / engine_tokps,
        'client_vs_in_node_engine_tokps': in_node,
        'engine_alone_ttft_ms': engine_ttft * 1e3, 'first_feedback_ms': first_fb * 1e3,
        'added_first_feedback_ms': (first_fb - engine_ttft) * 1e3,
        'ros_overhead_first_feedback_ms': overhead * 1e3,
        'node_rss_mb': rss / 2**20, 'soak': soaked, 'alone': alone, 'served': served,
        'node_exit_code': node_exit_code,
    }
    checks = {
        'client_vs_engine_tokps': report['client_vs_engine_tokps'] >= TARGETS[
            'client_vs_engine_tokps'],
        'added_first_feedback_ms': report['ros_overhead_first_feedback_ms'] <= TARGETS[
            'added_first_feedback_ms'],
        'rss_mb': report['node_rss_mb'] <= TARGETS['rss_mb'],
    }
    if soaked:
        checks['soak_rss_growth'] = soaked['growth'] <= TARGETS['soak_rss_growth']
    report['targets'] = TARGETS
    report['meets'] = checks
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    rows = [
        ('decode tok/s, engine alone', f'{engine_tokps:.1f}', ''),
        ('decode tok/s, action client', f'{client_tokps:.1f}',
         f'ratio {report["client_vs_engine_tokps"]:.3f} (target >= 0.95)'),
        ('client vs engine inside the node', f'{in_node:.3f}', 'same goal (median ratio)'),
        ('TTFT engine alone (ms)', f'{engine_ttft * 1e3:.1f}', ''),
        ('first feedback at client (ms)', f'{first_fb * 1e3:.1f}',
         f'+{report["added_first_feedback_ms"]:.1f} ms vs engine alone'),
        ('ROS overhead to first feedback (ms)', f'{overhead * 1e3:.2f}',
         'client latency - TTFT inside node (target <= 5)'),
        ('node RSS (MB)', f'{rss / 2**20:.0f}', 'target <= 450'),
    ]
    if soaked:
        rows.append((f'RSS growth over {soaked["goals"]} goals', f'{soaked["growth"]:+.2%}',
                     f'{soaked["rss_after_warmup_mb"]:.0f} -> {soaked["rss_end_mb"]:.0f} MB '
                     '(target <= 5%)'))
    print('\n'.join(f'{a:<38} {b:>10}  {c}' for a, b, c in rows), file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

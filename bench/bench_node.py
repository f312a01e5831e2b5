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
The client spins in a SingleThreadedExecutor on a background thread (as `edge-llm ask` does),
on a node without parameter services: every feedback message wakes that executor, and
rclpy's per-wake cost is what a client pays per token.
The JSON's `targets` says, per target: the target, the measured value, met or missed, and by
how much; the 1-minute load average is recorded before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Dict, List

import psutil
import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.client import LLMClient
from edge_llm_ros.node_process import NodeProcess
from edge_llm_ros.nodes import spin
from edge_llm_ros.nodes.llm_node import GIL_SWITCH_INTERVAL_S
from edge_llm_ros.runtime.types import GenerationRequest
from edge_llm_ros.serving.engine import Engine, EngineConfig

# name: (target, 'min' = the measured value must be at least the target, 'max' = at most)
TARGETS = {'client_vs_engine_tokps': (0.95, 'min'),
           'ros_overhead_first_feedback_ms': (5.0, 'max'),
           'node_rss_mb': (450.0, 'max'), 'soak_rss_growth': (0.05, 'max')}
PROMPT = ('A mobile robot in a warehouse must move ten boxes to shelf B7 and avoid a forklift '
          'in aisle four. Write a step-by-step plan for its shift, with the checks it should '
          'make and how it recovers when something goes wrong.')
NODE_NAME = f'llm_node_bench_{os.getpid()}'


def start_node(model_path: str, threads: int) -> NodeProcess:
    return NodeProcess('llm_node', name=NODE_NAME, params={
        'autostart': True, 'kv.prefix_reuse': False, 'engine.intra_op_threads': threads,
        'model.path': model_path})


def cpu_s(processes: List[psutil.Process]) -> float:
    """CPU seconds (user + system) the processes used so far."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def engine_run(engine: Engine, max_tokens: int) -> Dict[str, float]:
    """One generation in this process; times of the first and last token event."""
    here = [psutil.Process()]
    cpu0 = cpu_s(here)
    t_call = time.perf_counter()
    times: List[float] = []
    generation = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=max_tokens))
    for _ in generation:
        times.append(time.perf_counter())
    result = generation.result
    n = len(times)
    return {'tokens': n, 'ttft_s': times[0] - t_call,
            'tokps': (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
            'engine_decode_tokps': result.timings.decode_tokens_per_second,
            'cpu_ms_per_token': (cpu_s(here) - cpu0) * 1e3 / max(n, 1)}


def node_run(client: LLMClient, max_tokens: int, node_pid: int) -> Dict[str, float]:
    """One goal; client-side arrival times of token feedback, CPU of node and client."""
    arrivals: List[tuple] = []
    both = [psutil.Process(), psutil.Process(node_pid)]
    cpu0 = cpu_s(both)

    def on_feedback(feedback) -> None:
        if feedback.token_ids:
            arrivals.append((time.perf_counter(), feedback.completion_tokens))
    t_send = time.perf_counter()
    handle = client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0,
                             on_feedback=on_feedback)
    outcome = handle.result(timeout=600)
    for _ in handle.stream(timeout=10):   # make sure the last feedback arrived
        pass
    cpu = cpu_s(both) - cpu0
    assert outcome.ok, outcome
    first_t, first_n = arrivals[0]
    last_t, last_n = arrivals[-1]
    return {'tokens': outcome.completion_tokens,
            'first_feedback_s': first_t - t_send,
            'node_ttft_s': outcome.timings.time_to_first_token_s,
            'node_queue_wait_s': outcome.timings.queue_wait_s,
            'tokps': (last_n - first_n) / (last_t - first_t) if last_t > first_t else 0.0,
            'node_engine_decode_tokps': outcome.timings.decode_tokens_per_second,
            'cpu_ms_per_token': cpu * 1e3 / max(outcome.completion_tokens, 1)}


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


def judge(name: str, measured: float) -> Dict[str, object]:
    """One target's verdict: target, measured, met, and by how much it was missed."""
    target, kind = TARGETS[name]
    met = measured >= target if kind == 'min' else measured <= target
    miss = 0.0 if met else abs(measured - target)
    return {'target': target, 'kind': 'at least' if kind == 'min' else 'at most',
            'measured': measured, 'met': met, 'missed_by': miss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model-path', default='', help="converted model ('' = SmolLM2)")
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--max-tokens', type=int, default=96)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--soak', type=int, default=200, help='sequential goals (0 = skip)')
    parser.add_argument('--json', type=pathlib.Path, help='also write the JSON here')
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    # The engine-alone runs share this process with the client's executor thread: give them
    # the GIL handoff llm_node's decode thread gets.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    engine = Engine(EngineConfig(model_dir=args.model_path, prefix_reuse=False,
                                 intra_op_threads=args.threads))
    node = start_node(engine.model_dir, args.threads)
    spin.init()
    client_node = rclpy.create_node(f'bench_node_client_{os.getpid()}',
                                    start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(client_node)
    spinning = spin.BackgroundSpin(executor)
    client = LLMClient(client_node, node.fqn)
    try:
        node.wait_until_active(client, timeout=600)
        if not client.wait_for_server(timeout=120):
            raise SystemExit(f'{node.fqn}/generate did not appear')
        node_run(client, 4, node.pid)
        engine_run(engine, 4)
        alone, served = [], []
        for _ in range(args.runs):   # alternate: drift of this shared machine hits both
            alone.append(engine_run(engine, args.max_tokens))
            served.append(node_run(client, args.max_tokens, node.pid))
        rss = psutil.Process(node.pid).memory_info().rss
        soaked = soak(client, node.pid, args.soak) if args.soak else {}
    finally:
        engine.close()
        spin.close_client(spinning, executor, client_node, client)
        node_exit_code = node.stop()
        if node_exit_code != 0:
            print(f'bench_node: {node.fqn} exited with code {node_exit_code} on SIGINT; its '
                  f'last output:\n{node.tail()}', file=sys.stderr)

    engine_tokps = median([r['tokps'] for r in alone])
    client_tokps = median([r['tokps'] for r in served])
    first_fb = median([r['first_feedback_s'] for r in served])
    engine_ttft = median([r['ttft_s'] for r in alone])
    overhead = median([r['first_feedback_s'] - r['node_ttft_s'] for r in served])
    # Each served run against the engine-alone run just before it (drift-free pairs).
    pair_ratio = median([s['tokps'] / a['tokps'] for a, s in zip(alone, served)])
    # Same goal, same process: what the client sees vs the engine's own decode rate inside
    # the node (which leaves out the per-token feedback work and any preemption there).
    in_node = median([r['tokps'] / r['node_engine_decode_tokps'] for r in served])
    # Load-independent view of the same cost: CPU per token, engine alone vs node + client
    # (includes ORT's spinning threads, so it is a rough measure; compare runs with it).
    cpu_alone = median([r['cpu_ms_per_token'] for r in alone])
    cpu_served = median([r['cpu_ms_per_token'] for r in served])
    report = {
        'model': engine.model_name, 'runs': args.runs, 'max_tokens': args.max_tokens,
        'threads': args.threads, 'machine_load_1min_before': load_before,
        'machine_load_1min_after': os.getloadavg()[0], 'cpus': os.cpu_count(),
        'engine_alone_tokps': engine_tokps, 'client_tokps': client_tokps,
        'client_vs_engine_tokps': client_tokps / engine_tokps,
        'client_vs_engine_tokps_pairs_median': pair_ratio,
        'client_vs_in_node_engine_tokps': in_node,
        'cpu_ms_per_token_alone': cpu_alone, 'cpu_ms_per_token_served': cpu_served,
        'cpu_alone_vs_served': cpu_alone / cpu_served,
        'node_queue_wait_ms': median([r['node_queue_wait_s'] for r in served]) * 1e3,
        'engine_alone_ttft_ms': engine_ttft * 1e3, 'first_feedback_ms': first_fb * 1e3,
        'added_first_feedback_ms': (first_fb - engine_ttft) * 1e3,
        'ros_overhead_first_feedback_ms': overhead * 1e3,
        'node_rss_mb': rss / 2**20, 'soak': soaked, 'alone': alone, 'served': served,
        'node_exit_code': node_exit_code,
    }
    verdicts = {name: judge(name, report[name]) for name in
                ('client_vs_engine_tokps', 'ros_overhead_first_feedback_ms', 'node_rss_mb')}
    if soaked:
        verdicts['soak_rss_growth'] = judge('soak_rss_growth', soaked['growth'])
    report['targets'] = verdicts
    report['all_targets_met'] = all(v['met'] for v in verdicts.values())
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)

    def verdict(name: str, unit: str = '') -> str:
        v = verdicts[name]
        sign = '>=' if v['kind'] == 'at least' else '<='
        state = 'met' if v['met'] else f'MISSED by {v["missed_by"]:.3g}{unit}'
        return f'target {sign} {v["target"]:g}{unit}: {state}'
    rows = [
        ('decode tok/s, engine alone', f'{engine_tokps:.1f}', ''),
        ('decode tok/s, action client', f'{client_tokps:.1f}', ''),
        ('client / engine alone (medians)', f'{report["client_vs_engine_tokps"]:.3f}',
         verdict('client_vs_engine_tokps')),
        ('client / engine alone (pairs, median)', f'{pair_ratio:.3f}', 'same drift'),
        ('client vs engine inside the node', f'{in_node:.3f}', 'same goal (median ratio)'),
        ('CPU ms/token alone vs node+client', f'{cpu_alone:.2f}/{cpu_served:.2f}',
         f'ratio {cpu_alone / cpu_served:.3f} (load-independent, rough)'),
        ('TTFT engine alone (ms)', f'{engine_ttft * 1e3:.1f}', ''),
        ('first feedback at client (ms)', f'{first_fb * 1e3:.1f}',
         f'{report["added_first_feedback_ms"]:+.1f} ms vs engine alone'),
        ('ROS overhead to first feedback (ms)', f'{overhead * 1e3:.2f}',
         'client latency - TTFT inside node; ' + verdict('ros_overhead_first_feedback_ms',
                                                         ' ms')),
        ('node RSS (MB)', f'{rss / 2**20:.0f}', verdict('node_rss_mb', ' MB')),
    ]
    if soaked:
        rows.append((f'RSS growth over {soaked["goals"]} goals', f'{soaked["growth"]:+.2%}',
                     f'{soaked["rss_after_warmup_mb"]:.0f} -> {soaked["rss_end_mb"]:.0f} MB; '
                     + verdict('soak_rss_growth')))
    rows.append(('load average (1 min) before/after',
                 f'{load_before:.1f}/{report["machine_load_1min_after"]:.1f}',
                 f'{os.cpu_count()} CPUs'))
    print('\n'.join(f'{a:<38} {b:>10}  {c}' for a, b, c in rows), file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

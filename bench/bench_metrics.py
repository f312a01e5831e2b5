"""What Prometheus metrics cost llm_node's decode rate: the same node, /metrics on vs off.

    .venv/bin/python bench/bench_metrics.py [--rounds 16] [--max-tokens 128]
        [--scrape-period-s 1.0] [--json-out FILE]

Three llm_node processes with the same parameters (the embedded SmolLM2-135M unless
--model-path, greedy, prefix reuse off so every goal prefills its whole prompt) run side by
side: `on` with metrics.port set and scraped over HTTP every --scrape-period-s for the whole
run (Prometheus' default is 15 s: 1 s is 15x harsher), `off` with metrics.port 0, and
`control`, a second `off` node: control / off shows how far two identical nodes differ on
this machine (the noise floor the on / off figure must be read against). Goals rotate over
the three nodes, the order shifted every round, so the drift of a shared machine hits all
alike; only one node decodes at a time. Per goal: the client's decode rate (token feedback
arrival times, as bench_node.py measures it) and the engine's own rate from the result.
The figure recorder behind /diagnostics runs in every node (it is the diagnostics' source
too): what differs is the HTTP server and the scrapes, so the cost is 1 - on/off.
A load-independent bound comes last: the `on` node's CPU time per scrape (back-to-back
scrapes of the idle node, minus its idle CPU rate), over the scrape period.
Prints one JSON object (also to --json-out) and a short table; the target (cost <= 1%) is
checked here, never in tests.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import socket
import statistics
import sys
import threading
import time
from typing import Dict, List
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
import psutil
import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.client import LLMClient
from edge_llm_ros.node_process import NodeProcess
from edge_llm_ros.nodes import spin

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # bench/ helpers
bench_node = importlib.import_module('bench_node')
median, node_run, cpu_s = bench_node.median, bench_node.node_run, bench_node.cpu_s

TARGET_COST = 0.01   # at most 1% lower decode tok/s with metrics on
NODES = ('off', 'on', 'control')
CPU_SCRAPES = 200    # back-to-back scrapes of the idle node for the CPU bound


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


class Scraper:
    """Scrapes /metrics every `period` seconds on a thread; keeps each scrape's latency."""

    def __init__(self, url: str, period: float) -> None:
        self.url, self.period = url, period
        self.latencies_s: List[float] = []
        self.failures: List[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            t0 = time.perf_counter()
            try:
                fetch(self.url)
            except OSError as exc:
                self.failures.append(str(exc))
                continue
            self.latencies_s.append(time.perf_counter() - t0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def goals_scraped(url: str) -> int:
    """Count the goals the `on` node recorded (sanity: every bench goal was)."""
    text = fetch(url).decode()
    return int(sum(s.value for f in text_string_to_metric_families(text)
                   if f.name == 'edge_llm_goal_duration_seconds'
                   for s in f.samples if s.name.endswith('_count')))


def scrape_cpu_ms(url: str, pid: int, scrapes: int) -> Dict[str, float]:
    """CPU ms the idle node spends per scrape: back-to-back scrapes minus its idle rate."""
    node = [psutil.Process(pid)]
    cpu0, t0 = cpu_s(node), time.perf_counter()
    time.sleep(3.0)
    idle_rate = (cpu_s(node) - cpu0) / (time.perf_counter() - t0)
    cpu0, t0 = cpu_s(node), time.perf_counter()
    for _ in range(scrapes):
        fetch(url)
    wall = time.perf_counter() - t0
    used = cpu_s(node) - cpu0 - idle_rate * wall
    return {'scrapes': scrapes, 'idle_cpu_share': idle_rate,
            'cpu_ms_per_scrape': max(used, 0.0) * 1e3 / scrapes,
            'wall_ms_per_scrape': wall * 1e3 / scrapes}


def ratios(runs: Dict[str, List[dict]], key: str, a: str, b: str) -> Dict[str, float]:
    """Compare node a with b on `key`: medians, per-round ratios' median and quartiles."""
    pairs = sorted(x[key] / y[key] for x, y in zip(runs[a], runs[b]))
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return {a: median([r[key] for r in runs[a]]), b: median([r[key] for r in runs[b]]),
            'pairs_median': median(pairs), 'pairs_q1': quartiles[0],
            'pairs_q3': quartiles[2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model-path', default='', help="converted model ('' = SmolLM2)")
    parser.add_argument('--rounds', type=int, default=16)
    parser.add_argument('--max-tokens', type=int, default=128)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--scrape-period-s', type=float, default=1.0)
    parser.add_argument('--json-out', type=pathlib.Path, help='also write the JSON here')
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    port = free_port()
    url = f'http://127.0.0.1:{port}/metrics'
    params = {'autostart': True, 'kv.prefix_reuse': False, 'model.path': args.model_path,
              'engine.intra_op_threads': args.threads}
    tag = os.getpid()
    nodes = {key: NodeProcess('llm_node', name=f'llm_node_metrics_{key}_{tag}', params={
        **params, 'metrics.port': port if key == 'on' else 0}) for key in NODES}
    spin.init()
    client_node = rclpy.create_node(f'bench_metrics_client_{tag}',
                                    start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(client_node)
    spinning = spin.BackgroundSpin(executor)
    clients = {k: LLMClient(client_node, node.fqn) for k, node in nodes.items()}
    scraper = Scraper(url, args.scrape_period_s)
    runs: Dict[str, List[dict]] = {key: [] for key in NODES}
    exit_codes = {}
    try:
        for key, node in nodes.items():
            node.wait_until_active(clients[key], timeout=600)
            if not clients[key].wait_for_server(timeout=120):
                raise SystemExit(f'{node.fqn}/generate did not appear')
            node_run(clients[key], 4, node.pid)   # warm-up
        scraper.start()
        t0 = time.monotonic()
        for index in range(args.rounds):
            shift = index % len(NODES)
            for key in NODES[shift:] + NODES[:shift]:
                runs[key].append(node_run(clients[key], args.max_tokens, nodes[key].pid))
        elapsed = time.monotonic() - t0
        scraper.stop()
        recorded = goals_scraped(url)
        cpu = scrape_cpu_ms(url, nodes['on'].pid, CPU_SCRAPES)
    finally:
        scraper.stop()
        spin.close_client(spinning, executor, client_node, *clients.values())
        for key, node in nodes.items():
            exit_codes[key] = node.stop()

    client = ratios(runs, 'tokps', 'on', 'off')
    control = ratios(runs, 'tokps', 'control', 'off')
    engine = ratios(runs, 'node_engine_decode_tokps', 'on', 'off')
    # CPU (node + client) per token: steadier than wall-clock rates when the machine is busy.
    cpu_per_token = ratios(runs, 'cpu_ms_per_token', 'on', 'off')
    cost = 1.0 - client['pairs_median']
    bound = cpu['cpu_ms_per_scrape'] / (args.scrape_period_s * 1e3)
    report = {
        'rounds': args.rounds, 'max_tokens': args.max_tokens, 'threads': args.threads,
        'scrape_period_s': args.scrape_period_s, 'scrapes': len(scraper.latencies_s),
        'scrape_failures': scraper.failures[:5],
        'scrape_latency_ms_median': median(scraper.latencies_s) * 1e3,
        'scrape_latency_ms_max': max(scraper.latencies_s, default=0.0) * 1e3,
        'scrape_cpu': cpu,
        # CPU per scrape over the period: the most a scrape can take from the decode thread.
        'cost_bound_from_scrape_cpu': bound,
        'goals_recorded_by_on_node': recorded, 'goals_sent_to_on_node': args.rounds + 1,
        'client_tokps_on_vs_off': client, 'client_tokps_control_vs_off': control,
        'engine_decode_tokps_on_vs_off': engine, 'cpu_ms_per_token_on_vs_off': cpu_per_token,
        'noise_floor': abs(1.0 - control['pairs_median']),
        # Two identical nodes differ by more than the target: this run cannot resolve it.
        'resolves_target': abs(1.0 - control['pairs_median']) <= TARGET_COST,
        'target_cost': TARGET_COST, 'cost': cost, 'target_met': cost <= TARGET_COST,
        'seconds': elapsed, 'cpus': os.cpu_count(),
        'machine_load_1min_before': load_before,
        'machine_load_1min_after': os.getloadavg()[0], 'node_exit_codes': exit_codes,
        'runs': runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)

    def spread(r: Dict[str, float]) -> str:
        return f'{r["pairs_median"]:.4f}', f'quartiles {r["pairs_q1"]:.3f}-{r["pairs_q3"]:.3f}'
    rows = [
        ('decode tok/s (client), off / on', f'{client["off"]:.1f}/{client["on"]:.1f}',
         f'medians; on scraped every {args.scrape_period_s:g} s'),
        ('on / off (per-round pairs, median)', *spread(client)),
        ('control / off (same config: noise)', *spread(control)),
        ('engine decode on / off (pairs)', *spread(engine)),
        ('CPU ms/token on / off (pairs)', *spread(cpu_per_token)),
        ('metrics cost on decode tok/s', f'{cost:+.2%}',
         f'target <= {TARGET_COST:.0%}: ' + ('met' if report['target_met'] else 'MISSED')
         + f'; noise floor {report["noise_floor"]:.2%}'
         + ('' if report['resolves_target'] else ' (too noisy to resolve 1%)')),
        ('node CPU per scrape (ms)', f'{cpu["cpu_ms_per_scrape"]:.2f}',
         f'bound at this period: {bound:.3%} of a core'),
        ('scrape latency (ms, median)', f'{report["scrape_latency_ms_median"]:.2f}',
         f'max {report["scrape_latency_ms_max"]:.1f}; {len(scraper.latencies_s)} scrapes'),
        ('goals recorded / sent (on node)', f'{recorded}/{args.rounds + 1}', ''),
        ('load average (1 min) before/after',
         f'{load_before:.1f}/{report["machine_load_1min_after"]:.1f}',
         f'{os.cpu_count()} CPUs'),
    ]
    print('\n'.join(f'{a:<36} {b:>12}  {c}' for a, b, c in rows), file=sys.stderr)
    return 0 if all(code == 0 for code in exit_codes.values()) else 1


if __name__ == '__main__':
    sys.exit(main())

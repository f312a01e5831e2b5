"""openai_bridge benchmark: what HTTP costs on top of the action, and streams under load.

    .venv/bin/python bench/bench_bridge.py [--model-path DIR] [--runs 15] [--clients 8]

llm_node (the embedded SmolLM2-135M, or --model-path; prefix reuse off, feedback every
token) and openai_bridge run as processes, as on a robot.
1. First streamed token, alternating runs of the same kind of goal: through the action
   (LLMClient: send -> first token feedback) and through the bridge (raw httpx: POST -> first
   SSE chunk with content). Each is measured minus the TTFT the node measured for that very
   goal (from the result, or from the goal's ~/transcript for HTTP), which leaves out the
   engine's own (noisy) prefill; the target is on the difference of the p50s.
2. `--clients` concurrent streaming HTTP clients, `--requests` each, every third request
   dropped (connection closed) after a few chunks. Every stream is checked against the
   goal's ~/transcript: a completed stream's text equals the result text exactly with the
   same finish reason; a dropped one is a prefix of the result text and its goal ended
   'cancelled'. Anything else (an error, a lost or duplicated token) is counted as a failure.
Prints one JSON object (also to --json) and a short table.
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional
import uuid

import httpx
import rclpy
from rclpy.executors import MultiThreadedExecutor

from edge_llm_msgs.msg import Transcript
from edge_llm_ros.client import LLMClient
from edge_llm_ros.node_process import NodeProcess
from edge_llm_ros.nodes import spin
from edge_llm_ros.nodes.openai_bridge import wait_serving
from edge_llm_ros.qos import TRANSCRIPT_QOS

TARGET_ADDED_FIRST_TOKEN_MS = 10.0
MODEL = 'edge-llm'
PROMPT = 'Write a short plan for a robot that must tidy a kitchen. Run {tag}.'
DROP_AFTER_CHUNKS = 4


class Transcripts:
    """The node's ~/transcript records, looked up by the last user message."""

    def __init__(self, node, server: str) -> None:
        self._by_text: Dict[str, Transcript] = {}
        self._cond = threading.Condition()
        node.create_subscription(Transcript, f'{server}/transcript', self._on, TRANSCRIPT_QOS)

    def _on(self, msg: Transcript) -> None:
        said = msg.messages[-1].content if msg.messages else msg.prompt
        with self._cond:
            self._by_text[said] = msg
            self._cond.notify_all()

    def wait(self, text: str, timeout: float = 120.0) -> Transcript:
        with self._cond:
            if not self._cond.wait_for(lambda: text in self._by_text, timeout):
                raise TimeoutError(f'no transcript for {text!r} within {timeout} s')
            return self._by_text[text]


def action_first_token(client: LLMClient, max_tokens: int) -> Dict[str, float]:
    text = PROMPT.format(tag=uuid.uuid4().hex[:8])
    first: List[float] = []

    def on_feedback(feedback) -> None:
        if feedback.token_ids and not first:
            first.append(time.perf_counter())
    sent = time.perf_counter()
    outcome = client.generate(messages=[('user', text)], max_tokens=max_tokens,
                              temperature=0.0, on_feedback=on_feedback).result(timeout=300)
    deadline = time.monotonic() + 10
    while not first and time.monotonic() < deadline:
        time.sleep(0.001)
    first_s = first[0] - sent
    return {'first_token_ms': first_s * 1e3,
            'node_ttft_ms': outcome.timings.time_to_first_token_s * 1e3,
            'overhead_ms': (first_s - outcome.timings.time_to_first_token_s) * 1e3}


def _body(text: str, max_tokens: int) -> dict:
    return {'model': MODEL, 'messages': [{'role': 'user', 'content': text}],
            'max_tokens': max_tokens, 'temperature': 0, 'stream': True}


def _content(line: str) -> Optional[dict]:
    if not line.startswith('data:') or line.strip() == 'data: [DONE]':
        return None
    return json.loads(line[5:])


def http_first_token(http: httpx.Client, url: str, transcripts: Transcripts,
                     max_tokens: int) -> Dict[str, float]:
    text = PROMPT.format(tag=uuid.uuid4().hex[:8])
    first = None
    sent = time.perf_counter()
    with http.stream('POST', f'{url}/chat/completions', json=_body(text, max_tokens)) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            chunk = _content(line)
            if first is None and chunk and chunk['choices'] and \
                    chunk['choices'][0]['delta'].get('content'):
                first = time.perf_counter()
    record = transcripts.wait(text)
    ttft = record.timings.time_to_first_token_s
    return {'first_token_ms': (first - sent) * 1e3, 'node_ttft_ms': ttft * 1e3,
            'overhead_ms': (first - sent - ttft) * 1e3}


def stream_client(url: str, index: int, requests: int, max_tokens: int,
                  out: List[dict]) -> None:
    """One HTTP client: sequential streams, every third one dropped after a few chunks."""
    with httpx.Client(timeout=600) as http:
        for number in range(requests):
            text = f'Client {index} request {number}: name a tool a robot uses.'
            drop = number % 3 == 2
            record = {'client': index, 'text': text, 'dropped': drop, 'deltas': [],
                      'finish_reason': None, 'error': None, 'done': False}
            try:
                with http.stream('POST', f'{url}/chat/completions',
                                 json=_body(text, max_tokens)) as reply:
                    if reply.status_code != 200:
                        record['error'] = f'{reply.status_code}: {reply.read()[:200]!r}'
                    else:
                        chunks = 0
                        for line in reply.iter_lines():
                            if line.strip() == 'data: [DONE]':
                                record['done'] = True
                                break
                            chunk = _content(line)
                            if chunk is None:
                                continue
                            if 'error' in chunk:
                                record['error'] = chunk['error'].get('message')
                                continue
                            for choice in chunk['choices']:
                                if choice['delta'].get('content'):
                                    record['deltas'].append(choice['delta']['content'])
                                    chunks += 1
                                record['finish_reason'] = (choice.get('finish_reason')
                                                           or record['finish_reason'])
                            if drop and chunks >= DROP_AFTER_CHUNKS:
                                break   # leaving the block drops the connection
            except httpx.HTTPError as exc:
                record['error'] = f'{type(exc).__name__}: {exc}'
            out.append(record)


def check_stream(record: dict, transcripts: Transcripts) -> Dict[str, object]:
    """Compare one stream against its goal's transcript (see the module docstring)."""
    streamed = ''.join(record['deltas'])
    if record['error']:
        return {'ok': False, 'why': f'error: {record["error"]}'}
    try:
        result = transcripts.wait(record['text'], timeout=60)
    except TimeoutError as exc:
        return {'ok': False, 'why': str(exc)}
    if record['dropped'] and not record['done']:
        ok = result.finish_reason == 'cancelled' and result.text.startswith(streamed)
        return {'ok': ok, 'kind': 'cancelled',
                'why': '' if ok else f'goal ended {result.finish_reason!r}, or the stream is '
                                     'not a prefix of the result'}
    ok = streamed == result.text and record['finish_reason'] == result.finish_reason
    return {'ok': ok, 'kind': 'complete',
            'why': '' if ok else f'streamed {streamed!r} ({record["finish_reason"]}) vs '
                                 f'result {result.text!r} ({result.finish_reason})'}


def p50(values: List[float]) -> float:
    return statistics.median(values) if values else float('nan')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model-path', default='', help="converted model ('' = SmolLM2)")
    parser.add_argument('--runs', type=int, default=15)
    parser.add_argument('--max-tokens', type=int, default=8)
    parser.add_argument('--clients', type=int, default=8)
    parser.add_argument('--requests', type=int, default=3, help='streams per client')
    parser.add_argument('--stream-tokens', type=int, default=24)
    parser.add_argument('--json', type=pathlib.Path, help='also write the JSON here')
    args = parser.parse_args()

    pid = os.getpid()
    node = NodeProcess('llm_node', name=f'llm_bench_bridge_{pid}', params={
        'autostart': True, 'kv.prefix_reuse': False, 'model.path': args.model_path,
        'feedback.period_tokens': 1, 'queue.depth': max(8, args.clients)})
    bridge = NodeProcess('openai_bridge', name=f'bridge_bench_{pid}',
                         params={'port': 0, 'llm_node': node.fqn, 'model_id': MODEL})
    spin.init()
    ros_node = rclpy.create_node(f'bench_bridge_client_{pid}', start_parameter_services=False)
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(ros_node)
    spinning = spin.BackgroundSpin(executor)
    client = LLMClient(ros_node, node.fqn)
    transcripts = Transcripts(ros_node, node.fqn)
    load_before = os.getloadavg()[0]
    try:
        url = wait_serving(bridge, 60)
        node.wait_until_active(client, timeout=600)
        client.wait_for_server(timeout=120)
        with httpx.Client(timeout=600) as http:
            action_first_token(client, 2)
            http_first_token(http, url, transcripts, 2)   # warm both paths
            action, served = [], []
            for _ in range(args.runs):
                action.append(action_first_token(client, args.max_tokens))
                served.append(http_first_token(http, url, transcripts, args.max_tokens))
        records: List[dict] = []
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda i: stream_client(url, i, args.requests, args.stream_tokens,
                                                  records), range(args.clients)))
        concurrent_s = time.perf_counter() - started
        checks = [dict(check_stream(r, transcripts), client=r['client'], text=r['text'])
                  for r in records]
    finally:
        spin.close_client(spinning, executor, ros_node, client)
        codes = {'bridge': bridge.stop(), 'llm_node': node.stop()}

    added = p50([r['overhead_ms'] for r in served]) - p50([r['overhead_ms'] for r in action])
    failures = [c for c in checks if not c['ok']]
    report = {
        'model': args.model_path or 'SmolLM2-135M (embedded)', 'runs': args.runs,
        'max_tokens': args.max_tokens, 'cpus': os.cpu_count(),
        'machine_load_1min_before': load_before, 'machine_load_1min_after': os.getloadavg()[0],
        'action_first_token_p50_ms': p50([r['first_token_ms'] for r in action]),
        'bridge_first_token_p50_ms': p50([r['first_token_ms'] for r in served]),
        'action_overhead_p50_ms': p50([r['overhead_ms'] for r in action]),
        'bridge_overhead_p50_ms': p50([r['overhead_ms'] for r in served]),
        'bridge_added_first_token_p50_ms': added,
        'target_added_first_token_ms': TARGET_ADDED_FIRST_TOKEN_MS,
        'first_token_target_met': added <= TARGET_ADDED_FIRST_TOKEN_MS,
        'concurrent': {'clients': args.clients, 'streams': len(checks),
                       'complete': sum(c.get('kind') == 'complete' and c['ok'] for c in checks),
                       'cancelled': sum(c.get('kind') == 'cancelled' and c['ok']
                                        for c in checks),
                       'failures': failures, 'seconds': concurrent_s},
        'streams_target_met': not failures and len(checks) == args.clients * args.requests,
        'exit_codes': codes, 'action': action, 'bridge': served,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    rows = [
        ('first token via action, p50 (ms)', f'{report["action_first_token_p50_ms"]:.1f}',
         f'node TTFT excluded: {report["action_overhead_p50_ms"]:.2f} ms'),
        ('first token via bridge, p50 (ms)', f'{report["bridge_first_token_p50_ms"]:.1f}',
         f'node TTFT excluded: {report["bridge_overhead_p50_ms"]:.2f} ms'),
        ('bridge added latency, p50 (ms)', f'{added:.2f}',
         f'target <= {TARGET_ADDED_FIRST_TOKEN_MS:g}: '
         + ('met' if report['first_token_target_met'] else 'MISSED')),
        (f'{args.clients} clients x {args.requests} streams',
         f'{report["concurrent"]["complete"]}+{report["concurrent"]["cancelled"]}',
         'complete + cleanly cancelled; ' + (f'{len(failures)} FAILED' if failures
                                             else 'no token lost or duplicated')),
        ('exit codes (bridge, llm_node)', f'{codes["bridge"]},{codes["llm_node"]}', ''),
    ]
    print('\n'.join(f'{a:<36} {b:>10}  {c}' for a, b, c in rows), file=sys.stderr)
    ok = report['streams_target_met'] and not any(codes.values())
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

"""Persisted sessions: first-turn TTFT after a restart with a restored session vs a cold prompt.

    .venv/bin/python bench/bench_sessions.py [--repeats 3] [--kv-dtype float32 int8] [--node]
                                             [--json-out FILE]

On the embedded SmolLM2-135M. Per repeat and kv.dtype: an engine with sessions.store runs turn
1 of a ~500-token conversation (session 'bench') and is closed; a new engine on the same store
(a restart) runs turn 2 (turn 1 + its answer + a short question): its TTFT is 'restored'. An
engine without a store runs the same turn-2 prompt: 'cold'. Both engines are fresh, so neither
has anything else cached. Also reported: engine start with and without restoring, the
store's size, the time to write the session (checkpoint + commit).

With --node, the same through llm_node processes (sessions.store set vs unset), TTFT as the
goal result reports it. Target (issue 15): restored TTFT >= 5x lower than cold.

With --conversation (issue 20), the second turn of the same ~500-token conversation on one
engine, three ways: 'session' sends only the question (the engine remembers turn 1 and
continues its ids: its KV is reused whole); 'resend' is a stateless client that sends the
whole history again without a session (prefix reuse still finds the live KV, up to where the
re-rendered answer tokenizes differently); 'cold' is the resent history on a fresh engine.
Prints one JSON object (and --json-out) and a short table; no test asserts these timings.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Dict, List

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest  # noqa: E402
from edge_llm_ros.serving.engine import Engine, EngineConfig  # noqa: E402

TARGET_GAIN = 5.0
SESSION = 'bench'
# A robot's running conversation: a system prompt and a long first report (~500 tokens).
SYSTEM = ('You are the assistant of a warehouse robot. You answer briefly and precisely, you '
          'never invent positions, and you ask when an order is unclear.')
REPORT = ' '.join(
    f'Shelf {i}: {3 + i % 5} boxes of part {100 + 7 * i}, last checked at {8 + i % 9}:{10 + i}, '
    f'aisle {1 + i % 4}, {"blocked" if i % 6 == 0 else "clear"}.' for i in range(13))
QUESTION = 'Which shelves are blocked?'


def turn_1() -> List[ChatMessage]:
    return [ChatMessage('system', SYSTEM),
            ChatMessage('user', f'Inventory report: {REPORT} Summarize it in one line.')]


def turn_2(answer: str) -> List[ChatMessage]:
    return turn_1() + [ChatMessage('assistant', answer), ChatMessage('user', QUESTION)]


def run(engine: Engine, messages: List[ChatMessage], max_tokens: int):
    return engine.generate(GenerationRequest(messages=messages, session_id=SESSION,
                                             max_tokens=max_tokens)).run_to_end()


def engine_round(kv_dtype: str, threads: int, store: str) -> Dict[str, float]:
    """One restart with a restored session, one cold engine, same turn-2 prompt."""
    config = EngineConfig(kv_dtype=kv_dtype, intra_op_threads=threads)
    with_store = EngineConfig(kv_dtype=kv_dtype, intra_op_threads=threads, session_store=store)
    for suffix in ('', '-wal', '-shm'):
        pathlib.Path(store + suffix).unlink(missing_ok=True)
    first_engine = Engine(with_store)
    first = run(first_engine, turn_1(), 24)
    t = time.perf_counter()
    first_engine.close()       # checkpoint is at the end of the turn; close waits for the commit
    close_s = time.perf_counter() - t
    store_bytes = sum(os.path.getsize(store + s) for s in ('', '-wal')
                      if os.path.exists(store + s))
    t = time.perf_counter()
    restarted = Engine(with_store)
    start_restore_s = time.perf_counter() - t
    restored = run(restarted, turn_2(first.text), 8)
    restarted.close()
    t = time.perf_counter()
    fresh = Engine(config)
    start_plain_s = time.perf_counter() - t
    cold = run(fresh, turn_2(first.text), 8)
    fresh.close()
    assert restored.token_ids[:1] == cold.token_ids[:1] or kv_dtype == 'int8', \
        'the restored session answered differently from the cold prompt'
    return {'ttft_restored_s': restored.timings.time_to_first_token_s,
            'ttft_cold_s': cold.timings.time_to_first_token_s,
            'prompt_tokens': restored.prompt_tokens,
            'cached_prompt_tokens': restored.timings.cached_prompt_tokens,
            'cold_cached_prompt_tokens': cold.timings.cached_prompt_tokens,
            'turn_1_prompt_tokens': first.prompt_tokens,
            'engine_start_with_restore_s': start_restore_s,
            'engine_start_plain_s': start_plain_s,
            'close_with_flush_s': close_s, 'store_bytes': store_bytes,
            'same_answer': restored.token_ids == cold.token_ids}


def conversation_round(threads: int) -> Dict[str, float]:
    """Second-turn TTFT: a remembered session vs resending the history (see the docstring)."""
    from edge_llm_ros.runtime.conversation import HISTORY_APPEND
    config = EngineConfig(intra_op_threads=threads)
    remembered = Engine(config)
    first = run(remembered, turn_1(), 24)
    second = remembered.generate(GenerationRequest(
        prompt=QUESTION, session_id=SESSION, history_mode=HISTORY_APPEND,
        max_tokens=8)).run_to_end()
    remembered.close()
    stateless = Engine(config)
    plain = stateless.generate(GenerationRequest(messages=turn_1(), max_tokens=24)).run_to_end()
    resent = stateless.generate(GenerationRequest(messages=turn_2(plain.text),
                                                  max_tokens=8)).run_to_end()
    stateless.close()
    fresh = Engine(config)
    cold = fresh.generate(GenerationRequest(messages=turn_2(first.text),
                                            max_tokens=8)).run_to_end()
    fresh.close()
    return {'ttft_session_s': second.timings.time_to_first_token_s,
            'ttft_resend_s': resent.timings.time_to_first_token_s,
            'ttft_cold_s': cold.timings.time_to_first_token_s,
            'history_tokens': first.prompt_tokens + first.completion_tokens,
            'prompt_tokens': second.prompt_tokens,
            'session_cached_tokens': second.timings.cached_prompt_tokens,
            'resend_cached_tokens': resent.timings.cached_prompt_tokens,
            'same_answer': second.token_ids == cold.token_ids}


def node_round(kv_dtype: str, store: str, index: int) -> Dict[str, float]:
    """Run the same through llm_node processes (restart = a new process)."""
    sys.path.insert(0, str(ROOT / 'test'))
    from llm_node_harness import served
    for suffix in ('', '-wal', '-shm'):
        pathlib.Path(store + suffix).unlink(missing_ok=True)
    name = f'bench_sessions_{os.getpid()}_{index}'
    base = {'autostart': True, 'kv.dtype': kv_dtype}

    def ask(params, messages, max_tokens, client):
        pairs = [(m.role, m.content) for m in messages]
        with served(name, params, client, timeout=600) as ros:
            return ros.llm('/' + name).generate(messages=pairs, session_id=SESSION,
                                                max_tokens=max_tokens).result(timeout=300)
    stored = dict(base, **{'sessions.store': store})
    first = ask(stored, turn_1(), 24, f'bench_c1_{index}')
    restored = ask(stored, turn_2(first.text), 8, f'bench_c2_{index}')
    cold = ask(base, turn_2(first.text), 8, f'bench_c3_{index}')
    return {'ttft_restored_s': restored.timings.time_to_first_token_s,
            'ttft_cold_s': cold.timings.time_to_first_token_s,
            'prompt_tokens': restored.prompt_tokens,
            'cached_prompt_tokens': restored.timings.cached_prompt_tokens,
            'cold_cached_prompt_tokens': cold.timings.cached_prompt_tokens}


def summarize(rounds: List[Dict[str, float]]) -> Dict[str, object]:
    out: Dict[str, object] = {'rounds': rounds}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
    gains = [r['ttft_cold_s'] / r['ttft_restored_s'] for r in rounds]
    out['ttft_gain'] = statistics.median(gains)
    out['target_met'] = out['ttft_gain'] >= TARGET_GAIN
    return out


def print_table(res: Dict) -> None:
    print(f'\n{"path":<8}{"kv.dtype":<10}{"prompt":>7}{"cached":>7}{"cold ms":>9}'
          f'{"restored ms":>13}{"gain":>7}  target >= {TARGET_GAIN:.0f}x', file=sys.stderr)
    for path in ('engine', 'node'):
        for dtype, r in res.get(path, {}).items():
            print(f'{path:<8}{dtype:<10}{r["prompt_tokens"]:>7.0f}'
                  f'{r["cached_prompt_tokens"]:>7.0f}{r["ttft_cold_s"] * 1000:>9.1f}'
                  f'{r["ttft_restored_s"] * 1000:>13.1f}{r["ttft_gain"]:>6.1f}x  '
                  f'{"met" if r["target_met"] else "MISSED"}', file=sys.stderr)
    for dtype, r in res.get('engine', {}).items():
        print(f'engine {dtype}: start {r["engine_start_plain_s"] * 1000:.0f} ms plain, '
              f'{r["engine_start_with_restore_s"] * 1000:.0f} ms with restore; close+flush '
              f'{r["close_with_flush_s"] * 1000:.0f} ms; store {r["store_bytes"] / 1e6:.1f} MB',
              file=sys.stderr)
    print(f'load average {res["loadavg_start"]:.1f} at start, {res["loadavg_end"]:.1f} at end '
          f'({os.cpu_count()} cores)', file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--threads', type=int, default=0, help='intra-op threads (0 = default)')
    p.add_argument('--kv-dtype', nargs='+', default=['float32', 'int8'],
                   choices=('float32', 'int8'))
    p.add_argument('--node', action='store_true', help='also through llm_node processes')
    p.add_argument('--conversation', action='store_true',
                   help='only the second-turn comparison: a session vs resending the history')
    p.add_argument('--json-out', default='')
    args = p.parse_args(argv)
    res: Dict[str, object] = {'model': 'SmolLM2-135M (embedded)', 'repeats': args.repeats,
                              'loadavg_start': os.getloadavg()[0]}
    if args.conversation:
        rounds = [conversation_round(args.threads) for _ in range(args.repeats)]
        res['conversation'] = {key: statistics.median([r[key] for r in rounds])
                               for key in rounds[0] if key != 'same_answer'}
        res['conversation']['rounds'] = rounds
        c = res['conversation']
        c['resend_vs_session'] = c['ttft_resend_s'] / c['ttft_session_s']
        c['cold_vs_session'] = c['ttft_cold_s'] / c['ttft_session_s']
        res['loadavg_end'] = os.getloadavg()[0]
        print(json.dumps(res, indent=1))
        print(f'\nsecond turn after {c["history_tokens"]:.0f} tokens of history: session '
              f'{c["ttft_session_s"] * 1000:.1f} ms ({c["session_cached_tokens"]:.0f} cached), '
              f'resent history {c["ttft_resend_s"] * 1000:.1f} ms '
              f'({c["resend_cached_tokens"]:.0f} cached, {c["resend_vs_session"]:.1f}x), cold '
              f'{c["ttft_cold_s"] * 1000:.1f} ms ({c["cold_vs_session"]:.1f}x)', file=sys.stderr)
        if args.json_out:
            pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix='bench_sessions_') as tmp:
        store = os.path.join(tmp, 'sessions.db')
        res['engine'] = {d: summarize([engine_round(d, args.threads, store)
                                       for _ in range(args.repeats)]) for d in args.kv_dtype}
        if args.node:
            import rclpy  # noqa: F401  (fails early when ROS is not sourced)
            res['node'] = {d: summarize([node_round(d, store, i) for i in range(args.repeats)])
                           for d in args.kv_dtype}
    res['loadavg_end'] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    print_table(res)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())

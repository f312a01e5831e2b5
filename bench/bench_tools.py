"""Tool calls with tool_choice=required on the embedded SmolLM2, over randomized tool schemas.

    .venv/bin/python bench/bench_tools.py [--requests 200] [--seed 0] [--threads 2]
                                          [--max-tokens 256] [--no-parallel]

Each request offers 1-3 tools whose parameter schemas are drawn at random (free and bounded
strings, enums, integers and numbers with ranges, booleans, arrays, nested objects, random
required sets) and asks for one of them in words, with tool_choice='required' and greedy
decoding, through Engine.prepare and Engine.generate like the node does. A call counts as
parsed when the engine returned it in result.tool_calls, and as validated when its arguments
are a JSON object that jsonschema accepts under the tool's original schema (checked here,
independently of the engine). Prints one JSON object and a short table (the issue's target:
100% parsed and validated).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from typing import Any, Dict, List

import jsonschema

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_llm_ros.runtime.types import GenerationRequest, StopReason  # noqa: E402
from edge_llm_ros.serving.engine import Engine, EngineConfig  # noqa: E402

VERBS = ('move', 'set', 'get', 'open', 'close', 'pick', 'place', 'scan', 'report', 'rotate',
         'dock', 'charge', 'follow', 'stop', 'inspect')
NOUNS = ('arm', 'gripper', 'base', 'camera', 'light', 'door', 'box', 'shelf', 'battery',
         'map', 'path', 'person', 'sensor', 'alarm', 'joint')
WORDS = ('left', 'right', 'front', 'back', 'red', 'green', 'blue', 'slow', 'fast', 'high',
         'low', 'kitchen', 'dock', 'office', 'lab', 'hall')


def random_property(rng: random.Random, depth: int = 0) -> Dict[str, Any]:
    """One parameter schema of a random kind."""
    kinds = ['string', 'bounded_string', 'enum', 'integer', 'number', 'boolean', 'array_enum',
             'array_int'] + (['object'] if depth == 0 else [])
    kind = rng.choice(kinds)
    desc = f'the {rng.choice(WORDS)} {rng.choice(NOUNS)}'
    if kind == 'string':
        return {'type': 'string', 'description': desc}
    if kind == 'bounded_string':
        return {'type': 'string', 'description': desc, 'maxLength': rng.choice((8, 16, 32))}
    if kind == 'enum':
        return {'type': 'string', 'enum': rng.sample(WORDS, rng.randint(2, 5))}
    if kind == 'integer':
        lo = rng.randint(-10, 10)
        return {'type': 'integer', 'minimum': lo, 'maximum': lo + rng.randint(1, 100)}
    if kind == 'number':
        return {'type': 'number', 'minimum': 0, 'maximum': rng.choice((1, 10, 360))}
    if kind == 'boolean':
        return {'type': 'boolean', 'description': desc}
    if kind == 'array_enum':
        return {'type': 'array', 'items': {'type': 'string', 'enum': rng.sample(WORDS, 3)},
                'maxItems': rng.randint(1, 4)}
    if kind == 'array_int':
        return {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9},
                'minItems': 1, 'maxItems': rng.randint(1, 3)}
    return random_object(rng, depth + 1, rng.randint(1, 2))


def random_object(rng: random.Random, depth: int, count: int) -> Dict[str, Any]:
    names = rng.sample(('x', 'y', 'z', 'speed', 'target', 'label', 'mode', 'count', 'angle',
                        'force', 'color', 'height', 'width', 'note', 'level'), count)
    props = {n: random_property(rng, depth) for n in names}
    required = sorted(rng.sample(names, rng.randint(1, count)))
    return {'type': 'object', 'properties': props, 'required': required}


def random_tool(rng: random.Random, index: int) -> Dict[str, Any]:
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    return {'type': 'function', 'function': {
        'name': f'{verb}_{noun}_{index}',
        'description': f'{verb.capitalize()} the {noun} of the robot',
        'parameters': random_object(rng, 0, rng.randint(1, 4))}}


def check_call(call: Any, tools: Dict[str, Dict[str, Any]]) -> str:
    """'' when the call names a tool and its arguments validate, else why not."""
    if call.name not in tools:
        return f'unknown tool {call.name}'
    try:
        args = json.loads(call.arguments)
    except ValueError as exc:
        return f'arguments are not JSON: {exc}'
    if not isinstance(args, dict):
        return 'arguments are not an object'
    try:
        jsonschema.validate(args, tools[call.name])
    except jsonschema.ValidationError as exc:
        return f'invalid: {exc.message}'
    return ''


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(engine: Engine, requests: int, seed: int, max_tokens: int,
        parallel: bool = True) -> Dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    schemas = 0
    for i in range(requests):
        tools = [random_tool(rng, i * 10 + k) for k in range(rng.randint(1, 3))]
        schemas += len(tools)
        wanted = rng.choice(tools)['function']
        request = GenerationRequest(
            prompt=f'{wanted["description"]}: call {wanted["name"]}.', tools=tools,
            tool_choice='required', parallel_tool_calls=parallel, max_tokens=max_tokens)
        t0 = time.perf_counter()
        prepared = engine.prepare(request)
        t1 = time.perf_counter()
        result = engine.generate(prepared).run_to_end()
        t2 = time.perf_counter()
        by_name = {t['function']['name']: t['function']['parameters'] for t in tools}
        problems = [check_call(c, by_name) for c in result.tool_calls]
        problems += [f'engine: {c.error}' for c in result.invalid_tool_calls]
        if not result.tool_calls and not problems:
            problems.append(f'no call ({result.stop_reason.value}): {result.text[:60]!r}')
        rows.append({'prepare_s': t1 - t0, 'generate_s': t2 - t1,
                     'ttft_s': result.timings.time_to_first_token_s,
                     'tokens': result.completion_tokens, 'calls': len(result.tool_calls),
                     'parsed': bool(result.tool_calls) and not result.invalid_tool_calls,
                     'valid': not [p for p in problems if p],
                     'finish': result.stop_reason.value,
                     'problems': [p for p in problems if p]})
    return summarize(rows, schemas)


def summarize(rows: List[Dict[str, Any]], schemas: int) -> Dict[str, Any]:
    n = len(rows)
    total = [r['prepare_s'] + r['generate_s'] for r in rows]
    calls = sum(r['calls'] for r in rows)
    return {
        'requests': n,
        'tool_schemas': schemas,
        'tool_calls': calls,
        'parsed_pct': 100.0 * sum(r['parsed'] for r in rows) / n,
        'validated_pct': 100.0 * sum(r['valid'] for r in rows) / n,
        'finish_tool_calls_pct': 100.0 * sum(r['finish'] == StopReason.TOOL_CALLS.value
                                             for r in rows) / n,
        'latency_ms_p50': 1e3 * statistics.median(total),
        'latency_ms_p95': 1e3 * percentile(total, 0.95),
        'latency_ms_per_call_mean': 1e3 * sum(total) / max(calls, 1),
        'prepare_ms_p50': 1e3 * statistics.median(r['prepare_s'] for r in rows),
        'prepare_ms_p95': 1e3 * percentile([r['prepare_s'] for r in rows], 0.95),
        'ttft_ms_p50': 1e3 * statistics.median(r['ttft_s'] for r in rows),
        'completion_tokens_mean': statistics.mean(r['tokens'] for r in rows),
        'failures': [{'request': i, 'finish': r['finish'], 'problems': r['problems']}
                     for i, r in enumerate(rows) if not r['valid'] or not r['parsed']][:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--requests', type=int, default=200)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--max-tokens', type=int, default=256)
    parser.add_argument('--no-parallel', action='store_true',
                        help='parallel_tool_calls=False: one call per request')
    args = parser.parse_args()
    engine = Engine(EngineConfig(intra_op_threads=args.threads, max_context=2048))
    results = {'model': engine.model_name, 'family': engine.model_info()['family'],
               'max_tokens': args.max_tokens, 'seed': args.seed,
               'parallel_tool_calls': not args.no_parallel,
               **run(engine, args.requests, args.seed, args.max_tokens, not args.no_parallel)}
    engine.close()
    print(json.dumps(results, indent=2))
    print(f'\n{"metric":<28} {"value":>10}')
    for key, value in results.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            print(f'{key:<28} {value:>10.1f}')


if __name__ == '__main__':
    main()

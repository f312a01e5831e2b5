"""Issue 39: the first token of a goal behind a long system prompt, cold, warm and restarted.

    .venv/bin/python bench/bench_warm_prompt.py [--runs default=4096] [--runs qwen2-1.5b=4096]
        [--threads 2] [--json-out bench/results/bench_warm_prompt.json]

For each shape (bench_batching.model_files: the embedded SmolLM2, or a make_random_gguf shape)
a robot skill catalogue of about LENGTH tokens is the system prompt of one goal ("Which skill
opens the door?", 2 new tokens), run in a fresh process per case:
- cold: an Engine without warm prompts: the goal prefills the whole catalogue;
- warm: `warm_prompts` = the catalogue with a new sessions.store: configure prefills it;
- restart: the same configuration again: configure restores it from the store.
Each case reports configure time (the Engine's construction), the goal's time to first token
and cached prompt tokens, the process's peak RSS and, for the warm cases, whether the prompt
was restored. Prints a markdown table and writes the JSON. Issue 39's target: first token
<= 0.5 s with a 4k warm prompt on the Qwen2.5-1.5B shape, and a restart without a prefill.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
DEFAULT_RUNS = ('default=4096', 'qwen2-1.5b=4096')
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_warm_prompt.json'
QUESTION = 'Which skill opens the door?'
CASES = ('cold', 'warm', 'restart')


def catalogue(tokenizer, tokens: int) -> str:
    """Write a skill catalogue of about `tokens` tokens (robot skills, one a line)."""
    lines = ['You are the task planner of a mobile manipulator. Its skills:']
    i = 0
    while len(tokenizer.encode('\n'.join(lines))) < tokens:
        lines.append(f'- skill_{i}: move the arm to stored pose {i}, check the gripper '
                     f'force, and report the result to the operator at station {i % 7}.')
        i += 1
    return '\n'.join(lines)


def case_main(args) -> Dict:
    """One case in this process: configure, then one goal behind the catalogue."""
    from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    text = pathlib.Path(args.text_file).read_text()
    warm = args.case != 'cold'
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(
        model_dir=args.model, intra_op_threads=args.threads, max_context=args.context,
        warm_prompts=(text,) if warm else (),
        session_store=args.store if warm else ''))
    configure_s = time.perf_counter() - t0
    try:
        result = engine.generate(GenerationRequest(
            messages=[ChatMessage('system', text), ChatMessage('user', QUESTION)],
            max_tokens=2, sampling=SamplingConfig(temperature=0.0))).run_to_end()
        pinned = engine.warm_prompts()
    finally:
        engine.close()
    return {'case': args.case, 'configure_s': configure_s,
            'first_token_s': result.timings.time_to_first_token_s,
            'prompt_tokens': result.prompt_tokens,
            'cached_prompt_tokens': result.timings.cached_prompt_tokens,
            'warm_tokens': pinned[0].tokens if pinned else 0,
            'restored': bool(pinned and pinned[0].restored),
            'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_shape(shape: str, tokens: int, args) -> Dict:
    bench_batching = importlib.import_module('bench_batching')
    from edge_llm_ros.runtime.tokenizer import TextTokenizer
    files = bench_batching.model_files(shape)
    text = catalogue(TextTokenizer.from_dir(files['dir']), tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text_file = pathlib.Path(tmp) / 'catalogue.txt'
        text_file.write_text(text)
        for case in CASES:
            proc = subprocess.run(
                [sys.executable, __file__, '--child', case, '--model', files['dir'],
                 '--text-file', str(text_file), '--store', str(pathlib.Path(tmp) / 's.db'),
                 '--context', str(tokens + 512), '--threads', str(args.threads)],
                capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f'bench_warm_prompt: {shape} {case} failed:\n'
                                 f'{proc.stderr[-3000:]}')
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f'bench_warm_prompt: {shape} {case}: configure {row["configure_s"]:.2f} s, '
                  f'first token {row["first_token_s"]:.3f} s, cached '
                  f'{row["cached_prompt_tokens"]} of {row["prompt_tokens"]}',
                  file=sys.stderr, flush=True)
            rows.append(row)
    return {'shape': shape, 'model_dir': files['dir'], 'target_tokens': tokens,
            'loadavg': os.getloadavg(), 'rows': rows}


def table(result: Dict) -> str:
    out = ['| shape | case | configure s | first token s | cached / prompt tokens | '
           'restored | peak RSS MB |', '|---|---|---|---|---|---|---|']
    for shape in result['shapes']:
        for r in shape['rows']:
            out.append(f"| {shape['shape']} | {r['case']} | {r['configure_s']:.2f} | "
                       f"{r['first_token_s']:.3f} | {r['cached_prompt_tokens']} / "
                       f"{r['prompt_tokens']} | {'yes' if r['restored'] else 'no'} | "
                       f"{r['peak_rss_mb']:.0f} |")
    return '\n'.join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', action='append', default=[],
                   help='SHAPE=TOKENS (repeatable; default: ' + ' '.join(DEFAULT_RUNS) + ')')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--json-out', default=str(DEFAULT_JSON))
    p.add_argument('--child', choices=CASES, help=argparse.SUPPRESS)
    p.add_argument('--model', help=argparse.SUPPRESS)
    p.add_argument('--text-file', help=argparse.SUPPRESS)
    p.add_argument('--store', help=argparse.SUPPRESS)
    p.add_argument('--context', type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.case = args.child
        print(json.dumps(case_main(args)))
        return 0
    result = {'bench': 'bench_warm_prompt', 'cores': os.cpu_count(), 'threads': args.threads,
              'shapes': []}
    json_out = pathlib.Path(args.json_out)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.runs or DEFAULT_RUNS:
        shape, _, tokens = spec.partition('=')
        result['shapes'].append(measure_shape(shape, int(tokens), args))
        json_out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f'bench_warm_prompt: JSON in {json_out}', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

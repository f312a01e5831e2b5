"""Nothing slower: single-stream prefill and decode of this checkout against an earlier commit.

    .venv/bin/python bench/bench_commits.py --base COMMIT [--shapes default,qwen2-1.5b]
        [--rounds 2] [--threads 2] [--prompt-tokens 256] [--new-tokens 32]
        [--json-out bench/results/bench_commits.json]

The base commit is checked out once as a git worktree in .cache/bench_commits/<commit> (its
own .cache; its build/ links to this checkout's op library, which keeps the older graphs'
batched interface: the base runs its own Python over the same kernels). Per shape each tree
converts the GGUF with its own converter; then the trees take turns (base, head, base, head,
...: --rounds each), each run a fresh process that loads the folder into an Engine, prefills
--prompt-tokens ids and decodes --new-tokens greedy tokens (EOS banned), and reports the
engine's prefill and decode tok/s and the token ids. The ids must be equal between the trees
(the same bits); the ratios are head / base of the medians. Shapes: `default` (the embedded
SmolLM2-135M's real GGUF) and bench/make_random_gguf.py's names.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Dict, List

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
bench_batching = importlib.import_module('bench_batching')   # model_files
DEFAULT_JSON = ROOT / 'bench' / 'results' / 'bench_commits.json'

# Runs in either tree (its own edge_llm_ros first on sys.path): the Engine API both share.
_RUN = r"""
import json, sys, time
from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig
folder, threads, prompt_tokens, new_tokens = sys.argv[1], *map(int, sys.argv[2:5])
eng = Engine(EngineConfig(model_dir=folder, intra_op_threads=threads,
                          max_context=2 * prompt_tokens + new_tokens + 64, prefix_reuse=False))
sentence = 'The robot logs its battery level, its pose and the obstacles it saw. '
text = sentence
while len(eng.tokenize(text)) < prompt_tokens:
    text += sentence
ban = {t: -100.0 for t in eng.tokenizer.eos_token_ids}
def once():
    req = GenerationRequest(prompt=text, max_tokens=new_tokens, use_chat_template=False,
                            sampling=SamplingConfig(temperature=0.0, logit_bias=ban))
    return eng.generate(req).run_to_end()
once()   # warm-up
r = once()
t = r.timings
print(json.dumps({'prompt_tokens': r.prompt_tokens, 'ids': r.token_ids,
                  'prefill_tok_s': t.prefill_tokens_per_second,
                  'decode_tok_s': t.decode_tokens_per_second}))
"""


def base_tree(commit: str) -> pathlib.Path:
    """Check the base commit out once (a detached worktree) with this checkout's op library."""
    sha = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', commit], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = ROOT / '.cache' / 'bench_commits' / sha[:12]
    if not (tree / 'edge_llm_ros').is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(['git', '-C', str(ROOT), 'worktree', 'add', '--detach', str(tree), sha],
                       check=True, capture_output=True, text=True)
    (tree / 'build').mkdir(exist_ok=True)
    native = tree / 'build' / 'native'
    if not native.exists():
        native.symlink_to(ROOT / 'build' / 'native')
    return tree


def in_tree(tree: pathlib.Path, argv: List[str], what: str) -> str:
    """Run this interpreter with `tree`'s edge_llm_ros first on the path; return stdout."""
    proc = subprocess.run([sys.executable, *argv], cwd=str(tree), capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    if proc.returncode:
        raise SystemExit(f'bench_commits: {what} in {tree} failed:\n{proc.stderr[-3000:]}')
    return proc.stdout


def convert(tree: pathlib.Path, gguf: str, name: str) -> str:
    """Convert the GGUF with the tree's own converter (once: the folder is kept)."""
    out = tree / '.cache' / 'bench_commits_models' / name
    if not (out / 'model.yaml').is_file():
        in_tree(tree, ['-m', 'edge_llm_ros.convert.converter', gguf, str(out), '--force',
                       '--quiet'], f'converting {gguf}')
    return str(out)


def run_tree(tree: pathlib.Path, folder: str, args) -> Dict:
    out = in_tree(tree, ['-c', _RUN, folder, str(args.threads), str(args.prompt_tokens),
                         str(args.new_tokens)], 'a run')
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--base', required=True, help='the commit to compare against')
    p.add_argument('--shapes', default='default,qwen2-1.5b')
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--prompt-tokens', type=int, default=256)
    p.add_argument('--new-tokens', type=int, default=32)
    p.add_argument('--json-out', default=str(DEFAULT_JSON))
    args = p.parse_args()
    base = base_tree(args.base)
    report: Dict = {'base': args.base, 'threads': args.threads, 'cpus': os.cpu_count(),
                    'machine_load_1min_before': os.getloadavg()[0], 'shapes': {}}
    for shape in args.shapes.split(','):
        gguf = bench_batching.model_files(shape)['gguf']
        folders = {'base': convert(base, gguf, shape), 'head': convert(ROOT, gguf, shape)}
        trees = {'base': base, 'head': ROOT}
        runs: Dict[str, List[Dict]] = {'base': [], 'head': []}
        for _ in range(args.rounds):
            for side in ('base', 'head'):
                runs[side].append(run_tree(trees[side], folders[side], args))
        med = {side: {k: statistics.median(r[k] for r in runs[side])
                      for k in ('prefill_tok_s', 'decode_tok_s')} for side in runs}
        same = all(r['ids'] == runs['base'][0]['ids'] for side in runs for r in runs[side])
        report['shapes'][shape] = {
            'runs': {side: [{k: v for k, v in r.items() if k != 'ids'} for r in rs]
                     for side, rs in runs.items()},
            'median': med, 'same_token_ids': same,
            'prefill_head_vs_base': med['head']['prefill_tok_s'] / med['base']['prefill_tok_s'],
            'decode_head_vs_base': med['head']['decode_tok_s'] / med['base']['decode_tok_s']}
    report['machine_load_1min_after'] = os.getloadavg()[0]
    text = json.dumps(report, indent=2)
    print(text)
    pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.json_out).write_text(text + '\n')
    print('| shape | prefill tok/s base / head | decode tok/s base / head | same ids |\n'
          '|---|---|---|---|', file=sys.stderr)
    for shape, row in report['shapes'].items():
        m = row['median']
        print(f"| {shape} | {m['base']['prefill_tok_s']:.1f} / {m['head']['prefill_tok_s']:.1f} "
              f"({row['prefill_head_vs_base']:.3f}x) | {m['base']['decode_tok_s']:.1f} / "
              f"{m['head']['decode_tok_s']:.1f} ({row['decode_head_vs_base']:.3f}x) | "
              f"{row['same_token_ids']} |", file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""The model compatibility matrix (docs/models.md), written by the tests that passed.

A test that proves a capability for a family and GGUF type records it through the `compat`
fixture (conftest.py): ``compat('qwen2', 'Q4_K', 'speculation')``. A record counts only when
that test's call passed (conftest's report hook settles it). At the end of a whole-suite run
that passed (every test collected from test/, no selection), conftest calls `write_doc`, which
renders docs/models.md from the records alone: a cell is filled only where a test that ran
says so, and names that test. Every run also leaves its records in build/compat/last_run.json.
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
import datetime
import json
import pathlib
import subprocess
from typing import Dict, Iterable, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / 'docs' / 'models.md'
LAST_RUN = ROOT / 'build' / 'compat' / 'last_run.json'   # per checkout
# The GGUF types of the models the engine tests use: the embedded SmolLM2-135M file, and
# tiny_model.py's default ('mixed') tiny GGUF.
SMOLLM2_TYPES = 'Q4_1+Q8_0'
TINY_TYPES = 'Q4_0+Q4_1+Q8_0'
CAPABILITIES = ('text', 'tools', 'reasoning', 'vision', 'sessions', 'speculation', 'batching',
                'embeddings', 'rerank')
# What each capability's test proves (the doc's legend).
MEANING = {
    'text': 'greedy ids equal to llama.cpp (32/32) on a tiny random GGUF of that type',
    'tools': 'tool calls made, parsed and validated through the chat template of the family',
    'reasoning': 'reasoning split from the answer, its budget forced, through the template',
    'vision': 'greedy ids equal to those of llama.cpp (mtmd) with images in the prompt',
    'sessions': 'a session continued (in memory or after a restart) equals the uninterrupted run',
    'speculation': 'speculative decoding gives the output of plain decoding',
    'batching': 'goals batched together give the bits of each goal run alone',
    'embeddings': 'vectors with cosine >= 0.9999 to llama.cpp embeddings, per text, same pooling',
    'rerank': 'rerank scores equal to llama.cpp rank pooling (1e-3) on the same GGUF',
}


@dataclass(frozen=True)
class Cell:
    """One capability a passing test proved for a family and a GGUF type."""

    family: str
    gguf_type: str
    capability: str
    test: str   # the test's node id, parameters stripped


class Recorder:
    """Collect the cells of one test; they count once its call has passed."""

    def __init__(self, nodeid: str, pending: Dict[str, List[Cell]]):
        self._test = nodeid.split('[', 1)[0]
        self._cells = pending.setdefault(nodeid, [])

    def __call__(self, family: str, gguf_type: str, capability: str) -> None:
        """Record that this test proves `capability` for `family` in `gguf_type`."""
        if capability not in CAPABILITIES:
            raise ValueError(f'capability {capability!r} is not one of {CAPABILITIES}')
        self._cells.append(Cell(family, gguf_type, capability, self._test))


def settle(pending: Dict[str, List[Cell]], passed: List[Cell], nodeid: str,
           call_passed: bool) -> None:
    """Move a test's pending cells into `passed` when its call passed; drop them otherwise."""
    cells = pending.pop(nodeid, [])
    if call_passed:
        passed.extend(cells)


def save(cells: Iterable[Cell], path: pathlib.Path = LAST_RUN) -> None:
    """Write the run's cells as JSON (sorted, one entry per distinct cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(set(cells), key=_order)
    path.write_text(json.dumps([asdict(c) for c in rows], indent=1) + '\n')


def render(cells: Iterable[Cell], run: str) -> str:
    """Return docs/models.md for these cells; `run` says which run wrote it."""
    cells = sorted(set(cells), key=_order)
    by_family: Dict[str, Dict[str, set]] = collections.defaultdict(
        lambda: collections.defaultdict(set))
    by_type: Dict[Tuple[str, str], set] = collections.defaultdict(set)
    tests: Dict[Tuple[str, str], set] = collections.defaultdict(set)
    for c in cells:
        by_family[c.family][c.capability].add(c.gguf_type)
        by_type[(c.family, c.gguf_type)].add(c.capability)
        tests[(c.family, c.capability)].add(c.test)
    out = ['# Model compatibility (written by the test suite)', '',
           'Do not edit: `test/compat_matrix.py` writes this file at the end of a whole-suite '
           f'run in which every test passed ({run}). A cell is filled only where a test that '
           'passed in that run proved it, and the list below each table names those tests. '
           'An empty cell means no test covers it, not that it fails.', '',
           '| capability | what its test proves |', '|---|---|']
    out += [f'| {cap} | {MEANING[cap]} |' for cap in CAPABILITIES]
    out += ['', '## Families', '',
            '| family | ' + ' | '.join(CAPABILITIES) + ' |',
            '|---|' + '---|' * len(CAPABILITIES)]
    for family in sorted(by_family):
        row = [', '.join(sorted(by_family[family][cap])) or ' ' for cap in CAPABILITIES]
        out.append(f'| {family} | ' + ' | '.join(row) + ' |')
    out += ['', 'Each cell lists the GGUF types its tests used.', '',
            '## Family x GGUF type', '',
            '| family | GGUF type | ' + ' | '.join(CAPABILITIES) + ' |',
            '|---|---|' + '---|' * len(CAPABILITIES)]
    for (family, qtype), caps in sorted(by_type.items()):
        marks = ['yes' if cap in caps else ' ' for cap in CAPABILITIES]
        out.append(f'| {family} | {qtype} | ' + ' | '.join(marks) + ' |')
    out += ['', '## The tests behind each cell', '']
    for (family, cap), names in sorted(tests.items()):
        out.append(f'- {family} / {cap}: ' + ', '.join(f'`{n}`' for n in sorted(names)))
    return '\n'.join(out) + '\n'


def _order(c: Cell) -> Tuple[str, str, str, str]:
    return c.family, c.gguf_type, c.capability, c.test


def parse_tests(doc: str) -> List[str]:
    """Return every test node id the doc names (for the check that they exist)."""
    names = []
    for line in doc.splitlines():
        if line.startswith('- ') and ': `' in line:
            names += [part.split('`')[1] for part in line.split(': ', 1)[1].split(', ')]
    return names


def run_label() -> str:
    """Say which run wrote the doc: the date and the commit (with + when the tree is dirty)."""
    day = datetime.date.today().isoformat()
    try:
        sha = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return day
    return f'{day}, commit {sha}{"+" if dirty else ""}'


def write_doc(cells: Iterable[Cell], path: pathlib.Path = DOC) -> None:
    """Render the cells into docs/models.md."""
    path.write_text(render(cells, run_label()))

"""README.md points at tests that exist, and every feature row of its tables names one.

Every `test/...py` path the README names exists (a glob such as `test/test_update*.py` matches
at least one file), and where it names `path::test_name` (or `path::Class::test_name`) that
test is defined in the file. Every body row of a README table outside "## Benchmarks" (whose
rows are measurements, each naming its bench script) names at least one test path: the table
says a feature exists, the path says which test shows it (issue 37 item 4).
"""
import ast
import pathlib
import re
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
# test/<file>.py, a glob of them, optionally ::name(::name) of a test in it.
TEST_PATH = re.compile(r'(?<![\w/.-])(test/[\w*.-]+\.py)((?:::\w+)*)')
# Sections whose tables hold measurements, not features.
MEASUREMENT_SECTIONS = ('Benchmarks',)


def named_test_paths(text: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """Return every (path, names) the text names, in order."""
    return [(m.group(1), tuple(n for n in m.group(2).split('::') if n))
            for m in TEST_PATH.finditer(text)]


def tables(text: str) -> List[Tuple[str, int, List[Tuple[int, str]]]]:
    """Return (level-2 section, header line number, body rows (line number, row)) per table."""
    found: List[Tuple[str, int, List[Tuple[int, str]]]] = []
    section, fenced, current = '', False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith('```'):
            fenced = not fenced
        if fenced:
            current = None
            continue
        if line.startswith('## '):
            section = line[3:].strip()
        if not line.startswith('|'):
            current = None
            continue
        if current is None:
            current = (section, number, [])
            found.append(current)
        elif not re.fullmatch(r'\|(\s*:?-+:?\s*\|)+', line.strip()):
            current[2].append((number, line))
    return found


def problems(text: str, root: pathlib.Path) -> List[str]:
    """Say what is wrong with the test paths a README text names (empty: nothing)."""
    out: List[str] = []
    defined: Dict[pathlib.Path, Optional[set]] = {}
    for path, names in named_test_paths(text):
        matches = sorted(root.glob(path))
        if not matches:
            out.append(f'{path} does not exist')
            continue
        if not names:
            continue
        if len(matches) > 1 or '*' in path:
            out.append(f'{path}::{"::".join(names)}: name a test in one file, not a glob')
            continue
        if matches[0] not in defined:
            defined[matches[0]] = _definitions(matches[0])
        if '::'.join(names) not in defined[matches[0]]:
            out.append(f'{path} defines no {"::".join(names)}')
    return out


def _definitions(path: pathlib.Path) -> set:
    """Return the top-level functions and classes of a test file, and Class::method."""
    names = set()
    for node in ast.parse(path.read_text(encoding='utf-8')).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f'{node.name}::{n.name}' for n in node.body
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def rows_without_a_test(text: str) -> List[str]:
    """Return the feature rows (tables outside MEASUREMENT_SECTIONS) that name no test."""
    return [f'line {number} ({section}): {row[:80]}'
            for section, _, rows in tables(text) if section not in MEASUREMENT_SECTIONS
            for number, row in rows if not named_test_paths(row)]


@pytest.fixture(scope='module')
def readme() -> str:
    return README.read_text(encoding='utf-8')


def test_every_test_path_the_readme_names_exists(readme):
    assert len(named_test_paths(readme)) >= 40   # the parser sees the paths at all
    assert problems(readme, ROOT) == []


def test_every_feature_row_names_the_test_that_shows_it(readme):
    sections = {section for section, _, _ in tables(readme)}
    # The tables that list features: what is in the box, the setup paths, the comparison
    # with llama_ros and reliability; none of them may lose its rows' tests unseen.
    assert {'What is in the box', 'Using it', 'Versus llama_ros, point by point',
            'Reliability and security'} <= sections, sections
    assert rows_without_a_test(readme) == []


def test_the_comparison_with_llama_ros_agrees_with_the_vision_section(readme):
    row = next(r for _, _, rows in tables(readme) for _, r in rows
               if r.startswith('| vision-language models |'))
    # The Vision section documents Gemma 3 images, measured: the table must not deny them.
    assert 'Gemma 3' in row and not re.search(r'gemma ?3 images[^|]*not yet', row, re.I)
    assert '### Vision' in readme and 'Gemma 3' in readme.split('### Vision', 1)[1]


def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / 'test').mkdir()
    (tmp_path / 'test' / 'test_a.py').write_text(
        'def test_one():\n    pass\n\n\nclass TestB:\n    def test_two(self):\n        pass\n')
    text = ('See `test/test_a.py::test_one`, `test/test_a.py::TestB::test_two`, '
            '`test/test_a*.py`, `test/test_a.py::test_gone`, `test/test_missing.py`, '
            '`test/test_a*.py::test_one` and bench/test/x.py.\n\n'
            '## Features\n\n| feature | shown by |\n|---|---|\n| one | `test/test_a.py` |\n'
            '| two | nothing |\n\n## Benchmarks\n\n| what | measured |\n|---|---|\n| x | 1 |\n'
            '```\n| not | a table |\n```\n')
    assert problems(text, tmp_path) == [
        'test/test_a.py defines no test_gone', 'test/test_missing.py does not exist',
        'test/test_a*.py::test_one: name a test in one file, not a glob']
    assert rows_without_a_test(text) == ['line 8 (Features): | two | nothing |']

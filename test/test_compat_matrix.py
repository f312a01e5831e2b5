"""The compatibility matrix: cells only from passing tests, and docs/models.md names real tests.

docs/models.md is written by test/compat_matrix.py at the end of a whole-suite run that passed
(conftest.py); these tests check the recording rules and the committed file.
"""
import ast
import pathlib

from compat_matrix import CAPABILITIES, Cell, DOC, parse_tests, Recorder, render, settle
import pytest

from edge_llm_ros.convert.architectures import SUPPORTED_ARCHITECTURES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_cell_counts_only_when_its_test_passed():
    pending, passed = {}, []
    Recorder('test/test_a.py::test_one[Q4_K]', pending)('qwen2', 'Q4_K', 'text')
    Recorder('test/test_a.py::test_two', pending)('llama', 'F16', 'batching')
    settle(pending, passed, 'test/test_a.py::test_one[Q4_K]', True)
    settle(pending, passed, 'test/test_a.py::test_two', False)
    assert passed == [Cell('qwen2', 'Q4_K', 'text', 'test/test_a.py::test_one')]
    assert pending == {}
    with pytest.raises(ValueError, match='capability'):
        Recorder('t', pending)('llama', 'F16', 'teleport')


def test_the_doc_fills_only_recorded_cells_and_names_their_tests():
    cells = [Cell('qwen2', 'Q4_K', 'text', 'test/test_a.py::test_one'),
             Cell('qwen2', 'Q8_0', 'text', 'test/test_a.py::test_one'),
             Cell('qwen2', 'Q4_K', 'speculation', 'test/test_b.py::test_spec'),
             Cell('lfm2', 'Q8_0', 'sessions', 'test/test_c.py::test_store')]
    doc = render(cells + cells[:1], 'a run')
    header = '| family | ' + ' | '.join(CAPABILITIES) + ' |'
    assert header in doc
    families = doc.split('## Families')[1].split('##')[0]
    rows = {line.split(' | ')[0]: line for line in families.splitlines() if line.startswith('| ')}
    assert rows['| qwen2'].split(' | ')[1:3] == ['Q4_K, Q8_0', ' ']      # text, tools
    assert rows['| lfm2'].split(' | ')[5] == 'Q8_0'                      # sessions
    assert '| qwen2 | Q8_0 | yes |' in doc and '| lfm2 | Q8_0 |   |   |' in doc
    assert sorted(parse_tests(doc)) == ['test/test_a.py::test_one', 'test/test_b.py::test_spec',
                                        'test/test_c.py::test_store']


def _test_functions(path: pathlib.Path) -> set:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_committed_doc_names_existing_tests_and_every_family():
    doc = DOC.read_text()
    assert doc.startswith('# Model compatibility (written by the test suite)')
    for name in parse_tests(doc):
        file, func = name.split('::')
        assert func in _test_functions(ROOT / file), f'{name} is not a test any more'
    texts = {line.split(' | ')[0][2:] for line in doc.splitlines()
             if line.startswith('| ') and ' | ' in line}
    missing = [arch for arch in SUPPORTED_ARCHITECTURES if arch not in texts]
    assert not missing, f'families without a row (record their parity test): {missing}'

"""Standard ament pep257 check (summary on the first docstring line: D212, not D213)."""
import pathlib

from ament_pep257.main import main
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ['edge_llm_ros', 'test', 'launch', 'bench', 'setup.py', 'scripts']


@pytest.mark.linter
@pytest.mark.pep257
def test_pep257():
    paths = [str(ROOT / p) for p in CHECKED if (ROOT / p).exists()]
    rc = main(argv=[*paths, '--add-ignore', 'D213', '--add-select', 'D212'])
    assert rc == 0, 'Found code style errors / warnings'

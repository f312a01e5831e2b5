"""Standard ament flake8 check of the package's Python code."""
import pathlib

from ament_flake8.main import main_with_errors
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ['edge_llm_ros', 'test', 'launch', 'bench', 'setup.py', 'scripts']


@pytest.mark.flake8
@pytest.mark.linter
def test_flake8():
    paths = [str(ROOT / p) for p in CHECKED if (ROOT / p).exists()]
    rc, errors = main_with_errors(argv=['--config', str(ROOT / 'test' / 'flake8.ini'), *paths])
    assert rc == 0, 'Found %d code style errors / warnings:\n' % len(errors) + '\n'.join(errors)

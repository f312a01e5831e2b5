"""Standard ament flake8 check of the package's Python code."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ['edge_llm_ros', 'test', 'launch', 'bench', 'setup.py', 'scripts']


@pytest.mark.flake8
@pytest.mark.linter
def test_flake8():
    # A fresh process: flake8 forks worker processes, and forking this pytest process
    # (rclpy and onnxruntime threads already running) can crash the children.
    paths = [str(ROOT / p) for p in CHECKED if (ROOT / p).exists()]
    code = ('import sys; from ament_flake8.main import main_with_errors; '
            'rc, errors = main_with_errors(argv=sys.argv[1:]); '
            'print("\\n".join(errors)); sys.exit(rc)')
    proc = subprocess.run([sys.executable, '-c', code, '--config',
                           str(ROOT / 'test' / 'flake8.ini'), *paths],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, 'code style errors / warnings:\n' + proc.stdout[-20000:]

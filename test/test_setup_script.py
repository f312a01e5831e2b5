"""scripts/setup.sh stops with one clear line when a prerequisite is missing."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP = ROOT / 'scripts' / 'setup.sh'


def _path_with(tmp_path, tools) -> str:
    """Make a PATH folder holding only the named tools (symlinks to the real ones)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for tool in tools:
        # The base interpreter itself, not a shim script (pyenv's needs bash on PATH).
        real = (str(pathlib.Path(sys.base_prefix) / 'bin' / 'python3') if tool == 'python3'
                else shutil.which(tool))
        if real is None:
            pytest.fail(f'{tool} is needed on this machine to run this test')
        (bin_dir / tool).symlink_to(real)
    return str(bin_dir)


def _run_setup(path: str, **extra) -> subprocess.CompletedProcess:
    env = {'PATH': path, 'EDGE_LLM_VENV': '/nonexistent/never-created', **extra}
    return subprocess.run(['/bin/bash', str(SETUP)], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize('missing, message', [
    ('cmake', 'cmake not found'),
    ('gcc', 'C compiler not found'),
])
def test_missing_tool_is_named(tmp_path, missing, message):
    tools = {'dirname', 'python3', 'cmake', 'gcc', 'g++', 'cat', 'sha256sum', 'cut'} - {missing}
    proc = _run_setup(_path_with(tmp_path, sorted(tools)))
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert 'Traceback' not in proc.stderr


def test_wrong_python_is_named(tmp_path):
    old_python = tmp_path / 'python3.8'
    old_python.write_text('#!/bin/sh\n'
                          'case "$1" in -c) exit 1;; -V) echo "Python 3.8.10";; esac\n')
    old_python.chmod(0o755)
    path = _path_with(tmp_path, ['dirname', 'cmake', 'gcc', 'g++'])
    proc = _run_setup(path, PYTHON=str(old_python))
    assert proc.returncode == 1
    assert 'Python >= 3.10 required, found Python 3.8.10' in proc.stderr, proc.stderr
    assert not os.path.exists('/nonexistent/never-created')

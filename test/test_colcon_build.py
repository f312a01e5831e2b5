"""The repository builds with a real `colcon build` in a ROS 2 workspace.

colcon stops descending into a folder once it is a package, so the nested
edge_llm_msgs is named with --base-paths (the README documents this).
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(sys.prefix)


def _source_files() -> list:
    out = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    if shutil.which('colcon', path=str(VENV / 'bin')) is None:
        pytest.fail('colcon is not installed in the venv: run scripts/test.sh '
                    '(requirements-test.txt lists it)')
    ws = tmp_path_factory.mktemp('colcon_ws')
    src = ws / 'src' / 'edge_llm_ros'
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    env = dict(os.environ, AMENT_PREFIX_PATH=str(VENV), CMAKE_PREFIX_PATH=str(VENV),
               PATH=f'{VENV / "bin"}:{os.environ.get("PATH", "")}')
    proc = subprocess.run(
        [str(VENV / 'bin' / 'colcon'), 'build', '--base-paths', 'src/edge_llm_ros',
         'src/edge_llm_ros/edge_llm_msgs', '--event-handlers', 'console_direct-',
         '--cmake-args', '-DBUILD_TESTING=OFF', f'-DPython3_EXECUTABLE={sys.executable}'],
        cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ws


def test_both_packages_built(workspace):
    install = workspace / 'install'
    assert (install / 'edge_llm_msgs' / 'share' / 'edge_llm_msgs' / 'action' /
            'Generate.action').is_file()
    share = install / 'edge_llm_ros' / 'share' / 'edge_llm_ros'
    assert (share / 'package.xml').is_file()
    marker = install / 'edge_llm_ros' / 'share' / 'ament_index' / 'resource_index' / 'packages'
    assert (marker / 'edge_llm_ros').is_file()


def test_console_scripts_where_ros2_run_looks(workspace):
    lib = workspace / 'install' / 'edge_llm_ros' / 'lib' / 'edge_llm_ros'
    for script in ('llm_node', 'ask'):
        assert os.access(lib / script, os.X_OK), f'{script} missing from {lib}'


def test_installed_interfaces_import_in_a_fresh_process(workspace):
    install = workspace / 'install' / 'edge_llm_msgs'
    site = next(install.glob('lib/python3*/site-packages'))
    code = ('import edge_llm_msgs, sys; from edge_llm_msgs.action import Generate; '
            'assert str(edge_llm_msgs.__file__).startswith(sys.argv[1]), edge_llm_msgs.__file__; '
            'print(Generate.Result.FINISH_CANCELLED)')
    env = dict(os.environ, PYTHONPATH=str(site),
               LD_LIBRARY_PATH=f'{install / "lib"}:{os.environ.get("LD_LIBRARY_PATH", "")}')
    proc = subprocess.run([sys.executable, '-c', code, str(install)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'cancelled'

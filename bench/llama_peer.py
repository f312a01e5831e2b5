"""Build the llama.cpp benchmark peer portably, once: llama-cpp-python in .cache/llama_cpp_peer.

    .venv/bin/python bench/llama_peer.py [--print-config]

Bench and test support, never a runtime dependency. A default llama-cpp-python build compiles
with GGML_NATIVE, and on a CPU with Intel AMX that build segfaults in its AMX path on the first
decode. This one is portable: GGML_NATIVE off, each x86 SIMD extension switched on only when
/proc/cpuinfo lists it, AMX always off.

- .cache/llama_cpp_peer/wheels/<key>/: the wheel, built once per (version, CMake flags) key.
  pip's own wheel cache is keyed by the source link only and would hand back a wheel built with
  other flags, so pip builds with --no-cache-dir and the folder is the cache.
- .cache/llama_cpp_peer/venv/: that wheel + numpy + psutil; peer.json there records what it was
  built with (version, flags, the library's own system_info). A different key reinstalls it.

Other code calls ensure_peer(install) and runs the returned python.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
import fcntl
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
from typing import AbstractSet, Dict, FrozenSet, List, Optional, Tuple

from peer_build import PeerBuildError, run_step

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / '.cache' / 'llama_cpp_peer'
VERSION = '0.3.36'  # pinned: the wheel cache key and the peer's API (llama_get_logits_ith)
EXTRA_PACKAGES = ('numpy', 'psutil')  # what bench_engine's peer process imports
STAMP = 'peer.json'

# GGML CMake option -> the /proc/cpuinfo flags the code it enables needs. GGML_AVX512 compiles
# with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw, so it needs all five.
X86_OPTIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ('GGML_AVX', ('avx',)),
    ('GGML_AVX2', ('avx2',)),
    ('GGML_FMA', ('fma',)),
    ('GGML_F16C', ('f16c',)),
    ('GGML_BMI2', ('bmi2',)),
    ('GGML_AVX_VNNI', ('avx_vnni',)),
    ('GGML_AVX512', ('avx512f', 'avx512cd', 'avx512vl', 'avx512dq', 'avx512bw')),
    ('GGML_AVX512_VBMI', ('avx512f', 'avx512vbmi')),
    ('GGML_AVX512_VNNI', ('avx512f', 'avx512_vnni')),
    ('GGML_AVX512_BF16', ('avx512f', 'avx512_bf16')),
)
# Off whatever the CPU says: the AMX path is what crashes.
ALWAYS_OFF = ('GGML_AMX_TILE', 'GGML_AMX_INT8', 'GGML_AMX_BF16')
X86_MACHINES = ('x86_64', 'amd64', 'i686', 'i386')


@dataclass(frozen=True)
class BuildConfig:
    """What the peer is built from: any difference means another wheel."""

    version: str
    cmake_args: Tuple[str, ...]
    cpu_has_amx: bool

    @property
    def key(self) -> str:
        text = json.dumps([self.version, list(self.cmake_args)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_flags(cpuinfo: str) -> FrozenSet[str]:
    """Return the feature flags of the first CPU in a /proc/cpuinfo text (x86 'flags' line)."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(':')
        if sep and name.strip() == 'flags':
            return frozenset(value.split())
    return frozenset()


def cmake_args(flags: AbstractSet[str], machine: str = 'x86_64') -> List[str]:
    """Return the CMake -D options of a portable build for a CPU with these cpuinfo flags.

    On x86 each SIMD option is on exactly when the CPU has every flag its code needs (a build
    never uses an instruction the CPU lacks), AMX is off. Elsewhere (aarch64: Jetson) there is
    no AMX path to avoid, and ggml's native detection is what picks the ARM extensions.
    """
    if machine.lower() not in X86_MACHINES:
        return []
    args = ['-DGGML_NATIVE=OFF']
    for option, needs in X86_OPTIONS:
        args.append(f'-D{option}={"ON" if all(f in flags for f in needs) else "OFF"}')
    args += [f'-D{option}=OFF' for option in ALWAYS_OFF]
    return args


def build_config(cpuinfo_path: str = '/proc/cpuinfo',
                 machine: Optional[str] = None) -> BuildConfig:
    """Return the portable build configuration for this machine's CPU."""
    try:
        flags = cpu_flags(pathlib.Path(cpuinfo_path).read_text())
    except OSError:
        flags = frozenset()
    return BuildConfig(version=VERSION,
                       cmake_args=tuple(cmake_args(flags, machine or platform.machine())),
                       cpu_has_amx=any(f.startswith('amx') for f in flags))


def venv_python(peer_dir: pathlib.Path = PEER_DIR) -> str:
    return str(peer_dir / 'venv' / 'bin' / 'python')


def read_stamp(peer_dir: pathlib.Path = PEER_DIR) -> Optional[Dict]:
    """Return the installed peer's record (peer.json), or None when there is none."""
    try:
        return json.loads((peer_dir / 'venv' / STAMP).read_text())
    except (OSError, ValueError):
        return None


def ensure_peer(install: bool, config: Optional[BuildConfig] = None,
                peer_dir: pathlib.Path = PEER_DIR) -> Dict:
    """Return the peer's record ({'python', 'version', 'cmake_args', 'system_info', ...}).

    Builds it first when its venv is missing or was built with other flags and install is
    true; raises PeerBuildError otherwise, or when a step fails.
    """
    config = config or build_config()
    stamp = read_stamp(peer_dir)
    if _current(stamp, config, peer_dir):
        return stamp
    if not install:
        why = 'not built' if stamp is None else 'built with other flags'
        raise PeerBuildError(f'llama-cpp-python peer in {peer_dir} is {why} '
                             '(run bench/llama_peer.py or bench_engine.py --with-peers)')
    peer_dir.mkdir(parents=True, exist_ok=True)
    with open(peer_dir / '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs: one builds, the others wait
        stamp = read_stamp(peer_dir)
        if not _current(stamp, config, peer_dir):
            stamp = _install(config, peer_dir)
    return stamp


def _current(stamp: Optional[Dict], config: BuildConfig, peer_dir: pathlib.Path) -> bool:
    return (stamp is not None and stamp.get('key') == config.key
            and os.path.exists(venv_python(peer_dir)))


def _install(config: BuildConfig, peer_dir: pathlib.Path) -> Dict:
    venv = peer_dir / 'venv'
    shutil.rmtree(venv, ignore_errors=True)
    run_step([sys.executable, '-m', 'venv', str(venv)], 'create the peer venv')
    python = venv_python(peer_dir)
    wheel = _wheel(python, config, peer_dir / 'wheels' / config.key)
    run_step([python, '-m', 'pip', 'install', '-q', str(wheel), *EXTRA_PACKAGES],
             'install the llama-cpp-python wheel')
    code = ('import json, llama_cpp; print(json.dumps({"version": llama_cpp.__version__, '
            '"system_info": llama_cpp.llama_print_system_info().decode().strip()}))')
    probe = run_step([python, '-c', code], 'import the installed llama_cpp')
    found = json.loads(probe.strip().splitlines()[-1])
    stamp = {**asdict(config), 'cmake_args': list(config.cmake_args), 'key': config.key,
             'python': python, 'version': found['version'], 'system_info': found['system_info']}
    (venv / STAMP).write_text(json.dumps(stamp, indent=1))
    return stamp


def _wheel(python: str, config: BuildConfig, folder: pathlib.Path) -> pathlib.Path:
    """Return the wheel for this key, compiling it (minutes) when the folder has none."""
    found = sorted(folder.glob('llama_cpp_python-*.whl'))
    if found:
        return found[-1]
    print(f'llama_peer: compiling llama-cpp-python {config.version} into {folder} '
          f'(about 6 min on 2 cores) with {" ".join(config.cmake_args) or "default flags"}',
          file=sys.stderr)
    work = folder.with_name(folder.name + '.work')
    shutil.rmtree(work, ignore_errors=True)
    env = dict(os.environ, CMAKE_ARGS=' '.join(config.cmake_args),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    run_step([python, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-cache-dir',
              '--no-binary', 'llama-cpp-python', '-w', str(work),
              f'llama-cpp-python=={config.version}'], 'compile llama-cpp-python', env)
    built = sorted(work.glob('llama_cpp_python-*.whl'))
    if not built:
        raise PeerBuildError(f'pip wheel left no llama_cpp_python wheel in {work}')
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)  # complete wheels only: an interrupted build leaves just .work
    return folder / built[-1].name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--print-config', action='store_true',
                   help='print the build configuration for this CPU and exit')
    args = p.parse_args(argv)
    config = build_config()
    if args.print_config:
        result = {**asdict(config), 'key': config.key}
    else:
        try:
            result = ensure_peer(True, config)
        except PeerBuildError as exc:
            sys.exit(f'llama_peer: {exc}')  # exit status 1
    print(json.dumps(result, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Build native/ once per test session (cmake, the ORT headers from scripts/ort_headers.sh).

The host build uses the same folder and flags as scripts/setup.sh (build/native), so after
the setup this is cmake's up-to-date check, and the converter and runtime find the library
the tests built. The aarch64 build (Debian's g++-aarch64-linux-gnu) runs under qemu: the
kernel checks and the arm64 stage's op library.
"""
import functools
import pathlib
import shutil
import subprocess
from typing import List

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD = ROOT / 'build' / 'native'
AARCH64_BUILD = ROOT / 'build' / 'native-aarch64'


def _ort_include() -> str:
    return subprocess.run(['bash', str(ROOT / 'scripts' / 'ort_headers.sh')], check=True,
                          capture_output=True, text=True).stdout.strip()


def _cmake(commands: List[List[str]]) -> None:
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@functools.lru_cache(maxsize=None)
def native_build() -> pathlib.Path:
    """Return the build folder holding libedge_llm_kquant.so and libedge_llm_ort_ops.so."""
    _cmake([['cmake', '-S', str(ROOT / 'native'), '-B', str(BUILD),
             '-DCMAKE_BUILD_TYPE=Release', f'-DORT_INCLUDE_DIR={_ort_include()}'],
            ['cmake', '--build', str(BUILD), '-j2']])
    return BUILD


@functools.lru_cache(maxsize=None)
def aarch64_build(target: str) -> pathlib.Path:
    """Cross-build one target of native/ for aarch64; return the build folder."""
    for tool in ('aarch64-linux-gnu-g++', 'qemu-aarch64-static'):
        if shutil.which(tool) is None:
            pytest.fail(f'{tool} is missing: scripts/arm64_rootfs.sh installs it '
                        '(apt-get install g++-aarch64-linux-gnu qemu-user-static)')
    toolchain = ROOT / 'native' / 'cmake' / 'aarch64-linux-gnu.cmake'
    _cmake([['cmake', '-S', str(ROOT / 'native'), '-B', str(AARCH64_BUILD),
             f'-DCMAKE_TOOLCHAIN_FILE={toolchain}', f'-DORT_INCLUDE_DIR={_ort_include()}',
             '-DCMAKE_BUILD_TYPE=Release'],
            ['cmake', '--build', str(AARCH64_BUILD), '-j2', '--target', target]])
    return AARCH64_BUILD


def op_session(graph, threads: int = 1):
    """Return a CPU InferenceSession of `graph` (ops of edge_llm_ros) with the op library."""
    import onnxruntime as ort
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17),
                                                    helper.make_opsetid('edge_llm_ros', 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_build() / 'libedge_llm_ort_ops.so'))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=['CPUExecutionProvider'])

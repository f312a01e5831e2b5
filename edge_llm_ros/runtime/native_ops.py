"""The project's ONNX Runtime op library (native/): where it is, loading it, its kernels.

scripts/setup.sh builds ``native/`` with cmake into ``build/native/``. The library holds the
``edge_llm_ros`` op domain (KQuantMatMul, KQuantGather: GGUF blocks read as they are) and
picks its kernels from the CPU at run time. A model folder whose model.yaml lists that domain
needs it; loading such a folder without it is a NativeLibraryMissingError that says how to
build it (there is no fallback: the graph cannot run without its ops).

The kernel choice lives in the library's globals. ctypes opens the same file ONNX Runtime
registered (dlopen returns the loaded object), so a pin set here is the one the op runs; it
holds for the whole process (one engine per process is the product's shape).
"""
from __future__ import annotations

import ctypes
import functools
import os
import pathlib
from typing import Optional

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.choices import KERNEL_CHOICES

DOMAIN = 'edge_llm_ros'
LIBRARY_FILE = 'libedge_llm_ort_ops.so'
ENV_LIBRARY = 'EDGE_LLM_NATIVE_LIB'  # a built library elsewhere (an install, a test build)
_REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_HINT = ('build it with scripts/setup.sh (cmake -S native -B build/native '
              '-DORT_INCLUDE_DIR=$(bash scripts/ort_headers.sh) && cmake --build build/native), '
              f'or point {ENV_LIBRARY} at a built {LIBRARY_FILE}')


class NativeLibraryMissingError(ModelLoadError):
    """A model needs the native op library and it is not built."""


class KernelPinError(ModelLoadError):
    """A kernel pin this CPU (or this build) cannot run."""


def library_path() -> Optional[pathlib.Path]:
    """Return the built op library, or None when there is none."""
    env = os.environ.get(ENV_LIBRARY)
    if env:
        path = pathlib.Path(env).expanduser()
        if not path.is_file():
            raise NativeLibraryMissingError(f'{ENV_LIBRARY}={env} is not a file: {BUILD_HINT}')
        return path
    path = _REPO / 'build' / 'native' / LIBRARY_FILE
    return path if path.is_file() else None


def require_library(why: str) -> pathlib.Path:
    """Return the op library, or raise NativeLibraryMissingError naming `why` it is needed."""
    path = library_path()
    if path is None:
        raise NativeLibraryMissingError(f'{why} needs the edge_llm_ros op library '
                                        f'({LIBRARY_FILE}), which is not built: {BUILD_HINT}')
    return path


@functools.lru_cache(maxsize=None)
def _handle(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name in ('elk_kernel_name', 'elk_cpu_features'):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.elk_select_kernel.argtypes = [ctypes.c_char_p]
    return lib


def register(options, why: str, kernel: str = 'auto') -> pathlib.Path:
    """Register the op library with onnxruntime SessionOptions and apply the kernel pin."""
    path = require_library(why)
    pin_kernel(kernel, path)
    options.register_custom_ops_library(str(path))
    return path


def pin_kernel(kernel: str, path: Optional[pathlib.Path] = None) -> str:
    """Choose the kernels ('auto' = the best this CPU has); return the running kernel's name.

    An ISA this CPU or build lacks is a KernelPinError naming the CPU's features.
    """
    if kernel not in KERNEL_CHOICES:
        raise KernelPinError(f'kernel {kernel!r} is not one of {", ".join(KERNEL_CHOICES)}')
    lib = _handle(str(path or require_library(f'kernel pin {kernel!r}')))
    if lib.elk_select_kernel(kernel.encode()) != 0:
        raise KernelPinError(
            f'kernel {kernel!r} cannot run here: this CPU has '
            f'{lib.elk_cpu_features().decode() or "no SIMD the library uses"}; use auto')
    return lib.elk_kernel_name().decode()


def kernel_name(path: Optional[pathlib.Path] = None) -> str:
    """Return the running kernel set (e.g. 'avx2'), '' when the library is not built."""
    path = path or library_path()
    return _handle(str(path)).elk_kernel_name().decode() if path else ''


def cpu_features(path: Optional[pathlib.Path] = None) -> str:
    """Return the CPU features the library found (e.g. 'avx2 fma f16c'), '' without it."""
    path = path or library_path()
    return _handle(str(path)).elk_cpu_features().decode() if path else ''

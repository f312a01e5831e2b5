"""CUDA kernel sets: which kernels a profile selects, and whether this machine can build them.

`check_kernel_support` runs at configure time: it finds a compiler (nvcc, else NVRTC through
cuda-python) that can target the profile's SM arch, and, where nvidia-smi reports the GPU's
compute capability, checks the arch matches the GPU. Any mismatch is a KernelSupportError
then, never a failure at the first token. Nothing here needs a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from edge_llm_ros.bringup.errors import KernelSupportError

# kernel set -> kernel source files (kernels/<name>.cu). 'kquant' (the CUDA boards' set):
# GEMV/GEMM on GGUF blocks as they are (Q4_K, Q6_K, Q8_0; what the CUDA execution provider's
# edge_llm_ros.KQuantMatMul in native/ runs). 'int4_decode': MatMulNBits layouts (folders
# converted with --weights matmulnbits).
KERNEL_SETS: Dict[str, Tuple[str, ...]] = {
    'none': (),
    'int4_decode': ('int4_gemv', 'rmsnorm', 'rope', 'kv_int8'),
    'kquant': ('kquant', 'rmsnorm', 'rope', 'kv_int8'),
}

# source -> extern "C" entry points it must define
ENTRY_POINTS: Dict[str, Tuple[str, ...]] = {
    'int4_gemv': ('int4_gemv_f32', 'int4_gemv_f16'),
    'kquant': ('kquant_quantize_q8_0', 'kquant_quantize_q8_K',
               'kquant_gemv_q4_K', 'kquant_gemv_q6_K', 'kquant_gemv_q8_0',
               'kquant_gemm_q4_K', 'kquant_gemm_q6_K', 'kquant_gemm_q8_0', 'kquant_glu'),
    'rmsnorm': ('rmsnorm_f32', 'rmsnorm_f16', 'add_rmsnorm_f32', 'add_rmsnorm_f16'),
    'rope': ('rope_f32', 'rope_f16'),
    'kv_int8': ('kv_quantize_f32', 'kv_quantize_f16', 'kv_dequantize_f32', 'kv_dequantize_f16'),
}

NVCC_FLAGS = ('-O3', '-std=c++17')


def kernels_dir() -> pathlib.Path:
    """kernels/ of a source checkout, else of the installed package's share folder."""
    here = pathlib.Path(__file__).resolve()
    for candidate in (here.parents[2] / 'kernels',
                      pathlib.Path(sys.prefix) / 'share' / 'edge_llm_ros' / 'kernels'):
        if candidate.is_dir():
            return candidate
    raise KernelSupportError('no kernels/ folder found next to the package or in %s' % (
        pathlib.Path(sys.prefix) / 'share' / 'edge_llm_ros'))


def kernel_sources(kernel_set: str, folder: Optional[pathlib.Path] = None
                   ) -> Tuple[pathlib.Path, ...]:
    """Return the .cu files of a kernel set (all must exist)."""
    if kernel_set not in KERNEL_SETS:
        raise KernelSupportError('unknown cuda.kernel_set %r; known: %s' % (
            kernel_set, ', '.join(KERNEL_SETS)))
    names = KERNEL_SETS[kernel_set]
    if not names:
        return ()
    folder = folder or kernels_dir()
    paths = tuple(folder / ('%s.cu' % name) for name in names)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise KernelSupportError('kernel set %r is missing %s' % (kernel_set, ', '.join(missing)))
    return paths


def nvcc_command(source: pathlib.Path, sm_arch: str, output: pathlib.Path,
                 nvcc: str = 'nvcc') -> List[str]:
    """Return the PTX compile command each kernel file documents in its first line."""
    return [nvcc, '-ptx', '-arch=%s' % sm_arch, *NVCC_FLAGS, str(source), '-o', str(output)]


def find_nvcc() -> Optional[str]:
    """Find nvcc on PATH, in $CUDA_HOME/bin, or in /usr/local/cuda/bin (JetPack's place)."""
    found = shutil.which('nvcc')
    if found:
        return found
    for base in (os.environ.get('CUDA_HOME', ''), os.environ.get('CUDA_PATH', ''),
                 '/usr/local/cuda'):
        if base and os.access(os.path.join(base, 'bin', 'nvcc'), os.X_OK):
            return os.path.join(base, 'bin', 'nvcc')
    return None


def _run(cmd: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          check=False)


def nvcc_version(nvcc: str) -> str:
    """'13.0' from `nvcc --version` ('' if unreadable)."""
    match = re.search(r'release (\d+\.\d+)', _run([nvcc, '--version']).stdout)
    return match.group(1) if match else ''


def nvcc_archs(nvcc: str) -> FrozenSet[str]:
    """SM archs nvcc can generate code for (`nvcc --list-gpu-arch`, CUDA 11.5+)."""
    out = _run([nvcc, '--list-gpu-arch']).stdout
    return frozenset('sm_%s' % m for m in re.findall(r'compute_(\d+)', out))


def nvrtc_archs() -> FrozenSet[str]:
    """SM archs NVRTC supports, through cuda-python when it is installed (else empty)."""
    try:
        from cuda.bindings import nvrtc   # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import nvrtc   # older cuda-python
        except ImportError:
            return frozenset()
    try:
        err, count = nvrtc.nvrtcGetNumSupportedArchs()
        err2, archs = nvrtc.nvrtcGetSupportedArchs()
    except Exception:   # a broken install behaves like no NVRTC at all
        return frozenset()
    if int(err) or int(err2):
        return frozenset()
    return frozenset('sm_%d' % a for a in archs)


def device_sm_arch() -> Optional[str]:
    """Compute capability of GPU 0 from nvidia-smi as 'sm_XY' (None when unavailable)."""
    smi = shutil.which('nvidia-smi')
    if smi is None:
        return None
    try:
        out = _run([smi, '--query-gpu=compute_cap', '--format=csv,noheader'], timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r'\s*(\d+)\.(\d+)', out)
    return 'sm_%s%s' % match.groups() if match else None


@dataclass(frozen=True)
class Toolchain:
    """The compiler that will build the kernels."""

    compiler: str                # 'nvcc' or 'nvrtc'
    path: str                    # nvcc's path ('' for NVRTC)
    version: str
    archs: FrozenSet[str]
    device_arch: Optional[str]   # what nvidia-smi reported, None when it could not say


def _arch_key(arch: str) -> int:
    return int(arch.split('_')[1])


def check_kernel_support(kernel_set: str, sm_arch: str, *, nvcc: Optional[str] = None,
                         use_nvrtc: bool = True, device_arch: Optional[str] = '',
                         folder: Optional[pathlib.Path] = None) -> Optional[Toolchain]:
    """Return the toolchain that can build `kernel_set` for `sm_arch`, or raise.

    None for kernel set 'none'. `device_arch` '' means ask nvidia-smi, None means unknown.
    """
    sources = kernel_sources(kernel_set, folder)
    if not sources:
        return None
    if not re.fullmatch(r'sm_\d{2,3}', sm_arch or ''):
        raise KernelSupportError('cuda.kernel_set %r needs cuda.sm_arch like sm_87, got %r' % (
            kernel_set, sm_arch))
    nvcc = nvcc or find_nvcc()
    tried = []
    toolchain = None
    if nvcc:
        archs = nvcc_archs(nvcc)
        version = nvcc_version(nvcc)
        tried.append('nvcc %s at %s targets %s' % (version or '?', nvcc, _arch_list(archs)))
        if sm_arch in archs:
            toolchain = Toolchain('nvcc', nvcc, version, archs, None)
    if toolchain is None and use_nvrtc:
        archs = nvrtc_archs()
        if archs:
            tried.append('NVRTC targets %s' % _arch_list(archs))
            if sm_arch in archs:
                toolchain = Toolchain('nvrtc', '', '', archs, None)
    if toolchain is None:
        found = '; '.join(tried) if tried else 'no nvcc (PATH, $CUDA_HOME/bin, ' \
            '/usr/local/cuda/bin) and no NVRTC (cuda-python)'
        raise KernelSupportError(
            'cuda.kernel_set %r cannot be built for %s: %s. Install a CUDA toolkit that '
            'targets %s (JetPack ships nvcc in /usr/local/cuda/bin), pick a supported '
            'cuda.sm_arch, or set cuda.kernel_set:=none' % (kernel_set, sm_arch, found, sm_arch))
    if device_arch == '':
        device_arch = device_sm_arch()
    if device_arch is not None and device_arch != sm_arch:
        raise KernelSupportError('cuda.sm_arch is %s but the GPU reports %s: set '
                                 'cuda.sm_arch:=%s' % (sm_arch, device_arch, device_arch))
    return Toolchain(toolchain.compiler, toolchain.path, toolchain.version, toolchain.archs,
                     device_arch)


def _arch_list(archs: FrozenSet[str]) -> str:
    return ', '.join(sorted(archs, key=_arch_key)) or 'nothing'


def compile_ptx(source: pathlib.Path, sm_arch: str, out_dir: pathlib.Path,
                nvcc: Optional[str] = None) -> pathlib.Path:
    """Compile one kernel file to PTX with nvcc; KernelSupportError carries nvcc's output."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise KernelSupportError('nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)')
    output = pathlib.Path(out_dir) / ('%s.%s.ptx' % (source.stem, sm_arch))
    result = _run(nvcc_command(source, sm_arch, output, nvcc), timeout=300)
    if result.returncode != 0:
        raise KernelSupportError('nvcc failed on %s for %s:\n%s' % (
            source, sm_arch, (result.stderr or result.stdout).strip()))
    return output


def ptx_entry_points(ptx: str) -> Tuple[str, ...]:
    """Names of the kernels (.entry) a PTX text defines."""
    return tuple(re.findall(r'^\.visible \.entry (\w+)\(', ptx, re.M))

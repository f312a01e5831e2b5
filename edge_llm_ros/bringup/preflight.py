"""Configure-time checks of llm_node's settings against this machine.

llm_node calls `preflight(values)` in on_configure, before loading the model, so a wrong
provider, a CPU list naming missing cores, or a kernel set the installed CUDA cannot build
fails the transition with a clear message instead of failing at the first token.
Soft findings (no matching thermal zone, a model larger than the board's comfortable
size) come back as warnings for the log and diagnostics.
"""
from __future__ import annotations

from dataclasses import dataclass
import pathlib
import re
from typing import Any, Mapping, Optional, Sequence, Tuple

import yaml

from edge_llm_ros.bringup import parameters
from edge_llm_ros.bringup.affinity import check_cpus, parse_cpu_list, usable_cpus
from edge_llm_ros.bringup.errors import KernelSupportError, ProviderError
from edge_llm_ros.bringup.kernels import check_kernel_support, Toolchain
from edge_llm_ros.bringup.thermal import list_zones, watched_zones
from edge_llm_ros.runtime import native_ops


@dataclass(frozen=True)
class PreflightReport:
    """What the checks found; `warnings` are for the log and diagnostics."""

    providers: Tuple[str, ...]
    cpus: Tuple[int, ...]                 # cores the process may use after pinning
    toolchain: Optional[Toolchain]        # None for kernel set 'none'
    cpu_kernel: str                       # the GGUF-block ops' kernels ('' = not built)
    thermal_zones: Tuple[str, ...]        # zone types the governor will watch
    warnings: Tuple[str, ...]


def check_providers(wanted: Sequence[str], available: Sequence[str]) -> None:
    """Raise ProviderError naming the missing providers and the installed ones."""
    missing = [p for p in wanted if p not in available]
    if missing:
        raise ProviderError(
            'engine.providers asks for %s, but this onnxruntime offers only %s. Install the '
            'matching build (onnxruntime-gpu for CUDA; NVIDIA publishes JetPack wheels) or '
            'remove them from engine.providers' % (', '.join(missing), ', '.join(available)))


def size_in_params(text: str) -> float:
    """'1.5B' -> 1.5e9, '135M' -> 1.35e8."""
    match = re.fullmatch(r'(\d+(?:\.\d+)?)([MB])', text)
    if match is None:
        raise ValueError('%r is not a size like 135M or 1.5B' % text)
    return float(match.group(1)) * (1e6 if match.group(2) == 'M' else 1e9)


# INT4 blocks of 32 with an fp32 scale and a 4-bit zero point: 4 + 32/32 + 4/32 bits each.
BITS_PER_INT4_PARAM = 5.125


def estimate_params(model_dir: str) -> Optional[float]:
    """Parameter count of a converted INT4 model from its weight bytes (None if absent).

    Architecture-free: the ONNX file plus its external data hold every weight, so bytes x 8
    / 5.125 bits counts them to within the few unquantized norms.
    """
    folder = pathlib.Path(model_dir)
    files = [folder / 'model.onnx'] + sorted(folder.glob('*.onnx.data'))
    sizes = [f.stat().st_size for f in files if f.is_file()]
    if not sizes:
        return None
    return sum(sizes) * 8 / BITS_PER_INT4_PARAM


def model_warnings(model_dir: str, default_size: str, quantization: str) -> Tuple[str, ...]:
    """Warnings when a model is well above the board's comfortable size or not INT4."""
    if not model_dir:
        return ()       # the embedded 135M INT4 model fits every profile
    out = []
    params = estimate_params(model_dir)
    if params is not None and params > 1.5 * size_in_params(default_size):
        out.append("model %s has ~%.2gB parameters, above this board's model.default_size %s: "
                   'expect slow decode and memory pressure' % (model_dir, params / 1e9,
                                                               default_size))
    try:
        meta = yaml.safe_load(pathlib.Path(model_dir, 'model.yaml').read_text())
        bits = int(meta['quantization']['bits'])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return tuple(out)   # the engine reports unreadable models itself
    if quantization == 'int4' and bits != 4:
        out.append("model %s stores %d-bit weights; this board's model.quantization is int4 "
                   '(%d-bit decode reads %.1fx the bytes per token)' % (
                       model_dir, bits, bits, bits / 4.0))
    return tuple(out)


def preflight(values: Mapping[str, Any], *, root: str = '/',
              available_providers: Optional[Sequence[str]] = None,
              check_kernels: bool = True) -> PreflightReport:
    """Validate llm_node's parameter values against this machine; raise on hard errors."""
    values = parameters.schema('llm_node').validate(dict(values), source='llm_node')
    parameters.check_consistency(values, source='llm_node')
    if available_providers is None:
        import onnxruntime
        available_providers = onnxruntime.get_available_providers()
    providers = tuple(values['engine.providers'])
    check_providers(providers, available_providers)
    usable = usable_cpus(root)
    pinned = parse_cpu_list(values['engine.cpu_affinity'])
    check_cpus(pinned, usable)
    toolchain = check_kernel_support(values['cuda.kernel_set'], values['cuda.sm_arch']) \
        if check_kernels else None
    cpu_kernel = check_cpu_kernel(values['cpu.kernel'])
    warnings = []
    zones: Tuple[str, ...] = ()
    if values['thermal.enabled']:
        present = list_zones(root)
        zones = tuple(kind for _, kind in watched_zones(present, values['thermal.zones']))
        if not zones:
            warnings.append('thermal: no zone matches %s (zones here: %s); generation will not '
                            'be throttled' % (', '.join(values['thermal.zones']), ', '.join(
                                sorted({k for _, k in present})) or 'none'))
    warnings.extend(model_warnings(values['model.path'], values['model.default_size'],
                                   values['model.quantization']))
    return PreflightReport(providers, pinned or usable, toolchain, cpu_kernel, zones,
                           tuple(warnings))


def check_cpu_kernel(kernel: str) -> str:
    """Return the op library's kernels under `kernel`; raise KernelSupportError if unusable.

    'auto' without the library is fine (matmulnbits models need none; a kquant model names
    the missing library when it loads); a pin needs the library and a CPU that has the ISA.
    """
    if kernel == 'auto' and native_ops.library_path() is None:
        return ''
    try:
        return native_ops.pin_kernel(kernel)
    except native_ops.NativeLibraryMissingError as exc:
        raise KernelSupportError('cpu.kernel %r: %s' % (kernel, exc)) from None
    except native_ops.KernelPinError as exc:
        raise KernelSupportError('cpu.kernel: %s' % exc) from None

"""Run the CUDA kernels (kernels/*.cu) on a GPU with pycuda and check them against NumPy.

    python -m edge_llm_ros.bringup.cuda_runner --arch sm_87      # on a Jetson Orin
    python -m edge_llm_ros.bringup.cuda_runner                   # arch from nvidia-smi

Each kernel is compiled with pycuda's SourceModule for the profile's SM arch, launched on
random inputs and compared with edge_llm_ros.bringup.kernel_reference. Prints one JSON
line per check and a table; exits 1 when a check fails, 2 without pycuda or a GPU.
`cases()` (inputs, launch shapes, expected outputs) needs no GPU, so the tests check every
case's arguments against the kernels' C signatures on any machine. pycuda is imported only
inside `run_checks`, so importing this module never needs CUDA.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
import json
import pathlib
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.bringup import kernel_reference as ref
from edge_llm_ros.bringup.kernels import kernels_dir, NVCC_FLAGS


@dataclass
class Arg:
    """One kernel argument: an array copied in/out, a null pointer, or a scalar."""

    kind: str            # 'in', 'out', 'inout', 'null', 'int', 'float'
    value: Any = None


@dataclass
class Expect:
    """An output argument and what it must hold."""

    index: int                      # position in KernelCase.args
    expected: np.ndarray
    atol: float
    rtol: float = 0.0
    max_int_diff: int = 0           # integer outputs: allowed |difference| (rounding ties)


@dataclass
class KernelCase:
    """One launch of one kernel and its expected outputs."""

    label: str
    source: str                     # kernels/<source>.cu
    entry: str                      # extern "C" kernel name
    args: List[Arg]
    block: Tuple[int, int, int]
    grid: Tuple[int, int, int]
    expects: List[Expect] = field(default_factory=list)


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one case on the GPU."""

    label: str
    entry: str
    max_abs_err: float
    tolerance: float
    passed: bool

    def as_dict(self) -> Dict[str, Any]:
        """JSON-friendly form."""
        return {'label': self.label, 'entry': self.entry, 'max_abs_err': self.max_abs_err,
                'tolerance': self.tolerance, 'passed': self.passed}


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _gemv_cases(rng: np.random.Generator) -> List[KernelCase]:
    cases = []
    warps = 4
    # N 300: not a multiple of the warps per block, on purpose. The last case has K 1120 (35
    # blocks: not a multiple of 256, and lanes 0-2 take a second block) and N 37.
    variants = ((300, 1024, np.float32, ref.ZP_NONE, 1e-4),
                (300, 1024, np.float32, ref.ZP_PACKED_U8, 1e-4),
                (300, 1024, np.float32, ref.ZP_FLOAT, 1e-4),
                (300, 1024, np.float16, ref.ZP_PACKED_U8, 2e-2),
                (300, 1024, np.float16, ref.ZP_FLOAT, 2e-2),
                (37, 1120, np.float32, ref.ZP_PACKED_U8, 1e-4))
    for n, k, dtype, zp_kind, tol in variants:
        weights = ref.quantize_int4(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                    zp_kind, dtype)
        x = rng.standard_normal(k).astype(dtype)
        expected = ref.int4_gemv(x, weights)
        zp = Arg('null') if weights.zero_points is None else Arg('in', np.ascontiguousarray(
            weights.zero_points))
        scale = float(np.abs(expected).max()) or 1.0
        cases.append(KernelCase(
            'int4_gemv %s zp=%d%s' % (np.dtype(dtype).name, zp_kind,
                                      '' if (n, k) == (300, 1024) else ' N=%d K=%d' % (n, k)),
            'int4_gemv',
            'int4_gemv_%s' % ('f32' if dtype == np.float32 else 'f16'),
            [Arg('in', x), Arg('in', weights.packed), Arg('in', weights.scales), zp,
             Arg('int', zp_kind), Arg('out', np.zeros(n, dtype)), Arg('int', n), Arg('int', k)],
            (32 * warps, 1, 1), (_blocks(n, warps), 1, 1),
            [Expect(5, expected, atol=tol * scale)]))
    return cases


def _norm_cases(rng: np.random.Generator) -> List[KernelCase]:
    cases = []
    rows, hidden, eps = 3, 576, 1e-5    # SmolLM2-135M's hidden size
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 4e-3)):
        suffix = 'f32' if dtype == np.float32 else 'f16'
        x = rng.standard_normal((rows, hidden)).astype(dtype)
        r = rng.standard_normal((rows, hidden)).astype(dtype)
        w = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
        y = ref.rmsnorm(x, w, eps)
        cases.append(KernelCase(
            'rmsnorm %s' % np.dtype(dtype).name, 'rmsnorm', 'rmsnorm_' + suffix,
            [Arg('in', x), Arg('in', w), Arg('out', np.zeros_like(x)), Arg('int', hidden),
             Arg('float', eps)], (256, 1, 1), (rows, 1, 1),
            [Expect(2, y, atol=tol * float(np.abs(y).max()))]))
        y2, h = ref.add_rmsnorm(x, r, w, eps)
        cases.append(KernelCase(
            'add_rmsnorm %s' % np.dtype(dtype).name, 'rmsnorm', 'add_rmsnorm_' + suffix,
            [Arg('in', x), Arg('in', r), Arg('in', w), Arg('out', np.zeros_like(x)),
             Arg('out', np.zeros_like(x)), Arg('int', hidden), Arg('float', eps)],
            (256, 1, 1), (rows, 1, 1),
            [Expect(3, y2, atol=tol * float(np.abs(y2).max())),
             Expect(4, h, atol=tol * float(np.abs(h).max()))]))
    return cases


def _rope_cases(rng: np.random.Generator) -> List[KernelCase]:
    cases = []
    seq, heads, head_dim = 5, 3, 64
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 4e-3)):
        for interleaved in (0, 1):
            for rot in (head_dim, head_dim // 2):        # full and partial rotary
                cos, sin = ref.rope_cache(64, rot)
                cos, sin = cos.astype(dtype), sin.astype(dtype)
                x = rng.standard_normal((seq, heads, head_dim)).astype(dtype)
                positions = np.array([0, 7, 8, 31, 63], np.int64)
                y = ref.rope(x, positions, cos, sin, bool(interleaved))
                pairs = seq * heads * rot // 2
                cases.append(KernelCase(
                    'rope %s interleaved=%d rot=%d' % (np.dtype(dtype).name, interleaved, rot),
                    'rope', 'rope_%s' % ('f32' if dtype == np.float32 else 'f16'),
                    [Arg('inout', x.copy()), Arg('in', positions), Arg('in', cos),
                     Arg('in', sin), Arg('int', seq), Arg('int', heads), Arg('int', head_dim),
                     Arg('int', rot // 2), Arg('int', interleaved)],
                    (256, 1, 1), (_blocks(pairs, 256), 1, 1),
                    [Expect(0, y, atol=tol * float(np.abs(y).max()))]))
    return cases


def _kv_cases(rng: np.random.Generator) -> List[KernelCase]:
    cases = []
    heads, max_ctx, head_dim, start, count, warps = 3, 16, 64, 2, 9, 4
    for dtype in (np.float32, np.float16):
        suffix = 'f32' if dtype == np.float32 else 'f16'
        kv = rng.standard_normal((heads, max_ctx, head_dim)).astype(dtype)
        kv[1, start + 3] = 0                        # an all-zero token: scale 0, q 0
        q_ref = np.zeros((heads, max_ctx, head_dim), np.int8)
        s_ref = np.zeros((heads, max_ctx), np.float32)
        q_part, s_part = ref.kv_quantize(kv[:, start:start + count].astype(np.float32))
        q_ref[:, start:start + count], s_ref[:, start:start + count] = q_part, s_part
        rows = heads * count
        cases.append(KernelCase(
            'kv_quantize %s' % np.dtype(dtype).name, 'kv_int8', 'kv_quantize_' + suffix,
            [Arg('in', kv), Arg('out', np.zeros_like(q_ref)), Arg('out', np.zeros_like(s_ref)),
             Arg('int', heads), Arg('int', max_ctx), Arg('int', head_dim), Arg('int', start),
             Arg('int', count)], (32 * warps, 1, 1), (_blocks(rows, warps), 1, 1),
            [Expect(1, q_ref, atol=0.0, max_int_diff=1), Expect(2, s_ref, atol=1e-7, rtol=1e-6)]))
        x_ref = np.zeros((heads, max_ctx, head_dim), dtype)
        x_ref[:, start:start + count] = ref.kv_dequantize(q_part, s_part)
        n = rows * head_dim
        cases.append(KernelCase(
            'kv_dequantize %s' % np.dtype(dtype).name, 'kv_int8', 'kv_dequantize_' + suffix,
            [Arg('in', q_ref), Arg('in', s_ref), Arg('out', np.zeros_like(x_ref)),
             Arg('int', heads), Arg('int', max_ctx), Arg('int', head_dim), Arg('int', start),
             Arg('int', count)], (256, 1, 1), (_blocks(n, 256), 1, 1),
            [Expect(2, x_ref, atol=1e-6 if dtype == np.float32 else 2e-3)]))
    return cases


def cases(seed: int = 0) -> List[KernelCase]:
    """Every kernel check, with deterministic inputs."""
    rng = np.random.default_rng(seed)
    return _gemv_cases(rng) + _norm_cases(rng) + _rope_cases(rng) + _kv_cases(rng)


def compare(case: KernelCase, outputs: Dict[int, np.ndarray]) -> CheckResult:
    """Compare a case's outputs (argument index -> array) with its expectations."""
    worst, tolerance, passed = 0.0, 0.0, True
    for expect in case.expects:
        got = outputs[expect.index].astype(np.float64)
        want = expect.expected.astype(np.float64)
        err = np.abs(got - want)
        if expect.max_int_diff:
            # Rounding ties may land one step apart; allow it on at most 1% of values.
            ok = bool(err.max() <= expect.max_int_diff and (err > 0).mean() <= 0.01)
            limit = float(expect.max_int_diff)
        else:
            limits = expect.atol + expect.rtol * np.abs(want)
            ok = bool((err <= limits).all())
            limit = float(limits.max())
        worst, tolerance, passed = max(worst, float(err.max())), max(tolerance, limit), \
            passed and ok
    return CheckResult(case.label, case.entry, worst, tolerance, passed)


def run_checks(sm_arch: str, seed: int = 0, folder: Optional[pathlib.Path] = None
               ) -> List[CheckResult]:
    """Compile every kernel with pycuda for `sm_arch`, run all cases, compare."""
    import pycuda.autoinit  # noqa: F401  (creates the context on GPU 0)
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule
    folder = folder or kernels_dir()
    modules: Dict[str, Any] = {}
    results = []
    for case in cases(seed):
        if case.source not in modules:
            source = (folder / ('%s.cu' % case.source)).read_text()
            modules[case.source] = SourceModule(source, arch=sm_arch, no_extern_c=True,
                                                options=list(NVCC_FLAGS))
        kernel = modules[case.source].get_function(case.entry)
        outputs: Dict[int, np.ndarray] = {}
        call_args: List[Any] = []
        for index, arg in enumerate(case.args):
            if arg.kind == 'in':
                call_args.append(cuda.In(np.ascontiguousarray(arg.value)))
            elif arg.kind in ('out', 'inout'):
                outputs[index] = np.ascontiguousarray(arg.value)
                wrap = cuda.Out if arg.kind == 'out' else cuda.InOut
                call_args.append(wrap(outputs[index]))
            elif arg.kind == 'null':
                call_args.append(np.intp(0))
            elif arg.kind == 'int':
                call_args.append(np.int32(arg.value))
            else:
                call_args.append(np.float32(arg.value))
        kernel(*call_args, block=case.block, grid=case.grid)
        cuda.Context.synchronize()
        results.append(compare(case, outputs))
    return results


def _table(results: Sequence[CheckResult]) -> str:
    lines = ['%-36s %-20s %12s %12s  %s' % ('check', 'kernel', 'max |err|', 'tolerance', 'ok')]
    for r in results:
        lines.append('%-36s %-20s %12.3e %12.3e  %s' % (
            r.label, r.entry, r.max_abs_err, r.tolerance, 'yes' if r.passed else 'NO'))
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--arch', default='', help="SM arch, e.g. sm_87; '' = ask nvidia-smi")
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import pycuda  # noqa: F401
    except ImportError as exc:
        out('pycuda is not installed (%s): pip install pycuda on a machine with a GPU' % exc)
        return 2
    arch = args.arch
    if not arch:
        from edge_llm_ros.bringup.kernels import device_sm_arch
        arch = device_sm_arch() or ''
        if not arch:
            out('no --arch given and nvidia-smi cannot tell the GPU arch')
            return 2
    results = run_checks(arch, args.seed)
    for r in results:
        out(json.dumps(dict(r.as_dict(), arch=arch)))
    out(_table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == '__main__':
    sys.exit(main())

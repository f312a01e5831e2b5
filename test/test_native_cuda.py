"""The CUDA KQuantMatMul: kernels/kquant.cu and native/'s libedge_llm_ort_ops_cuda.so.

On any machine with nvcc (no GPU needed): kquant.cu compiles for Orin (sm_87) and Hopper
(sm_90) and defines every entry point (PTX entries and cubin symbols), its float arithmetic is
round-to-nearest and never fused (the CPU reference's expressions, so the bits can agree), and
cmake builds the op library for 87;90, with cudart linked statically and RegisterCustomOps its
export. Without nvcc too: the kernels themselves (the same source, through
native/tests/cuda_emulation.h) run on the CPU bit-equal to ref.cpp (kquant_emulate).

Where an NVIDIA GPU and onnxruntime-gpu are present (skipped otherwise): the op in a CUDA
session gives the CPU op's bits on random Q4_K / Q6_K / Q8_0 blocks (tolerance 0: the kernels
compute the CPU op's integer sums and float expressions in its order; and within 2% of
|A| x |W| of the dense product, as the CPU op's own test), refuses the other types when the
session is created, and times the decode GEMV at a 1.5B shape (K 1536, N 8960).
"""
import ctypes
import pathlib
import re
import shutil
import subprocess
import time

from gguf import GGMLQuantizationType, quants
from native_build import native_build
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest
from test_native_ref import random_blocks, TYPES

from edge_llm_ros.bringup import kernels

NVCC = kernels.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason='nvcc (CUDA toolkit) is not installed')
KQUANT = kernels.kernels_dir() / 'kquant.cu'
CUDA_LIBRARY = 'libedge_llm_ort_ops_cuda.so'
CUDA_TYPES = ('Q4_K', 'Q6_K', 'Q8_0')


def gpu_present() -> bool:
    """Whether an NVIDIA GPU answers: nvidia-smi -L, else the driver's cuInit (Jetson)."""
    smi = shutil.which('nvidia-smi')
    if smi is not None:
        try:
            out = subprocess.run([smi, '-L'], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and 'GPU ' in out.stdout:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        cuda = ctypes.CDLL('libcuda.so.1')
    except OSError:
        return False
    count = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and \
        count.value > 0


GPU = gpu_present() and 'CUDAExecutionProvider' in ort.get_available_providers()
needs_gpu = pytest.mark.skipif(not GPU, reason='needs an NVIDIA GPU and onnxruntime-gpu '
                                               '(CUDAExecutionProvider); none here')


def cuda_library() -> pathlib.Path:
    """Return the built CUDA op library (native_build builds it where CMake finds nvcc)."""
    path = native_build() / CUDA_LIBRARY
    assert path.is_file(), f'{path} was not built: see build/native/CMakeCache.txt (ELK_CUDA)'
    return path


# ---- the kernels: builds and the CPU emulation -------------------------------------------

@needs_nvcc
@pytest.mark.parametrize('arch', ['sm_87', 'sm_90'])
def test_kquant_compiles_for_orin_and_hopper_and_defines_every_entry_point(tmp_path, arch):
    cubin = tmp_path / f'kquant.{arch}.cubin'
    proc = subprocess.run([NVCC, '-cubin', f'-arch={arch}', *kernels.NVCC_FLAGS, str(KQUANT),
                           '-o', str(cubin)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    symbols = subprocess.run(['nm', str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    defined = set(re.findall(r'^[0-9a-f]+ T (\w+)$', symbols, re.M))
    assert set(kernels.ENTRY_POINTS['kquant']) <= defined
    text = kernels.compile_ptx(KQUANT, arch, tmp_path, NVCC).read_text()
    assert '.target %s' % arch in text
    assert set(kernels.ENTRY_POINTS['kquant']) <= set(kernels.ptx_entry_points(text))
    # Every f32 multiply, add and subtract rounds to nearest and none is fused: ptxas may not
    # contract mul.rn + add.rn into an FMA, so the GPU computes the CPU's expressions.
    ops = re.findall(r'\b(fma|mad|mul|add|sub)((?:\.\w+)*)\.f32\b', text)
    assert ops and not [op for op in ops if op[0] in ('fma', 'mad')]
    assert all('.rn' in suffix for op, suffix in ops if op in ('mul', 'sub')), ops
    assert all('.rn' in suffix or '.rz' in suffix for op, suffix in ops if op == 'add')


def test_kquant_kernels_run_on_the_cpu_bit_equal_to_the_reference():
    """The kernels' own source under cuda_emulation.h: every output and activation byte."""
    proc = subprocess.run([str(native_build() / 'kquant_emulate')], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '38 cases, 0 different' in proc.stdout
    for name in CUDA_TYPES:
        for path in ('gemv', 'gemm'):
            assert re.search(rf'^{name} .*\({path}.*: bit-equal$', proc.stdout, re.M)
    for kind in (1, 2):  # a fused gate|up product's activation: elk_glu's bits
        assert re.search(rf'^glu kind {kind} .*: bit-equal$', proc.stdout, re.M)


# ---- the op library ----------------------------------------------------------------------

def needed(path: pathlib.Path) -> list:
    out = subprocess.run(['readelf', '-d', str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r'\(NEEDED\)\s+Shared library: \[([^\]]+)\]', out)


@needs_nvcc
def test_cuda_op_library_builds_for_87_and_90_with_static_cudart():
    path = cuda_library()
    exported = subprocess.run(['nm', '-D', '--defined-only', str(path)], capture_output=True,
                              text=True, check=True).stdout
    assert re.findall(r'^[0-9a-f]+ T (\w+)$', exported, re.M) == ['RegisterCustomOps']
    # No libcudart.so or libcuda.so to find at load time (cudart opens the driver itself).
    assert not [lib for lib in needed(path) if 'cuda' in lib], needed(path)
    # The fatbin holds a cubin per architecture (nvcc records each one's ptxas arch).
    blob = path.read_bytes()
    assert b'-arch sm_87' in blob and b'-arch sm_90' in blob
    # The CPU libraries stay CUDA-free.
    for cpu in ('libedge_llm_ort_ops.so', 'libedge_llm_kquant.so'):
        assert not [lib for lib in needed(native_build() / cpu) if 'cuda' in lib]


def matmul_model(type_id: int, weights: np.ndarray, k: int, n: int, bias=None) -> bytes:
    """Y = KQuantMatMul(A, W[, B]) with W (and B) initializers, A [M, K] any M."""
    initializers = [numpy_helper.from_array(weights, 'W')]
    names = ['A', 'W']
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, 'B'))
        names.append('B')
    node = helper.make_node('KQuantMatMul', names, ['Y'], domain='edge_llm_ros',
                            quant_type=type_id, K=k, N=n)
    graph = helper.make_graph(
        [node], 'kquant', [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', n])], initializers)
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid('', 17), helper.make_opsetid('edge_llm_ros', 1)]).SerializeToString()


def session(model: bytes, library: pathlib.Path, providers) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=list(providers))


@needs_nvcc
def test_the_op_has_a_kernel_for_the_cuda_provider_only():
    model = matmul_model(8, np.zeros((1, 34), np.uint8), 32, 1)
    with pytest.raises(Exception, match='Could not find an implementation for KQuantMatMul'):
        session(model, cuda_library(), ['CPUExecutionProvider'])
    # One session holds one of the two libraries: ORT refuses a domain registered twice.
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_build() / 'libedge_llm_ort_ops.so'))
    options.register_custom_ops_library(str(cuda_library()))
    with pytest.raises(Exception, match='Domain already set in registry'):
        ort.InferenceSession(model, options, providers=['CPUExecutionProvider'])


# ---- on a GPU ------------------------------------------------------------------------------

def case(name: str, k: int, n: int, seed: int):
    type_id, _, per, _ = TYPES[name]
    rng = np.random.default_rng(seed)
    return type_id, random_blocks(rng, name, n * k // per).reshape(n, -1), rng


def cpu_and_cuda(model: bytes):
    cpu = session(model, native_build() / 'libedge_llm_ort_ops.so', ['CPUExecutionProvider'])
    gpu = session(model, cuda_library(), ['CUDAExecutionProvider', 'CPUExecutionProvider'])
    return cpu, gpu


@needs_gpu
@needs_nvcc
@pytest.mark.parametrize('name, k, n', [('Q4_K', 1536, 200), ('Q6_K', 768, 37),
                                        ('Q8_0', 1120, 70)])
def test_cuda_op_gives_the_cpu_ops_bits(name, k, n):
    type_id, weights, rng = case(name, k, n, seed=k + n)
    bias = rng.standard_normal(n).astype(np.float32)
    for with_bias in (False, True):
        cpu, gpu = cpu_and_cuda(matmul_model(type_id, weights, k, n,
                                             bias if with_bias else None))
        for m in (1, 2, 4, 5, 37, 130):   # GEMV up to 4 rows, GEMM (64-row tiles) above
            a = rng.standard_normal((m, k)).astype(np.float32)
            want = cpu.run(None, {'A': a})[0]
            got = gpu.run(None, {'A': a})[0]
            assert got.shape == (m, n)
            diff = np.abs(got.astype(np.float64) - want).max()
            assert np.array_equal(got, want), f'{name} M {m}: max |CUDA - CPU| {diff:.3g}'
        dense = quants.dequantize(weights, GGMLQuantizationType[name]).astype(np.float64)
        exact = a.astype(np.float64) @ dense.T + (bias if with_bias else 0.0)
        scale = np.abs(a).astype(np.float64) @ np.abs(dense.T)
        assert np.all(np.abs(got - exact) <= 0.02 * scale)


@needs_gpu
@needs_nvcc
@pytest.mark.parametrize('name', ['Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q5_K'])
def test_cuda_op_refuses_the_types_it_does_not_hold(name):
    type_id, weights, _ = case(name, 256, 4, seed=1)
    with pytest.raises(Exception, match='the CUDA op holds only Q4_K'):
        session(matmul_model(type_id, weights, 256, 4), cuda_library(),
                ['CUDAExecutionProvider', 'CPUExecutionProvider'])


@needs_gpu
@needs_nvcc
@pytest.mark.parametrize('name', CUDA_TYPES)
def test_decode_gemv_time_at_a_1p5b_shape(name, record_property):
    """One token through a 1.5B FFN matrix (K 1536, N 8960): A and Y bound on the device."""
    k, n, runs = 1536, 8960, 200
    type_id, weights, rng = case(name, k, n, seed=15)
    cpu, gpu = cpu_and_cuda(matmul_model(type_id, weights, k, n))
    a = rng.standard_normal((1, k)).astype(np.float32)
    assert np.array_equal(gpu.run(None, {'A': a})[0], cpu.run(None, {'A': a})[0])
    binding = gpu.io_binding()
    binding.bind_ortvalue_input('A', ort.OrtValue.ortvalue_from_numpy(a, 'cuda', 0))
    binding.bind_output('Y', 'cuda')
    for _ in range(20):
        gpu.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(runs):
        gpu.run_with_iobinding(binding)   # ORT synchronizes the stream at the end of a run
    seconds = (time.perf_counter() - start) / runs
    gigabytes = weights.nbytes / 1e9
    record_property('gemv_us', seconds * 1e6)
    print(f'\n{name} GEMV K {k} N {n}: {seconds * 1e6:.1f} us a run (ORT overhead included), '
          f'{weights.nbytes / 1e6:.1f} MB of blocks, {gigabytes / seconds:.0f} GB/s')
    assert np.array_equal(binding.copy_outputs_to_cpu()[0], cpu.run(None, {'A': a})[0])

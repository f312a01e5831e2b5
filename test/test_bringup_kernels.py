"""CUDA kernels: PTX builds for Orin and Hopper, NumPy references vs onnxruntime's CPU ops.

No GPU is needed: nvcc compiles PTX without one, and the references are checked against
the contrib ops the engine runs on CPU (MatMulNBits, SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization, RotaryEmbedding, QuantizeLinear/DequantizeLinear).
The references are what cuda_runner compares the kernels with on a GPU.
"""
import pathlib
import re

import numpy as np
from onnx import helper, numpy_helper
import onnxruntime as ort
import pytest

from edge_llm_ros.bringup import cuda_runner, kernel_reference as ref, kernels, parameters
from edge_llm_ros.bringup.errors import KernelSupportError

NVCC = kernels.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason='nvcc (CUDA toolkit) is not installed')
# Every kernel file of every set ('kquant' and 'int4_decode' share rmsnorm, rope, kv_int8).
SOURCES = tuple(sorted({path for name in kernels.KERNEL_SETS
                        for path in kernels.kernel_sources(name)}))
# What cuda_runner checks on a GPU against NumPy (kquant.cu: test_native_cuda.py, against the
# CPU op, and kquant_emulate, its source run on the CPU).
RUNNER_SOURCES = kernels.kernel_sources('int4_decode')


def run_op(op, inputs, outputs, initializers=(), domain='com.microsoft', **attrs):
    """Run one onnxruntime CPU op on named numpy inputs; returns the outputs."""
    node = helper.make_node(op, list(inputs) + [i.name for i in initializers],
                            list(outputs), domain=domain, **attrs)
    graph = helper.make_graph(
        [node], 'g',
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs if o],
        list(initializers))
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=['CPUExecutionProvider'])
    return session.run(None, inputs)


# ---- PTX builds -------------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize('arch', ['sm_87', 'sm_90'])
@pytest.mark.parametrize('source', SOURCES, ids=lambda p: p.stem)
def test_kernel_compiles_to_ptx(tmp_path, source, arch):
    ptx = kernels.compile_ptx(source, arch, tmp_path, NVCC)
    text = ptx.read_text()
    assert '.target %s' % arch in text
    assert set(kernels.ENTRY_POINTS[source.stem]) <= set(kernels.ptx_entry_points(text))


@pytest.mark.parametrize('source', SOURCES, ids=lambda p: p.stem)
def test_each_file_opens_with_its_compile_command(source):
    first = source.read_text().splitlines()[0]
    assert first.startswith('// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/%s' % source.name)
    expected = kernels.nvcc_command(pathlib.Path('kernels', source.name), 'sm_87',
                                    pathlib.Path('%s.ptx' % source.stem))
    assert first[3:] == ' '.join(expected)


@needs_nvcc
def test_support_check_accepts_orin_and_refuses_what_cuda_cannot_target():
    for kernel_set in ('kquant', 'int4_decode'):
        chain = kernels.check_kernel_support(kernel_set, 'sm_87', nvcc=NVCC, device_arch=None)
        assert chain.compiler == 'nvcc' and 'sm_87' in chain.archs and 'sm_90' in chain.archs
    # CUDA 12.x+ cannot target Xavier's sm_72 any more; CUDA 13 also drops sm_70/sm_72.
    if 'sm_72' not in kernels.nvcc_archs(NVCC):
        with pytest.raises(KernelSupportError) as err:
            kernels.check_kernel_support('int4_decode', 'sm_72', nvcc=NVCC, use_nvrtc=False,
                                         device_arch=None)
        assert 'sm_72' in str(err.value) and 'sm_87' in str(err.value)
        assert 'cuda.kernel_set:=none' in str(err.value)
    with pytest.raises(KernelSupportError, match='GPU reports sm_89'):
        kernels.check_kernel_support('int4_decode', 'sm_87', nvcc=NVCC, device_arch='sm_89')


def test_support_check_without_any_compiler(tmp_path):
    fake = tmp_path / 'nvcc'
    fake.write_text('#!/bin/sh\necho "nvcc: NVIDIA (R) Cuda compiler, release 11.4"\n')
    fake.chmod(0o755)
    with pytest.raises(KernelSupportError, match='targets nothing'):
        kernels.check_kernel_support('int4_decode', 'sm_87', nvcc=str(fake), use_nvrtc=False,
                                     device_arch=None)
    assert kernels.check_kernel_support('none', '', device_arch=None) is None
    with pytest.raises(KernelSupportError, match='unknown cuda.kernel_set'):
        kernels.check_kernel_support('fast', 'sm_87')
    with pytest.raises(KernelSupportError, match='needs cuda.sm_arch'):
        kernels.check_kernel_support('int4_decode', '', device_arch=None)


def test_missing_kernel_file_is_reported(tmp_path):
    with pytest.raises(KernelSupportError, match='rmsnorm.cu'):
        kernels.kernel_sources('int4_decode', tmp_path)
    with pytest.raises(KernelSupportError, match='kquant.cu'):
        kernels.kernel_sources('kquant', tmp_path)


def test_every_source_has_its_entry_points_and_the_sets_are_the_parameters_choices():
    assert {p.stem for p in SOURCES} == set(kernels.ENTRY_POINTS)
    assert set(kernels.KERNEL_SETS) == set(parameters.KERNEL_SETS)
    assert [p.stem for p in kernels.kernel_sources('kquant')] == [
        'kquant', 'rmsnorm', 'rope', 'kv_int8']


# ---- references vs onnxruntime ------------------------------------------------------------

@pytest.mark.parametrize('zp_kind', [ref.ZP_NONE, ref.ZP_PACKED_U8, ref.ZP_FLOAT])
@pytest.mark.parametrize('n, k', [(48, 64), (33, 96), (96, 576)])
def test_int4_gemv_matches_matmulnbits(zp_kind, n, k):
    rng = np.random.default_rng(n * k + zp_kind)
    weights = ref.quantize_int4(rng.standard_normal((n, k)).astype(np.float32), zp_kind)
    x = rng.standard_normal((1, k)).astype(np.float32)
    inits = [numpy_helper.from_array(weights.packed, 'B'),
             numpy_helper.from_array(weights.scales.reshape(-1), 'scales')]
    if weights.zero_points is not None:
        inits.append(numpy_helper.from_array(weights.zero_points.reshape(-1), 'zp'))
    y, = run_op('MatMulNBits', {'x': x}, ['y'], inits, K=k, N=n, bits=4, block_size=32)
    want = ref.int4_gemv(x, weights)
    assert np.abs(y[0] - want).max() <= 1e-5 * np.abs(want).max()
    # The quantizer is good: the dequantized matrix stays close to the original.
    assert weights.packed.shape == (n, k // 32, 16)


def test_int4_packing_round_trips():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (5, 64)).astype(np.uint8)
    assert (ref.unpack_nibbles(ref.pack_nibbles(q)) == q).all()
    zp = rng.integers(0, 16, (5, 3)).astype(np.uint8)
    packed = ref.pack_zero_points(zp)
    assert packed.shape == (5, 2)
    assert (ref.unpack_zero_points(packed, 3) == zp).all()
    with pytest.raises(ValueError):
        ref.pack_nibbles(q[:, :40])


@pytest.mark.parametrize('hidden', [64, 576])
def test_rmsnorm_matches_simplified_layer_norm(hidden):
    rng = np.random.default_rng(hidden)
    x = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    y, = run_op('SimplifiedLayerNormalization', {'x': x}, ['y'],
                [numpy_helper.from_array(w, 'w')], domain='', epsilon=1e-5, axis=-1)
    assert np.abs(y - ref.rmsnorm(x, w, 1e-5)).max() < 1e-5


def test_add_rmsnorm_matches_skip_simplified_layer_norm():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 4, 576)).astype(np.float32)
    r = rng.standard_normal((1, 4, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    y, h = run_op('SkipSimplifiedLayerNormalization', {'x': x, 'r': r}, ['y', '', '', 'h'],
                  [numpy_helper.from_array(w, 'w')], epsilon=1e-6)
    want_y, want_h = ref.add_rmsnorm(x, r, w, 1e-6)
    assert np.abs(y - want_y).max() < 1e-5
    assert np.abs(h - want_h.astype(np.float32)).max() == 0.0   # the fp32 sum, exactly


@pytest.mark.parametrize('interleaved', [0, 1])
@pytest.mark.parametrize('rot', [64, 32])
def test_rope_matches_rotary_embedding(interleaved, rot):
    rng = np.random.default_rng(rot + interleaved)
    seq, heads, head_dim = 4, 3, 64
    cos, sin = ref.rope_cache(128, rot, theta=100000.0)
    x = rng.standard_normal((1, seq, heads * head_dim)).astype(np.float32)
    positions = np.array([[5, 6, 7, 100]], np.int64)
    attrs = {'interleaved': interleaved, 'num_heads': heads}
    if rot != head_dim:
        attrs['rotary_embedding_dim'] = rot
    y, = run_op('RotaryEmbedding', {'x': x, 'pos': positions, 'cos': cos, 'sin': sin}, ['y'],
                **attrs)
    want = ref.rope(x.reshape(seq, heads, head_dim), positions[0], cos, sin, bool(interleaved))
    assert np.abs(y.reshape(seq, heads, head_dim) - want).max() < 2e-6
    if rot < head_dim:   # the unrotated tail passes through untouched
        assert (want[..., rot:] == x.reshape(seq, heads, head_dim)[..., rot:]).all()


def test_rope_layouts_differ():
    cos, sin = ref.rope_cache(8, 8)
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 8)
    a = ref.rope(x, np.array([3]), cos, sin, True)
    b = ref.rope(x, np.array([3]), cos, sin, False)
    assert not np.allclose(a, b)
    assert np.allclose(np.linalg.norm(a), np.linalg.norm(x))   # a rotation keeps the norm


def test_kv_int8_matches_quantize_linear():
    rng = np.random.default_rng(3)
    heads, tokens, head_dim = 3, 17, 64
    kv = (rng.standard_normal((heads, tokens, head_dim)) * rng.uniform(
        0.1, 10, (heads, tokens, 1))).astype(np.float32)
    q, scales = ref.kv_quantize(kv)
    rows = kv.reshape(heads * tokens, head_dim)
    zero = numpy_helper.from_array(np.zeros(heads * tokens, np.int8), 'zp')
    scale = numpy_helper.from_array(scales.reshape(-1), 's')
    got_q, = run_op('QuantizeLinear', {'x': rows}, ['q'], [scale, zero], domain='', axis=0)
    diff = np.abs(got_q.astype(np.int32) - q.reshape(rows.shape).astype(np.int32))
    # Ties may round one step apart (x / s vs x * (1/s)); anything else is a bug.
    assert diff.max() <= 1 and (diff > 0).mean() < 0.001
    assert np.abs(q).max() == 127
    got_x, = run_op('DequantizeLinear', {'q': q.reshape(rows.shape)}, ['x'], [scale, zero],
                    domain='', axis=0)
    assert np.abs(got_x - ref.kv_dequantize(q, scales).reshape(rows.shape)).max() == 0.0
    err = np.abs(ref.kv_dequantize(q, scales) - kv).max(axis=-1)
    assert (err <= scales * 0.5 + 1e-6).all()      # half a step at most


def test_kv_int8_zero_token():
    kv = np.zeros((1, 2, 8), np.float32)
    kv[0, 1] = 1.0
    q, scales = ref.kv_quantize(kv)
    assert scales[0, 0] == 0.0 and (q[0, 0] == 0).all()
    assert (q[0, 1] == 127).all() and (ref.kv_dequantize(q, scales) == kv).all()


# ---- the GPU runner's cases, checked against the kernels' C signatures --------------------

POINTER_DTYPES = {'float': np.float32, '__half': np.float16, 'uint8_t': np.uint8,
                  'int8_t': np.int8, 'int64_t': np.int64, 'void': None}


def c_signatures():
    out = {}
    for source in RUNNER_SOURCES:
        text = source.read_text()
        for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', text):
            out[name] = [p.split() for p in ' '.join(params.split()).split(', ')]
    return out


def test_runner_cases_match_kernel_signatures():
    signatures = c_signatures()
    cases = cuda_runner.cases()
    entries = {c.entry for c in cases}
    assert entries == {e for source in RUNNER_SOURCES for e in kernels.ENTRY_POINTS[source.stem]}
    for case in cases:
        params = signatures[case.entry]
        assert len(params) == len(case.args), case.label
        for param, arg in zip(params, case.args):
            ctype = ' '.join(param[:-1]).replace('const ', '')
            if ctype.endswith('*'):
                assert arg.kind in ('in', 'out', 'inout', 'null'), (case.label, param)
                want = POINTER_DTYPES[ctype[:-1]]
                if want is not None:
                    assert arg.value.dtype == want, (case.label, param)
                if 'const' not in param:
                    assert arg.kind in ('out', 'inout'), (case.label, param)
            else:
                assert (ctype, arg.kind) in (('int', 'int'), ('float', 'float')), (
                    case.label, param)
        for expect in case.expects:
            assert case.args[expect.index].kind in ('out', 'inout')
            assert expect.expected.shape == case.args[expect.index].value.shape


def test_runner_comparison_catches_wrong_outputs():
    case = next(c for c in cuda_runner.cases() if c.entry == 'rmsnorm_f32')
    expect = case.expects[0]
    good = cuda_runner.compare(case, {expect.index: expect.expected.astype(np.float32)})
    assert good.passed
    bad = cuda_runner.compare(case, {expect.index: expect.expected * 1.01})
    assert not bad.passed and bad.max_abs_err > bad.tolerance


def test_runner_without_pycuda_says_so():
    try:
        import pycuda  # noqa: F401
    except ImportError:
        lines = []
        assert cuda_runner.main(['--arch', 'sm_87'], out=lines.append) == 2
        assert 'pycuda is not installed' in lines[0]
    else:
        pytest.skip('pycuda is installed here; the GPU run is the real check')

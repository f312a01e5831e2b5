"""The op library's LoRA kernels: every ISA path gives the scalar reference's bits.

native/src/lora.cpp (reference), avx2.cpp, avx512.cpp: a row's result does not depend on
the rows beside it, a scale of 0 leaves the row untouched, and the result is B·(A·x) scaled
(float64 to 1e-5).
"""
import ctypes

from native_build import native_build
import numpy as np
import pytest

F32P = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope='module')
def lib():
    lib = ctypes.CDLL(str(native_build() / 'libedge_llm_kquant.so'))
    lib.elk_lora_apply.argtypes = [F32P, ctypes.c_int64, ctypes.c_int64, F32P, ctypes.c_int64,
                                   F32P, ctypes.c_int64, F32P, F32P]
    lib.elk_select_kernel.argtypes = [ctypes.c_char_p]
    lib.elk_kernel_name.restype = ctypes.c_char_p
    yield lib
    lib.elk_select_kernel(b'auto')


def ptr(a: np.ndarray):
    return a.ctypes.data_as(F32P)


def apply(lib, x, a_t, b_t, scales, y):
    y = y.copy()
    rc = lib.elk_lora_apply(ptr(x), x.shape[0], x.shape[1], ptr(a_t), a_t.shape[1], ptr(b_t),
                            b_t.shape[1], ptr(scales), ptr(y))
    assert rc == 0
    return y


@pytest.mark.parametrize('k, r, n', [(64, 16, 96), (576, 16, 1536), (100, 7, 33), (32, 1, 5)])
def test_isa_paths_equal_the_reference(lib, k, r, n):
    rng = np.random.default_rng(k + r + n)
    rows = 5
    x = rng.normal(size=(rows, k)).astype(np.float32)
    a_t = rng.normal(0, 0.1, (k, r)).astype(np.float32)
    b_t = rng.normal(0, 0.1, (r, n)).astype(np.float32)
    y = rng.normal(size=(rows, n)).astype(np.float32)
    scales = np.array([0.5, 0.0, 2.0, -1.0, 1.0], dtype=np.float32)
    results = {}
    for isa in ('scalar', 'avx2', 'avx512_vnni', 'amx'):
        if lib.elk_select_kernel(isa.encode()) == 0:
            results[isa] = apply(lib, x, a_t, b_t, scales, y)
    lib.elk_select_kernel(b'auto')
    ref = results.pop('scalar')
    for isa, out in results.items():
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), isa
    assert np.array_equal(ref[1], y[1])           # scale 0: untouched
    want = y.astype(np.float64) + scales[:, None] * (x @ a_t.astype(np.float64) @ b_t)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    for m in range(rows):                         # a row alone: the same bits
        alone = apply(lib, x[m:m + 1].copy(), a_t, b_t, scales[m:m + 1].copy(),
                      y[m:m + 1].copy())
        assert np.array_equal(alone[0], ref[m])

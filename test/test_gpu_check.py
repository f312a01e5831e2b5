"""scripts/gpu_check.sh (issue 44): the GPU check, kept from rotting on machines without a GPU.

No GPU here: the script says so in one line and exits 2 at once. Its harness
(native/tests/gpu_check.cu) runs on the CPU through native/tests/cuda_emulation.h
(`--emulate`, the reduced case list): kquant.cu bit-equal to ref.cpp, the older kernels within
kernel_reference.py's tolerances, the timing path and the JSON and table the GPU run writes. A
planted rounding error in kquant.cu and a wrong older-kernel output each fail the check, and a
harness that hangs is killed. With nvcc (no GPU needed): the harness compiles for Orin (sm_87)
and Hopper (sm_90) with every kernel's entry point in it, and the script's own nvcc build runs
for a GPU nvidia-smi reports (also past an nvcc that refuses the g++'s version).
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from test_native_cuda import gpu_present

from edge_llm_ros.bringup import cuda_runner, gpu_check, kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'scripts' / 'gpu_check.sh'
HARNESS = ROOT / 'native' / 'tests' / 'gpu_check.cu'
NVCC = kernels.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason='nvcc (CUDA toolkit) is not installed')
GPU = gpu_present()
KQUANT_TYPES = ('Q8_0', 'Q4_K', 'Q6_K')


def fake_nvidia_smi(folder: pathlib.Path, body: str) -> dict:
    """Return an environment whose PATH starts with a fake nvidia-smi running `body`."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / 'nvidia-smi'
    smi.write_text('#!/bin/sh\n' + body + '\n')
    smi.chmod(0o755)
    return dict(os.environ, PATH='%s:%s' % (folder, os.environ['PATH']),
                PYTHON=sys.executable)


def run_script(*args: str, env: dict = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ, PYTHON=sys.executable))


# ---- no GPU ----------------------------------------------------------------------------------

@pytest.mark.parametrize('smi', [
    'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; '
    'exit 9',
    'echo "No devices were found"; exit 6',
    'exit 0',
], ids=['no-driver', 'no-devices', 'silent'])
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_2(tmp_path, smi):
    env = fake_nvidia_smi(tmp_path / 'bin', smi)
    start = time.monotonic()
    proc = run_script(str(tmp_path / 'out'), env=env, timeout=30)
    assert time.monotonic() - start < 5
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0] == ('gpu_check: no NVIDIA GPU on this machine (nvidia-smi reports none): '
                        'nothing to check, exit 2')
    assert not (tmp_path / 'out').exists()  # nothing built, nothing written


def test_this_machine_without_a_gpu_gets_the_one_line_too(tmp_path):
    if GPU:
        pytest.skip('this machine has a GPU: bash scripts/gpu_check.sh is the real check here')
    proc = run_script(str(tmp_path / 'out'), timeout=30)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith('gpu_check: no NVIDIA GPU on this machine (')


# ---- the harness on the CPU ------------------------------------------------------------------

@pytest.fixture(scope='module')
def emulated(tmp_path_factory):
    """`bash scripts/gpu_check.sh --emulate OUT`: its output, OUT and the JSON report."""
    out = tmp_path_factory.mktemp('gpu_check')
    proc = run_script('--emulate', str(out))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    return proc, out, json.loads((out / 'gpu_check.json').read_text())


def test_the_emulated_check_runs_every_kquant_kernel_bit_equal_to_ref_cpp(emulated):
    proc, out, report = emulated
    assert report['passed'] and report['kquant']['passed'] and report['quick']
    assert report['device']['emulated'] is True and report['arch'] == 'cpu-emulation'
    checks = [c for c in report['kquant']['checks'] if c['kernel'] == 'kquant_cuda_matmul']
    for c in checks:
        assert c['passed'] and c['different'] == 0 and c['activations_equal'], c
        assert c['status'] == 0 and c['tolerance'] == 0 and c['max_abs_err'] == 0
        assert c['path'] == ('gemv' if c['m'] <= 4 else 'gemm')
    for name in KQUANT_TYPES:  # every type, both kernels, with and without the bias
        mine = [c for c in checks if c['type'] == name]
        assert {c['path'] for c in mine} == {'gemv', 'gemm'}
        assert {c['bias'] for c in mine} == {True, False}
        assert any(c['n'] % 8 for c in mine)
    assert any(c['k'] % 256 for c in checks if c['type'] == 'Q8_0')
    assert {c['m'] for c in checks} >= {1, 3, 4, 5, 70}
    glu = [c for c in report['kquant']['checks'] if c['kernel'] == 'kquant_cuda_glu']
    assert sorted(c['kind'] for c in glu) == [1, 2] and all(c['passed'] for c in glu)
    assert re.search(r'^  kquant Q4_K K 256 N 37 M 70 \(gemm\): bit-equal$', proc.stdout, re.M)


def test_the_emulated_check_runs_the_older_kernels_against_kernel_reference(emulated):
    _, _, report = emulated
    results = report['kernels']['checks']
    # cuda_runner's case list as it is: every entry point of int4_gemv, rmsnorm, rope, kv_int8.
    assert [r['label'] for r in results] == [c.label for c in cuda_runner.cases()]
    assert {r['entry'] for r in results} == {
        e for s in ('int4_gemv', 'rmsnorm', 'rope', 'kv_int8') for e in kernels.ENTRY_POINTS[s]}
    for r in results:
        assert r['passed'] and r['max_abs_err'] <= r['tolerance'], r


def test_the_emulated_check_times_every_shape_and_writes_the_table(emulated):
    proc, out, report = emulated
    shapes = gpu_check.model_shapes(quick=True)
    assert report['shapes'] == shapes
    timed = {(t['name'], t['type'], t['m']) for t in report['timings']}
    assert timed == {(s['name'], s['type'], m) for s in shapes
                     for m in (1, gpu_check.QUICK_PREFILL_ROWS)}
    for t in report['timings']:
        assert t['ms'] > 0 and t['gb_s'] > 0 and t['fraction_of_roof'] > 0
        assert t['gb_s'] == pytest.approx(t['weight_bytes'] / t['ms'] / 1e6, rel=1e-6)
        assert t['tops'] == pytest.approx(2 * t['m'] * t['n'] * t['k'] / t['ms'] / 1e9)
        assert t['weight_bytes'] == t['n'] * t['k'] // 256 * {'Q4_K': 144, 'Q6_K': 210}[t['type']]
    assert report['roof']['gb_s'] > 0 and report['roof']['what'] == 'device-to-device copy'
    model = report['model']
    decode = {t['name'] + t['type']: t['ms'] for t in report['timings'] if t['m'] == 1}
    per_token = sum(s['count'] * decode[s['name'] + s['type']] for s in shapes)
    assert model['decode_tokens_per_s'] == pytest.approx(1e3 / per_token)
    assert model['roof_tokens_per_s'] == pytest.approx(
        report['roof']['gb_s'] * 1e9 / model['matmul_weight_bytes'])
    text = (out / 'gpu_check.txt').read_text()
    assert text.startswith('GPU check on cuda_emulation.h on the CPU (cpu-emulation) [quick')
    assert 'PASSED' in text.splitlines()[0] and text.strip() in proc.stdout
    assert re.search(r'^head\s+Q6_K\s+297\s+256\s+1 \|', text, re.M)
    # Progress lines: the build, the run, the end.
    for step in ('building the CPU references', 'building native/tests/gpu_check.cu as C++',
                 'running the checks', 'done: every kernel matched'):
        assert re.search(r'^gpu_check: \[\d+s\] ' + step, proc.stdout, re.M), step


def test_the_full_model_shapes_are_one_qwen2p5_1p5b_q4_k_m_layer_and_its_head():
    shapes = {(s['name'], s['type']): s for s in gpu_check.model_shapes()}
    assert shapes[('head', 'Q6_K')] == {'name': 'head', 'type': 'Q6_K', 'n': 151936, 'k': 1536,
                                        'count': 1}
    assert (shapes[('ffn_gate+ffn_up', 'Q4_K')]['n'], shapes[('ffn_gate+ffn_up', 'Q4_K')]['k'],
            shapes[('ffn_gate+ffn_up', 'Q4_K')]['count']) == (8960, 1536, 56)
    # llama.cpp's Q4_K_M: Q6_K for attn_v and ffn_down in 14 of the 28 layers.
    assert shapes[('ffn_down', 'Q6_K')]['count'] == shapes[('ffn_down', 'Q4_K')]['count'] == 14
    assert shapes[('ffn_down', 'Q6_K')]['k'] == 8960
    assert sum(s['count'] for s in shapes.values()) == 28 * 7 + 1


def test_a_planted_rounding_error_in_kquant_fails_the_harness(emulated, tmp_path):
    """kquant.cu's adds made a little wrong: outputs differ from ref.cpp, exit 1, JSON says so."""
    _, out, _ = emulated
    wrapper = tmp_path / 'planted.cpp'
    wrapper.write_text('#include "cuda_emulation.h"\n'
                       '#define __fadd_rn(a, b) ((a) + (b) + 1e-3f)\n'
                       '#include "gpu_check.cu"\n')
    binary = tmp_path / 'planted'
    native = ROOT / 'native'
    subprocess.run(['g++', '-O1', '-std=c++17', '-ffp-contract=off', '-w',
                    '-I', str(native / 'tests' / 'cuda_shim'), '-I', str(native / 'tests'),
                    '-I', str(native / 'include'), '-I', str(native / 'src'),
                    '-I', str(ROOT / 'kernels'), str(wrapper),
                    str(out / 'build' / 'ref.o'), str(out / 'build' / 'glu.o'),
                    '-o', str(binary)], check=True, timeout=300)
    result = tmp_path / 'planted.json'
    proc = subprocess.run([str(binary), '--quick', '--json', str(result)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert 'DIFFERENT' in proc.stdout
    planted = json.loads(result.read_text())
    assert not planted['passed']
    assert any(c['different'] > 0 for c in planted['checks'] if c['kernel'] ==
               'kquant_cuda_matmul')


def test_a_wrong_older_kernel_output_fails_the_check(emulated, tmp_path, monkeypatch):
    _, out, _ = emulated
    cases = cuda_runner.cases()
    bad = next(c for c in cases if c.entry == 'rope_f32')
    bad.expects[0].expected = bad.expects[0].expected + 0.01
    monkeypatch.setattr(cuda_runner, 'cases', lambda seed=0: cases)
    lines = []
    status = gpu_check.main(['--harness', str(out / 'build' / 'gpu_check'), '--out',
                             str(tmp_path), '--quick', '--arch', 'cpu-emulation'], lines.append)
    assert status == 1
    report = json.loads((tmp_path / 'gpu_check.json').read_text())
    assert not report['passed'] and report['kquant']['passed']
    assert [r['label'] for r in report['kernels']['checks'] if not r['passed']] == [bad.label]
    assert 'FAILED %s (rope_f32)' % bad.label in '\n'.join(lines)


def test_a_harness_that_dies_fails_the_check(tmp_path):
    harness = tmp_path / 'harness'
    harness.write_text('#!/bin/sh\necho "gpu_check: cudaGetDevice: no CUDA-capable device"\n'
                       'exit 2\n')
    harness.chmod(0o755)
    lines = []
    assert gpu_check.main(['--harness', str(harness), '--out', str(tmp_path), '--quick'],
                          lines.append) == 1
    assert 'gpu_check: cudaGetDevice: no CUDA-capable device' in lines
    assert lines[-1] == 'gpu_check: the harness failed (exit 2) before writing its JSON'


def test_a_harness_that_never_returns_is_killed(tmp_path):
    harness = tmp_path / 'harness'
    harness.write_text('#!/bin/sh\necho started\nexec sleep 60\n')
    harness.chmod(0o755)
    lines = []
    start = time.monotonic()
    status = gpu_check.run_harness([str(harness)], lines.append, timeout=1.0)
    assert status != 0 and time.monotonic() - start < 30
    assert lines == ['started', 'gpu_check: the harness was killed after 1 s']


def test_the_manifest_round_trips_every_argument_kind(tmp_path):
    cases = cuda_runner.cases()
    manifest = gpu_check.write_cases(cases, tmp_path).read_text().splitlines()
    heads = [line for line in manifest if line.startswith('case ')]
    assert len(heads) == len(cases)
    gemv = cases[0]  # int4_gemv, zp_kind 0: a null zero-point pointer
    assert heads[0] == 'case 0 %s %d %d %d %d %d %d %d' % (gemv.entry, *gemv.grid, *gemv.block,
                                                           len(gemv.args))
    assert manifest[4] == 'null' and manifest[5] == 'int 0'
    norm = next(i for i, c in enumerate(cases) if c.entry == 'rmsnorm_f32')
    at = manifest.index(heads[norm])
    assert manifest[at + 5] == 'float %d' % np.array(1e-5, np.float32).view(np.uint32)
    kind, path, size = manifest[at + 1].split()
    x = cases[norm].args[0].value
    assert kind == 'in' and int(size) == x.nbytes
    assert np.array_equal(np.fromfile(path, np.float32).reshape(x.shape), x)


# ---- with nvcc: the GPU build --------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize('arch', ['sm_87', 'sm_90'])
def test_the_harness_compiles_for_orin_and_hopper_with_every_kernel(tmp_path, arch):
    cubin = tmp_path / ('gpu_check.%s.cubin' % arch)
    native = ROOT / 'native'
    proc = subprocess.run([NVCC, '-cubin', '-arch=%s' % arch, *kernels.NVCC_FLAGS,
                           '-I', str(native / 'include'), '-I', str(native / 'src'),
                           '-I', str(ROOT / 'kernels'), str(HARNESS), '-o', str(cubin)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    symbols = subprocess.run(['nm', str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    defined = set(re.findall(r'^[0-9a-f]+ T (\w+)$', symbols, re.M))
    assert defined == {e for entries in kernels.ENTRY_POINTS.values() for e in entries}


@needs_nvcc
@pytest.mark.parametrize('picky', [False, True], ids=['nvcc', 'nvcc-refusing-the-gcc'])
def test_the_script_builds_the_harness_with_nvcc_for_the_gpu_nvidia_smi_reports(
        tmp_path, picky):
    if GPU:
        pytest.skip('a real GPU is here: the fake nvidia-smi would run the whole check on it')
    env = fake_nvidia_smi(tmp_path / 'bin', 'echo "9.0, NVIDIA H100 80GB HBM3"')
    if picky:  # an nvcc older than the g++: its version check refuses, the flag lets it build
        nvcc = tmp_path / 'bin' / 'nvcc'
        nvcc.write_text('#!/bin/sh\ncase " $* " in\n'
                        '  *" -allow-unsupported-compiler "*) ;;\n'
                        '  *" -arch="*) echo "#error -- unsupported GNU version!" >&2; exit 1;;\n'
                        'esac\nexec %s "$@"\n' % NVCC)
        nvcc.chmod(0o755)
        env['NVCC'] = str(nvcc)
    proc = run_script(str(tmp_path / 'out'), env=env)
    output = proc.stdout + proc.stderr
    assert re.search(r'^gpu_check: \[\d+s\] building native/tests/gpu_check.cu for sm_90 '
                     r'\(NVIDIA H100 80GB HBM3\) with nvcc \d+\.\d+$', proc.stdout, re.M), output
    assert ('building again with -allow-unsupported-compiler' in proc.stdout) == picky, output
    binary = tmp_path / 'out' / 'build' / 'gpu_check'
    assert b'-arch sm_90' in binary.read_bytes()  # the fatbin's cubin, as test_native_cuda
    # No driver here: the harness stops at its first CUDA call, and the check fails.
    assert proc.returncode == 1, output
    assert 'the harness failed (exit 2) before writing its JSON' in output


@needs_nvcc
def test_the_script_refuses_an_arch_nvcc_cannot_build(tmp_path):
    env = fake_nvidia_smi(tmp_path / 'bin', 'echo "99.0, A GPU from the future"')
    proc = run_script(str(tmp_path / 'out'), env=env, timeout=60)
    assert proc.returncode == 1
    assert re.match(r'gpu_check: nvcc \d+\.\d+ \(.*\) cannot build for sm_990 '
                    r'\(A GPU from the future\); it lists: compute_', proc.stderr), proc.stderr
    assert not (tmp_path / 'out').exists()

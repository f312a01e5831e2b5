"""Every kernel of native/ against the scalar reference, bit for bit, on this CPU and on aarch64.

native/tests/kernel_check runs each ISA path the CPU has (others are refused by the
dispatcher, so a build never assumes the build machine's CPU). The aarch64 build comes from
Debian's g++-aarch64-linux-gnu and runs under qemu-aarch64: cortex-a53 has no dotprod (the
NEON fallback, and no SIGILL), cortex-a76 and max have it. qemu timings mean nothing.
"""
import pathlib
import subprocess

from native_build import aarch64_build, native_build
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_host_kernels_equal_the_reference():
    proc = subprocess.run([str(native_build() / 'kernel_check')], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'ok scalar' in proc.stdout
    features = proc.stdout.split('cpu: ')[1].split(')')[0].split()
    if 'avx2' in features:
        assert 'ok avx2' in proc.stdout
    if 'avx512vnni' in features:
        assert 'ok avx512_vnni' in proc.stdout
    if 'amx_int8' in features:
        assert 'ok amx' in proc.stdout


@pytest.fixture(scope='module')
def aarch64_kernel_check() -> pathlib.Path:
    return aarch64_build('kernel_check') / 'kernel_check'


@pytest.mark.parametrize('cpu, kernels', [
    ('cortex-a53', ['scalar', 'neon']),                    # no dotprod: refused, no SIGILL
    ('cortex-a76', ['scalar', 'neon', 'neon_dotprod']),
    ('max', ['scalar', 'neon', 'neon_dotprod', 'neon_i8mm']),  # i8mm: SMMLA batches
])
def test_aarch64_kernels_equal_the_reference_under_qemu(aarch64_kernel_check, cpu, kernels):
    proc = subprocess.run(['qemu-aarch64-static', '-cpu', cpu, '-L', '/usr/aarch64-linux-gnu',
                           str(aarch64_kernel_check)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith('ok ')]
    assert ran == kernels, proc.stdout

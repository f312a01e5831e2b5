"""Configure-time checks (what llm_node runs in on_configure) and the bring-up CLI."""
import os
import pathlib
import subprocess
import sys

import onnxruntime
import pytest
import yaml

from edge_llm_ros.bringup import kernels, parameters, preflight, profiles
from edge_llm_ros.bringup.__main__ import main
from edge_llm_ros.bringup.errors import (AffinityError, KernelSupportError, ParameterRangeError,
                                         ProviderError)

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOARDS = ROOT / 'test' / 'data' / 'boards'
DEFAULTS = parameters.schema('llm_node').defaults()


def values(**changes):
    out = dict(DEFAULTS)
    out.update({k.replace('__', '.'): v for k, v in changes.items()})
    return out


def test_defaults_pass_here():
    report = preflight.preflight(values(), root='/')
    assert report.providers == ('CPUExecutionProvider',)
    assert set(report.cpus) == set(os.sched_getaffinity(0))
    assert report.toolchain is None


def test_missing_provider_names_installed_ones():
    wanted = values(engine__providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])
    with pytest.raises(ProviderError) as err:
        preflight.preflight(wanted, available_providers=['CPUExecutionProvider'])
    assert 'CUDAExecutionProvider' in str(err.value) and 'offers only CPUExecutionProvider' in \
        str(err.value)
    if 'CUDAExecutionProvider' not in onnxruntime.get_available_providers():
        with pytest.raises(ProviderError):
            preflight.preflight(wanted)


def test_affinity_beyond_this_machine():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(AffinityError, match='valid cores'):
        preflight.preflight(values(engine__cpu_affinity=str(missing)))


def test_recorded_board_profile_passes_on_its_tree():
    resolved = profiles.resolve('auto', root=str(BOARDS / 'rk3588'))
    report = preflight.preflight(resolved.llm_params(), root=str(BOARDS / 'rk3588'),
                                 available_providers=['CPUExecutionProvider'])
    assert report.cpus == (4, 5, 6, 7)
    assert report.thermal_zones == ('soc-thermal', 'bigcore0-thermal', 'bigcore1-thermal',
                                    'littlecore-thermal', 'center-thermal')
    assert report.warnings == ()


@pytest.mark.skipif(kernels.find_nvcc() is None, reason='nvcc (CUDA toolkit) is not installed')
def test_cuda_profile_kernels_checked_at_configure(monkeypatch):
    monkeypatch.setattr(kernels, 'device_sm_arch', lambda: None)   # no GPU here
    resolved = profiles.resolve('auto', root=str(BOARDS / 'orin_nano'))
    providers = ['CUDAExecutionProvider', 'CPUExecutionProvider']
    report = preflight.preflight(resolved.llm_params(), root=str(BOARDS / 'orin_nano'),
                                 available_providers=providers)
    assert report.toolchain.compiler == 'nvcc' and 'sm_87' in report.toolchain.archs
    if 'sm_72' not in report.toolchain.archs:
        xavier = dict(resolved.llm_params(), **{'cuda.sm_arch': 'sm_72'})
        monkeypatch.setattr(kernels, 'nvrtc_archs', frozenset)
        with pytest.raises(KernelSupportError, match='cannot be built for sm_72'):
            preflight.preflight(xavier, root=str(BOARDS / 'orin_nano'),
                                available_providers=providers)


def test_thermal_warning_when_no_zone_matches():
    pi = str(BOARDS / 'rpi5')
    report = preflight.preflight(values(thermal__zones=['tj-thermal']), root=pi)
    assert report.warnings == ('thermal: no zone matches tj-thermal (zones here: cpu-thermal); '
                               'generation will not be throttled',)
    assert report.thermal_zones == ()
    report = preflight.preflight(values(thermal__zones=['tj-thermal'], thermal__enabled=False),
                                 root=pi)
    assert report.warnings == ()


def _model(tmp_path, name, params, bits=4):
    folder = tmp_path / name
    folder.mkdir()
    (folder / 'model.yaml').write_text(yaml.safe_dump({
        'name': name, 'quantization': {'bits': bits, 'block_size': 32}}))
    (folder / 'model.onnx').write_bytes(b'\0' * 4096)
    with open(folder / 'model.onnx.data', 'wb') as data:   # sparse: no disk used
        data.truncate(int(params * preflight.BITS_PER_INT4_PARAM / 8))
    return str(folder)


def test_model_size_and_quantization_warnings(tmp_path):
    small = _model(tmp_path, 'small', 0.5e9)
    big = _model(tmp_path, 'big', 7.6e9)
    eight = _model(tmp_path, 'eight', 1.5e9, bits=8)
    assert abs(preflight.estimate_params(big) / 7.6e9 - 1) < 0.01
    assert preflight.estimate_params(str(tmp_path)) is None
    assert preflight.model_warnings(small, '0.5B', 'int4') == ()
    assert preflight.model_warnings('', '0.5B', 'int4') == ()
    warning, = preflight.model_warnings(big, '1.5B', 'int4')
    assert '~7.6B parameters' in warning and 'model.default_size 1.5B' in warning
    warning, = preflight.model_warnings(eight, '3B', 'int4')
    assert '8-bit' in warning
    report = preflight.preflight(values(model__path=big, model__default_size='1.5B'))
    assert any('1.5B' in w for w in report.warnings)
    assert preflight.size_in_params('135M') == 135e6
    with pytest.raises(ValueError):
        preflight.size_in_params('huge')


def test_inconsistent_values_rejected():
    with pytest.raises(ParameterRangeError, match='exceeds'):
        preflight.preflight(values(engine__cpu_affinity='0', engine__intra_op_threads=2))


def test_cli_detect_resolve_check():
    lines = []
    assert main(['detect', '--root', str(BOARDS / 'rk3588')], out=lines.append) == 0
    assert 'board: rk3588' in lines and 'fast_cores: 4,5,6,7' in lines
    lines = []
    assert main(['resolve', '--root', str(BOARDS / 'rpi5'), '--set', 'max_tokens=32'],
                out=lines.append) == 0
    assert '  max_tokens: 32  [override]' in lines
    assert "  engine.cpu_affinity: '1-3'  [profile]" in lines
    lines = []
    assert main(['check', '--root', str(BOARDS / 'rk3588')], out=lines.append) == 0
    assert 'thermal zones: soc-thermal, bigcore0-thermal, bigcore1-thermal, ' \
        'littlecore-thermal, center-thermal' in lines
    lines = []
    assert main(['check', '--board', 'rk3588', '--root', str(BOARDS / 'rpi5')],
                out=lines.append) == 2
    assert 'valid cores: 0-3' in lines[-1]
    lines = []
    assert main(['resolve', '--board', 'nope', '--root', str(BOARDS / 'rpi5')],
                out=lines.append) == 2
    assert lines[0].startswith('error: unknown board')


def test_cli_as_module():
    result = subprocess.run([sys.executable, '-m', 'edge_llm_ros.bringup', 'check',
                             '--set', 'engine.intra_op_threads=1'], capture_output=True,
                            text=True, cwd=str(ROOT), timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'providers: CPUExecutionProvider' in result.stdout

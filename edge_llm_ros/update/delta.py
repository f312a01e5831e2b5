"""Delta packages: a bsdiff4 patch of model.onnx.data plus the target's other files.

A delta package is a folder:
  delta.json, delta.sig    what the patch is for (signed, canonical JSON, see below)
  manifest.json, .sig      the signed manifest of the RESULT (the new model folder)
  model.onnx.data.bsdiff4  bsdiff4 patch: base model.onnx.data -> the new one
  every other file of the new folder that differs from the base's (model.onnx, ...)
delta.json fields (all required, nothing else allowed):
  format "edge-llm-model-delta", format_version 1, algorithm "bsdiff4",
  target_manifest_sha256  sha256 of the package's manifest.json bytes
  base {sha256, size}     the model.onnx.data the patch applies to
  patch {sha256, size}    model.onnx.data.bsdiff4 itself, so a truncated or corrupt patch is
                          refused before bsdiff4 reads it
  from_base [names]       files not shipped: identical in the base folder, copied from there
                          (and checked against the target manifest like every file)
Applying a delta yields exactly the files of the full new folder, manifest included.
bsdiff4 works in memory: applying holds the base, the patch and the result (about 2x
model.onnx.data); making one needs about 17x (a 106 MB SmolLM2 file: ~2 GB, ~1 min).
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
import os
import pathlib
import shutil
from typing import Iterable, Tuple

import bsdiff4

from edge_llm_ros.update import canonical, signing
from edge_llm_ros.update.errors import DeltaError, ManifestError, UpdateError
from edge_llm_ros.update.files import read_chunks, split
from edge_llm_ros.update.manifest import (check_file_set, check_name, FileEntry, hash_file,
                                          Manifest, MANIFEST_FILE, read_small, SIGNATURE_FILE,
                                          verified_manifest, verify_folder)

FORMAT = 'edge-llm-model-delta'
FORMAT_VERSION = 1
ALGORITHM = 'bsdiff4'
DELTA_FILE = 'delta.json'
DELTA_SIG = 'delta.sig'
DATA_FILE = 'model.onnx.data'
PATCH_FILE = 'model.onnx.data.bsdiff4'
_FIELDS = {'format': str, 'format_version': int, 'algorithm': str,
           'target_manifest_sha256': str, 'base': dict, 'patch': dict, 'from_base': list}
_ENTRY = {'sha256': str, 'size': int}


@dataclass(frozen=True)
class Delta:
    target_manifest_sha256: str
    base: FileEntry
    patch: FileEntry
    from_base: Tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return canonical.dumps({
            'format': FORMAT, 'format_version': FORMAT_VERSION, 'algorithm': ALGORITHM,
            'target_manifest_sha256': self.target_manifest_sha256,
            'base': {'sha256': self.base.sha256, 'size': self.base.size},
            'patch': {'sha256': self.patch.sha256, 'size': self.patch.size},
            'from_base': sorted(self.from_base)})

    @classmethod
    def from_bytes(cls, data: bytes, what: str = DELTA_FILE) -> 'Delta':
        obj = canonical.fields(canonical.loads(data, what), _FIELDS, what)
        if (obj['format'], obj['format_version'], obj['algorithm']) != (
                FORMAT, FORMAT_VERSION, ALGORITHM):
            raise ManifestError(f'{what}: not a {FORMAT} version {FORMAT_VERSION} '
                                f'({ALGORITHM}) description; update edge_llm_ros to read it')
        entries = [canonical.fields(obj[key], _ENTRY, f'{what}: {key}')
                   for key in ('base', 'patch')]
        for name in obj['from_base']:
            check_name(name, f'{what}: from_base')
        if DATA_FILE in obj['from_base'] or len(set(obj['from_base'])) != len(
                obj['from_base']):
            raise ManifestError(f'{what}: from_base lists {DATA_FILE} or a name twice')
        return cls(obj['target_manifest_sha256'],
                   *(FileEntry(e['sha256'], e['size']) for e in entries),
                   tuple(obj['from_base']))


def is_delta(folder: pathlib.Path) -> bool:
    return (pathlib.Path(folder) / DELTA_FILE).exists()


def make_delta(old: pathlib.Path, new: pathlib.Path, out: pathlib.Path, private) -> Delta:
    """Write the delta package turning `old`'s model.onnx.data into signed folder `new`."""
    old, new, out = pathlib.Path(old), pathlib.Path(new), pathlib.Path(out)
    manifest = verify_folder(new, private.public_key())
    if DATA_FILE not in manifest.files:
        raise DeltaError(f'{new} has no {DATA_FILE}: a delta patches that file; ship the '
                         'folder in full')
    if os.path.lexists(out):
        raise UpdateError(f'{out} exists: give a new folder for the delta package')
    old_data = (old / DATA_FILE).read_bytes()
    patch = bsdiff4.diff(old_data, (new / DATA_FILE).read_bytes())
    same = tuple(sorted(name for name, entry in manifest.files.items() if name != DATA_FILE
                        and (old / name).is_file() and hash_file(old / name) == entry))
    tmp = out.with_name(f'.{out.name}.tmp-{os.getpid()}')
    tmp.mkdir(parents=True)
    try:
        for name in manifest.files:
            if name != DATA_FILE and name not in same:
                shutil.copyfile(new / name, tmp / name)
        for name in (MANIFEST_FILE, SIGNATURE_FILE):
            shutil.copyfile(new / name, tmp / name)
        (tmp / PATCH_FILE).write_bytes(patch)
        delta = Delta(hashlib.sha256((new / MANIFEST_FILE).read_bytes()).hexdigest(),
                      FileEntry(hashlib.sha256(old_data).hexdigest(), len(old_data)),
                      FileEntry(hashlib.sha256(patch).hexdigest(), len(patch)), same)
        data = delta.to_bytes()
        (tmp / DELTA_FILE).write_bytes(data)
        (tmp / DELTA_SIG).write_bytes(signing.sign(data, private))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return delta


def verified_delta(package: pathlib.Path, trusted) -> Tuple[Delta, Manifest]:
    """Check a delta package before any of it is used: signatures, file set, patch hash."""
    package = pathlib.Path(package)
    data = read_small(package / DELTA_FILE, DELTA_FILE)
    signing.verify(data, read_small(package / DELTA_SIG, DELTA_SIG), trusted,
                   str(package / DELTA_FILE), DELTA_SIG)
    delta = Delta.from_bytes(data, str(package / DELTA_FILE))
    manifest = verified_manifest(package, trusted)
    if hashlib.sha256((package / MANIFEST_FILE).read_bytes()).hexdigest() != (
            delta.target_manifest_sha256):
        raise DeltaError(f'{package}: {DELTA_FILE} was made for another {MANIFEST_FILE}: the '
                         'package mixes two updates; make it again with make-delta')
    if DATA_FILE not in manifest.files or not set(delta.from_base) <= set(manifest.files):
        raise DeltaError(f'{package}: {DELTA_FILE} and the target manifest do not match '
                         f'({DATA_FILE} or a from_base file is not in the manifest)')
    check_file_set(package, (set(manifest.files) - {DATA_FILE} - set(delta.from_base)) | {
        PATCH_FILE, DELTA_FILE, DELTA_SIG, MANIFEST_FILE, SIGNATURE_FILE}, 'the delta package')
    patch_path = package / PATCH_FILE
    actual = hash_file(patch_path)
    if actual.size != delta.patch.size:
        raise DeltaError(f'{patch_path} has {actual.size} bytes, {DELTA_FILE} says '
                         f'{delta.patch.size}: the delta is truncated or corrupt; download '
                         'it again')
    if actual.sha256 != delta.patch.sha256:
        raise DeltaError(f'{patch_path} does not have the sha256 {DELTA_FILE} gives: the delta '
                         'is corrupt or was tampered with; download it again')
    return delta, manifest


def file_source(package: pathlib.Path, delta: Delta, base: pathlib.Path,
                name: str) -> Tuple[str, Iterable[bytes]]:
    """Say where the bytes of the target's file `name` come from: (label, chunks)."""
    package, base = pathlib.Path(package), pathlib.Path(base)
    if name == DATA_FILE:
        return f'{package / PATCH_FILE} applied to {base / DATA_FILE}', split(
            patched_data(package, delta, base))
    if name in delta.from_base:
        if not (base / name).is_file():
            raise DeltaError(f'the delta takes {name} from the base model, but {base} has '
                             'none: apply the full folder')
        return str(base / name), read_chunks(base / name)
    return str(package / name), read_chunks(package / name)


def patched_data(package: pathlib.Path, delta: Delta, base: pathlib.Path) -> bytes:
    """Return the new model.onnx.data: the checked patch applied to the base folder's.

    The result is checked against the signed manifest as it is written (install.py).
    """
    base_path = pathlib.Path(base) / DATA_FILE
    try:
        old = base_path.read_bytes()
    except OSError as exc:
        raise DeltaError(f'cannot read the base {base_path}: {exc.strerror}; apply the full '
                         'folder instead') from None
    if len(old) != delta.base.size or hashlib.sha256(old).hexdigest() != delta.base.sha256:
        raise DeltaError(f'the delta was made for another base model: {base_path} is not the '
                         f'model.onnx.data it patches (sha256 {delta.base.sha256[:16]}...); '
                         'apply the full folder, or the delta made for the installed version')
    try:
        return bsdiff4.patch(old, (pathlib.Path(package) / PATCH_FILE).read_bytes())
    except Exception as exc:  # noqa: B902 - bsdiff4 raises ValueError and others on bad input
        raise DeltaError(f'bsdiff4 could not apply {PATCH_FILE} ({exc}); the delta is '
                         'corrupt: download it again') from None

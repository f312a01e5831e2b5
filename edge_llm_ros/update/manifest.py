"""The signed manifest of a model folder: every file's sha256 and size, strictly checked.

manifest.json (canonical JSON, see canonical.py), with exactly these fields:
  format            "edge-llm-model-manifest"
  format_version    1
  converter_version CONVERTER_VERSION of edge-llm-convert that wrote the folder (model.yaml)
  model_name        model.yaml's name
  files             {file name: {"sha256": 64 lowercase hex, "size": bytes}} for every file
                    of the folder except manifest.json and manifest.sig
manifest.sig is its detached ed25519 signature (signing.py). A folder is valid when the
signature verifies with the trusted key (checked first, over the file's raw bytes), the
manifest parses strictly (an unknown field is refused, never ignored), and the folder holds
exactly the listed files (flat: no sub-folders, no symlinks), each with its size and sha256.
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
import os
import pathlib
import re
from typing import Dict, Iterable, Mapping, Optional, Set

import yaml

from edge_llm_ros.update import canonical, signing
from edge_llm_ros.update.errors import (ExtraFileError, HashMismatchError, ManifestError,
                                        MissingFileError, SignatureError)

FORMAT = 'edge-llm-model-manifest'
FORMAT_VERSION = 1
MANIFEST_FILE = 'manifest.json'
SIGNATURE_FILE = 'manifest.sig'
MODEL_YAML = 'model.yaml'
MAX_MANIFEST_BYTES = 1 << 20
CHUNK = 1 << 20
_FIELDS = {'format': str, 'format_version': int, 'converter_version': str, 'model_name': str,
           'files': dict}
_ENTRY_FIELDS = {'sha256': str, 'size': int}
_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.+\-]{0,254}')
_SHA256 = re.compile(r'[0-9a-f]{64}')
# The files a loadable model folder needs besides its tokenizer (model_format.py).
REQUIRED_FILES = (MODEL_YAML, 'model.onnx')


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """A parsed, schema-checked manifest (see the module docstring)."""

    converter_version: str
    model_name: str
    files: Mapping[str, FileEntry]

    def to_bytes(self) -> bytes:
        """Return the canonical bytes that are written and signed."""
        return canonical.dumps({
            'format': FORMAT, 'format_version': FORMAT_VERSION,
            'converter_version': self.converter_version, 'model_name': self.model_name,
            'files': {name: {'sha256': e.sha256, 'size': e.size}
                      for name, e in self.files.items()}})

    @property
    def digest(self) -> str:
        """sha256 of the canonical bytes: names this exact model content."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.files.values())

    @classmethod
    def from_bytes(cls, data: bytes, what: str = MANIFEST_FILE) -> 'Manifest':
        """Parse and check strictly (ManifestError / UnknownFieldError saying why)."""
        obj = canonical.fields(canonical.loads(data, what), _FIELDS, what)
        if obj['format'] != FORMAT:
            raise ManifestError(f'{what}: format is {obj["format"]!r}, not {FORMAT!r}: not a '
                                'model manifest')
        if obj['format_version'] != FORMAT_VERSION:
            raise ManifestError(f'{what}: format_version {obj["format_version"]} is not '
                                f'{FORMAT_VERSION}; update edge_llm_ros to read it')
        files: Dict[str, FileEntry] = {}
        for name, entry in obj['files'].items():
            check_name(name, what)
            entry = canonical.fields(entry, _ENTRY_FIELDS, f'{what}: files[{name!r}]')
            if not _SHA256.fullmatch(entry['sha256']) or entry['size'] < 0:
                raise ManifestError(f'{what}: files[{name!r}] needs a 64-hex lowercase sha256 '
                                    'and a size >= 0')
            files[name] = FileEntry(entry['sha256'], entry['size'])
        for name in REQUIRED_FILES:
            if name not in files:
                raise ManifestError(f'{what} does not list {name}: not a converted model '
                                    'folder')
        return cls(obj['converter_version'], obj['model_name'], files)


def check_name(name: str, what: str) -> None:
    """Refuse file names that are not plain names in the folder (no paths, no dot files)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (
            MANIFEST_FILE, SIGNATURE_FILE):
        raise ManifestError(f'{what}: {name!r} is not an allowed file name (plain names '
                            'only: no folders, no leading dot, not the manifest itself)')


def hash_file(path: pathlib.Path) -> FileEntry:
    """sha256 and size of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, 'rb') as fh:
        while True:
            chunk = fh.read(CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(digest.hexdigest(), size)


def build(folder: pathlib.Path) -> Manifest:
    """Hash every file of a converted model folder into a manifest (not yet signed)."""
    try:
        meta = yaml.safe_load((folder / MODEL_YAML).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f'{folder} has no readable {MODEL_YAML} ({exc}): not a model '
                            'folder written by edge-llm-convert') from None
    if not isinstance(meta, dict) or 'converter_version' not in meta:
        raise ManifestError(f'{folder / MODEL_YAML} has no converter_version: convert the '
                            'model again with edge-llm-convert')
    names = folder_files(folder, ignore={MANIFEST_FILE, SIGNATURE_FILE})
    files = {name: hash_file(folder / name) for name in sorted(names)}
    manifest = Manifest(str(meta['converter_version']), str(meta.get('name') or folder.name),
                        files)
    return Manifest.from_bytes(manifest.to_bytes())   # same checks as a reader's


def folder_files(folder: pathlib.Path, ignore: Iterable[str] = ()) -> Set[str]:
    """Names of the regular files of a flat folder; ExtraFileError for anything else."""
    try:
        entries = list(os.scandir(folder))
    except OSError as exc:
        raise MissingFileError(f'cannot read the folder {folder}: {exc.strerror}') from None
    names = set()
    skip = set(ignore)
    for entry in entries:
        if entry.name in skip:
            continue
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise ExtraFileError(f'{folder / entry.name} is not a regular file (a model folder '
                                 'holds plain files only): remove it')
        names.add(entry.name)
    return names


def check_file_set(folder: pathlib.Path, expected: Set[str], what: str) -> None:
    """Check that the folder holds exactly `expected`: Missing/ExtraFileError if not."""
    present = folder_files(folder)
    missing = sorted(expected - present)
    if missing:
        raise MissingFileError(f'{folder} lacks {", ".join(missing)} listed in {what}: the '
                               'copy is incomplete; copy the folder again')
    extra = sorted(present - expected)
    if extra:
        raise ExtraFileError(f'{folder} holds {", ".join(extra)}, not listed in {what}: '
                             'remove it, or sign the folder again if it belongs to the model')


def check_entry(path, entry: FileEntry, actual: Optional[FileEntry] = None) -> None:
    """Compare a file (or its already computed hash) with its manifest entry."""
    actual = actual or hash_file(path)
    if actual.size != entry.size:
        raise HashMismatchError(f'{path} has {actual.size} bytes, the signed manifest says '
                                f'{entry.size}: the file is truncated or was changed')
    if actual.sha256 != entry.sha256:
        raise HashMismatchError(f'{path} does not have the sha256 of the signed manifest: it '
                                'was tampered with or is corrupt; do not use it')


def read_small(path: pathlib.Path, what: str) -> bytes:
    """Read a manifest/signature file, bounded; ManifestError when absent or too large."""
    try:
        with open(path, 'rb') as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        kind = SignatureError if path.name.endswith('.sig') else ManifestError
        raise kind(f'{path.parent} has no {path.name}: sign the folder with '
                   f'`edge-llm-update sign {path.parent} --key <private key>`') from None
    except OSError as exc:
        raise ManifestError(f'cannot read {path}: {exc.strerror}') from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f'{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest')
    return data


def verified_manifest(folder: pathlib.Path, trusted) -> Manifest:
    """Check manifest.sig over manifest.json's bytes first, then parse strictly."""
    data = read_small(folder / MANIFEST_FILE, MANIFEST_FILE)
    sig = read_small(folder / SIGNATURE_FILE, SIGNATURE_FILE)
    signing.verify(data, sig, trusted, str(folder / MANIFEST_FILE), SIGNATURE_FILE)
    return Manifest.from_bytes(data, str(folder / MANIFEST_FILE))


def verify_folder(folder: pathlib.Path, trusted) -> Manifest:
    """Verify a signed model folder in full: signature, schema, file set, sizes, hashes."""
    folder = pathlib.Path(folder)
    manifest = verified_manifest(folder, trusted)
    check_file_set(folder, set(manifest.files) | {MANIFEST_FILE, SIGNATURE_FILE},
                   MANIFEST_FILE)
    for name, entry in sorted(manifest.files.items(), key=lambda item: item[1].size):
        check_entry(folder / name, entry)
    return manifest


def sign_folder(folder: pathlib.Path, private) -> Manifest:
    """Write manifest.json and manifest.sig for a model folder (replacing old ones)."""
    folder = pathlib.Path(folder)
    manifest = build(folder)
    data = manifest.to_bytes()
    write_atomic(folder / MANIFEST_FILE, data)
    write_atomic(folder / SIGNATURE_FILE, signing.sign(data, private))
    return manifest


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write a small file through a temporary file and a rename."""
    tmp = path.with_name(f'.{path.name}.tmp-{os.getpid()}')
    with open(tmp, 'wb') as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)

"""A models root: verified versions in their own folders, `current` naming the active one.

    <root>/versions/<name>-<12 hex>/   complete, verified model folders (never changed)
    <root>/current -> versions/<...>   relative symlink; llm_node's model.path may name it
    <root>/.staging/                   folders being written (same filesystem)
An update is written into .staging, checked (signature first, then every file's hash) and
fsynced, then renamed into versions/ (atomic on one filesystem). `current` is switched by
renaming a temporary symlink over it (os.replace: atomic), after which the root folder is
fsynced. So at any point a kill -9 leaves `current` naming a complete, verified folder: the
old one or the new one. A killed install leaves only .staging leftovers, removed by the next
install; a full disk leaves nothing behind (DiskFullError). Installs, switches and removals
hold an exclusive lock on <root>/.lock, so a shell install and a node's update never clean
up each other's staging folder.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
import fcntl
import os
import pathlib
import re
import shutil
import tempfile
from typing import Iterator, List, Optional

from edge_llm_ros.update import delta as delta_mod
from edge_llm_ros.update.errors import DeltaError, HashMismatchError, InstallError, UpdateError
from edge_llm_ros.update.files import fsync_dir, read_chunks, write_chunks
from edge_llm_ros.update.manifest import (check_entry, check_file_set, Manifest, MANIFEST_FILE,
                                          read_small, SIGNATURE_FILE, verified_manifest,
                                          verify_folder)

VERSIONS = 'versions'
CURRENT = 'current'
STAGING = '.staging'
LOCK = '.lock'


@dataclass(frozen=True)
class Installed:
    """Where an update landed and what it holds."""

    path: pathlib.Path
    manifest: Manifest
    reused: bool          # the same content was already installed (nothing written)


def version_name(manifest: Manifest) -> str:
    slug = re.sub(r'[^a-z0-9]+', '-', manifest.model_name.lower()).strip('-')[:48] or 'model'
    return f'{slug}-{manifest.digest[:12]}'


class ModelsRoot:
    """One models root (see the module docstring)."""

    def __init__(self, path) -> None:
        self.path = pathlib.Path(path).expanduser().absolute()
        self.versions = self.path / VERSIONS
        self.staging = self.path / STAGING
        self.current_link = self.path / CURRENT

    def ensure(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise InstallError(f'models root {self.path} is not a folder')
        for folder in (self.versions, self.staging):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InstallError(f'cannot create {folder}: {exc.strerror}; set a writable '
                                   'models root') from None
        if os.path.lexists(self.current_link) and not self.current_link.is_symlink():
            raise InstallError(f'{self.current_link} exists and is not a symlink: move it '
                               'away; the models root manages it')

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.ensure()
        with open(self.path / LOCK, 'a+') as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def current(self) -> Optional[pathlib.Path]:
        """Return the active version folder, or None before the first switch."""
        if not self.current_link.is_symlink():
            return None
        return (self.path / os.readlink(self.current_link)).resolve()

    def installed(self) -> List[pathlib.Path]:
        if not self.versions.is_dir():
            return []
        return sorted(p for p in self.versions.iterdir() if p.is_dir())

    def install(self, source, trusted, base=None) -> Installed:
        """Verify `source` (a signed folder or a delta package) and install it as a version.

        `base`: the folder a delta patches (default: the current version). Nothing is
        switched: call `switch` once the new model is known to load.
        """
        source = pathlib.Path(source)
        if not source.is_dir():
            raise UpdateError(f'{source} is not a folder: give a signed model folder or a '
                              'delta package (edge-llm-update make-delta)')
        with self._locked():
            self._clean_staging()
            return self._install(source, trusted, base)

    def _install(self, source: pathlib.Path, trusted, base) -> Installed:
        is_delta = delta_mod.is_delta(source)
        if is_delta:
            delta, manifest = delta_mod.verified_delta(source, trusted)
            base_dir = pathlib.Path(base) if base else self.current()
            if base_dir is None:
                raise UpdateError('a delta needs a base model: none is installed under '
                                  f'{self.path}; give --base or apply the full folder')
        else:
            manifest = verified_manifest(source, trusted)
            check_file_set(source, set(manifest.files) | {MANIFEST_FILE, SIGNATURE_FILE},
                           MANIFEST_FILE)
        target = self.versions / version_name(manifest)
        if target.is_dir():
            # Already installed: nothing is copied, but tampered input is still refused.
            if not is_delta:
                verify_folder(source, trusted)
            return Installed(target, verify_folder(target, trusted), reused=True)
        work = pathlib.Path(tempfile.mkdtemp(prefix='install-', dir=self.staging))
        try:
            needed = manifest.total_size
            for name, entry in sorted(manifest.files.items()):
                if is_delta:
                    label, chunks = delta_mod.file_source(source, delta, base_dir, name)
                else:
                    label, chunks = str(source / name), read_chunks(source / name)
                # Hashed as written: what is installed is what was checked.
                written = write_chunks(work / name, chunks, needed)
                try:
                    check_entry(label, entry, written)
                except HashMismatchError as exc:
                    if is_delta and name in delta.from_base:
                        raise DeltaError(f'{exc}: the delta was made against another base '
                                         'model; apply the full folder') from None
                    raise
            for name in (MANIFEST_FILE, SIGNATURE_FILE):
                write_chunks(work / name, [read_small(source / name, name)], needed)
            fsync_dir(work)
            os.chmod(work, 0o755)
            os.rename(work, target)
            fsync_dir(self.versions)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return Installed(target, manifest, reused=False)

    def switch(self, version: pathlib.Path, trusted=None) -> None:
        """Point `current` at an installed version, atomically (verified first if trusted)."""
        version = pathlib.Path(version).absolute()
        if version.parent != self.versions or not version.is_dir():
            raise InstallError(f'{version} is not a version installed under {self.versions}')
        if trusted is not None:
            verify_folder(version, trusted)
        with self._locked():
            self._switch(version)

    def _switch(self, version: pathlib.Path) -> None:
        tmp = self.path / f'.{CURRENT}.tmp-{os.getpid()}'
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(os.path.join(VERSIONS, version.name), tmp)
        os.replace(tmp, self.current_link)
        fsync_dir(self.path)

    def _clean_staging(self) -> None:
        """Remove what a killed or failed install left in .staging (locked)."""
        if self.staging.is_dir():
            for leftover in self.staging.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
        for tmp in self.path.glob(f'.{CURRENT}.tmp-*'):
            tmp.unlink()

    def remove(self, version: pathlib.Path) -> None:
        """Delete an installed version that is not current."""
        with self._locked():
            self._remove(pathlib.Path(version).absolute())

    def _remove(self, version: pathlib.Path) -> None:
        if version.parent != self.versions:
            raise InstallError(f'{version} is not under {self.versions}')
        if self.current() == version.resolve():
            raise InstallError(f'{version} is the current version; switch away first')
        # Renamed first, so a kill mid-delete never leaves a half folder under versions/.
        doomed = pathlib.Path(tempfile.mkdtemp(prefix='remove-', dir=self.staging))
        os.rename(version, doomed / version.name)
        shutil.rmtree(doomed, ignore_errors=True)

    def prune(self, keep: int = 2) -> List[pathlib.Path]:
        """Remove all but the current version and the newest others, `keep` in all."""
        with self._locked():
            return self._prune(keep)

    def _prune(self, keep: int) -> List[pathlib.Path]:
        current = self.current()
        others = sorted((p for p in self.installed() if p.resolve() != current),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        doomed = others[max(0, keep - (1 if current else 0)):]
        for version in doomed:
            self._remove(version)
        return doomed

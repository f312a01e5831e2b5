#!/usr/bin/env python3
"""Print the host folders the DMA-BUF test VM must share on their own (stdlib only).

The guest sees the host root over 9p. qemu's local backend follows the host's own
mounts under it (multidevs=remap keeps inode numbers apart), but the guest mounts its
own /tmp (tmpfs), /dev, /proc and /sys over the host's, which hides anything the tests
need from there: a CI clone in /tmp/ci, its venv, a run folder. Run this with the venv's
python: it lists the checkout, the interpreter's prefixes, sys.path and LD_LIBRARY_PATH
(as given and resolved), keeps those under a guest mount and drops nested ones. Each
printed folder becomes a read-only 9p share that init.sh mounts at the same path.
"""
import argparse
import os
import sys
from typing import Iterable, List

# Folders init.sh mounts inside the guest, hiding the host's.
GUEST_MOUNTS = ('/tmp', '/dev', '/proc', '/sys')


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip('/') + '/')


def needed_paths(extra: Iterable[str]) -> List[str]:
    """Return the absolute folders the guest's python and pytest read, as given and resolved."""
    candidates = list(extra) + [
        sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
        os.path.dirname(os.path.abspath(sys.executable)),
    ]
    candidates += [p for p in sys.path if p]
    candidates += [p for p in os.environ.get('LD_LIBRARY_PATH', '').split(':') if p]
    found = set()
    for path in candidates:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.isfile(form):
                form = os.path.dirname(form)
            if os.path.isdir(form):
                found.add(form)
    return sorted(found)


def shares(paths: Iterable[str]) -> List[str]:
    """Return the outermost paths that sit under a guest mount."""
    hidden = sorted(p for p in paths if any(_under(p, m) for m in GUEST_MOUNTS))
    kept: List[str] = []
    for path in hidden:
        if any(_under(path, k) for k in kept):
            continue
        if path in GUEST_MOUNTS:
            raise SystemExit(f'the VM needs {path} from the host, but the guest mounts its '
                             f'own {path} there: move the checkout or venv out of it')
        if '\n' in path:
            raise SystemExit(f'{path!r}: a folder name with a newline cannot be shared')
        kept.append(path)
    return kept


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('paths', nargs='*', help='more folders or files the guest reads')
    args = parser.parse_args(argv)
    for path in shares(needed_paths(args.paths)):
        print(path)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

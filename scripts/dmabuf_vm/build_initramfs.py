#!/usr/bin/env python3
"""Build the tiny initramfs that boots the DMA-BUF test VM (stdlib only).

The archive holds busybox, the kernel modules needed to mount the host root over
virtio-9p (with their dependencies, resolved from each module's .modinfo and
decompressed because busybox insmod does not read .ko.xz), /dev/console, and the
init script. It is a gzip'd cpio "newc" archive written here directly, because
the machine may have no cpio binary.
"""
import argparse
import gzip
import io
import lzma
import pathlib
import stat
import sys
from typing import Dict, List, Tuple

# (path in archive, mode, data or None, rdev major, rdev minor)
Entry = Tuple[str, int, bytes, int, int]


def _newc_header(ino: int, mode: int, size: int, name: bytes, rmaj: int, rmin: int) -> bytes:
    fields = (ino, mode, 0, 0, 1, 0, size, 0, 0, rmaj, rmin, len(name) + 1, 0)
    return b'070701' + b''.join(b'%08X' % f for f in fields)


def _pad4(n: int) -> bytes:
    return b'\0' * ((4 - n % 4) % 4)


def write_cpio(entries: List[Entry]) -> bytes:
    """Serialize entries as a cpio newc archive."""
    out = io.BytesIO()
    for ino, (path, mode, data, rmaj, rmin) in enumerate(entries, start=1):
        name = path.encode()
        hdr = _newc_header(ino, mode, len(data), name, rmaj, rmin) + name + b'\0'
        out.write(hdr + _pad4(len(hdr)))
        out.write(data + _pad4(len(data)))
    trailer = _newc_header(0, 0, 0, b'TRAILER!!!', 0, 0) + b'TRAILER!!!\0'
    out.write(trailer + _pad4(len(trailer)))
    return out.getvalue()


def _module_index(moddir: pathlib.Path) -> Dict[str, pathlib.Path]:
    index = {}
    for path in moddir.rglob('*.ko*'):
        index[path.name.split('.ko')[0].replace('-', '_')] = path
    return index


def _read_module(path: pathlib.Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith('.xz'):
        return lzma.decompress(data)
    if path.name.endswith('.zst'):
        raise SystemExit(f'{path}: zstd modules unsupported; add a decompressor')
    return data


def _depends(blob: bytes) -> List[str]:
    for field in blob.split(b'\0'):
        if field.startswith(b'depends='):
            names = field[len(b'depends='):].decode()
            return [n.replace('-', '_') for n in names.split(',') if n]
    return []


def resolve_modules(moddir: pathlib.Path, wanted: List[str]) -> List[Tuple[str, bytes]]:
    """Return (name, decompressed .ko) for wanted modules, dependencies first."""
    index = _module_index(moddir)
    builtin = set()
    builtin_file = moddir / 'modules.builtin'
    if builtin_file.exists():
        for line in builtin_file.read_text().split():
            builtin.add(pathlib.Path(line).name.split('.ko')[0].replace('-', '_'))
    ordered: List[Tuple[str, bytes]] = []
    seen = set()

    def visit(name: str) -> None:
        if name in seen or name in builtin:
            return
        seen.add(name)
        if name not in index:
            raise SystemExit(f'module {name} is neither built in nor under {moddir}')
        blob = _read_module(index[name])
        for dep in _depends(blob):
            visit(dep)
        ordered.append((name, blob))

    for name in wanted:
        visit(name.replace('-', '_'))
    return ordered


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--moddir', type=pathlib.Path, required=True,
                        help='lib/modules/<version> of the extracted kernel package')
    parser.add_argument('--busybox', type=pathlib.Path, required=True)
    parser.add_argument('--init', type=pathlib.Path, required=True)
    parser.add_argument('--modules', default='9pnet_virtio,9p')
    parser.add_argument('--out', type=pathlib.Path, required=True)
    args = parser.parse_args(argv)

    d = stat.S_IFDIR | 0o755
    entries: List[Entry] = [(p, d, b'', 0, 0) for p in (
        'bin', 'dev', 'proc', 'sys', 'host', 'lib', 'lib/modules')]
    entries.append(('dev/console', stat.S_IFCHR | 0o600, b'', 5, 1))
    entries.append(('bin/busybox', stat.S_IFREG | 0o755, args.busybox.read_bytes(), 0, 0))
    entries.append(('init', stat.S_IFREG | 0o755, args.init.read_bytes(), 0, 0))
    modules = resolve_modules(args.moddir, args.modules.split(','))
    order = []
    for name, blob in modules:
        entries.append((f'lib/modules/{name}.ko', stat.S_IFREG | 0o644, blob, 0, 0))
        order.append(f'{name}.ko')
    entries.append(('lib/modules/order', stat.S_IFREG | 0o644,
                    ('\n'.join(order) + '\n').encode(), 0, 0))
    args.out.write_bytes(gzip.compress(write_cpio(entries), compresslevel=1))
    print(f'initramfs: {args.out} modules: {" ".join(order) or "(all built in)"}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

"""edge-llm-update: sign model folders, make deltas, verify, install and switch models.

    edge-llm-update keygen fleet                      # fleet.key (private), fleet.pub
    edge-llm-update sign <model folder> --key fleet.key
    edge-llm-update verify <folder or delta> --public-key fleet.pub
    edge-llm-update make-delta <old folder> <new signed folder> <out> --key fleet.key
    edge-llm-update apply <folder or delta> --root <models root> --public-key fleet.pub
                    [--base <folder>] [--switch]
    edge-llm-update switch <version folder> --root <models root> --public-key fleet.pub
Exit status: 0 done, 1 refused (the message says why; nothing was installed or switched),
2 bad usage.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import List, Optional

from edge_llm_ros.update import delta as delta_mod, manifest as manifest_mod, signing
from edge_llm_ros.update.errors import UpdateError
from edge_llm_ros.update.install import ModelsRoot


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='edge-llm-update',
                                description='Signed model updates (docs/model_updates.md).')
    sub = p.add_subparsers(dest='command', required=True)
    keygen = sub.add_parser('keygen', help='make an ed25519 key pair: NAME.key and NAME.pub')
    keygen.add_argument('name')
    sign = sub.add_parser('sign', help='write manifest.json + manifest.sig for a model folder')
    sign.add_argument('folder', type=pathlib.Path)
    sign.add_argument('--key', required=True, help='private key file')
    verify = sub.add_parser('verify', help='verify a signed folder or a delta package')
    verify.add_argument('folder', type=pathlib.Path)
    verify.add_argument('--public-key', required=True, help='key file or base64')
    make = sub.add_parser('make-delta', help='package a bsdiff4 delta from OLD to NEW')
    make.add_argument('old', type=pathlib.Path)
    make.add_argument('new', type=pathlib.Path, help='the signed new folder')
    make.add_argument('out', type=pathlib.Path)
    make.add_argument('--key', required=True, help='private key file (signs delta.json)')
    apply = sub.add_parser('apply', help='verify and install a folder or delta as a version')
    apply.add_argument('source', type=pathlib.Path)
    apply.add_argument('--root', required=True, type=pathlib.Path)
    apply.add_argument('--public-key', required=True)
    apply.add_argument('--base', type=pathlib.Path,
                       help='folder a delta patches (default: <root>/current)')
    apply.add_argument('--switch', action='store_true',
                       help='then point <root>/current at it (a running llm_node keeps its '
                            'model: use its ~/update_model service instead)')
    switch = sub.add_parser('switch', help='point <root>/current at an installed version')
    switch.add_argument('version', type=pathlib.Path)
    switch.add_argument('--root', required=True, type=pathlib.Path)
    switch.add_argument('--public-key', required=True)
    return p


def run(args: argparse.Namespace) -> str:
    """Do one command; return what to print."""
    if args.command == 'keygen':
        public = signing.generate(f'{args.name}.key', f'{args.name}.pub')
        return (f'wrote {args.name}.key (private: keep it off the robots) and {args.name}.pub '
                f'(key id {signing.key_id(public)})')
    if args.command == 'sign':
        private = signing.load_private(args.key)
        manifest = manifest_mod.sign_folder(args.folder, private)
        return (f'signed {args.folder}: {len(manifest.files)} files, {manifest.total_size} '
                f'bytes, key {signing.key_id(private.public_key())}')
    if args.command == 'make-delta':
        delta = delta_mod.make_delta(args.old, args.new, args.out,
                                     signing.load_private(args.key))
        return (f'wrote {args.out}: patch {delta.patch.size} bytes for a {delta.base.size}-'
                'byte model.onnx.data')
    trusted = signing.load_public(args.public_key)
    if args.command == 'verify':
        if delta_mod.is_delta(args.folder):
            _, manifest = delta_mod.verified_delta(args.folder, trusted)
            return f'{args.folder}: valid delta package for {manifest.model_name}'
        manifest = manifest_mod.verify_folder(args.folder, trusted)
        return f'{args.folder}: valid, {len(manifest.files)} files ({manifest.model_name})'
    root = ModelsRoot(args.root)
    if args.command == 'switch':
        root.switch(args.version, trusted)
        return f'{root.current_link} -> {args.version}'
    installed = root.install(args.source, trusted, base=args.base)
    lines = [f'{"already installed" if installed.reused else "installed"}: {installed.path}']
    if args.switch:
        root.switch(installed.path)
        lines.append(f'{root.current_link} -> {installed.path.name}')
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Console script `edge-llm-update`."""
    args = _parser().parse_args(argv)
    try:
        print(run(args))
    except UpdateError as exc:
        print(f'edge-llm-update: error: {exc}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())

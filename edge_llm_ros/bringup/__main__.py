"""Board bring-up from a shell, without ROS: see what the launch files will do here.

Usage::

  python -m edge_llm_ros.bringup detect
  python -m edge_llm_ros.bringup resolve --board auto --params-file robot.yaml \
      --set kv.max_context=4096
  python -m edge_llm_ros.bringup check --board orin_nx
"""
import argparse
import sys
from typing import Callable, Optional, Sequence

from edge_llm_ros.bringup import preflight, profiles
from edge_llm_ros.bringup.detect import detect_board
from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.runtime import native_ops


def main(argv: Optional[Sequence[str]] = None, out: Callable[[str], None] = print) -> int:
    """Run one sub-command; 2 and a one-line message on a bring-up error."""
    parser = argparse.ArgumentParser(prog='python -m edge_llm_ros.bringup',
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='command', required=True)
    detect = sub.add_parser('detect', help='describe this machine and the profile it matches')
    detect.add_argument('--root', default='/', help='root of the system to describe')
    for name, text in (('resolve', 'print the resolved llm_node parameters and their origin'),
                       ('check', 'resolve, then run the configure-time checks')):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument('--board', default='auto')
        cmd.add_argument('--params-file', default='')
        cmd.add_argument('--set', action='append', default=[], metavar='NAME=VALUE',
                         help='llm_node override (repeatable)')
        cmd.add_argument('--root', default='/')
    args = parser.parse_args(argv)
    try:
        if args.command == 'detect':
            for key, value in detect_board(args.root).summary().items():
                out('%s: %s' % (key, value))
            return 0
        resolved = profiles.resolve(args.board, args.params_file,
                                    {'llm_node': profiles.flatten_overrides(args.set)},
                                    root=args.root)
        for line in profiles.describe(resolved):
            out(line)
        if args.command == 'check':
            report = preflight.preflight(resolved.llm_params(), root=args.root)
            out('providers: %s' % ', '.join(report.providers))
            out('toolchain: %s' % (report.toolchain or 'none needed'))
            out('cpu kernels: %s' % ('kquant %s (cpu: %s)' % (
                report.cpu_kernel, native_ops.cpu_features() or 'no SIMD it uses')
                if report.cpu_kernel else 'matmulnbits only (op library not built)'))
            out('thermal zones: %s' % (', '.join(report.thermal_zones) or 'none'))
            for warning in report.warnings:
                out('warning: %s' % warning)
        return 0
    except BringupError as exc:
        out('error: %s' % exc)
        return 2


if __name__ == '__main__':
    sys.exit(main())

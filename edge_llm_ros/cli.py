"""`edge-llm`: one command line tool, one subcommand per module, imported only when used.

A subcommand is a module with two functions:

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int

registered in SUBCOMMANDS below by module path. Only the chosen subcommand's module is imported,
so `edge-llm generate` never imports rclpy even though `edge-llm ask` (a ROS client) does.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
import importlib
import sys
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Subcommand:
    module: str       # defines add_arguments(parser) and run(args) -> int
    description: str
    add_arguments: str = 'add_arguments'   # the functions' names, when a module has several
    run: str = 'run'


SUBCOMMANDS: Dict[str, Subcommand] = {
    'generate': Subcommand('edge_llm_ros.cli_generate',
                           'generate text on this machine with the engine (no ROS needed)'),
    'ask': Subcommand('edge_llm_ros.nodes.ask',
                      'send a prompt to a running llm_node over ROS 2 and stream the answer'),
    'embed': Subcommand('edge_llm_ros.nodes.embed_cli',
                        'embed texts with a running llm_node that serves an embedding model',
                        'add_embed_arguments', 'run_embed'),
    'rerank': Subcommand('edge_llm_ros.nodes.embed_cli',
                         'score documents against a query with a llm_node serving a reranker',
                         'add_rerank_arguments', 'run_rerank'),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='edge-llm', description='On-device language model tools.',
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='commands:\n' + '\n'.join(
            f'  {name:<10} {sc.description}' for name, sc in SUBCOMMANDS.items())
        + "\n\nRun `edge-llm COMMAND --help` for a command's options.")
    parser.add_argument('command', nargs='?', choices=sorted(SUBCOMMANDS), metavar='COMMAND')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `edge-llm`; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith('-'):
        parser = _top_parser()
        parser.parse_args(argv[:1])  # handles --help; anything else is an error
        parser.print_help(sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        _top_parser().error(f'unknown command {name!r} (choose from {", ".join(SUBCOMMANDS)})')
    spec = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        print(f'edge-llm {name}: cannot load {spec.module} ({e}); is the package installed '
              'with everything this command needs (ROS 2 for ask)?', file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f'edge-llm {name}', description=spec.description)
    getattr(module, spec.add_arguments)(parser)
    return int(getattr(module, spec.run)(parser.parse_args(rest)) or 0)


if __name__ == '__main__':
    sys.exit(main())

"""edge-llm-memory-reembed: re-embed a memory store through an embedding node's ~/embed.

    edge-llm-memory-reembed --store ~/.ros/edge_llm/memory.db --embed-service /embedder/embed

The command a model mismatch names (StoreModelMismatchError). Stop the memory node first (the
store is locked while it runs). Every row is embedded again, one text per call, into a new
store (edge_llm_ros/memory/reembed.py); without --out the new store then replaces the old
one, which is kept beside it as <store>.<old model id>.bak.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_msgs.srv import Embed
from edge_llm_ros.errors import EngineError
from edge_llm_ros.memory.reembed import reembed
from edge_llm_ros.memory.store import MemoryStore, StoreConfig
from edge_llm_ros.nodes import spin
from edge_llm_ros.nodes.memory_calls import embed_call, ServiceCaller


def _discard(out: str) -> None:
    """Remove a half-written new store, so that the same command can simply be run again."""
    for path in (out, out + '-wal', out + '-shm', out + '-journal', out + '.lock'):
        if os.path.exists(path):
            os.remove(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script: 0 when the store was re-embedded, 2 with one line saying why not."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--store', required=True, help='the memory store file')
    ap.add_argument('--embed-service', required=True,
                    help="the embedding node's Embed service, e.g. /embedder/embed")
    ap.add_argument('--out', default='', help='write the new store here and keep the old one')
    ap.add_argument('--timeout', type=float, default=30.0, help='seconds per embed call')
    args = ap.parse_args(argv)
    store = os.path.abspath(os.path.expanduser(args.store))
    if not os.path.isfile(store):
        print(f'edge-llm-memory-reembed: error: no memory store at {store}', file=sys.stderr)
        return 2
    out = os.path.abspath(args.out) if args.out else store + '.reembed'
    if os.path.exists(out):
        print(f'edge-llm-memory-reembed: error: {out} exists: remove it or choose --out',
              file=sys.stderr)
        return 2
    spin.init()
    node = rclpy.create_node('memory_reembed', start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    # Stopped and joined before the context goes down: a context shut down under a spinning
    # thread aborts the process at exit ("terminate called without an active exception").
    spinning = spin.BackgroundSpin(executor)
    try:
        old = MemoryStore(StoreConfig(store))
        old_model = old.model_id or 'none'
        old.close()
        caller = ServiceCaller(node, Embed, args.embed_service, args.timeout)
        count = reembed(store, out, lambda texts, q: embed_call(caller, texts, q))
    except EngineError as exc:
        _discard(out)
        print(f'edge-llm-memory-reembed: error: {exc}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _discard(out)
        print(f'edge-llm-memory-reembed: interrupted; {store} is unchanged', file=sys.stderr)
        return 130
    finally:
        spin.close_client(spinning, executor, node)
    if not args.out:
        backup = f'{store}.{re.sub(r"[^A-Za-z0-9._-]", "_", old_model)}.bak'
        os.replace(store, backup)
        os.replace(out, store)
        print(f're-embedded {count} memories into {store} (the old store: {backup})')
    else:
        print(f're-embedded {count} memories into {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

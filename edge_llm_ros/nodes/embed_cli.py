"""`edge-llm embed TEXT...` and `edge-llm rerank QUERY DOC...`: ask a running llm_node.

The node must serve an embedding (embed) or rerank (rerank) folder. embed prints one JSON line
per text ({"text", "tokens", "embedding"}); rerank prints one line per document, best first
({"index", "score", "document"}). Exit status: 0 answered, 1 refused or unreachable (the
node's error_kind and message on stderr).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.client import EmbedRefusedError, LLMClient, LLMClientError
from edge_llm_ros.nodes import spin

EXIT_OK, EXIT_FAILED = 0, 1


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--server', default='/llm_node',
                        help='fully qualified name of the llm_node (default: /llm_node)')
    parser.add_argument('--truncate', action='store_true',
                        help='cut texts over the context instead of refusing them')
    parser.add_argument('--timeout', type=float, default=60.0,
                        help='seconds to wait for the node and its answer (default 60)')


def add_embed_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `edge-llm embed`."""
    parser.add_argument('texts', nargs='+', help='texts to embed')
    parser.add_argument('--query', action='store_true',
                        help="embed as queries (the model's query prefix)")
    parser.add_argument('--dimensions', type=int, default=0,
                        help='keep the first N dimensions, renormalized (default 0: all)')
    _common(parser)


def add_rerank_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `edge-llm rerank`."""
    parser.add_argument('query', help='the query')
    parser.add_argument('documents', nargs='+', help='documents to score against the query')
    parser.add_argument('--top-n', type=int, default=0, help='print the best N (default all)')
    _common(parser)


def _with_client(args: argparse.Namespace, what: str,
                 action: Callable[[LLMClient], None]) -> int:
    spin.init()
    node = rclpy.create_node(f'edge_llm_{what}', start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinning = spin.BackgroundSpin(executor)
    client = LLMClient(node, args.server)
    try:
        action(client)
        return EXIT_OK
    except EmbedRefusedError as exc:
        print(f'{what}: {args.server} refused: {exc}', file=sys.stderr)
    except (LLMClientError, TimeoutError) as exc:
        print(f'{what}: {exc}', file=sys.stderr)
    finally:
        spin.close_client(spinning, executor, node, client)
    return EXIT_FAILED


def run_embed(args: argparse.Namespace) -> int:
    """Embed args.texts on the node and print one JSON line per text."""
    def action(client: LLMClient) -> None:
        reply = client.embed(args.texts, is_query=args.query, dimensions=args.dimensions,
                             truncate=args.truncate, timeout=args.timeout)
        for text, tokens, vector in zip(args.texts, reply.token_counts, reply.vectors):
            print(json.dumps({'text': text, 'tokens': tokens,
                              'embedding': [round(float(v), 7) for v in vector]}))
    return _with_client(args, 'embed', action)


def run_rerank(args: argparse.Namespace) -> int:
    """Score args.documents against args.query on the node; print them best first."""
    def action(client: LLMClient) -> None:
        reply = client.rerank(args.query, args.documents, top_n=args.top_n,
                              truncate=args.truncate, timeout=args.timeout)
        for i in reply.order:
            print(json.dumps({'index': i, 'score': float(reply.scores[i]),
                              'document': args.documents[i]}))
    return _with_client(args, 'rerank', action)

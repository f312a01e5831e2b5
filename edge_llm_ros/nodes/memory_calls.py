"""The memory node's calls out: the embedding node's ~/embed and a reranker's ~/rerank.

Both are blocking calls made from a service callback (or a tool's main thread) while an
executor spins the node on another thread: call_async, then wait on an event, so a node
that is down or slow costs at most the timeout and is an EmbeddingServiceError that says
which service to start. The memory node and the embedding node restart independently.
"""
from __future__ import annotations

import threading
import time
from typing import Any, List, Sequence, Tuple

import numpy as np
from rclpy.callback_groups import CallbackGroup
from rclpy.node import Node

from edge_llm_ros.embed_reply import EmbedReplyError, EmbedReplyReader
from edge_llm_ros.memory.errors import EmbeddingServiceError

POLL_S = 0.05


class ServiceCaller:
    """One service client, called synchronously with a timeout."""

    def __init__(self, node: Node, srv_type: Any, name: str, timeout_s: float,
                 group: CallbackGroup = None) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._client = node.create_client(srv_type, name, callback_group=group)
        self.replies = EmbedReplyReader(node.get_name())   # large Embed results (handles)

    def call(self, request: Any) -> Any:
        """Send request and return the response; EmbeddingServiceError when none comes."""
        deadline = time.monotonic() + self.timeout_s
        while not self._client.service_is_ready():
            if time.monotonic() >= deadline:
                raise EmbeddingServiceError(
                    f'service {self.name} is not available (waited {self.timeout_s:g} s): start '
                    'the embedding llm_node, or point the parameter at its service')
            time.sleep(POLL_S)
        done = threading.Event()
        future = self._client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        if not done.wait(max(0.0, deadline - time.monotonic())):
            self._client.remove_pending_request(future)
            raise EmbeddingServiceError(f'service {self.name} did not answer within '
                                        f'{self.timeout_s:g} s: is the node busy or stopped?')
        if future.exception() is not None:
            raise EmbeddingServiceError(f'service {self.name} failed: {future.exception()}')
        return future.result()


def embed_call(caller: ServiceCaller, texts: Sequence[str], is_query: bool
               ) -> Tuple[str, np.ndarray]:
    """Embed texts through an Embed service: (model_id, float32 [len(texts), dimensions])."""
    from edge_llm_msgs.srv import Embed
    response = caller.call(Embed.Request(texts=list(texts), is_query=is_query, dimensions=0,
                                         truncate=False))
    if not response.success:
        raise EmbeddingServiceError(f'{caller.name} refused the text '
                                    f'({response.error_kind}): {response.message}')
    try:
        vectors = caller.replies.vectors(response, len(texts))
    except EmbedReplyError as exc:
        raise EmbeddingServiceError(f'{caller.name}: {exc}') from None
    return response.model_id, vectors


def rerank_call(caller: ServiceCaller, query: str, documents: Sequence[str]
                ) -> Tuple[List[int], List[float]]:
    """Score documents against query through a Rerank service: (order best first, scores)."""
    from edge_llm_msgs.srv import Rerank
    response = caller.call(Rerank.Request(query=query, documents=list(documents), top_n=0,
                                          truncate=True))
    if not response.success:
        raise EmbeddingServiceError(f'{caller.name} refused the rerank '
                                    f'({response.error_kind}): {response.message}')
    order, scores = [int(i) for i in response.order], [float(s) for s in response.scores]
    if sorted(order) != list(range(len(documents))) or len(scores) != len(documents):
        raise EmbeddingServiceError(f'{caller.name} answered an order of {len(order)} and '
                                    f'{len(scores)} scores for {len(documents)} documents')
    return order, scores

"""The memory node's tests: a real memory process and a stand-in embedding node in-process.

StandInEmbedder is a real rclpy node serving edge_llm_msgs/srv/Embed and Rerank over real
services, with memory_embed.hashed_embed (hashed trigrams; deterministic) and a word-overlap
reranker. It STANDS IN for the embedding llm_node, whose own tests (real models, parity with
llama.cpp) live with it: here it only has to answer the interface. `model_id` and `dims` can
be changed while it runs, as an embedding node restarted with another model would.
"""
import contextlib
import os
import pathlib
from typing import Iterator, Tuple

from llm_node_harness import RosClient
from memory_embed import DIMS, hashed_embed, MODEL_ID
import rclpy

from edge_llm_msgs.srv import Embed, Rerank
from edge_llm_ros.memory_client import MemoryClient
from edge_llm_ros.node_process import NodeProcess


class StandInEmbedder:
    """Embed and Rerank services on `node` under /<name>/embed and /<name>/rerank."""

    def __init__(self, node, name: str) -> None:
        self.model_id, self.dims = MODEL_ID, DIMS
        self.calls = 0
        self.embed_service = f'/{name}/embed'
        self.rerank_service = f'/{name}/rerank'
        node.create_service(Embed, self.embed_service, self._embed)
        node.create_service(Rerank, self.rerank_service, self._rerank)

    def _embed(self, request, response):
        self.calls += 1
        if not request.texts or any(not t.strip() for t in request.texts):
            response.success, response.error_kind = False, 'EmptyInputError'
            response.message = 'empty text'
            return response
        model_id, vectors = hashed_embed(request.texts, request.is_query, self.dims,
                                         self.model_id)
        response.success, response.model_id = True, model_id
        response.dimensions = self.dims
        response.vectors = vectors.reshape(-1).tolist()
        response.token_counts = [len(t.split()) for t in request.texts]
        return response

    def _rerank(self, request, response):
        words = set(request.query.lower().split())
        scores = [float(len(words & set(d.lower().split()))) for d in request.documents]
        response.success, response.scores = True, scores
        response.order = sorted(range(len(scores)), key=lambda i: -scores[i])
        return response


@contextlib.contextmanager
def served_memory(root: pathlib.Path, tag: str
                  ) -> Iterator[Tuple[NodeProcess, RosClient, MemoryClient, StandInEmbedder]]:
    """Run a memory node over a stand-in embedder; yield (process, client, memory, embedder)."""
    name = f'memory_{tag}_{os.getpid()}'
    rclpy.init()
    client = RosClient(f'memory_client_{tag}_{os.getpid()}')
    embedder = StandInEmbedder(client.node, f'embedder_{tag}_{os.getpid()}')
    proc = NodeProcess('memory', name=name, params={
        'store': str(root / 'memory.db'), 'embed.service': embedder.embed_service,
        'rerank.service': embedder.rerank_service, 'embed.timeout_s': 10.0,
        'max_k': 20, 'diagnostics.period_s': 0.2})
    try:
        client.wait_state('/' + name, 'active', timeout=60)
        memory = MemoryClient(client.node, '/' + name, timeout_s=30.0)
        assert memory.wait_ready(30), proc.log()
        yield proc, client, memory, embedder
    finally:
        client.close()
        rclpy.shutdown()
        assert proc.stop() == 0, proc.log()

"""llm_node's ~/embed and ~/rerank (edge_llm_msgs/srv/Embed, Rerank), for an encoder folder.

Served when the node's model folder is an embedding or rerank model (serving/embedding.py);
a chat folder answers them with WrongModelKindError's message. Each call runs on the engine
worker between jobs (EngineWorker.run_between_jobs), so inference stays on that thread. Bad
input (no texts, a text over the context without truncate, a batch over the limit,
dimensions above the model's, rerank without documents) is answered with success false, the
message saying what to change and error_kind the error's class name; the node serves on.
Vectors up to HANDLE_MIN_BYTES travel in the response as float32 (row-major
[len(texts), dimensions]); larger results are written once into the node's own reply pool
(VectorReplies: sealed memfd or DMA-BUF, edge_llm_ros.ipc) and the response carries their
TensorHandle, so a big batch does not cross DDS as a float array. A reply slot stays readable
until REPLY_SLOTS - 1 later large replies have been published (oldest slot reused first);
LLMClient.embed maps and copies it as soon as the response arrives.
"""
from __future__ import annotations

import re
import threading
from typing import Any, Optional

import numpy as np
from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.srv import Embed, Rerank
from edge_llm_ros.errors import EngineError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.serving.embedding import not_an_embedding_model
from edge_llm_ros.serving.worker import EngineWorker, WorkerStoppedError

CALL_WAIT_S = 60.0   # how long a call waits for a running job before it is answered
# Results above this go back as a TensorHandle: a few KB of floats is cheap inline, a batch of
# 256 x 1024 floats (1 MiB) is not.
HANDLE_MIN_BYTES = 16 * 1024
REPLY_SLOTS = 8
# A reply slot is handed out again after this; the client reads it as the response arrives.
REPLY_LEASE_S = 10.0


class VectorReplies:
    """The node's pool of large embed results (created on the first one, sized to max_batch)."""

    def __init__(self, node_name: str) -> None:
        # Pool ids are socket file names: keep the node's name readable but safe.
        self.pool_id = re.sub(r'[^A-Za-z0-9_.-]', '_', f'{node_name}_embed').lstrip('.-')[:64]
        self._pool: Optional[TensorPool] = None
        self._lock = threading.Lock()

    def publish(self, vectors: np.ndarray, slot_nbytes: int):
        """Copy vectors into a reply slot and return its TensorHandle message."""
        with self._lock:
            if self._pool is not None and self._pool.buffer_size < vectors.nbytes:
                self._pool.close()   # a model with wider vectors since: size the pool anew
                self._pool = None
            if self._pool is None:
                self._pool = TensorPool(PoolConfig(
                    pool_id=self.pool_id, slot_nbytes=max(slot_nbytes, vectors.nbytes),
                    slots=REPLY_SLOTS, lease_s=REPLY_LEASE_S))
            return to_handle(self._pool.publish_array(vectors))

    def close(self) -> None:
        """Free the pool (its handles go stale)."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def _engine_call(worker: Optional[EngineWorker], method: str, *args):
    """Return engine.<method>(*args) run on the worker between jobs."""
    if worker is None:
        raise WorkerStoppedError('the model is not loaded: configure the node')

    def action(engine: Any):
        call = getattr(engine, method, None)
        if call is None:
            raise not_an_embedding_model(str(getattr(engine, 'model_name', 'this model')))
        return call(*args)
    return worker.run_between_jobs(action, CALL_WAIT_S)


def _largest_reply(worker: EngineWorker, dimensions: int) -> int:
    """Bytes of the largest result this engine returns (max_batch texts of its width)."""
    config = getattr(worker.engine, 'config', None)
    return int(getattr(config, 'max_batch', 1)) * dimensions * 4


def embed(worker: Optional[EngineWorker], request: Embed.Request,
          response: Embed.Response, replies: Optional[VectorReplies] = None) -> Embed.Response:
    """Fill `response` with the texts' vectors (see the module docstring)."""
    out = _engine_call(worker, 'embed', list(request.texts), bool(request.is_query),
                       int(request.dimensions), bool(request.truncate))
    response.dimensions = out.dimensions
    vectors = np.ascontiguousarray(out.vectors, np.float32)
    if replies is not None and vectors.nbytes > HANDLE_MIN_BYTES:
        response.handle = replies.publish(vectors, _largest_reply(worker, out.dimensions))
    else:
        response.vectors = vectors.reshape(-1).tolist()
    response.model_id = out.model_id
    response.token_counts = [int(n) for n in out.token_counts]
    response.success = True
    return response


def rerank(worker: Optional[EngineWorker], request: Rerank.Request,
           response: Rerank.Response) -> Rerank.Response:
    """Fill `response` with each document's score and the order, best first."""
    out = _engine_call(worker, 'rerank', request.query, list(request.documents),
                       int(request.top_n), bool(request.truncate))
    response.scores = [float(s) for s in out.scores]
    response.order = [int(i) for i in out.order]
    response.success = True
    return response


class EmbedServices:
    """Registers ~/embed and ~/rerank on an llm_node and answers them (never raises)."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._group = ReentrantCallbackGroup()
        self.replies = VectorReplies(node.get_name())
        self._services = [
            node.create_service(Embed, '~/embed', self.on_embed, callback_group=self._group),
            node.create_service(Rerank, '~/rerank', self.on_rerank, callback_group=self._group)]

    def _answer(self, what: str, answer, response):
        try:
            return answer()
        except Exception as exc:  # noqa: B902 - answer, never crash (see refusal)
            response.success = False
            response.error_kind = type(exc).__name__ if isinstance(
                exc, (EngineError, WorkerStoppedError)) else 'InternalError'
            response.message = self._node.admission.refusal(exc, what)
            return response

    def on_embed(self, request: Embed.Request, response: Embed.Response) -> Embed.Response:
        return self._answer('~/embed', lambda: embed(self._node.worker, request, response,
                                                     self.replies), response)

    def on_rerank(self, request: Rerank.Request, response: Rerank.Response) -> Rerank.Response:
        return self._answer('~/rerank', lambda: rerank(self._node.worker, request, response),
                            response)

    def close(self) -> None:
        """Free the reply pool (on cleanup / shutdown)."""
        self.replies.close()

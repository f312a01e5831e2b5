"""llm_node's ~/embed and ~/rerank (edge_llm_msgs/srv/Embed, Rerank), for an encoder folder.

Served when the node's model folder is an embedding or rerank model (serving/embedding.py);
a chat folder answers them with WrongModelKindError's message. Each call runs on the engine
worker between jobs (EngineWorker.run_between_jobs), so inference stays on that thread. Bad
input (no texts, a text over the context without truncate, a batch over the limit,
dimensions above the model's, rerank without documents) is answered with success false, the
message saying what to change and error_kind the error's class name; the node serves on.
Vectors travel in the response as float32 (row-major [len(texts), dimensions]); the
TensorHandle path for large results is not built yet (handle.pool_id stays empty).
"""
from __future__ import annotations

from typing import Any, Optional

from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.srv import Embed, Rerank
from edge_llm_ros.errors import EngineError
from edge_llm_ros.serving.embedding import not_an_embedding_model
from edge_llm_ros.serving.worker import EngineWorker, WorkerStoppedError

CALL_WAIT_S = 60.0   # how long a call waits for a running job before it is answered


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


def embed(worker: Optional[EngineWorker], request: Embed.Request,
          response: Embed.Response) -> Embed.Response:
    """Fill `response` with the texts' vectors (see the module docstring)."""
    out = _engine_call(worker, 'embed', list(request.texts), bool(request.is_query),
                       int(request.dimensions), bool(request.truncate))
    response.dimensions = out.dimensions
    response.vectors = out.vectors.reshape(-1).tolist()
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
        return self._answer('~/embed', lambda: embed(self._node.worker, request, response),
                            response)

    def on_rerank(self, request: Rerank.Request, response: Rerank.Response) -> Rerank.Response:
        return self._answer('~/rerank', lambda: rerank(self._node.worker, request, response),
                            response)

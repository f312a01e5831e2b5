"""The bridge's /v1/embeddings (OpenAI's shape) and /v1/rerank (llama-server's / Jina's shape).

Served when the backend has `embed(texts, dimensions) -> EmbedResult` and
`rerank(query, documents, top_n) -> RerankResult` (serving/embedding.py's shapes); a backend
without them, or a request the model refuses (serving/embedding: EmbeddingInputError,
WrongModelKindError), is an OpenAI-shaped 400 naming the parameter.
- POST /v1/embeddings {"model", "input": str | [str], "encoding_format": "float" | "base64",
  "dimensions"?} -> {"object": "list", "data": [{"object": "embedding", "index",
  "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}; base64 is the
  little-endian float32 bytes, as OpenAI sends them.
- POST /v1/rerank {"model", "query", "documents": [str], "top_n"?} -> {"model", "object":
  "list", "results": [{"index", "relevance_score"}] best first, "usage"}.
"""
from __future__ import annotations

import base64
from typing import Any, Dict, List

import anyio
import numpy as np
from starlette.requests import Request

from edge_llm_ros.bridge.errors import InvalidRequestError
from edge_llm_ros.errors import InvalidRequestError as EngineRequestError

__all__ = ('embeddings_response', 'rerank_response', 'EmbeddingRoutes')


def _texts(body: Dict[str, Any]) -> List[str]:
    value = body.get('input')
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise InvalidRequestError("'input' must be a non-empty string or list of strings "
                                  '(token id arrays are not accepted)', param='input')
    return value


def _count(body: Dict[str, Any], key: str) -> int:
    value = body.get(key, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"'{key}' must be a non-negative integer", param=key)
    return value


def embeddings_response(result, model: str, encoding: str) -> Dict[str, Any]:
    """Return OpenAI's embeddings object for `result` (vectors, token_counts)."""
    data = []
    for i, row in enumerate(np.asarray(result.vectors, np.float32)):
        value: Any = (base64.b64encode(row.astype('<f4').tobytes()).decode('ascii')
                      if encoding == 'base64' else [float(v) for v in row])
        data.append({'object': 'embedding', 'index': i, 'embedding': value})
    tokens = int(sum(result.token_counts))
    return {'object': 'list', 'data': data, 'model': model,
            'usage': {'prompt_tokens': tokens, 'total_tokens': tokens}}


def rerank_response(result, model: str) -> Dict[str, Any]:
    """Return llama-server's rerank object: results best first."""
    return {'model': model, 'object': 'list',
            'results': [{'index': int(i), 'relevance_score': float(result.scores[i])}
                        for i in result.order],
            'usage': {'prompt_tokens': 0, 'total_tokens': 0}}


class EmbeddingRoutes:
    """/v1/embeddings and /v1/rerank on the bridge's handlers (auth, body, model checks)."""

    def __init__(self, handlers) -> None:
        self.handlers = handlers

    async def _body(self, request: Request) -> Dict[str, Any]:
        h = self.handlers
        h.authorize(request)
        body = await h.read_json(request)
        if not isinstance(body, dict):
            raise InvalidRequestError('the request body must be a JSON object')
        model = body.get('model')
        if not isinstance(model, str):
            raise InvalidRequestError("'model' is required (a string)", param='model')
        h.check_model(model)
        return body

    def _method(self, name: str, param: str):
        method = getattr(self.handlers.backend, name, None)
        if method is None:
            raise InvalidRequestError(f"this bridge's model does not serve {name}: start the "
                                      'node with an embedding or rerank model folder',
                                      param=param)
        return method

    async def embeddings(self, request: Request) -> Dict[str, Any]:
        body = await self._body(request)
        texts = _texts(body)
        encoding = body.get('encoding_format') or 'float'
        if encoding not in ('float', 'base64'):
            raise InvalidRequestError("'encoding_format' must be 'float' or 'base64'",
                                      param='encoding_format')
        dims = _count(body, 'dimensions')
        embed = self._method('embed', 'model')
        try:
            result = await anyio.to_thread.run_sync(lambda: embed(texts, dims))
        except EngineRequestError as exc:
            raise InvalidRequestError(str(exc), param='input') from None
        return embeddings_response(result, body['model'], encoding)

    async def rerank(self, request: Request) -> Dict[str, Any]:
        body = await self._body(request)
        query, docs = body.get('query'), body.get('documents')
        if not isinstance(query, str) or not query:
            raise InvalidRequestError("'query' must be a non-empty string", param='query')
        if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            raise InvalidRequestError("'documents' must be a list of strings",
                                      param='documents')
        top_n = _count(body, 'top_n')
        rerank = self._method('rerank', 'model')
        try:
            result = await anyio.to_thread.run_sync(lambda: rerank(query, docs, top_n))
        except EngineRequestError as exc:
            raise InvalidRequestError(str(exc), param='documents') from None
        return rerank_response(result, body['model'])

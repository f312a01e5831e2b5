"""Errors the bridge answers in OpenAI's shape, and the typed ones a backend raises.

A backend (the node's LLMClient adapter) raises InvalidRequestError, QueueFullError or
BackendUnavailableError from `generate()` or while its events are iterated; the bridge turns
them into 400, 429 (with Retry-After) and 503. Raised before the first event they are the
HTTP status; raised later in a stream they are an SSE `error` event, as OpenAI sends them.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional


class BridgeError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with `status`.

    `error_type` is the body's `type` (OpenAI's: invalid_request_error, server_error, ...).
    """

    status = 500
    error_type = 'server_error'
    code: Optional[str] = None

    def __init__(self, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> Dict[str, Any]:
        return {'error': {'message': self.message, 'type': self.error_type,
                          'param': self.param, 'code': self.code}}

    def headers(self) -> Dict[str, str]:
        return {}


class InvalidRequestError(BridgeError):
    """The request is malformed or asks for something the model cannot do (400)."""

    status = 400
    error_type = 'invalid_request_error'


class AuthenticationError(InvalidRequestError):
    """The bearer token is missing or wrong (401)."""

    status = 401
    code = 'invalid_api_key'

    def headers(self) -> Dict[str, str]:
        return {'WWW-Authenticate': 'Bearer'}


class NotFoundError(InvalidRequestError):
    """No such route or model (404)."""

    status = 404


class ModelNotFoundError(NotFoundError):
    """The request names a model the backend does not serve (404 model_not_found)."""

    code = 'model_not_found'


class MethodNotAllowedError(InvalidRequestError):
    status = 405


class BodyTooLargeError(InvalidRequestError):
    """The HTTP body is over BridgeConfig.max_body_bytes (413)."""

    status = 413
    code = 'request_too_large'


class QueueFullError(BridgeError):
    """The backend's queue is full: try again later (429 with Retry-After)."""

    status = 429
    error_type = 'rate_limit_error'
    code = 'queue_full'

    def __init__(self, message: str = 'the model queue is full: retry later',
                 *, retry_after_s: float = 1.0, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s

    def headers(self) -> Dict[str, str]:
        return {'Retry-After': str(max(1, math.ceil(self.retry_after_s)))}


class BackendUnavailableError(BridgeError):
    """The backend cannot serve now (llm_node not active, or gone): 503."""

    status = 503
    error_type = 'server_error'
    code = 'model_not_ready'

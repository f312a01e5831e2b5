"""OpenAI-compatible HTTP bridge (FastAPI on uvicorn) in front of any Backend.

    from edge_llm_ros.bridge import BridgeConfig, run_bridge
    bridge = run_bridge(backend, BridgeConfig(port=0, api_key='secret'))
    ...  # OpenAI(base_url=bridge.base_url, api_key='secret')
    bridge.stop()

The backend protocol and its event types are in bridge/backend.py, the errors a backend
raises in bridge/errors.py.
"""
from edge_llm_ros.bridge.app import create_app
from edge_llm_ros.bridge.backend import (Backend, BackendRequest, Event, Finished, Message,
                                         ReasoningDelta, TextDelta, TokenLogprob, ToolCall,
                                         ToolCallDelta, ToolChoice, ToolSpec, TopLogprob, Usage)
from edge_llm_ros.bridge.config import BridgeConfig
from edge_llm_ros.bridge.errors import (BackendUnavailableError, BridgeError, InvalidRequestError,
                                        QueueFullError)
from edge_llm_ros.bridge.server import BridgeStartError, run_bridge, RunningBridge

__all__ = [
    'Backend', 'BackendRequest', 'BackendUnavailableError', 'BridgeConfig', 'BridgeError',
    'BridgeStartError', 'create_app', 'Event', 'Finished', 'InvalidRequestError', 'Message',
    'QueueFullError', 'ReasoningDelta', 'run_bridge', 'RunningBridge', 'TextDelta',
    'TokenLogprob', 'ToolCall', 'ToolCallDelta', 'ToolChoice', 'ToolSpec', 'TopLogprob', 'Usage',
]

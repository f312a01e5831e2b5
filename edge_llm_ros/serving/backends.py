"""Which engine llm_node's worker builds: the local ONNX engine or the remote backend.

engine.backend 'local' (default) loads model.path here; 'remote' forwards every goal to the
OpenAI-compatible server at remote.url (serving/remote.py). The factory runs on the worker
thread (see serving/worker.py), so the remote engine's HTTP client lives there too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from edge_llm_ros.bringup import parameters as schema_mod
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.remote import RemoteConfig, RemoteEngine


def engine_factory(values: Mapping[str, Any], engine: EngineConfig) -> Callable[[], Any]:
    """Return what builds the engine for llm_node's validated parameter `values`."""
    if values.get('engine.backend', 'local') == 'remote':
        return functools.partial(RemoteEngine, RemoteConfig(**schema_mod.remote_kwargs(values)))
    return functools.partial(Engine, engine)

"""Which engine llm_node's worker builds: the local ONNX engine or the remote backend.

engine.backend 'local' (default) loads the EngineConfig's model here (an embedding or rerank
folder: serving/embedding.EmbeddingEngine); 'remote' forwards every
goal to the OpenAI-compatible server of a RemoteConfig (serving/remote.py). The node reads its
parameters into these typed configs once (nodes/llm_config.py); this module sees no
parameter names. The factory runs on the worker thread (see serving/worker.py), so the remote
engine's HTTP client lives there too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from edge_llm_ros.serving.embedding import EmbeddingConfig, EmbeddingEngine, is_encoder_folder
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.remote import RemoteConfig, RemoteEngine


def engine_factory(engine: EngineConfig,
                   remote: Optional[RemoteConfig] = None) -> Callable[[], Any]:
    """Return what builds the engine: remote's RemoteEngine when given, else the local one."""
    if remote is not None:
        return functools.partial(RemoteEngine, remote)
    if engine.model_dir and is_encoder_folder(engine.model_dir):
        return functools.partial(EmbeddingEngine, EmbeddingConfig(
            engine.model_dir, threads=engine.intra_op_threads))
    return functools.partial(Engine, engine)

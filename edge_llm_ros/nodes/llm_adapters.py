"""llm_node's LoRA adapter services: ~/list_adapters, ~/load_adapter, ~/unload_adapter.

They act on the loaded engine's adapters (serving/adapters.py) at once, without the queue:
loading registers the adapter's pairs on the op nodes beside running goals (the op library's
registry is locked), and an adapter that running goals use is unloaded when the last of them
ends. `engine` is None while the node is unconfigured: the answer then says so. A LoRA GGUF or
PEFT folder is converted once into the engine's numpy form (convert/lora.py ensure_converted,
cached beside the model folder) before the engine loads it.
"""
from __future__ import annotations

from typing import Any

from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.msg import AdapterInfo
from edge_llm_msgs.srv import ListAdapters, LoadAdapter, UnloadAdapter
from edge_llm_ros.errors import EngineError
from edge_llm_ros.runtime.lora_adapter import is_converted

_REMOTE = ('this node forwards goals to a remote server (engine.backend remote): adapters '
           'belong to that server')


def _adapters(engine: Any, response, unloaded: str):
    """Return the engine's Adapters, or None with `response` saying why there are none."""
    if engine is None:
        response.success, response.message = False, unloaded
        return None
    adapters = getattr(engine, 'adapters', None)
    if adapters is None:
        response.success, response.message = False, _REMOTE
    return adapters


def list_adapters(engine: Any, response: ListAdapters.Response) -> ListAdapters.Response:
    """Fill `response` with every loaded adapter (none while unconfigured or remote)."""
    adapters = getattr(engine, 'adapters', None)
    for a in adapters.loaded() if adapters is not None else ():
        response.adapters.append(AdapterInfo(
            name=a.name, path=a.path, default_scale=float(a.default_scale), rank=int(a.rank),
            alpha=float(a.alpha), bytes=int(a.nbytes), load_seconds=float(a.load_seconds),
            digest=str(a.digest), in_use=int(a.in_use), unloading=bool(a.unloading)))
    return response


def load_adapter(engine: Any, request: LoadAdapter.Request, response: LoadAdapter.Response,
                 unloaded: str) -> LoadAdapter.Response:
    """Load one adapter; a typed error becomes success false with its message."""
    adapters = _adapters(engine, response, unloaded)
    if adapters is None:
        return response
    try:
        path = request.path
        if not is_converted(path):   # a LoRA GGUF or PEFT folder: converted once, cached
            from edge_llm_ros.convert.lora import ensure_converted   # the converter, only now
            path = ensure_converted(path, engine.model_dir, name=request.name)
        a = adapters.load(request.name, path, float(request.default_scale))
    except EngineError as exc:   # AdapterFileError / AdapterMismatchError / AdapterRequestError
        response.success, response.message = False, str(exc)
        return response
    response.success = True
    response.message = (f'adapter {a.name!r} loaded from {a.path}: rank {a.rank}, '
                        f'{a.nbytes} bytes in {a.load_seconds:.2f} s')
    return response


def unload_adapter(engine: Any, request: UnloadAdapter.Request,
                   response: UnloadAdapter.Response, unloaded: str) -> UnloadAdapter.Response:
    """Unload one adapter now, or after the running goals that use it."""
    adapters = _adapters(engine, response, unloaded)
    if adapters is None:
        return response
    try:
        response.unloaded_now = adapters.unload(request.name)
    except EngineError as exc:
        response.success, response.message = False, str(exc)
        return response
    response.success = True
    response.message = (f'adapter {request.name!r} unloaded' if response.unloaded_now else
                        f'adapter {request.name!r} is unloaded when its running goals end')
    return response


class LLMAdapterServices:
    """Registers the adapter services on an llm_node and answers them."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._group = ReentrantCallbackGroup()
        self._services = [node.create_service(kind, name, callback, callback_group=self._group)
                          for kind, name, callback in (
                              (ListAdapters, '~/list_adapters', self.on_list),
                              (LoadAdapter, '~/load_adapter', self.on_load),
                              (UnloadAdapter, '~/unload_adapter', self.on_unload))]

    def _unloaded(self) -> str:
        node = self._node
        return f'{node.get_name()} is {node.lifecycle_state()}: configure it to load the model'

    def on_list(self, request: ListAdapters.Request,
                response: ListAdapters.Response) -> ListAdapters.Response:
        return list_adapters(self._node.engine, response)

    def on_load(self, request: LoadAdapter.Request,
                response: LoadAdapter.Response) -> LoadAdapter.Response:
        return load_adapter(self._node.engine, request, response, self._unloaded())

    def on_unload(self, request: UnloadAdapter.Request,
                  response: UnloadAdapter.Response) -> UnloadAdapter.Response:
        return unload_adapter(self._node.engine, request, response, self._unloaded())

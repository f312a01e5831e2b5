"""The vectors of an Embed response: inline floats, or a TensorHandle into the node's pool.

llm_node answers a large ~/embed result with a handle into its reply pool (llm_embed.py);
every caller (LLMClient, the memory node, edge-llm-memory-reembed) reads responses here, so
both forms are handled in one place. The handle is only readable on the node's host.
"""
from typing import Any, Optional

import numpy as np


class EmbedReplyError(Exception):
    """An Embed response whose vectors cannot be read; the message says what to do."""


class EmbedReplyReader:
    """Reads Embed responses; opens a TensorResolver on the first handle and keeps it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._resolver: Optional[Any] = None

    def vectors(self, response: Any, count: int) -> np.ndarray:
        """Return float32 [count, dimensions] from the response (EmbedReplyError if unreadable)."""
        dims = int(response.dimensions)
        if response.handle.pool_id:
            flat = self._read_handle(response.handle)
        else:
            flat = np.asarray(response.vectors, dtype=np.float32)
        if dims <= 0 or flat.size != dims * count:
            raise EmbedReplyError(f'the node answered {flat.size} floats for {count} texts of '
                                  f'{dims} dimensions: check that node')
        return flat.reshape(count, dims)

    def _read_handle(self, handle: Any) -> np.ndarray:
        from edge_llm_ros.ipc.errors import IpcError
        from edge_llm_ros.ipc.resolver import TensorResolver
        if self._resolver is None:
            self._resolver = TensorResolver(name=self._name)
        try:
            with self._resolver.borrow(handle) as view:
                return np.array(view, np.float32).reshape(-1)
        except (IpcError, OSError) as exc:
            raise EmbedReplyError(
                f'the vectors came back in pool {handle.pool_id!r}, which this process cannot '
                f"read ({exc}): call ~/embed from the node's host with the same "
                'EDGE_LLM_IPC_DIR, or send fewer texts per call') from None

    def close(self) -> None:
        """Disconnect from the reply pools."""
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            resolver.close()

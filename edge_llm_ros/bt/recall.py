"""Recall: a py_trees behaviour that asks the memory node's ~/recall without blocking the tree.

    memory = MemoryClient(node, '/memory')    # node spun by an executor on another thread
    recall = Recall('where is the charger', memory, keys=RecallKeys(query='/task'), k=3,
                    near_key='/robot_pose', radius_m=10.0)

- First tick (initialise): sends the request (the query from `query` or the blackboard key
  keys.query; a geometry_msgs/PoseStamped from keys.near, if set, filters by distance) and
  returns RUNNING.
- Later ticks: RUNNING until the answer comes, then SUCCESS with the hits in keys.hits (a
  list of dicts: id, text, distance, rerank_score, tags, stamp, pose or None; nearest first;
  possibly empty), or FAILURE (the node's typed error: feedback_message and keys.error say
  which and why; or no answer within timeout_s).
- Halted by the tree while waiting: the pending call is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Any, Optional, Tuple

import py_trees
from py_trees.common import Access, Status

from edge_llm_ros.memory_client import hit_dict, MemoryClient, recall_request


@dataclass(frozen=True)
class RecallKeys:
    """Where Recall reads its input and writes its output ('' = not used)."""

    query: str = ''                     # read: the query (else Recall's `query`)
    near: str = ''                      # read: a PoseStamped to filter by distance from
    hits: str = '/memory/hits'          # written on SUCCESS: the hits, nearest first
    error: str = '/memory/error'        # written on FAILURE: why

    def read(self) -> Tuple[str, ...]:
        return tuple(key for key in (self.query, self.near) if key)

    def written(self) -> Tuple[str, ...]:
        return tuple(key for key in (self.hits, self.error) if key)


class Recall(py_trees.behaviour.Behaviour):
    """One ~/recall per run of the behaviour (see the module docstring)."""

    def __init__(self, name: str, client: MemoryClient, *, query: str = '',
                 keys: RecallKeys = RecallKeys(), k: int = 5, timeout_s: float = 30.0,
                 **filters: Any) -> None:
        """Prepare the behaviour; filters are recall_request's (tags, since, until, ...)."""
        super().__init__(name)
        if not query and not keys.query:
            raise ValueError(f'{name}: give query, or keys.query')
        self.client = client
        self.query = query
        self.keys = keys
        self.k = k
        self.timeout_s = timeout_s
        self.filters = filters
        self.future: Any = None
        self._deadline = 0.0
        self.blackboard = self.attach_blackboard_client(name=name)
        for key in keys.read():
            self.blackboard.register_key(key, Access.READ)
        for key in keys.written():
            self.blackboard.register_key(key, Access.WRITE)

    def initialise(self) -> None:
        """Send the request (called on the first tick of each run)."""
        keys = self.keys
        query = self.blackboard.get(keys.query) if keys.query else self.query
        filters = dict(self.filters)
        if keys.near:
            filters['near'] = self.blackboard.get(keys.near)
        self.future = self.client.recall_async(recall_request(str(query or ''), self.k,
                                                              **filters))
        self._deadline = time.monotonic() + self.timeout_s
        self.feedback_message = f'recalling {str(query)[:40]!r}'

    def update(self) -> Status:
        future = self.future
        if future is None:
            return Status.FAILURE
        if not future.done():
            if time.monotonic() > self._deadline:
                self.client.cancel(future)
                return self._fail(f'no answer from the memory node within {self.timeout_s:g} s')
            return Status.RUNNING
        if future.exception() is not None:
            return self._fail(f'recall failed: {future.exception()}')
        response = future.result()
        if not response.success:
            return self._fail(f'{response.error_kind}: {response.message}')
        hits = [hit_dict(h) for h in response.hits]
        if self.keys.hits:
            self.blackboard.set(self.keys.hits, hits)
        self.feedback_message = f'{len(hits)} hits'
        return Status.SUCCESS

    def _fail(self, why: str) -> Status:
        self.feedback_message = why
        if self.keys.error:
            self.blackboard.set(self.keys.error, why)
        return Status.FAILURE

    def terminate(self, new_status: Status) -> None:
        """Drop the pending call when the tree halts this behaviour while it waits."""
        future: Optional[Any] = self.future
        if new_status == Status.INVALID and future is not None and not future.done():
            self.client.cancel(future)
            self.feedback_message = 'halted: recall dropped'

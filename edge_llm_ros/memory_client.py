"""A client of the memory node's ~/remember, ~/recall and ~/forget (nodes/memory.py).

    memory = MemoryClient(node, '/memory')        # node spun by an executor on another thread
    memory.remember('the charger is behind the door', pose=pose_stamped, tags=['place'])
    hits = memory.recall('where is the charger?', k=3, near=pose_stamped, radius_m=5.0)

The blocking calls raise MemoryClientError with the node's message and error_kind; the
`*_async` ones return the rclpy future (the py_trees Recall behaviour polls it).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

from builtin_interfaces.msg import Time
from geometry_msgs.msg import PoseStamped
from rclpy.node import Node

from edge_llm_msgs.srv import Forget, Recall, Remember


class MemoryClientError(RuntimeError):
    """The memory node refused a call (error_kind says which typed error) or did not answer."""

    def __init__(self, message: str, error_kind: str = '') -> None:
        super().__init__(message)
        self.error_kind = error_kind


def to_stamp(seconds: Optional[float]) -> Time:
    """Return seconds since the epoch as a builtin_interfaces/Time (None: zero, unset)."""
    if seconds is None:
        return Time()
    sec = int(seconds // 1)
    return Time(sec=sec, nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))


def hit_dict(hit: Any) -> Dict[str, Any]:
    """Return a MemoryHit as a plain dict (what Recall writes to the blackboard)."""
    pose = None
    if hit.has_pose:
        p, q = hit.pose.pose.position, hit.pose.pose.orientation
        pose = {'frame_id': hit.pose.header.frame_id, 'x': p.x, 'y': p.y, 'z': p.z,
                'qx': q.x, 'qy': q.y, 'qz': q.z, 'qw': q.w}
    return {'id': int(hit.id), 'text': hit.text, 'distance': float(hit.distance),
            'rerank_score': float(hit.rerank_score), 'tags': list(hit.tags),
            'stamp': hit.stamp.sec + hit.stamp.nanosec * 1e-9, 'pose': pose}


def recall_request(query: str, k: int = 5, tags: Sequence[str] = (),
                   since: Optional[float] = None, until: Optional[float] = None,
                   near: Optional[PoseStamped] = None, radius_m: float = 0.0,
                   rerank: bool = False) -> Recall.Request:
    """Build a Recall request (times in seconds since the epoch; None = unbounded)."""
    request = Recall.Request(query=query, k=int(k), tags=list(tags), since=to_stamp(since),
                             until=to_stamp(until), has_near=near is not None,
                             radius_m=float(radius_m), rerank=rerank)
    if near is not None:
        request.near = near
    return request


class MemoryClient:
    """Service clients of one memory node."""

    def __init__(self, node: Node, memory_node: str = '/memory', timeout_s: float = 30.0,
                 callback_group: Any = None) -> None:
        self.timeout_s = timeout_s
        base = memory_node.rstrip('/')
        self._remember = node.create_client(Remember, f'{base}/remember',
                                            callback_group=callback_group)
        self._recall = node.create_client(Recall, f'{base}/recall',
                                          callback_group=callback_group)
        self._forget = node.create_client(Forget, f'{base}/forget',
                                          callback_group=callback_group)

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until the node's three services are discovered."""
        return all(c.wait_for_service(timeout_sec=timeout)
                   for c in (self._remember, self._recall, self._forget))

    def recall_async(self, request: Recall.Request) -> Any:
        """Send a Recall request; return its future."""
        return self._recall.call_async(request)

    def cancel(self, future: Any) -> None:
        """Drop a pending call's future (its answer, if any, is ignored)."""
        self._recall.remove_pending_request(future)

    def _call(self, client: Any, request: Any) -> Any:
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        if not done.wait(self.timeout_s):
            client.remove_pending_request(future)
            raise MemoryClientError(f'{client.srv_name} did not answer within '
                                    f'{self.timeout_s:g} s: is the memory node running and '
                                    'active?')
        response = future.result()
        if not response.success:
            raise MemoryClientError(response.message, response.error_kind)
        return response

    def remember(self, text: str, pose: Optional[PoseStamped] = None, tags: Sequence[str] = (),
                 stamp: Optional[float] = None) -> int:
        """Store one memory; return its id."""
        request = Remember.Request(text=text, has_pose=pose is not None, tags=list(tags),
                                   stamp=to_stamp(stamp))
        if pose is not None:
            request.pose = pose
        return int(self._call(self._remember, request).id)

    def recall(self, query: str, k: int = 5, **filters: Any) -> List[Dict[str, Any]]:
        """Return the k nearest memories as dicts (filters: recall_request's arguments)."""
        response = self._call(self._recall, recall_request(query, k, **filters))
        return [hit_dict(h) for h in response.hits]

    def forget(self, ids: Sequence[int] = (), tags: Sequence[str] = (),
               older_than_s: float = 0.0) -> int:
        """Delete by id, tag or age; return how many were deleted."""
        request = Forget.Request(ids=[int(i) for i in ids], tags=list(tags),
                                 older_than_s=float(older_than_s))
        return int(self._call(self._forget, request).removed)

"""memory: a robot's semantic memory, a lifecycle node over edge_llm_ros.memory (issue 42).

  ~/remember  edge_llm_msgs/srv/Remember  text (+ PoseStamped, tags, time) -> id
  ~/recall    edge_llm_msgs/srv/Recall    query -> k nearest, filtered by time window, tags and
                                          distance from a pose; optionally reranked
  ~/forget    edge_llm_msgs/srv/Forget    by id, tag or age
  /diagnostics                           rows, bytes, model, last error (diagnostics.period_s)

Texts are embedded by the embedding llm_node's ~/embed (embed.service), so the memory and
the model restart independently; a recall that asks to rerank goes through rerank.service.
Configure opens the store (memory.store, SQLite WAL + sqlite-vec); a store of another model
is refused at the first embed, with the command that re-embeds it. Every bad request is an
answer with success false, a message and error_kind (the typed error's class name): the node
serves on. Services answer NotActiveError outside the active state.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any, Callable, Optional, Tuple

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from edge_llm_msgs.msg import MemoryHit
from edge_llm_msgs.srv import Embed, Forget, Recall, Remember, Rerank
from edge_llm_ros import rclpy_internals
from edge_llm_ros.bringup.parameters import schema
from edge_llm_ros.errors import EngineError
from edge_llm_ros.memory.errors import InvalidMemoryRequestError
from edge_llm_ros.memory.memory import Memory, MemoryConfig
from edge_llm_ros.memory.store import Filters, Hit, MemoryStore, Pose, StoreConfig
from edge_llm_ros.nodes.memory_calls import embed_call, rerank_call, ServiceCaller
from edge_llm_ros.nodes.node_params import ConfigError, declare, read
from edge_llm_ros.nodes.runner import run_node

NODE_NAME = 'memory'
SCHEMA = schema('memory')


class NotActiveError(EngineError):
    """The memory node is not active: activate it (lifecycle) before calling it."""


def default_store() -> str:
    """$ROS_HOME/edge_llm/memory.db (ROS_HOME defaults to ~/.ros)."""
    home = os.environ.get('ROS_HOME') or os.path.join(os.path.expanduser('~'), '.ros')
    return os.path.join(home, 'edge_llm', 'memory.db')


def seconds(stamp: Time) -> Optional[float]:
    """Return a builtin_interfaces/Time as seconds since the epoch; None for zero (unset)."""
    if stamp.sec == 0 and stamp.nanosec == 0:
        return None
    return stamp.sec + stamp.nanosec * 1e-9


def to_time(value: float) -> Time:
    sec = int(value // 1)
    return Time(sec=sec, nanosec=min(int(round((value - sec) * 1e9)), 999_999_999))


def to_pose(msg: PoseStamped) -> Pose:
    p, q = msg.pose.position, msg.pose.orientation
    return Pose(msg.header.frame_id, p.x, p.y, p.z, q.x, q.y, q.z, q.w)


def to_msg(hit: Hit, score: float = 0.0) -> MemoryHit:
    out = MemoryHit(id=hit.id, text=hit.text, distance=hit.distance, rerank_score=score,
                    has_pose=hit.pose is not None, tags=list(hit.tags), stamp=to_time(hit.stamp))
    if hit.pose is not None:
        p = hit.pose
        out.pose.header.frame_id = p.frame_id
        out.pose.header.stamp = out.stamp
        out.pose.pose.position.x, out.pose.pose.position.y, out.pose.pose.position.z = \
            p.x, p.y, p.z
        o = out.pose.pose.orientation
        o.x, o.y, o.z, o.w = p.qx, p.qy, p.qz, p.qw
    return out


class MemoryNode(LifecycleNode):
    """Lifecycle node serving ~/remember, ~/recall and ~/forget (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(NODE_NAME, **kwargs)
        declare(self, SCHEMA)
        self.memory: Optional[Memory] = None
        self.load_error = ''
        self.last_error = ''
        self.served = {'remember': 0, 'recall': 0, 'forget': 0, 'refused': 0}
        self._lock = threading.Lock()
        self._active = False
        calls = ReentrantCallbackGroup()
        self._out = ReentrantCallbackGroup()      # ~/embed and ~/rerank answers
        self.create_service(Remember, '~/remember', self._remember, callback_group=calls)
        self.create_service(Recall, '~/recall', self._recall, callback_group=calls)
        self.create_service(Forget, '~/forget', self._forget, callback_group=calls)
        self._diag = self.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._diag_timer = self.create_timer(
            self.get_parameter('diagnostics.period_s').value, self._publish_diagnostics,
            callback_group=MutuallyExclusiveCallbackGroup())
        self._embed: Optional[ServiceCaller] = None
        self._rerank: Optional[ServiceCaller] = None
        self._autostart_timer = None
        if self.get_parameter('autostart').value:
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    def _autostart(self) -> None:
        self._autostart_timer.cancel()
        self.destroy_timer(self._autostart_timer)
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    # --- lifecycle -------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            values = read(self, SCHEMA)
            timeout = values['embed.timeout_s']
            if self._embed is None:
                self._embed = ServiceCaller(self, Embed, values['embed.service'], timeout,
                                            self._out)
            if values['rerank.service'] and self._rerank is None:
                self._rerank = ServiceCaller(self, Rerank, values['rerank.service'], timeout,
                                             self._out)
            store = MemoryStore(StoreConfig(values['store'] or default_store(),
                                            values['max_rows'], values['max_bytes']))
        except (ConfigError, EngineError) as exc:
            self.load_error = str(exc)
            self.get_logger().error(f'configure failed, staying unconfigured: {exc}')
            return TransitionCallbackReturn.FAILURE
        embed = self._embed
        self.memory = Memory(store, lambda texts, q: embed_call(embed, texts, q),
                             MemoryConfig(values['max_k'], values['max_text_bytes']))
        self.load_error = ''
        self.get_logger().info(
            f'memory store {store.path}: {store.rows} memories, {store.nbytes} bytes, '
            f'{store.model_id or "no model yet"}; embedding through {embed.name}')
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = True
        self.get_logger().info('active: serving ~/remember, ~/recall and ~/forget')
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        return TransitionCallbackReturn.SUCCESS

    def release(self) -> None:
        """Close the store (every acknowledged write is already on disk)."""
        self._active = False
        with self._lock:
            memory, self.memory = self.memory, None
        if memory is not None:
            memory.store.close()

    # --- services --------------------------------------------------------------------------
    def _serve(self, kind: str, response: Any, work: Callable[[Memory], None]) -> Any:
        """Run work; any failure becomes success false with its message and class name."""
        try:
            memory = self.memory
            if not self._active or memory is None:
                raise NotActiveError(f'{self.get_name()} is '
                                     f'{rclpy_internals.lifecycle_state(self)}, not active: '
                                     'activate it (ros2 lifecycle set <node> activate)')
            work(memory)
            response.success = True
            self.served[kind] += 1
        except EngineError as exc:
            self._refuse(response, type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: B902 - the node serves on; the trace is logged
            self.get_logger().error(f'{kind} failed: {traceback.format_exc()}')
            self._refuse(response, type(exc).__name__, f'internal error: {exc!r}')
        return response

    def _refuse(self, response: Any, kind: str, message: str) -> None:
        response.success = False
        response.error_kind = kind
        response.message = message
        self.served['refused'] += 1
        self.last_error = f'{kind}: {message}'
        self.get_logger().warn(f'refused: {self.last_error}')

    def _remember(self, request: Remember.Request, response: Remember.Response) -> Any:
        def work(memory: Memory) -> None:
            pose = to_pose(request.pose) if request.has_pose else None
            response.id, response.evicted = memory.remember(
                request.text, pose, tuple(request.tags), seconds(request.stamp))
            response.model_id = memory.store.model_id
            if response.evicted:
                self.get_logger().info(
                    f'evicted the {response.evicted} oldest memories to stay within max_rows '
                    f'and max_bytes ({memory.store.rows} memories, {memory.store.nbytes} bytes)')
        return self._serve('remember', response, work)

    def _recall(self, request: Recall.Request, response: Recall.Response) -> Any:
        def work(memory: Memory) -> None:
            if request.rerank and self._rerank is None:
                raise InvalidMemoryRequestError('this recall asks to rerank but the memory node '
                                                'has no reranker: set rerank.service to a '
                                                "reranker's ~/rerank, or set rerank false")
            filters = Filters(tuple(request.tags), seconds(request.since),
                              seconds(request.until),
                              to_pose(request.near) if request.has_near else None,
                              request.radius_m)
            hits = memory.recall(request.query, int(request.k), filters)
            if request.rerank and hits:
                order, scores = rerank_call(self._rerank, request.query, [h.text for h in hits])
                response.hits = [to_msg(hits[i], scores[i]) for i in order]
            else:
                response.hits = [to_msg(h) for h in hits]
            response.model_id = memory.store.model_id
        return self._serve('recall', response, work)

    def _forget(self, request: Forget.Request, response: Forget.Response) -> Any:
        def work(memory: Memory) -> None:
            response.removed = memory.forget(tuple(request.ids), tuple(request.tags),
                                             request.older_than_s)
        return self._serve('forget', response, work)

    # --- diagnostics -----------------------------------------------------------------------
    def status(self) -> DiagnosticStatus:
        """One DiagnosticStatus: ERROR when the store failed to open, WARN when not active."""
        memory = self.memory
        store = memory.store if memory is not None else None
        if self.load_error:
            level, message = DiagnosticStatus.ERROR, 'store failed to open: ' + self.load_error
        elif not self._active or store is None:
            level, message = DiagnosticStatus.WARN, 'not serving'
        else:
            level, message = DiagnosticStatus.OK, 'ready'
        values = [('state', rclpy_internals.lifecycle_state(self)),
                  ('store', store.path if store else ''),
                  ('rows', str(store.rows if store else 0)),
                  ('bytes', str(store.nbytes if store else 0)),
                  ('model', store.model_id if store else ''),
                  ('dimensions', str(store.dimensions if store else 0)),
                  ('embed_service', self._embed.name if self._embed else ''),
                  *((k, str(v)) for k, v in self.served.items()),
                  ('load_error', self.load_error), ('last_error', self.last_error)]
        return DiagnosticStatus(level=level, name=f'{self.get_fully_qualified_name()}: memory',
                                message=message,
                                hardware_id=store.model_id if store and store.model_id else 'none',
                                values=[KeyValue(key=k, value=v) for k, v in values])

    def _publish_diagnostics(self) -> None:
        msg = DiagnosticArray(status=[self.status()])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag.publish(msg)


def main(args: Optional[Tuple[str, ...]] = None) -> int:
    """Console script `memory`: spin until Ctrl-C or SIGTERM, then close the store; exit 0."""
    return run_node(NODE_NAME, MemoryNode, (ConfigError,), args,
                    executor_factory=lambda: MultiThreadedExecutor(num_threads=4),
                    release_after_spin=MemoryNode.release)


if __name__ == '__main__':
    sys.exit(main())

"""rclpy helpers shared by record and replay: message classes, QoS matching, raw recording."""
from __future__ import annotations

import importlib
import threading
from typing import Callable, Optional

from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.subscription import Subscription
from rosbags.interfaces import (
    Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime)

from edge_llm_ros.regression.bagio import BagWriter, FEEDBACK_TYPE, goal_id_of_raw, TRANSCRIPT_TYPE

# Iron and later: how many publishers a subscription is matched with. Humble's rclpy only
# tells how many publishers the graph lists for the topic.
HAS_MATCHED_COUNT = hasattr(Subscription, 'get_publisher_count')
_ACTION_PARTS = {'Goal': 'Goal', 'Result': 'Result', 'Feedback': 'Feedback',
                 'FeedbackMessage': 'Impl.FeedbackMessage'}


def message_class(msgtype: str) -> type:
    """Return the rclpy class of 'pkg/msg/T' or of an action part 'pkg/action/A_Goal'."""
    try:
        pkg, kind, name = msgtype.split('/')
        module = importlib.import_module(f'{pkg}.{kind}')
        if kind == 'action':
            action, part = name.split('_', 1)
            obj = getattr(module, action)
            for attr in _ACTION_PARTS[part].split('.'):
                obj = getattr(obj, attr)
            return obj
        return getattr(module, name)
    except (ValueError, ImportError, AttributeError, KeyError) as exc:
        raise LookupError(
            f"no Python class for '{msgtype}' ({exc}): is its interface package built and "
            'installed in this environment?') from exc


def _to_bag_qos(profile: QoSProfile) -> Qos:
    def ns_time(duration) -> QosTime:
        total = duration.nanoseconds
        return QosTime(sec=total // 1_000_000_000, nsec=total % 1_000_000_000)

    return Qos(
        history=QosHistory.KEEP_ALL if profile.history == HistoryPolicy.KEEP_ALL
        else QosHistory.KEEP_LAST,
        depth=int(profile.depth),
        reliability=QosReliability.BEST_EFFORT
        if profile.reliability == ReliabilityPolicy.BEST_EFFORT else QosReliability.RELIABLE,
        durability=QosDurability.TRANSIENT_LOCAL
        if profile.durability == DurabilityPolicy.TRANSIENT_LOCAL else QosDurability.VOLATILE,
        deadline=ns_time(profile.deadline), lifespan=ns_time(profile.lifespan),
        liveliness=QosLiveliness.AUTOMATIC,
        liveliness_lease_duration=ns_time(profile.liveliness_lease_duration),
        avoid_ros_namespace_conventions=False)


def matching_qos(node: Node, topic: str, depth: int = 100) -> tuple:
    """Subscription QoS that matches every current publisher, plus their offered QoS.

    Same rule as `ros2 bag record`: transient-local only if every publisher offers it
    (so latched history is received), reliable unless some publisher is best effort.
    """
    infos = node.get_publishers_info_by_topic(topic)
    offered = [info.qos_profile for info in infos]
    reliable = all(p.reliability != ReliabilityPolicy.BEST_EFFORT for p in offered)
    latched = bool(offered) and all(
        p.durability == DurabilityPolicy.TRANSIENT_LOCAL for p in offered)
    qos = QoSProfile(
        depth=depth, history=HistoryPolicy.KEEP_LAST,
        reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
        durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)
    return qos, [_to_bag_qos(p) for p in offered]


class RawRecorder:
    """Raw (CDR) subscriptions of a node that append every message to a BagWriter.

    Like `ros2 bag record`, a topic is subscribed once a publisher of it is discovered,
    with a QoS matching the publishers, and their offered QoS is stored in the bag; a
    timer keeps looking for topics not seen yet. `goal_filter`, when set, keeps only
    transcripts and feedback of the goal ids it accepts (replay records just its own
    goals). `on_message(topic, msgtype, stamp, data)` sees every kept message.
    """

    def __init__(self, node: Node, writer: BagWriter, topics: dict,
                 goal_filter: Optional[Callable[[str], bool]] = None,
                 on_message: Optional[Callable] = None, poll_s: float = 0.2) -> None:
        self.node = node
        self.writer = writer
        self.goal_filter = goal_filter
        self.on_message = on_message
        self.pending = dict(topics)
        self.subscriptions = {}
        self.warnings: list = []
        self._lock = threading.Lock()
        self.poll()
        self._timer = node.create_timer(poll_s, self.poll)

    def poll(self) -> None:
        """Subscribe to every pending topic that has publishers now."""
        for topic, msgtype in list(self.pending.items()):
            infos = self.node.get_publishers_info_by_topic(topic)
            if not infos:
                continue
            offered_type = infos[0].topic_type
            if offered_type != msgtype:
                if topic not in self.warnings:
                    self.warnings.append(topic)
                    self.node.get_logger().error(
                        f"{topic} carries '{offered_type}', not '{msgtype}': not recorded")
                continue
            del self.pending[topic]
            self._subscribe(topic, msgtype)

    def _subscribe(self, topic: str, msgtype: str) -> None:
        qos, offered = matching_qos(self.node, topic)
        self.writer.add_topic(topic, msgtype, offered)

        def callback(data: bytes, topic=topic, msgtype=msgtype) -> None:
            self._received(topic, msgtype, data)

        self.subscriptions[topic] = self.node.create_subscription(
            message_class(msgtype), topic, callback, qos, raw=True)

    def _received(self, topic: str, msgtype: str, data: bytes) -> None:
        if self.goal_filter is not None and msgtype in (TRANSCRIPT_TYPE, FEEDBACK_TYPE) and \
                not self.goal_filter(goal_id_of_raw(data)):
            return
        stamp = self.node.get_clock().now().nanoseconds
        with self._lock:
            self.writer.write(topic, stamp, data)
        if self.on_message is not None:
            self.on_message(topic, msgtype, stamp, data)

    def publisher_count(self, topic: str, matched: bool = HAS_MATCHED_COUNT) -> int:
        """Count publishers matched by the subscription of `topic` (0 if none yet).

        Without `matched` (Humble), the graph's publishers of the topic: the subscription
        was made with a QoS that matches every one of them.
        """
        sub: Optional[Subscription] = self.subscriptions.get(topic)
        if sub is None:
            return 0
        if matched:
            return sub.get_publisher_count()
        return self.node.count_publishers(topic)

    def close(self) -> None:
        self.node.destroy_timer(self._timer)
        for sub in self.subscriptions.values():
            self.node.destroy_subscription(sub)
        self.subscriptions.clear()

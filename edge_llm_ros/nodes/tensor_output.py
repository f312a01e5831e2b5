"""Producer side of a tensor topic: handles for local consumers, copies for remote ones.

``<topic>`` carries ``edge_llm_msgs/TensorHandle`` messages naming buffers of the
producer's pool. A consumer on another host (or without access to the socket directory)
cannot map them; for it the producer also publishes the bytes on ``<topic>_copy``
(``sensor_msgs/Image`` for frames, ``std_msgs/UInt8MultiArray`` for other tensors):
always, never, or automatically while that topic has a subscriber (TensorInput only
subscribes to it when it cannot reach the pool).
"""
import dataclasses
import enum
from typing import Optional

import numpy as np
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header, UInt8MultiArray

from edge_llm_msgs.msg import TensorHandle
from edge_llm_ros.ipc.descriptor import TensorDescriptor
from edge_llm_ros.nodes import copy_codec
from edge_llm_ros.nodes.handles import to_handle

COPY_SUFFIX = '_copy'
COPY_MODES = ('auto', 'always', 'never')
# Sensor streams: the latest sample matters, a lost one is replaced by the next.
SENSOR_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=2,
                        reliability=ReliabilityPolicy.BEST_EFFORT)
# Copies are offered reliably: a reliable writer also serves best-effort readers, so remote
# tools with default (reliable) subscriptions match too; keep-last 2 never blocks on them.
COPY_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=2,
                      reliability=ReliabilityPolicy.RELIABLE)


class CopyKind(enum.Enum):
    """Message type of the copy topic."""

    IMAGE = 'image'      # sensor_msgs/Image rgb8 (uint8 [h, w, 3] frames)
    TENSOR = 'tensor'    # std_msgs/UInt8MultiArray with a dtype-naming layout


def copy_topic(topic: str) -> str:
    """Name of the copy topic that goes with a handle topic."""
    return topic + COPY_SUFFIX


@dataclasses.dataclass
class OutputStats:
    """Counters of a TensorOutput."""

    handles: int = 0
    copies: int = 0


class TensorOutput:
    """Publishes a pool's tensors as handles, and as copies when someone needs them."""

    def __init__(self, node: Node, topic: str, kind: CopyKind, copy_fallback: str = 'auto',
                 qos: QoSProfile = SENSOR_QOS, copy_qos: QoSProfile = COPY_QOS) -> None:
        if copy_fallback not in COPY_MODES:
            raise ValueError(f'copy_fallback {copy_fallback!r} is not one of '
                             f'{", ".join(COPY_MODES)}')
        self.kind = kind
        self.copy_fallback = copy_fallback
        self.stats = OutputStats()
        self._node = node
        self._handles = node.create_publisher(TensorHandle, topic, qos)
        self._copies = None
        if copy_fallback != 'never':
            msg_type = Image if kind is CopyKind.IMAGE else UInt8MultiArray
            self._copies = node.create_publisher(msg_type, copy_topic(topic), copy_qos)

    @property
    def topic(self) -> str:
        """Fully resolved handle topic."""
        return self._handles.topic_name

    def copy_wanted(self) -> bool:
        """Whether the next publish() also sends a copy."""
        if self._copies is None:
            return False
        return self.copy_fallback == 'always' or self._copies.get_subscription_count() > 0

    def publish(self, desc: TensorDescriptor, array: np.ndarray,
                header: Optional[Header] = None) -> bool:
        """Publish desc's handle and, when wanted, a copy of array; True if copied.

        array is the producer's view of the just-published buffer (still intact: the
        producer only rewrites a slot after loaning it again).
        """
        copied = False
        if self.copy_wanted():
            if self.kind is CopyKind.IMAGE:
                msg = copy_codec.frame_to_image(array, header)
            else:
                msg = copy_codec.tensor_to_multiarray(array)
            self._copies.publish(msg)
            self.stats.copies += 1
            copied = True
        self._handles.publish(to_handle(desc, header))
        self.stats.handles += 1
        return copied

    def destroy(self) -> None:
        """Remove the publishers."""
        self._node.destroy_publisher(self._handles)
        if self._copies is not None:
            self._node.destroy_publisher(self._copies)

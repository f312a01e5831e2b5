"""TensorDescriptor <-> edge_llm_msgs/msg/TensorHandle: the one module that knows both.

edge_llm_ros.ipc never imports ROS messages (its descriptor converts by attribute name);
the nodes build and read handle messages through these functions.
"""
from typing import Any, Optional

from std_msgs.msg import Header

from edge_llm_msgs.msg import TensorHandle
from edge_llm_ros.ipc.allocators import BufferKind
from edge_llm_ros.ipc.descriptor import TensorDescriptor

# The message's KIND_* constants per BufferKind (the tests check both agree).
KIND_CONSTANTS = {
    BufferKind.MEMFD: TensorHandle.KIND_MEMFD,
    BufferKind.DMA_HEAP: TensorHandle.KIND_DMA_HEAP,
    BufferKind.UDMABUF: TensorHandle.KIND_UDMABUF,
    BufferKind.NVBUF: TensorHandle.KIND_NVBUF,
}


def to_handle(desc: TensorDescriptor, header: Optional[Header] = None) -> TensorHandle:
    """Build a TensorHandle message describing desc (header copied when given)."""
    msg = TensorHandle()
    desc.to_msg(msg)
    if header is not None:
        msg.header = header
    return msg


def from_handle(msg: Any) -> TensorDescriptor:
    """Validate a TensorHandle message into a descriptor (DescriptorError when malformed)."""
    return TensorDescriptor.from_msg(msg)


def make_header(node: Any, frame_id: str = '') -> Header:
    """Return a header stamped with the node's clock now."""
    return Header(stamp=node.get_clock().now().to_msg(), frame_id=frame_id)

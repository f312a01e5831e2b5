"""TensorDescriptor <-> edge_llm_msgs/msg/TensorHandle: the one module that knows both.

edge_llm_ros.ipc never imports ROS messages (its descriptor converts by attribute name);
the nodes build and read handle messages through these functions.
"""
import contextlib
import dataclasses
from typing import Any, Iterator, List, Optional, Sequence

import numpy as np
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


# Byte alignment of each image inside a shared slot.
_ALIGN = 64


@contextlib.contextmanager
def image_pool(images: Sequence[np.ndarray], pool_id: str,
               socket_dir: Optional[str] = None) -> Iterator[List[TensorHandle]]:
    """Copy RGB images into one published slot of a new pool; yield a handle per image.

    For clients that hold pixels, not a camera pool (edge-llm ask --image, the OpenAI
    bridge): the images of one goal are packed into one slot, so llm_node holds one frame of
    the pool for all of them. The pool (memfd or DMA-BUF, its unix socket in socket_dir,
    default EDGE_LLM_IPC_DIR) lives for the with-block: send the goal and wait for its result
    inside it. IpcError when the pool cannot be opened (e.g. pool_id already served).
    """
    if not images:
        yield []
        return
    from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
    from edge_llm_ros.nodes.embeddings import MAX_INFLIGHT
    offsets, end = [], 0
    for image in images:
        offsets.append(end)
        end += -(-image.nbytes // _ALIGN) * _ALIGN
    # One slot for the producer's loan, the rest for llm_node's holds (its max_inflight).
    config = PoolConfig(pool_id=pool_id, slot_nbytes=end, slots=1 + MAX_INFLIGHT,
                        socket_dir=socket_dir)
    with TensorPool(config) as pool:
        loan = pool.loan()
        try:
            for image, offset in zip(images, offsets):
                loan.ndarray('uint8', image.shape, byte_offset=offset)[...] = image
            whole = loan.publish('uint8', (end,))
        except BaseException:
            loan.discard()
            raise
        # Each image is a handle into the one published slot (one frame for the node to hold).
        yield [to_handle(dataclasses.replace(whole, shape=image.shape, byte_offset=offset,
                                             nbytes=-1))
               for image, offset in zip(images, offsets)]

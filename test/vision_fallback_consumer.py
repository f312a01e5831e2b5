"""A frames consumer that drops to another user before it resolves any handle.

    python vision_fallback_consumer.py TOPIC SOCKET_DIR SECONDS USER

It joins ROS as the starting user (the interpreter lives in a folder only root can read,
and Fast DDS's shared-memory discovery with a root peer needs the participant created
first), waits until the producer is discovered, then switches the whole process to USER
with setgid/setuid. From then on the producer's 0700 socket directory is closed to it, so
TensorInput must fall back to the copy topic. Prints one JSON line, then leaves with
os._exit: Fast DDS cannot tear down the shared-memory files it made as root once the
process runs as USER (it aborts), so the caller removes what USER left in /dev/shm.
"""
import json
import os
import pwd
import sys
import threading
import time

import rclpy
from rclpy.executors import SingleThreadedExecutor
from sensor_msgs.msg import Image

from edge_llm_ros.nodes.tensor_input import TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind
from edge_llm_ros.vision import synthetic
from edge_llm_ros.vision.errors import TornFrameError


def main() -> int:
    topic, socket_dir, seconds, user = sys.argv[1:5]
    rclpy.init()
    node = rclpy.create_node(f'fallback_consumer_{os.getpid()}')
    frames = TensorInput(node, topic, CopyKind.IMAGE, socket_dir=socket_dir)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    deadline = time.monotonic() + 30
    while node.count_publishers(topic) == 0 or frames.stats.handles == 0:
        if time.monotonic() > deadline:
            print(json.dumps({'error': f'no handles on {topic}'}), flush=True)
            return 1
        time.sleep(0.05)
    # The copy topic's type support libraries live in that root-only folder: load them now,
    # as the starting user (the fallback subscribes to it after the switch).
    node.destroy_subscription(node.create_subscription(Image, '~/preload', lambda _: None, 1))
    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    result = {'uid': os.getuid(), 'access': os.access(socket_dir, os.X_OK), 'frames': 0,
              'zero_copy': 0, 'torn': 0, 'counters': []}
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        sample = frames.take(0.2)
        if sample is None:
            continue
        with sample:
            result['frames'] += 1
            result['zero_copy'] += int(sample.zero_copy)
            try:
                result['counters'].append(synthetic.check_frame(sample.array))
            except TornFrameError:
                result['torn'] += 1
    result['mode'] = frames.mode
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == '__main__':
    sys.exit(main())

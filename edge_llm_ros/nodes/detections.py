"""Grounded answers as ROS detections: vision_msgs where it is installed, else our own.

`vision_msgs/Detection2DArray` is what perception stacks consume; it has no PyPI wheel, so on a
machine without ROS installed (the PyPI path) the node publishes `edge_llm_msgs/Detection2DArray`,
which has the same fields, except that a hypothesis carries no pose. The choice is made once,
when the publisher is created (`detection_messages`), and logged.
"""
from __future__ import annotations

from dataclasses import dataclass
import importlib
from typing import Any, Optional, Sequence

from edge_llm_ros.vision.grounding import Detection


@dataclass(frozen=True)
class DetectionMessages:
    """The message classes one mapping uses, and whose they are."""

    package: str               # 'vision_msgs' or 'edge_llm_msgs'
    array: Any                 # Detection2DArray
    detection: Any             # Detection2D
    hypothesis: Any            # ObjectHypothesis
    with_pose: Optional[Any]   # vision_msgs' ObjectHypothesisWithPose; None for ours


def detection_messages(package: Optional[str] = None) -> DetectionMessages:
    """Return vision_msgs' classes when importable, else edge_llm_msgs' (or the one named)."""
    if package in (None, 'vision_msgs'):
        try:
            msg = importlib.import_module('vision_msgs.msg')
        except ImportError:
            if package == 'vision_msgs':
                raise
        else:
            return DetectionMessages('vision_msgs', msg.Detection2DArray, msg.Detection2D,
                                     msg.ObjectHypothesis, msg.ObjectHypothesisWithPose)
    msg = importlib.import_module('edge_llm_msgs.msg')
    return DetectionMessages('edge_llm_msgs', msg.Detection2DArray, msg.Detection2D,
                             msg.ObjectHypothesis, None)


def detection_array(types: DetectionMessages, detections: Sequence[Detection], header,
                    goal_id: str):
    """Build one Detection2DArray (of `types`) stamped with the frame's header."""
    out = types.array()
    out.header = header
    for index, det in enumerate(detections):
        item = types.detection()
        item.header = header
        item.id = f'{goal_id}/{index}'
        item.bbox.center.position.x = float(det.center_x)
        item.bbox.center.position.y = float(det.center_y)
        item.bbox.center.theta = 0.0
        item.bbox.size_x = float(det.size_x)
        item.bbox.size_y = float(det.size_y)
        hypothesis = types.hypothesis(class_id=det.label, score=float(det.score))
        if types.with_pose is not None:
            hypothesis = types.with_pose(hypothesis=hypothesis)
        item.results.append(hypothesis)
        out.detections.append(item)
    return out

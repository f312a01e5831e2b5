"""llm_node's grounded answers: a result's boxes and points as detections, on ~/detections.

A grounding family (config/models `grounding`, e.g. Qwen2.5-VL's `absolute`) answers "where is
the red cup?" with boxes or points. When a goal with one image ends with such an answer, its
Result carries them as edge_llm_msgs/Detection2D in that frame's pixels (the engine's
PreparedRequest.image_sizes: the frame's size and the size the model saw it at), stamped with
the image handle's header, and the node publishes them on ~/detections as one
Detection2DArray (vision_msgs where installed, else edge_llm_msgs: nodes/detections.py).

`detections.publish`: 'auto' publishes when the model grounds and takes images; 'on' requires
that (configure fails with DetectionsConfigError otherwise); 'off' never publishes (results
still carry their detections). A text-only answer, an answer without boxes, or a goal with
several images (the answer does not say which image a box is in) gives none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from edge_llm_ros.nodes.detections import (detection_array, detection_messages,
                                           DetectionMessages)
from edge_llm_ros.nodes.node_params import ConfigError
from edge_llm_ros.qos import DETECTIONS_QOS
from edge_llm_ros.vision.grounding import ground, GroundingResult

TOPIC = '~/detections'


class DetectionsConfigError(ConfigError):
    """detections.publish asks for a topic the model cannot fill (it does not ground)."""


def grounding_frame(engine: Any) -> str:
    """Return the coordinate frame of the engine's grounded answers, '' when it does not ground.

    Only a local engine with a vision encoder whose family sets `grounding` grounds.
    """
    family = getattr(engine, 'family', None)
    frame = getattr(family, 'grounding', '') if family is not None else ''
    return frame if frame and getattr(engine, 'vision', None) is not None else ''


@dataclass(frozen=True)
class Grounded:
    """One goal's detections: its image handle's header and the mapped result."""

    header: Any
    result: GroundingResult


class DetectionPublisher:
    """Maps finished goals' answers to detections and publishes them (one per node config)."""

    def __init__(self, node: Any, mode: str, engine: Any) -> None:
        """Decide from `mode` (detections.publish) and the loaded engine; create the topic.

        Raises DetectionsConfigError for 'on' with a model that does not ground.
        """
        self._node = node
        self.frame = grounding_frame(engine)
        name = getattr(engine, 'model_name', 'the model')
        if mode == 'on' and not self.frame:
            family = getattr(getattr(engine, 'family', None), 'family', '?')
            raise DetectionsConfigError(
                f'detections.publish is on but {name} (family {family}) does not ground: '
                'serve a grounding VLM converted with its mmproj (Qwen2.5-VL: config/models '
                "`grounding`), or set detections.publish to 'auto' or 'off'")
        self.types: Optional[DetectionMessages] = None
        self._result_types = detection_messages('edge_llm_msgs')
        self._publisher = None
        if self.frame and mode != 'off':
            self.types = detection_messages()
            self._publisher = node.create_publisher(self.types.array, TOPIC, DETECTIONS_QOS)
            node.get_logger().info(f'grounded answers on ~/detections as '
                                   f'{self.types.package}/Detection2DArray')

    @property
    def publishing(self) -> bool:
        """Tell whether answers go out on ~/detections."""
        return self._publisher is not None

    def ground(self, text: str, image_sizes: Sequence, handles: Sequence) -> Optional[Grounded]:
        """Map an answer onto its one image; None when there is nothing to map.

        image_sizes: PreparedRequest.image_sizes; handles: the goal's image TensorHandles.
        """
        if not self.frame or not text or len(image_sizes) != 1 or len(handles) != 1:
            if self.frame and text and len(image_sizes) > 1:
                self._node.get_logger().info(
                    'answer not grounded: the goal had several images and the answer does '
                    'not say which one a box is in', throttle_duration_sec=30.0)
            return None
        original, model_input = image_sizes[0]
        if min(*original, *model_input) <= 0:
            return None
        found = ground(text, self.frame, tuple(original), tuple(model_input))
        if found.dropped:
            self._node.get_logger().warn(f'{found.dropped} malformed box(es) in the answer '
                                         'left out of its detections')
        if not found.detections:
            return None
        return Grounded(handles[0].header, found)

    def result_detections(self, grounded: Optional[Grounded], goal_id: str) -> List[Any]:
        """Return the Result's edge_llm_msgs/Detection2D list (empty for None)."""
        if grounded is None:
            return []
        return list(detection_array(self._result_types, grounded.result.detections,
                                    grounded.header, goal_id).detections)

    def publish(self, grounded: Optional[Grounded], goal_id: str) -> None:
        """Publish one Detection2DArray of a grounded answer (nothing for None or 'off')."""
        if grounded is None or self._publisher is None:
            return
        self._publisher.publish(detection_array(self.types, grounded.result.detections,
                                                grounded.header, goal_id))

    def destroy(self) -> None:
        """Remove ~/detections (cleanup)."""
        if self._publisher is not None:
            self._node.destroy_publisher(self._publisher)
            self._publisher = None

"""llm_node's grounded answers: a result's boxes and points as detections, on ~/detections.

A grounding family (config/models `grounding`, e.g. Qwen2.5-VL's `absolute`) answers "where is
the red cup?" with boxes or points. When a goal with images ends with such an answer, its
Result carries them as edge_llm_msgs/Detection2D, each in the pixels of the image it was found
in (the engine's PreparedRequest.image_sizes: each frame's size and the size the model saw it
at) and stamped with that image handle's header, and the node publishes one Detection2DArray
per image that has any on ~/detections (vision_msgs where installed, else edge_llm_msgs:
nodes/detections.py). With several images, each box goes to the image the answer names
before it ("Picture 2: ...", or a JSON entry's "image": 2): vision/grounding.py's rule; a box
the answer gives no image is left out (and logged), never guessed.

`detections.publish`: 'auto' publishes when the model grounds and takes images; 'on' requires
that (configure fails with DetectionsConfigError otherwise); 'off' never publishes (results
still carry their detections). A text-only answer or an answer without boxes gives none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from edge_llm_ros.nodes.detections import (detection_array, detection_messages,
                                           DetectionMessages)
from edge_llm_ros.nodes.node_params import ConfigError
from edge_llm_ros.qos import DETECTIONS_QOS
from edge_llm_ros.vision.grounding import ground_images, GroundingResult

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
    """One image's detections: its handle's header, the mapped result, its id's suffix."""

    header: Any
    result: GroundingResult
    image: str = ''   # '' for a goal's only image, else '/image<n>' (1-based, prompt order)


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

    def ground(self, text: str, image_sizes: Sequence, handles: Sequence) -> List[Grounded]:
        """Map an answer onto the goal's images: one Grounded per image with detections.

        image_sizes: PreparedRequest.image_sizes; handles: the goal's image TensorHandles, in
        the same order. Empty when there is nothing to map.
        """
        if not self.frame or not text or not image_sizes or len(image_sizes) != len(handles):
            return []
        sizes = [(tuple(original), tuple(model_input)) for original, model_input in image_sizes]
        if any(min(*original, *model_input) <= 0 for original, model_input in sizes):
            return []
        found = ground_images(text, self.frame, sizes)
        if found[0].dropped:
            self._node.get_logger().warn(
                f'{found[0].dropped} box(es) left out of the detections: malformed, or (with '
                'several images) the answer does not say which image they are in (docs/vision.md'
                ', "Grounded answers")')
        several = len(found) > 1
        return [Grounded(handle.header, result, f'/image{n}' if several else '')
                for n, (handle, result) in enumerate(zip(handles, found), 1)
                if result.detections]

    def result_detections(self, grounded: Sequence[Grounded], goal_id: str) -> List[Any]:
        """Return the Result's edge_llm_msgs/Detection2D list, images in order."""
        out: List[Any] = []
        for image in grounded:
            out.extend(detection_array(self._result_types, image.result.detections,
                                       image.header, goal_id + image.image).detections)
        return out

    def publish(self, grounded: Sequence[Grounded], goal_id: str) -> None:
        """Publish one Detection2DArray per grounded image, with its header (none when 'off')."""
        if self._publisher is None:
            return
        for image in grounded:
            self._publisher.publish(detection_array(self.types, image.result.detections,
                                                    image.header, goal_id + image.image))

    def destroy(self) -> None:
        """Remove ~/detections (cleanup)."""
        if self._publisher is not None:
            self._node.destroy_publisher(self._publisher)
            self._publisher = None

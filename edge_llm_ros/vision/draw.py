"""Draw a grounded answer's detections on its image (`edge-llm ask --image ... --draw out.png`).

Boxes are outlined with their label above; a point (a box of size 0) is a ring with its label
beside it. Coordinates are the frame's pixels, as the detections carry them.
"""
from __future__ import annotations

from dataclasses import dataclass
import pathlib
from typing import Sequence

import numpy as np

COLORS = ((255, 64, 64), (64, 200, 64), (64, 128, 255), (255, 200, 0), (200, 64, 255))
POINT_RADIUS = 5


@dataclass(frozen=True)
class Box:
    """One detection to draw: center and size in pixels, and its label."""

    center_x: float
    center_y: float
    size_x: float
    size_y: float
    label: str = ''


def draw_boxes(pixels: np.ndarray, boxes: Sequence[Box]):
    """Return a PIL image of RGB `pixels` [H, W, 3] uint8 with `boxes` drawn on it."""
    from PIL import Image, ImageDraw
    image = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), 'RGB')
    pen = ImageDraw.Draw(image)
    width = max(1, round(min(image.size) / 200))
    for i, box in enumerate(boxes):
        color = COLORS[i % len(COLORS)]
        x0, y0 = box.center_x - box.size_x / 2, box.center_y - box.size_y / 2
        x1, y1 = box.center_x + box.size_x / 2, box.center_y + box.size_y / 2
        if box.size_x == 0 and box.size_y == 0:
            r = POINT_RADIUS
            pen.ellipse((x0 - r, y0 - r, x0 + r, y0 + r), outline=color, width=width)
            at = (x0 + r + 2, y0 - r)
        else:
            pen.rectangle((x0, y0, x1, y1), outline=color, width=width)
            at = (x0 + 2, max(y0 - 12, 0))
        if box.label:
            pen.text(at, box.label, fill=color)
    return image


def save_drawing(pixels: np.ndarray, boxes: Sequence[Box], path: str) -> pathlib.Path:
    """Draw `boxes` on `pixels` and write the picture to `path` (format from its suffix)."""
    out = pathlib.Path(path)
    draw_boxes(pixels, boxes).save(out)
    return out

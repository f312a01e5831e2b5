"""Grounded answers: the boxes and points a Qwen-VL answer names, in the original image's pixels.

Qwen-VL models answer "where is the red cup?" with coordinates in one of two forms:

* JSON, as their cookbooks prompt for it (often inside a ```json fence)::

      [{"bbox_2d": [135, 114, 410, 372], "label": "red cup"},
       {"point_2d": [220, 240], "label": "handle"}]

* Qwen2-VL's tagged form, always on a 0..1000 grid::

      <|object_ref_start|>red cup<|object_ref_end|><|box_start|>(135,114),(410,372)<|box_end|>

The JSON numbers depend on the model (its family's ``grounding`` in config/models/):

* ``absolute``: pixels of the image *as the model saw it*, after its smart resize (Qwen2.5-VL);
* ``normalized_1000``: a 0..1000 grid over the image (Qwen3-VL).

`parse_grounding` reads both forms from the answer text; `to_image_pixels` maps them onto the
original frame (the one whose header stamps the detections): corners sorted, clamped to the
frame. A box the answer gives with a non-finite or missing coordinate is not a detection; it is
dropped and counted in `GroundingResult.dropped`, so a caller can say so.

A generated answer has no confidence: every detection's score is 1.0.

Several images (`ground_images`): Qwen-VL numbers a goal's images in prompt order (its chat
template's vision ids read "Picture 1:", "Picture 2:", ...), and its answers name them the same
way. Each box or point goes to one image, by this rule, first match wins:

1. the goal has one image: that image;
2. a JSON entry with an integer ``"image": n`` key (1-based, as a prompt may ask): image n;
3. the last "Picture n", "Image n" or "Frame n" (any case, 1-based) the answer writes before the
   box: image n;
4. otherwise the box is not attributed: it is dropped and counted in `dropped`, never guessed.

A reference to an image the goal does not have (n = 0 or n > the image count) drops the box too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import math
import re
from typing import Iterator, List, Optional, Sequence, Tuple

from edge_llm_ros.runtime.choices import GROUNDING_FRAMES
from edge_llm_ros.vision.errors import VisionError

_GRID = 1000.0
_TAGGED = re.compile(
    r'(?:<\|object_ref_start\|>(?P<label>.*?)<\|object_ref_end\|>\s*)?'
    r'<\|box_start\|>\s*(?P<body>.*?)\s*<\|box_end\|>', re.S)
_NUMBER = r'\s*(-?\d+(?:\.\d*)?)\s*'
_PAIR = rf'\({_NUMBER},{_NUMBER}\)'
# A tagged body is one pair (a point) or two (a box's corners), nothing else.
_BODY = re.compile(rf'{_PAIR}(?:\s*,\s*{_PAIR})?')
# How an answer names the n-th image of a goal (1-based): Qwen's "Picture n", or Image/Frame n.
_IMAGE_REF = re.compile(r'\b(?:picture|image|frame)\s*#?\s*(\d+)\b', re.I)


class GroundingError(VisionError, ValueError):
    """Grounding cannot be done as asked (an unknown coordinate frame, an empty image size)."""


@dataclass(frozen=True)
class GroundedItem:
    """One box or point as the answer wrote it (its own coordinates, not yet mapped).

    `box` is (x1, y1, x2, y2); a point is a box with x1 == x2 and y1 == y2 (`is_point`).
    `frame`: 'absolute' or 'normalized_1000' (the tagged form is always the latter).
    """

    label: str
    box: Tuple[float, float, float, float]
    is_point: bool
    frame: str
    offset: int = 0                # where the item starts in the answer text
    image: Optional[int] = None    # a JSON entry's own "image": n (1-based), else None


@dataclass(frozen=True)
class Detection:
    """A grounded item in the original image's pixels: the box's center and size."""

    label: str
    center_x: float
    center_y: float
    size_x: float
    size_y: float
    is_point: bool
    score: float = 1.0


@dataclass
class GroundingResult:
    """What `ground` found: the detections, and how many malformed items were dropped."""

    detections: List[Detection] = field(default_factory=list)
    dropped: int = 0


def parse_grounding(text: str, json_frame: str) -> Tuple[List[GroundedItem], int]:
    """Read every box and point of `text`: (items in order of appearance, malformed count).

    json_frame: the coordinate frame of the JSON form for this model (GROUNDING_FRAMES).
    """
    if json_frame not in GROUNDING_FRAMES:
        raise GroundingError(f'grounding frame {json_frame!r} is not one of '
                             f'{", ".join(GROUNDING_FRAMES)}: fix `grounding` in the family file '
                             'in config/models/')
    items: List[Tuple[int, GroundedItem]] = []
    dropped = 0
    for start, obj in _json_values(text):
        for entry in _entries(obj):
            item = _json_item(entry, json_frame, start)
            if item is None:
                dropped += 1
            else:
                items.append((start, item))
    for match in _TAGGED.finditer(text):
        body = _BODY.fullmatch(match.group('body'))
        if body is None:
            dropped += 1
            continue
        coords = [float(v) for v in body.groups() if v is not None]
        is_point = len(coords) == 2
        label = (match.group('label') or '').strip()
        items.append((match.start(), GroundedItem(
            label, tuple(coords * 2 if is_point else coords), is_point, 'normalized_1000',
            match.start())))
    items.sort(key=lambda pair: pair[0])
    return [item for _, item in items], dropped


def to_image_pixels(item: GroundedItem, original: Tuple[int, int],
                    model_input: Tuple[int, int]) -> Detection:
    """Map one item onto the original image (width, height), given the model's input size.

    model_input: (width, height) of the image as the model saw it (used by 'absolute').
    """
    _check_sizes(original, model_input)
    width, height = original
    in_width, in_height = model_input
    if item.frame == 'absolute':
        sx, sy = width / in_width, height / in_height
    else:
        sx, sy = width / _GRID, height / _GRID
    x1, y1, x2, y2 = item.box
    xs = sorted((_clamp(x1 * sx, width), _clamp(x2 * sx, width)))
    ys = sorted((_clamp(y1 * sy, height), _clamp(y2 * sy, height)))
    return Detection(item.label, (xs[0] + xs[1]) / 2, (ys[0] + ys[1]) / 2,
                     xs[1] - xs[0], ys[1] - ys[0], item.is_point)


def ground(text: str, json_frame: str, original: Tuple[int, int],
           model_input: Tuple[int, int]) -> GroundingResult:
    """Parse `text` and map every item onto the original image (see the module docstring)."""
    _check_sizes(original, model_input)
    items, dropped = parse_grounding(text, json_frame)
    return GroundingResult([to_image_pixels(i, original, model_input) for i in items], dropped)


def ground_images(text: str, json_frame: str,
                  sizes: Sequence[Tuple[Tuple[int, int], Tuple[int, int]]]
                  ) -> List[GroundingResult]:
    """Parse `text` and map each item onto the image it belongs to (the module docstring's rule).

    sizes: per image of the goal, in prompt order, (original, model_input) as (width, height).
    Returns one GroundingResult per image; the items no image can be given are counted in the
    first result's `dropped` (with the malformed ones).
    """
    if not sizes:
        raise GroundingError('ground_images needs the size of at least one image')
    for original, model_input in sizes:
        _check_sizes(original, model_input)
    items, dropped = parse_grounding(text, json_frame)
    results = [GroundingResult() for _ in sizes]
    refs = [(m.start(), int(m.group(1))) for m in _IMAGE_REF.finditer(text)]
    for item in items:
        index = _image_of(item, refs, len(sizes))
        if index is None:
            dropped += 1
            continue
        results[index].detections.append(to_image_pixels(item, *sizes[index]))
    results[0].dropped = dropped
    return results


def _image_of(item: GroundedItem, refs: Sequence[Tuple[int, int]], count: int
              ) -> Optional[int]:
    """Return the 0-based image an item belongs to, None when the answer does not say."""
    if count == 1:
        return 0
    number = item.image
    if number is None:
        before = [n for offset, n in refs if offset < item.offset]
        number = before[-1] if before else None
    return number - 1 if number is not None and 1 <= number <= count else None


def _check_sizes(original: Tuple[int, int], model_input: Tuple[int, int]) -> None:
    if min(*original, *model_input) <= 0:
        raise GroundingError(f'image sizes {original} / {model_input} must be positive: '
                             'give the width and height of the frame and of the model input')


def _clamp(value: float, limit: int) -> float:
    return min(max(value, 0.0), float(limit))


def _json_values(text: str) -> Iterator[Tuple[int, object]]:
    """Yield (offset, value) of each outermost JSON array or object in free text."""
    decoder = json.JSONDecoder()
    i = 0
    while True:
        starts = [p for p in (text.find('[', i), text.find('{', i)) if p >= 0]
        if not starts:
            return
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        yield start, value
        i = end


def _entries(obj: object) -> Iterator[dict]:
    """Yield the dicts holding bbox_2d / point_2d, at any depth of lists."""
    if isinstance(obj, dict):
        if 'bbox_2d' in obj or 'point_2d' in obj:
            yield obj
    elif isinstance(obj, list):
        for value in obj:
            yield from _entries(value)


def _json_item(entry: dict, frame: str, offset: int) -> Optional[GroundedItem]:
    is_point = 'bbox_2d' not in entry
    raw = entry['point_2d'] if is_point else entry['bbox_2d']
    label = entry.get('label', '')
    want = 2 if is_point else 4
    if not isinstance(raw, Sequence) or isinstance(raw, str) or len(raw) != want:
        return None
    try:
        coords = [float(v) for v in raw]
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in coords):
        return None
    box = tuple(coords * 2) if is_point else tuple(coords)
    image = entry.get('image')
    image = image if isinstance(image, int) and not isinstance(image, bool) else None
    return GroundedItem(str(label) if label is not None else '', box, is_point, frame, offset,
                        image)

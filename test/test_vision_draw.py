"""`edge-llm ask --draw`: a grounded answer's boxes and points drawn on its image (PIL)."""
import argparse

import numpy as np
from PIL import Image

from edge_llm_ros.nodes.ask import add_arguments, check_draw
from edge_llm_ros.vision.draw import Box, save_drawing


def test_boxes_and_points_are_drawn_where_the_detections_say(tmp_path):
    pixels = np.zeros((90, 120, 3), np.uint8)
    out = save_drawing(pixels, [Box(45.0, 45.0, 30.0, 60.0, 'cup'),
                                Box(100.0, 20.0, 0.0, 0.0, 'handle')], str(tmp_path / 'a.png'))
    drawn = np.asarray(Image.open(out).convert('RGB'))
    assert drawn.shape == pixels.shape
    # The box's outline: its left edge at x = 30 from y = 15 to 75, red; its inside untouched.
    assert (drawn[20:70, 30] == (255, 64, 64)).all()
    assert (drawn[40:50, 40:50] == 0).all()
    # The point: a ring of radius 5 around (100, 20), green; its center untouched.
    assert (drawn[20, 95] == (64, 200, 64)).all() and (drawn[20, 100] == 0).all()
    assert (pixels == 0).all()   # the frame itself is not drawn on


def test_draw_needs_exactly_one_image():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(['where?', '--draw', 'out.png', '--max-image-tokens', '400'])
    assert args.max_image_tokens == 400
    assert check_draw(args, 0) == ('--draw needs exactly one --image (got 0): boxes are drawn '
                                   'on it')
    assert 'got 2' in check_draw(args, 2)
    assert check_draw(args, 1) == ''
    assert check_draw(parser.parse_args(['where?']), 2) == ''

"""Grounded answers (vision/grounding.py) and their ROS detections (nodes/detections.py).

The parser reads Qwen-VL's JSON form (absolute pixels of the model's input for Qwen2.5-VL, a
0..1000 grid for Qwen3-VL) and Qwen2-VL's tagged form, and maps each box or point onto the
original frame. The ROS mapping is checked on edge_llm_msgs' Detection2DArray, and on
vision_msgs' where that package is installed (it has no PyPI wheel: a ROS install brings it).
"""
import importlib.util

import pytest
from rclpy.serialization import deserialize_message, serialize_message

from edge_llm_ros.nodes.detections import detection_array, detection_messages
from edge_llm_ros.vision.grounding import (
    Detection, ground, ground_images, GroundingError, parse_grounding, to_image_pixels)

QWEN25_ANSWER = """The cup is on the left.
```json
[
  {"bbox_2d": [100, 50, 300, 250], "label": "red cup"},
  {"point_2d": [420, 90], "label": "handle"}
]
```"""


def test_absolute_boxes_scale_from_the_model_input_to_the_frame():
    # The model saw 560x280 (its smart resize of a 1120x560 frame): every coordinate doubles.
    result = ground(QWEN25_ANSWER, 'absolute', original=(1120, 560), model_input=(560, 280))
    assert result.dropped == 0
    cup, handle = result.detections
    assert cup == Detection('red cup', 400.0, 300.0, 400.0, 400.0, False)
    assert handle == Detection('handle', 840.0, 180.0, 0.0, 0.0, True)


def test_normalized_boxes_map_from_the_1000_grid():
    text = '[{"bbox_2d": [250, 500, 750, 1000], "label": "door"}]'
    (door,) = ground(text, 'normalized_1000', original=(640, 480),
                     model_input=(644, 476)).detections
    assert (door.center_x, door.center_y, door.size_x, door.size_y) == (320.0, 360.0, 320.0, 240.0)


def test_the_tagged_form_is_on_the_1000_grid_whatever_the_json_frame():
    text = ('<|object_ref_start|>the mug<|object_ref_end|><|box_start|>(100,200),(300,400)'
            '<|box_end|> and <|box_start|>(500,500)<|box_end|>')
    items, dropped = parse_grounding(text, 'absolute')
    assert dropped == 0
    assert [(i.label, i.box, i.is_point, i.frame) for i in items] == [
        ('the mug', (100.0, 200.0, 300.0, 400.0), False, 'normalized_1000'),
        ('', (500.0, 500.0, 500.0, 500.0), True, 'normalized_1000')]
    mug = to_image_pixels(items[0], original=(2000, 1000), model_input=(1, 1))
    assert (mug.center_x, mug.center_y, mug.size_x, mug.size_y) == (400.0, 300.0, 400.0, 200.0)


def test_corners_are_sorted_and_clamped_to_the_frame():
    text = '{"bbox_2d": [700, 300, -20, 100], "label": "shelf"}'
    (shelf,) = ground(text, 'absolute', original=(640, 480), model_input=(640, 480)).detections
    # x from 0 (clamped) to 640 (clamped), y from 100 to 300.
    got = (shelf.center_x, shelf.center_y, shelf.size_x, shelf.size_y)
    assert got == (320.0, 200.0, 640.0, 200.0)


def test_malformed_items_are_counted_not_guessed():
    text = ('[{"bbox_2d": [1, 2, 3], "label": "short"}, {"bbox_2d": "x", "label": "text"}, '
            '{"point_2d": [1, null]}, {"bbox_2d": [0, 0, 10, 10], "label": "ok"}] '
            '<|box_start|>(1,2),(3)<|box_end|>')
    result = ground(text, 'absolute', original=(100, 100), model_input=(100, 100))
    assert [d.label for d in result.detections] == ['ok']
    assert result.dropped == 4


def test_a_text_only_answer_has_no_detections():
    for text in ('The red cup is on the table.', 'Use {braces} and [brackets] freely.',
                 '{"answer": "no boxes", "items": [1, 2]}'):
        assert ground(text, 'absolute', original=(10, 10), model_input=(10, 10)).detections == []


def test_items_keep_their_order_of_appearance_across_both_forms():
    text = ('<|box_start|>(0,0),(10,10)<|box_end|> then '
            '[{"point_2d": [5, 5], "label": "b"}] then '
            '<|object_ref_start|>c<|object_ref_end|><|box_start|>(1,1),(2,2)<|box_end|>')
    items, _ = parse_grounding(text, 'normalized_1000')
    assert [i.label for i in items] == ['', 'b', 'c']


def test_several_images_take_the_boxes_the_answer_names_them_with():
    """Picture n before a box (Qwen's vision ids), a JSON "image": n; unnamed boxes dropped."""
    text = ('<|box_start|>(0,0),(10,10)<|box_end|> is not said to be in any picture. '
            'Picture 2: [{"bbox_2d": [0, 0, 500, 500], "label": "cup"}] and in Picture 1: '
            '<|object_ref_start|>mug<|object_ref_end|><|box_start|>(500,500),(1000,1000)'
            '<|box_end|> also [{"point_2d": [100, 100], "label": "pen", "image": 2}, '
            '{"point_2d": [1, 1], "label": "ghost", "image": 3}]')
    first, second = ground_images(text, 'normalized_1000',
                                  [((200, 100), (28, 28)), ((640, 480), (644, 476))])
    assert [d.label for d in first.detections] == ['mug']
    assert first.detections[0] == Detection('mug', 150.0, 75.0, 100.0, 50.0, False)
    assert [d.label for d in second.detections] == ['cup', 'pen']
    assert second.detections[0] == Detection('cup', 160.0, 120.0, 320.0, 240.0, False)
    assert second.detections[1] == Detection('pen', 64.0, 48.0, 0.0, 0.0, True)
    assert (first.dropped, second.dropped) == (2, 0)   # the unnamed box and the 3rd image's


def test_one_image_takes_every_box_whatever_the_answer_names():
    (only,) = ground_images('Image 2: [{"bbox_2d": [0, 0, 5, 5]}]', 'absolute',
                            [((10, 10), (10, 10))])
    assert len(only.detections) == 1 and only.dropped == 0
    with pytest.raises(GroundingError, match='at least one image'):
        ground_images('[]', 'absolute', [])


@pytest.mark.parametrize('call, words', [
    (lambda: parse_grounding('[]', 'pixels'), 'absolute, normalized_1000'),
    (lambda: ground('[]', 'absolute', original=(0, 10), model_input=(10, 10)), 'positive'),
])
def test_bad_frames_and_sizes_are_typed_errors(call, words):
    with pytest.raises(GroundingError, match=words):
        call()


def _header():
    from std_msgs.msg import Header
    header = Header(frame_id='head_camera')
    header.stamp.sec, header.stamp.nanosec = 12, 345
    return header


def _check_mapping(types):
    result = ground(QWEN25_ANSWER, 'absolute', original=(1120, 560), model_input=(560, 280))
    msg = detection_array(types, result.detections, _header(), 'goal-7')
    back = deserialize_message(serialize_message(msg), types.array)
    assert back.header.frame_id == 'head_camera' and back.header.stamp.nanosec == 345
    cup, handle = back.detections
    assert (cup.id, handle.id) == ('goal-7/0', 'goal-7/1')
    assert cup.header.frame_id == 'head_camera'
    assert (cup.bbox.center.position.x, cup.bbox.center.position.y) == (400.0, 300.0)
    assert (cup.bbox.size_x, cup.bbox.size_y) == (400.0, 400.0)
    assert (handle.bbox.size_x, handle.bbox.size_y) == (0.0, 0.0)
    hypotheses = [d.results[0] for d in back.detections]
    if types.with_pose is not None:
        hypotheses = [h.hypothesis for h in hypotheses]
    assert [(h.class_id, h.score) for h in hypotheses] == [('red cup', 1.0), ('handle', 1.0)]


def test_detections_map_onto_edge_llm_msgs():
    types = detection_messages('edge_llm_msgs')
    assert types.package == 'edge_llm_msgs'
    _check_mapping(types)


def test_detections_map_onto_vision_msgs_where_installed():
    if importlib.util.find_spec('vision_msgs') is None:
        # The PyPI path has no vision_msgs wheel; the same mapping runs on edge_llm_msgs above.
        assert detection_messages().package == 'edge_llm_msgs'
        pytest.skip('vision_msgs is not installed (it comes with a ROS install)')
    types = detection_messages()
    assert types.package == 'vision_msgs'
    _check_mapping(types)

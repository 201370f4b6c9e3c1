import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vagent.geometry import (
    BoxError,
    clamp_span,
    expand_box,
    giou,
    iou,
    model_to_original,
    original_to_model,
    sanitize_box,
    span_iou,
    to_pixel_box,
)
from vagent.media import smart_resize


def test_iou_and_giou_hand_computed():
    assert iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)
    assert iou((0, 0, 2, 2), (0, 0, 2, 2)) == 1.0
    assert iou((0, 0, 1, 1), (1, 0, 2, 1)) == 0.0  # touching edges share no area
    assert iou((0, 0, 0, 5), (0, 0, 0, 5)) == 0.0  # empty boxes
    # disjoint: IoU 0 for both, GIoU ranks the nearer box higher
    near, far = giou((0, 0, 1, 1), (2, 0, 3, 1)), giou((0, 0, 1, 1), (9, 0, 10, 1))
    assert near == pytest.approx(-1 / 3)
    assert far == pytest.approx(2 / 10 - 1)
    assert giou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7 - (9 - 7) / 9)


def test_box_mapped_from_resized_frame_matches_hand_computed_value():
    # A 1000x750 photo under a 256-token budget: smart resize gives 364x504 (h x w), by hand:
    # round(750/28)*28=756, round(1000/28)*28=1008 -> too many pixels -> beta=sqrt(750000/200704)=1.93305
    # h=floor(750/1.93305/28)*28=13*28=364, w=floor(1000/1.93305/28)*28=18*28=504
    h, w = smart_resize(750, 1000, min_pixels=3136, max_pixels=200704)
    assert (h, w) == (364, 504)
    # model box (28, 56, 84, 112) in the 504x364 frame -> x * 1000/504, y * 750/364
    box = model_to_original((28, 56, 84, 112), "absolute", (504, 364), (1000, 750))
    assert box == pytest.approx((55.5555556, 115.3846154, 166.6666667, 230.7692308))
    # integer pixels covering it: floor the top-left, ceil the bottom-right (an off-by-one would show here)
    assert to_pixel_box(box, 1000, 750) == (55, 115, 167, 231)
    # norm1000: 0..1000 spans the whole original image regardless of the resized frame
    assert model_to_original((0, 0, 1000, 1000), "norm1000", (504, 364), (1000, 750)) == (0, 0, 1000, 750)
    assert model_to_original((500, 200, 750, 400), "norm1000", (504, 364), (1000, 750)) == (500, 150, 750, 300)


@given(
    st.lists(st.floats(0, 1000, allow_nan=False), min_size=4, max_size=4),
    st.sampled_from(["absolute", "norm1000"]),
    st.integers(28, 2000),
    st.integers(28, 2000),
)
def test_model_original_round_trip(box, convention, ow, oh):
    there = model_to_original(box, convention, (448, 336), (ow, oh))
    back = original_to_model(there, convention, (448, 336), (ow, oh))
    assert back == pytest.approx(tuple(box), abs=1e-6)


def test_sanitize_box_repairs_and_rejects():
    assert sanitize_box([10, 10, 20, 20], 100, 100) == ((10, 10, 20, 20), [])
    box, notes = sanitize_box([20, 30, 10, 5], 100, 100)
    assert box == (10, 5, 20, 30) and notes == ["swapped reversed corners"]
    box, notes = sanitize_box([-5, 90, 50, 120], 100, 100)
    assert box == (0, 90, 50, 100) and "clipped" in notes[0]
    for bad in ([1, 2, 3], "1,2,3,4", [1, "a", 3, 4], [math.nan, 0, 1, 1], [0, 0, math.inf, 1], None):
        with pytest.raises(BoxError):
            sanitize_box(bad, 100, 100)
    with pytest.raises(BoxError, match="outside"):
        sanitize_box([150, 150, 200, 200], 100, 100)
    with pytest.raises(BoxError, match="zero"):
        sanitize_box([10, 10, 10, 50], 100, 100)


def test_expand_box_grows_around_centre_and_stays_inside():
    assert expand_box((45, 45, 55, 55), 40, 40, 100, 100) == (30, 30, 70, 70)
    assert expand_box((0, 0, 4, 4), 40, 40, 100, 100) == (0, 0, 40, 40)  # shifted off the top-left edge
    assert expand_box((96, 96, 100, 100), 40, 40, 100, 100) == (60, 60, 100, 100)
    assert expand_box((1, 1, 2, 2), 400, 400, 100, 50) == (0, 0, 100, 50)  # image smaller than the minimum
    assert expand_box((10, 10, 90, 90), 40, 40, 100, 100) == (10, 10, 90, 90)  # already big enough


def test_span_iou_and_clamp():
    assert span_iou((0, 10), (5, 15)) == pytest.approx(1 / 3)
    assert span_iou((0, 1), (1, 2)) == 0.0
    assert span_iou((3, 3), (3, 3)) == 0.0
    assert clamp_span((2, 5), 10) == ((2, 5), [])
    assert clamp_span((8, -1), 6) == ((0, 6), ["swapped start and end", "clipped to the video's duration [0, 6] s"])
    with pytest.raises(ValueError, match="outside"):
        clamp_span((20, 30), 10)
    with pytest.raises(ValueError, match="finite"):
        clamp_span((math.nan, 1), 10)

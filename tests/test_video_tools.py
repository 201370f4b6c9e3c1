"""sample_frames and crop_clip on generated videos whose frames show their own index."""

import dataclasses
import json
import os

import numpy as np
import pytest
from PIL import Image

from vagent.chat import observation_text
from vagent.toolbox import ToolContext, call_tool
from vagent.types import ToolCall

FPS = 10.0
FRAMES = 40  # 4 s at 10 fps
WIDTH, HEIGHT = 160, 64
STRIPE = WIDTH // FRAMES  # frame i has a white stripe in columns [i * STRIPE, (i + 1) * STRIPE)


def _write_video(path, frames=FRAMES, fps=FPS, fourcc="mp4v"):
    """Frame i shows a white vertical stripe in slot i of ``frames`` slots: the stripe position survives
    lossy coding and resizing, where a brightness level would blur into its neighbours."""
    import cv2

    slot = WIDTH // frames
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (WIDTH, HEIGHT))
    for i in range(frames):
        frame = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
        frame[:, i * slot : (i + 1) * slot] = 255
        writer.write(frame)
    writer.release()
    return str(path)


def _shown_index(image: Image.Image, frames=FRAMES) -> int:
    """Which frame an image shows: the stripe's centroid, as a fraction of the width, times the slot count."""
    columns = np.asarray(image.convert("L"), dtype=float).mean(axis=0)
    bright = np.flatnonzero(columns > 128)
    return int(bright.mean() / image.width * frames)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return _write_video(tmp_path_factory.mktemp("video") / "stripes.mp4")


def _call(name, arguments, video, **context):
    context.setdefault("videos", [video])
    return call_tool(ToolCall(name, arguments), ToolContext(**context))


def _check_frames(obs, frames=FRAMES, fps=FPS):
    """The pixels show exactly the frames the metadata names, at the times it gives."""
    assert obs.ok, obs.text
    indices = obs.metadata["frame_indices"]
    assert [_shown_index(image, frames) for image in obs.images] == indices
    assert obs.timestamps == obs.metadata["timestamps"] == pytest.approx([i / fps for i in indices])
    assert indices == sorted(set(indices))  # distinct, in time order
    return indices


def test_sample_frames_defaults_to_eight_frames_over_the_whole_video(video):
    three_images = [Image.new("RGB", (28, 28))] * 3
    obs = _call("sample_frames", {}, video, images=three_images)
    # Segment centres 0.25, 0.75, ... 3.75 s fall in frames floor(t * 10).
    assert _check_frames(obs) == [2, 7, 12, 17, 22, 27, 32, 37]
    assert obs.metadata["span"] == [0.0, 4.0] and obs.metadata["video_index"] == 0
    assert "t = 0.20, 0.70" in obs.text and "Note" not in obs.text
    # appended after three images, the frames become images 3-10: the engine sets first_image, vagent's text says so
    assert observation_text(dataclasses.replace(obs, first_image=3)).startswith("Images 3–10: 8 frame(s) of video 0")


def test_sample_frames_over_a_span_by_count_and_by_fps(video):
    by_count = _call("sample_frames", {"start": 1, "end": 2, "num_frames": 4}, video)
    assert _check_frames(by_count) == [11, 13, 16, 18]  # centres 1.125, 1.375, 1.625, 1.875 s
    assert by_count.metadata["span"] == [1.0, 2.0]
    by_fps = _call("sample_frames", {"start": 0.5, "end": 2.0, "fps": 2}, video)
    assert len(_check_frames(by_fps)) == 3  # 2 fps x 1.5 s: float noise must not make it 4
    single = _call("sample_frames", {"num_frames": 1}, video, images=[Image.new("RGB", (28, 28))])
    assert _check_frames(single) == [20]
    assert observation_text(dataclasses.replace(single, first_image=1)).startswith("Image 1: 1 frame(s) of video 0")


def test_out_of_range_times_are_clamped_and_said(video):
    obs = _call("sample_frames", {"start": -2.5, "end": 99}, video)
    assert obs.ok and obs.metadata["span"] == [0.0, 4.0]
    assert "requested span [-2.5, 99] s: clipped to the video's duration [0, 4] s" in obs.text
    reversed_ = _call("crop_clip", {"start": 2, "end": 1}, video)
    assert reversed_.metadata["span"] == [1.0, 2.0] and "swapped start and end" in reversed_.text


@pytest.mark.parametrize(
    ("arguments", "kind", "says"),
    [
        ({"start": 2, "end": 2}, "bad_span", "give start < end, inside [0, 4.00] s"),
        ({"start": 5, "end": 8}, "bad_span", "outside the video"),
        ({"start": 4, "end": 6}, "bad_span", "empty within the video"),  # clipped to [4, 4]
        (json.loads('{"start": NaN, "end": 2}'), "bad_span", "finite"),  # Python's json carries NaN
        (json.loads('{"fps": Infinity}'), "bad_arguments", "finite"),
        ({"num_frames": 3, "fps": 1}, "bad_arguments", "either num_frames or fps"),
        ({"num_frames": 0}, "bad_arguments", "minimum"),  # the schema's bound
        ({"fps": -1}, "bad_arguments", "fps"),
        ({"frames": 3}, "bad_arguments", "'frames' was unexpected"),
        ({"video_index": 1}, "bad_arguments", "video_index 1 does not exist"),
    ],
)
def test_bad_arguments_give_error_observations(video, arguments, kind, says):
    obs = _call("sample_frames", arguments, video)
    assert obs.error == kind and says in obs.text and not obs.images


def test_max_frames_caps_a_call_and_says_so(video):
    obs = _call("sample_frames", {"num_frames": 30}, video, max_frames=5)
    assert len(_check_frames(obs)) == 5 and "30 frames is more than the 5 frames one call may return" in obs.text
    obs = _call("sample_frames", {"fps": 1e308}, video, max_frames=5)  # fps x span overflows to inf
    assert len(_check_frames(obs)) == 5 and "sampled 5" in obs.text


def test_frames_on_the_same_decoded_frame_are_sent_once(tmp_path):
    short = _write_video(tmp_path / "short.mp4", frames=4, fps=2.0)  # 2 s, 4 frames
    obs = _call("sample_frames", {"num_frames": 8}, short)
    assert _check_frames(obs, frames=4, fps=2.0) == [0, 1, 2, 3]
    assert "holds only 4 distinct frame(s)" in obs.text


@pytest.mark.parametrize("factor", [28, 32])
def test_frames_fit_the_pixel_budget_on_the_patch_grid(video, factor):
    budget = factor * factor * 8
    obs = _call("sample_frames", {"num_frames": 3}, video, image_factor=factor, frame_max_pixels=budget, min_pixels=0)
    for image in obs.images:
        assert image.width % factor == 0 and image.height % factor == 0
        assert factor * factor <= image.width * image.height <= budget


def test_broken_and_missing_videos_give_error_observations(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(os.urandom(4096))
    good = open(_write_video(tmp_path / "good.mp4"), "rb").read()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(good[: len(good) // 2])  # the index (moov atom) is at the end: cannot even open
    # An AVI opens without its index, then fails when the missing frames are decoded.
    avi = open(_write_video(tmp_path / "good.avi", fourcc="MJPG"), "rb").read()
    cut_avi = tmp_path / "cut.avi"
    cut_avi.write_bytes(avi[: len(avi) // 2])
    for path in (junk, cut, cut_avi, tmp_path / "missing.mp4"):
        # Both calls reach the end of the video, which the truncated AVI lost (its early frames may still decode).
        for name, arguments in (("sample_frames", {"num_frames": 16}), ("crop_clip", {"start": 0, "end": 99})):
            obs = _call(name, arguments, str(path))
            assert obs.error == "bad_video" and f"{name} failed: video 0 cannot be" in obs.text, (path, obs.text)
    assert _call("crop_clip", {"start": 0, "end": 1}, "", videos=[]).error == "bad_arguments"


def test_crop_clip_returns_every_frame_of_a_short_window(video):
    clip = _call("crop_clip", {"start": 1, "end": 2}, video)
    assert _check_frames(clip) == list(range(10, 20))
    assert "at 10 fps (every frame)" in clip.text and clip.metadata["span"] == [1.0, 2.0]
    overview = _call("sample_frames", {"start": 1, "end": 2}, video)
    assert len(clip.images) > len(overview.images) == 8
    half_rate = _call("crop_clip", {"start": 1, "end": 2, "fps": 5}, video)
    assert len(_check_frames(half_rate)) == 5 and "about 5 fps" in half_rate.text


def test_crop_clip_says_when_it_cannot_be_dense(video):
    too_fast = _call("crop_clip", {"start": 1, "end": 1.5, "fps": 60}, video)
    assert _check_frames(too_fast) == [10, 11, 12, 13, 14] and "used its 10 fps" in too_fast.text
    long = _call("crop_clip", {"start": 0, "end": 4}, video, max_frames=8)
    assert len(_check_frames(long)) == 8
    assert "needs 40 frames, more than the 8" in long.text and "Use a shorter window" in long.text
    assert _call("crop_clip", {"start": 1}, video).error == "bad_arguments"  # end is required

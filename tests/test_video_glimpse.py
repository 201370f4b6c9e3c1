"""The glimpse video task (``data_pipelines.synthetic.video.glimpse_rows``, the video proof's data) holds what makes it
learnable: its first view says when to look and never what, the gold clip shows the answer; and SFT with
``data.frame_budget`` trains on exactly the ids the rollout produces from that first view."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from data_pipelines.synthetic.video import COLORS, MARKER, glimpse_rows
from vagent.agents.vagent import first_view
from vagent.data import encode_messages
from vagent.model import load_policy
from vagent.rollout import RolloutLimits, Task, run
from vagent.training.data import gold_conversation

FRAMES = 8


def _shows(image: Image.Image, bgr: tuple[int, int, int], tolerance: int = 40) -> bool:
    """More than 2% of the image's pixels are within ``tolerance`` of the OpenCV (BGR) color ``bgr``."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    close = (np.abs(pixels - np.array(bgr[::-1], dtype=np.int16)) <= tolerance).all(axis=-1)
    return close.mean() > 0.02


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return glimpse_rows(tmp_path_factory.mktemp("glimpse"), 12, seed=0, frames=FRAMES)


def test_the_first_view_marks_one_frame_and_never_shows_the_color_that_the_gold_clip_shows(rows):
    for row in rows:
        view = [part.image for part in first_view(0, row.videos[0], FRAMES) if part.type == "image"]
        assert len(view) == FRAMES
        marked = [i for i, image in enumerate(view) if _shows(image, MARKER, tolerance=25)]
        assert len(marked) == 1, (row.id, marked)  # when to look
        assert not any(_shows(image, bgr) for image in view for bgr in COLORS.values()), row.id  # never what
        [tool] = [m for m in row.messages if m.role == "tool"]
        clip = [Image.open(part.path) for part in tool.content if part.type == "image"]
        shown = [name for name, bgr in COLORS.items() if any(_shows(image, bgr) for image in clip)]
        assert shown == [row.answer], (row.id, shown)
        # the gold clip starts at the marked frame's time as the prompt prints it, one segment long, and it covers
        # most of the marker's span
        call = next(m for m in row.messages if m.role == "assistant").plain_text
        times = [part.timestamps[0] for part in first_view(0, row.videos[0], FRAMES) if part.type == "image"]
        start, end = times[marked[0]], min(times[marked[0]] + 12.0 / FRAMES, 12.0)
        assert f'"start": {round(start, 2)}' in call and f'"end": {round(end, 2)}' in call
        (lo, hi) = row.evidence.spans[0]
        iou = (min(hi, end) - max(lo, start)) / (max(hi, end) - min(lo, start))
        assert iou >= 0.6
    assert len({row.answer for row in rows}) > 1 and len({tuple(row.evidence.spans[0]) for row in rows}) > 1


def test_sft_with_the_frame_budget_trains_on_the_ids_the_rollout_produces(rows, tiny_qwen25):
    """The gold conversation SFT encodes under ``data.frame_budget`` [8, 8] equals, token for token, the episode the
    rollout engine produces under ``rollout.frame_budget`` [8, 8] from the same row with the gold turns scripted: the
    first view's frames with their times, the crop_clip call and the frames it returns, the answer."""
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    min_pixels, max_pixels = policy.pixel_budget
    row = rows[0]
    conversation = gold_conversation(row, ["crop_clip"], frame_budget=[FRAMES, FRAMES], seed=0)
    assert sum(part.type == "image" for part in conversation[1].content) == FRAMES  # the first view, in the prompt
    encoded = encode_messages(conversation, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
    task = Task.from_row(row, ["crop_clip"])
    task.scripted_turns = [m.plain_text for m in row.messages if m.role == "assistant"]
    limits = RolloutLimits(max_turns=3, max_new_tokens=64, max_images=24, frame_budget=(FRAMES, FRAMES), seed=0)
    [episode] = run(policy, [task], limits=limits, batch_size=1)
    assert episode.stop_reason == "answered" and len(episode.tool_results) == 1
    assert episode.token_ids == encoded.input_ids.tolist()


def test_the_window_tasks_gold_frames_are_the_ones_the_rollout_returns(tmp_path, tiny_qwen25):
    """``video_rows`` (the older video task: a sample_frames overview, then crop_clip): its gold tool turns are made
    at the engine's frame budget, so SFT trains on the ids a rollout of the same calls produces, frames included."""
    from data_pipelines.synthetic.video import video_rows

    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    min_pixels, max_pixels = policy.pixel_budget
    [row] = video_rows(tmp_path, 1, seed=2, duration=6.0)
    encoded = encode_messages(gold_conversation(row, ["sample_frames", "crop_clip"]), policy.processor,
                              min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)  # fmt: skip
    task = Task.from_row(row, ["sample_frames", "crop_clip"])
    task.scripted_turns = [m.plain_text for m in row.messages if m.role == "assistant"]
    [episode] = run(policy, [task], limits=RolloutLimits(max_turns=4, max_new_tokens=64, max_images=24), batch_size=1)
    assert episode.stop_reason == "answered" and len(episode.tool_results) == 2
    assert episode.token_ids == encoded.input_ids.tolist()

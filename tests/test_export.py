"""Trajectory export: JSONL round trip, atomic and streaming writes, and the self-contained HTML viewer."""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
from pathlib import Path

import pytest
from PIL import Image

from vagent.rollout.export import JsonlWriter, read_jsonl, write_html, write_jsonl
from vagent.types import ContentPart, Message, ToolCall, Trajectory

CROP_CALL = '{"name": "crop", "arguments": {"bbox": [10, 20, 200, 300]}}'
XSS = "<script>alert(1)</script>"


def noise(width: int, height: int, seed: int) -> Image.Image:
    """Random pixels: any resampling or lossy save would change them, so equality means a true round trip."""
    return Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))


def assistant(text: str, calls: list[ToolCall] | None = None, sampled: list[int] | None = None) -> Message:
    ids = list(range(len(sampled))) if sampled else None
    return Message("assistant", [ContentPart("text", text)], tool_calls=calls or [], token_ids=ids, sampled=sampled)


def crop_episode(prompt: Image.Image) -> Trajectory:
    """system / user (image) / assistant think + crop / tool (crop image + text) / assistant answer."""
    crop = noise(40, 30, seed=2)
    messages = [
        Message.text("system", "You answer questions about images."),
        Message("user", [ContentPart("image", image=prompt), ContentPart("text", "What digit is on the tile?")]),
        assistant(
            f"<think>The tile is too small.</think>\n<tool_call>{CROP_CALL}</tool_call>",
            [ToolCall("crop", {"bbox": [10, 20, 200, 300]}, CROP_CALL)],
            sampled=[1, 1, 1, 1, 0, 0],
        ),
        Message("tool", [ContentPart("image", image=crop), ContentPart("text", "Cropped [10, 20, 200, 300].")]),
        assistant("<answer>7</answer>", sampled=[1, 1, 0]),
    ]
    return Trajectory(
        task_id="tile/1",  # a slash, to check that image names are sanitized
        messages=messages,
        token_ids=[5, 6, 7, 8, 9, 10],
        loss_mask=[0, 1, 1, 0, 1, 0],
        logprobs=[0.0, -0.5, -1.25, 0.0, -0.125, 0.0],
        answer="7",
        stop_reason="answered",
        metrics={"turns": 2, "tool_calls": 1, "sampled_tokens": 3},
        reward=1.0,
    )


def video_episode() -> Trajectory:
    """Frames from a video tool, each with its timestamp; the prompt video is a path."""
    frames = [noise(32, 24, seed=10), noise(32, 24, seed=11)]
    call = '{"name": "sample_frames", "arguments": {"start": 1.5, "end": 3.0, "num_frames": 2}}'
    messages = [
        Message("user", [ContentPart("video", path="/data/clip.mp4"), ContentPart("text", "When does it fall?")]),
        assistant(f"<tool_call>{call}</tool_call>", [ToolCall("sample_frames", json.loads(call)["arguments"], call)]),
        Message(
            "tool",
            [
                ContentPart("image", image=frames[0], timestamps=[1.5]),
                ContentPart("image", image=frames[1], timestamps=[3.0]),
                ContentPart("text", "2 frames."),
            ],
        ),
        assistant("<answer>[1.5, 3.0]</answer>"),
    ]
    return Trajectory(
        "clip-9", messages, answer="[1.5, 3.0]", stop_reason="answered", reward=0.25, metrics={"turns": 2}
    )


def error_episode() -> Trajectory:
    """A bad-argument call that comes back as an error observation, then untrusted text and no answer."""
    bad = '{"name": "crop", "arguments": {"bbox": [1, 2]}}'
    messages = [
        Message.text("user", "Read the sign."),
        assistant(
            f"<tool_call>{bad}</tool_call><tool_call>{{not json</tool_call>", [ToolCall("crop", {"bbox": [1, 2]}, bad)]
        ),
        Message.text("tool", "Error: bbox must have 4 numbers"),
        assistant(f"I give up {XSS}"),
    ]
    metrics = {"turns": 2, "tool_calls": 2, "tool_error/bad_arguments": 1, "tool_error/bad_json": 1}
    return Trajectory("sign-3", messages, stop_reason="no_action", metrics=metrics)


@pytest.fixture
def episodes() -> list[Trajectory]:
    prompt = noise(64, 48, seed=1)
    return [crop_episode(prompt), crop_episode(prompt), video_episode(), error_episode()]  # 2 samples share a prompt


def image_parts(trajectories: list[Trajectory]) -> list[ContentPart]:
    return [p for t in trajectories for m in t.messages for p in m.content if p.type == "image"]


def test_jsonl_round_trip_keeps_everything_and_images_pixel_exact(tmp_path, episodes):
    path = write_jsonl(episodes, tmp_path / "out" / "rollouts.jsonl", extra=lambda t: {"gold": t.task_id.upper()})
    back = read_jsonl(path)
    assert len(back) == len(episodes)
    for old, new in zip(episodes, back, strict=True):
        for field in ("task_id", "token_ids", "loss_mask", "logprobs", "answer", "stop_reason", "metrics", "reward"):
            assert getattr(new, field) == getattr(old, field), field
        assert [(m.role, m.plain_text, m.tool_calls, m.token_ids, m.sampled) for m in new.messages] == [
            (m.role, m.plain_text, m.tool_calls, m.token_ids, m.sampled) for m in old.messages
        ]
        assert [p.timestamps for m in new.messages for p in m.content] == [
            p.timestamps for m in old.messages for p in m.content
        ]
    for old, new in zip(image_parts(episodes), image_parts(back), strict=True):
        with Image.open(new.path) as reloaded:
            assert reloaded.size == old.image.size and reloaded.tobytes() == old.image.tobytes()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["gold"] for r in records] == ["TILE/1", "TILE/1", "CLIP-9", "SIGN-3"]
    saved = [p["path"] for r in records for m in r["messages"] for p in m["content"] if p["type"] == "image"]
    assert all(p.startswith("rollouts_images/tile_1_") or p.startswith("rollouts_images/clip-9_") for p in saved)
    # the prompt shared by two samples (and by nothing else) is one file: 1 prompt + 1 crop + 2 frames
    assert sorted(f.name for f in (tmp_path / "out" / "rollouts_images").iterdir()) == sorted(
        set(p.split("/")[1] for p in saved)
    )
    assert len(set(saved)) == 4
    # a video path outside the export folder stays absolute
    assert records[2]["messages"][0]["content"][0]["path"] == "/data/clip.mp4"


def test_jsonl_folder_can_be_moved(tmp_path, episodes):
    write_jsonl(episodes, tmp_path / "a" / "r.jsonl")
    shutil.move(tmp_path / "a", tmp_path / "b")
    moved = read_jsonl(tmp_path / "b" / "r.jsonl")
    assert all(str(tmp_path / "b") in p.path for p in image_parts(moved))
    Image.open(image_parts(moved)[0].path).load()


def test_failing_export_leaves_the_previous_file_intact(tmp_path, episodes):
    path = write_jsonl(episodes[:1], tmp_path / "r.jsonl")
    before = path.read_bytes()

    def extra(trajectory: Trajectory) -> dict:
        if trajectory.task_id == "clip-9":  # third record: two lines already written to the temp file
            raise RuntimeError("gold lookup failed")
        return {}

    with pytest.raises(RuntimeError, match="gold lookup"):
        write_jsonl(episodes, path, extra=extra)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind
    with pytest.raises(ValueError, match="overwrite"):
        write_jsonl(episodes, tmp_path / "x.jsonl", extra=lambda t: {"reward": 0.0})
    assert not (tmp_path / "x.jsonl").exists()


def test_streaming_writer_leaves_complete_lines_and_recovers_a_cut_line(tmp_path, episodes):
    path = tmp_path / "stream.jsonl"
    with JsonlWriter(path) as writer:
        for i, trajectory in enumerate(episodes[:2], 1):
            writer.write(trajectory)
            text = path.read_text()  # readable while the writer is still open
            assert text.endswith("\n") and len([json.loads(line) for line in text.splitlines()]) == i
    with open(path, "a") as f:  # a run killed in the middle of a line
        f.write('{"task_id": "half", "messa')
    with JsonlWriter(path) as writer:
        writer.write(episodes[3])
    assert [t.task_id for t in read_jsonl(path)] == ["tile/1", "tile/1", "sign-3"]


def test_read_jsonl_names_the_bad_line(tmp_path, episodes):
    path = write_jsonl(episodes[:1], tmp_path / "r.jsonl")
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:2: "):
        read_jsonl(path)


def test_html_is_self_contained_readable_and_escaped(tmp_path, episodes):
    page = write_html(episodes, tmp_path / "view.html").read_text()
    assert page.count("data:image/") == len(image_parts(episodes)) == 6
    assert "http://" not in page and "https://" not in page and "<link" not in page  # nothing fetched from outside
    assert "crop(bbox=[10, 20, 200, 300])" in page  # a call reads as a call, not as JSON
    assert "sample_frames(start=1.5, end=3.0, num_frames=2)" in page
    assert "t=1.50s" in page and "t=3.00s" in page  # frame timestamps
    assert XSS not in page and html_escaped(XSS) in page
    assert page.count("<script>") == 1  # only the viewer's own filter script
    assert '<div class="think">The tile is too small.</div>' in page
    assert '<div class="answer">answer: 7</div>' in page
    assert '<div class="text bad">Error: bbox must have 4 numbers</div>' in page
    assert "bad_json" in page and "bad_arguments: 1" in page  # the unparsable call and the error counts
    assert "6 tokens (4 sampled, 2 forced)" in page
    assert "<b>reward</b> 1</span>" in page and "<b>reward</b> 0.25</span>" in page
    assert "mean reward</th><td>0.75 over 3" in page
    assert "answered: 3, no_action: 1" in page and "crop: 3, sample_frames: 1" in page
    assert "answer rate</th><td>75.0%" in page
    assert page.count('<details class="msg"><summary class="role">system') == 2  # collapsed by default


def html_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_html_from_paths_shows_a_placeholder_for_a_missing_image(tmp_path, episodes):
    back = read_jsonl(write_jsonl(episodes, tmp_path / "r.jsonl"))
    frame = next(p for p in image_parts(back) if p.timestamps == [3.0])
    Path(frame.path).unlink()
    page = write_html(back, tmp_path / "view.html", max_trajectories=3).read_text()
    assert page.count("data:image/") == 6 - 1 and page.count("image not available") == 1
    assert "4 (first 3 shown)" in page and page.count('<section class="traj"') == 3


def test_html_downscales_large_images(tmp_path):
    big = Image.new("RGB", (2000, 1000), (200, 30, 30))
    trajectory = Trajectory("big", [Message("user", [ContentPart("image", image=big)])])
    page = write_html([trajectory], tmp_path / "v.html").read_text()
    uri = page.split('src="data:image/')[1].split('"')[0]
    with Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))) as shown:
        assert shown.size == (768, 384)

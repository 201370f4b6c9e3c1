"""Each converter on a small file in its source format, written by the test."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from data_pipelines.convert import charades, mat, refcoco
from tests.videos import write_video
from vagent.data import load_rows
from vagent.toolbox import TOOLS


def test_refcoco_refs_become_grounding_rows_with_gold_crop_trajectories(tmp_path, policy):
    images = tmp_path / "images"
    images.mkdir()
    image = Image.new("RGB", (640, 480), (200, 200, 200))
    image.paste((220, 30, 30), (300, 200, 380, 260))  # the referred object
    image.save(images / "0001.jpg")
    instances = {"images": [{"id": 1, "file_name": "0001.jpg", "width": 640, "height": 480}],
                 "annotations": [{"id": 7, "image_id": 1, "bbox": [300, 200, 80, 60], "category_id": 3},
                                 {"id": 8, "image_id": 1, "bbox": [0, 0, 0.5, 10], "category_id": 3}],
                 "categories": [{"id": 3, "name": "car"}]}  # fmt: skip
    refs = [{"ref_id": 1, "ann_id": 7, "image_id": 1, "split": "val", "sentences": [{"sent": "red car"}, {"sent": "the car"}]},
            {"ref_id": 2, "ann_id": 99, "image_id": 1, "split": "val", "sentences": [{"sent": "ghost"}]},
            {"ref_id": 3, "ann_id": 7, "image_id": 1, "split": "train", "sentences": [{"sent": "other split"}]}]  # fmt: skip
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    min_pixels, max_pixels = policy.pixel_budget
    out = tmp_path / "out"
    assert refcoco.main(["--instances", str(tmp_path / "instances.json"), "--refs", str(tmp_path / "refs.json"),
                         "--image-root", str(images), "--out", str(out), "--split", "val", "--trajectories",
                         "--min-pixels", str(min_pixels), "--max-pixels", str(max_pixels)]) == 0  # fmt: skip
    rows = load_rows(out / "rows.jsonl", known_tools=TOOLS)
    assert [r.id for r in rows] == ["ref1-0", "ref1-1"]  # the missing annotation is skipped, the other split too
    assert rows[0].answer == [300.0, 200.0, 380.0, 260.0] and rows[0].evidence.boxes == [rows[0].answer]
    assert '"red car"' in rows[0].question and rows[0].answer_type == "box"
    call, tool, answer = rows[0].messages
    assert '"name": "crop"' in call.plain_text and tool.plain_text.startswith("Image 1: cropped region [")
    crop = Image.open(next(p.path for p in tool.content if p.type == "image"))
    center = crop.convert("RGB").getpixel((crop.width // 2, crop.height // 2))
    assert max(abs(a - b) for a, b in zip(center, (220, 30, 30), strict=True)) <= 4  # the real crop tool's output
    # the answer is the box in the frame the policy sees (640x480 fits the budget: the same pixels here or scaled)
    assert answer.plain_text.endswith("</answer>") and "[" in answer.plain_text


def test_refcoco_without_refs_uses_each_annotation(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64)).save(images / "a.jpg")
    instances = {"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 1, "image_id": 1, "bbox": [1, 2, 30, 40],
                 "category_id": 5}], "categories": [{"id": 5, "name": "dog"}]}  # fmt: skip
    rows, skipped = refcoco.convert(instances, None, images, tmp_path / "o", trajectories=False, split=None, budget={})
    assert skipped == [] and rows[0].question.startswith('Give the bounding box of "the dog"')


def test_mat_json_becomes_rows_and_bad_records_are_reported(tmp_path, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    records = [{"id": 1, "question": "Q?", "answers": ["x"], "type": ["ocr"], "ori_image_path": "a.png",
                "processed_image_path": "a.png"},
               {"id": 2, "question": "Q?", "answers": ["y"], "processed_image_path": "missing.png"}]  # fmt: skip
    (tmp_path / "mat.json").write_text(json.dumps(records))
    assert (
        mat.main(["--kind", "coding", "--data", str(tmp_path / "mat.json"), "--out", str(tmp_path / "rows.jsonl")]) == 0
    )
    rows = load_rows(tmp_path / "rows.jsonl")
    assert [r.id for r in rows] == ["1"] and rows[0].answer == ["x"] and rows[0].extra["type"] == ["ocr"]
    assert "id 2" in capsys.readouterr().out


def test_charades_sta_lines_become_span_rows(tmp_path):
    write_video(tmp_path / "ABC12.mp4", frames=16, fps=8.0)
    text = "ABC12 0.5 1.5##a person opens a door.\nABC12 1.5##broken line\nZZZ99 1 2##missing video\n"
    rows, skipped = charades.convert(text, tmp_path, "mp4")
    assert len(rows) == 1 and rows[0].answer == [0.5, 1.5] and rows[0].evidence.spans == [[0.5, 1.5]]
    assert "a person opens a door" in rows[0].question
    assert [s.split(":")[0] for s in skipped] == ["line 2", "line 3"]


def test_distillation_keeps_trajectories_above_the_threshold_as_sft_rows(tmp_path, policy):
    from data_pipelines.distill import distill_rows
    from vagent.data import Row, write_rows
    from vagent.rollout import RolloutLimits, Task, run
    from vagent.training.data import gold_conversation

    Image.new("RGB", (320, 240), (90, 160, 60)).save(tmp_path / "img.png")
    rows = [Row(id=f"r{i}", question="What color?", answer="green", answer_type="exact", images=[str(tmp_path / "img.png")])
            for i in range(2)]  # fmt: skip
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [10, 10, 120, 120]}}</tool_call>'
    tasks = [
        Task(id=r.id, question=r.question, images=r.images, scripted_turns=[crop, "<answer>green</answer>"])
        for r in rows
    ]
    trajectories = run(policy, tasks, 2, RolloutLimits(max_turns=3))
    rewards = [1.0, 0.0, 0.5, 0.9]  # row r0: samples 1.0 and 0.0; row r1: 0.5 and 0.9
    kept = distill_rows(rows, trajectories, rewards, 2, min_reward=0.8, per_row=1, image_dir=tmp_path / "images")
    assert [(r.id, r.extra["distill_reward"]) for r in kept] == [("r0-d0", 1.0), ("r1-d0", 0.9)]
    path = write_rows(kept, tmp_path / "distilled.jsonl")
    loaded = load_rows(path, known_tools=TOOLS)
    roles = [m.role for m in loaded[0].messages]
    assert roles == ["assistant", "tool", "assistant"] and "crop" in loaded[0].messages[0].plain_text
    conversation = gold_conversation(loaded[0], ["crop"])  # SFT reads it like any gold trajectory
    assert [m.role for m in conversation] == ["system", "user", "assistant", "tool", "assistant"]
    assert Image.open(conversation[3].content[0].path).size == trajectories[0].messages[3].images[0].size


def test_synthetic_video_rows_hide_the_answer_in_a_short_window(tmp_path, policy):
    from data_pipelines.synthetic.video import video_rows
    from vagent.data import write_rows
    from vagent.media import probe_video, read_frames
    from vagent.training.data import gold_conversation

    rows = video_rows(tmp_path, 2, seed=3, duration=6.0, window=1.0, fps=8.0)
    path = write_rows(rows, tmp_path / "rows.jsonl")
    loaded = load_rows(path, known_tools=TOOLS)
    row = loaded[0]
    (t0, t1) = row.evidence.spans[0]
    assert t1 - t0 == 1.0 and probe_video(row.videos[0]).duration == 6.0
    (inside, outside), _ = read_frames(row.videos[0], [(t0 + t1) / 2, (t1 + 0.5) % 6.0])
    colored = [int((np.ptp(np.asarray(f), axis=-1) > 80).sum()) for f in (inside, outside)]  # saturated pixels
    assert colored[0] > 500 and colored[1] == 0, colored  # the square is on screen only inside the window
    roles = [m.role for m in gold_conversation(row, ["sample_frames"])]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    clip_turn = row.messages[3].content
    assert any(p.type == "text" and p.text.startswith("t=") for p in clip_turn)  # frames carry their times
    overview = len(row.messages[1].images)  # the clip's frames are labelled as the images after the overview's
    assert [p.text for p in clip_turn if p.type == "text"][-1].startswith(f"Images {overview}–"), clip_turn[-1]


def test_synthetic_grounding_rows_score_their_own_gold_answer_as_a_perfect_box(tmp_path, policy):
    from data_pipelines.synthetic.grounding import grounding_rows
    from vagent.rewards import REWARDS
    from vagent.types import Frame, Trajectory

    min_pixels, max_pixels = policy.pixel_budget
    rows = grounding_rows(tmp_path, 3, seed=1, min_pixels=min_pixels, max_pixels=max_pixels)
    seen = policy.model_view(Image.open(rows[0].images[0])).size
    frames = [Frame((448, 336), seen, "absolute")]
    answers = [r.messages[0].plain_text.removeprefix("<answer>").removesuffix("</answer>") for r in rows]
    trajectories = [
        Trajectory(r.id, [], answer=a, stop_reason="answered", frames=frames)
        for r, a in zip(rows, answers, strict=True)
    ]
    ious = REWARDS["box_iou"](trajectories, rows)
    assert min(ious) > 0.8, ious  # the gold answer, mapped back from the model's frame, is the tile (up to rounding)


def test_synthetic_zoom_rows_are_the_same_whatever_their_number_and_workers(tmp_path):
    from data_pipelines.synthetic.zoom import spawn_pool, zoom_rows

    knobs = dict(size=(336, 252), tile=60, clutter=10, distractors=0, direct_share=0.3, grid=2, margin=0,
                 glyph="stripes", min_pixels=3136, max_pixels=50176)  # fmt: skip
    one = zoom_rows(tmp_path / "one", 5, seed=4, **knobs)
    two = zoom_rows(tmp_path / "two", 5, seed=4, workers=2, **knobs)  # two processes, each a share of the rows
    with spawn_pool(2) as pool:  # processes already up, as the quickstart's splits share them
        again = zoom_rows(tmp_path / "again", 5, seed=4, workers=2, pool=pool, **knobs)
    fewer = zoom_rows(tmp_path / "fewer", 3, seed=4, **knobs)
    other = zoom_rows(tmp_path / "other", 5, seed=5, **knobs)

    def content(rows, root):
        return [json.loads(json.dumps(r.__dict__, default=lambda o: o.__dict__).replace(str(root), "")) for r in rows]

    assert content(one, tmp_path / "one") == content(two, tmp_path / "two") == content(again, tmp_path / "again")
    assert content(one, tmp_path / "one")[:3] == content(fewer, tmp_path / "fewer")
    assert content(one, tmp_path / "one") != content(other, tmp_path / "other")
    for a, b in zip(one, two, strict=True):
        assert Image.open(a.images[0]).tobytes() == Image.open(b.images[0]).tobytes()
    assert [r.id for r in two] == [f"zoom-4-{i}" for i in range(5)]


def test_synthetic_zoom_gold_think_text_names_the_quarter_the_tile_is_in(tmp_path):
    from data_pipelines.synthetic.zoom import zoom_rows

    rows = zoom_rows(tmp_path, 24, seed=1, size=(336, 252), tile=60, clutter=5, distractors=0, direct_share=0.0,
                     grid=2, glyph="stripes", max_pixels=50176)  # fmt: skip
    named = set()
    for row in rows:
        x1, y1, x2, y2 = row.evidence.boxes[0]
        where = f"{'top' if y1 + y2 < 252 else 'bottom'} {'left' if x1 + x2 < 336 else 'right'}"
        think = row.messages[0].plain_text
        assert f"at the {where}" in think, (where, think)
        said = " ".join(m.plain_text for m in row.messages)
        assert "stripes is" not in said  # "the stripes ... are unreadable", "the stripes are rising"
        named.add(where)
    assert len(named) == 4  # every quarter drawn, so a constant word would fail


def test_distill_tools_flag_wins_over_the_rows_own_and_says_so(tmp_path, policy, monkeypatch, capsys):
    """distill's --tools, as vagent rollout's and eval's: offered to every row, replacing a row's own list, with a
    note; without it each row keeps its own (docs/guide/data.md)."""
    import argparse

    import data_pipelines.distill as distill
    from vagent.data import Row, write_rows

    rows = [Row(id="a", question="?", answer="x", answer_type="exact", tools=["crop"]),
            Row(id="b", question="?", answer="x", answer_type="exact")]  # fmt: skip
    data = write_rows(rows, tmp_path / "rows.jsonl")
    seen = []
    monkeypatch.setattr("vagent.rollout.run", lambda policy, tasks, *a, **k: seen.append(tasks) or [])
    monkeypatch.setattr("vagent.model.load_policy", lambda path: policy)
    monkeypatch.setattr(distill, "combine", lambda *a, **k: ([], None))
    parser = argparse.ArgumentParser()
    distill.add_rollout_arguments(parser)
    distill.roll_out(parser.parse_args(["--model", "m", "--data", str(data), "--tools", "crop,zoom_in"]))
    assert [t.tools for t in seen[0]] == [["crop", "zoom_in"]] * 2
    assert "replaces the tools of 1 of 2 rows" in capsys.readouterr().err
    distill.roll_out(parser.parse_args(["--model", "m", "--data", str(data)]))
    assert [t.tools for t in seen[1]] == [["crop"], ["crop"]]

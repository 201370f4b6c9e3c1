"""The video benchmarks as they ship: Video-MME (parquet + .srt), LongVideoBench (lvb_val.json + JSON subtitles),
Charades-STA (the TALL text file and lmms-lab's parquet). Each test writes a tiny copy of the published layout (the
source of each layout is cited where it is written), loads it, and runs it end to end on canned answers."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.videos import write_video
from vagent.eval import BENCHMARKS, BenchmarkError
from vagent.eval.runner import evaluate
from vagent.rollout import RolloutLimits
from vagent.types import Message, Trajectory

# Video-MME, as https://huggingface.co/datasets/lmms-lab/Video-MME ships it (README dataset_info: every column a
# string, options a sequence of strings; videomme/test-*.parquet, subtitle.zip -> subtitle/<videoID>.srt, the
# videos_chunked_*.zip -> data/<videoID>.mp4, as lmms_eval/tasks/videomme/utils.py finds them).
MME_COLUMNS = ("video_id", "duration", "domain", "sub_category", "url", "videoID", "question_id", "task_type",
               "question", "options", "answer")  # fmt: skip
MME_ROWS = [
    ("001", "short", "Knowledge", "Humanity & History", "https://www.youtube.com/watch?v=fFjv93ACGo8", "fFjv93ACGo8",
     "001-1", "Counting Problem", "How many soldiers appear?", ["A. One.", "B. Two.", "C. Three.", "D. Four."], "B"),
    ("001", "short", "Knowledge", "Humanity & History", "https://www.youtube.com/watch?v=fFjv93ACGo8", "fFjv93ACGo8",
     "001-2", "Object Recognition", "What is on the table?", ["A. A map.", "B. A cup.", "C. A gun.", "D. A hat."], "A"),
    ("302", "medium", "Sports Competition", "Football", "https://www.youtube.com/watch?v=Xz1yZ2w3V4u", "Xz1yZ2w3V4u",
     "302-1", "Action Reasoning", "Why does he fall?", ["A. Pushed.", "B. Slipped.", "C. Tired.", "D. Tackled."], "B"),
]  # fmt: skip
# Video-MME's .srt: numbered cues, each line in a <font> tag (the pattern lmms-eval's videomme utils strip).
MME_SRT = ('1\n00:00:01,240 --> 00:00:06,879\n<font color="white" size=".72c">two soldiers walk in</font>\n\n'
           '2\n00:01:05,500 --> 00:01:07,000\n<font color="white" size=".72c">the map is on the table</font>\n')  # fmt: skip


def _mme(root, rows=MME_ROWS):
    (root / "videomme").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "subtitle").mkdir()
    columns = {name: [r[i] for r in rows] for i, name in enumerate(MME_COLUMNS)}
    schema = pa.schema([(n, pa.list_(pa.string()) if n == "options" else pa.string()) for n in MME_COLUMNS])
    pq.write_table(pa.table(columns, schema=schema), root / "videomme" / "test-00000-of-00001.parquet")
    for video_id in ("fFjv93ACGo8", "Xz1yZ2w3V4u"):
        write_video(root / "data" / f"{video_id}.mp4", frames=8)
    (root / "subtitle" / "fFjv93ACGo8.srt").write_text(MME_SRT)  # Xz1yZ2w3V4u has none
    return root / "videomme" / "test-00000-of-00001.parquet"


def test_video_mme_loads_as_it_ships_with_and_without_subtitles(tmp_path):
    data = _mme(tmp_path)
    rows, errors = BENCHMARKS["video-mme"].load(data, None)  # the dataset folder is the one above videomme/
    assert errors == [] and [r.id for r in rows] == ["001-1", "001-2", "302-1"]
    first = rows[0]
    assert first.question == "How many soldiers appear?" and first.choices == ["One.", "Two.", "Three.", "Four."]
    assert first.answer == "B" and first.answer_type == "choice" and first.source == "video-mme"
    assert first.videos == [str(tmp_path / "data" / "fFjv93ACGo8.mp4")]
    assert first.extra["groups"] == {"duration": "short", "domain": "Knowledge", "task_type": "Counting Problem"}

    subbed, errors = BENCHMARKS["video-mme-sub"].load(data, tmp_path)
    assert errors == [] and [r.answer for r in subbed] == ["B", "A", "B"]
    assert subbed[0].question == ("This video's subtitles are listed below, each with the second it starts at:\n"
                                  "[1.2s] two soldiers walk in\n[65.5s] the map is on the table\n"
                                  "How many soldiers appear?")  # fmt: skip
    # no .srt for this video: no subtitles, as lmms-eval does, not a bad record
    assert "No subtitles available\nWhy does he fall?" in subbed[2].question


def test_video_mme_bad_records_are_named_and_the_rest_loads(tmp_path):
    bad = [MME_ROWS[0], (*MME_ROWS[1][:10], "E"), (*MME_ROWS[2][:5], "gone", *MME_ROWS[2][6:])]
    data = _mme(tmp_path, bad)
    rows, errors = BENCHMARKS["video-mme"].load(data, None)
    assert [r.id for r in rows] == ["001-1"]
    reasons = dict(errors)
    assert "field 'answer'" in reasons["question_id '001-2' (test-00000-of-00001.parquet[1])"]
    assert "field 'videoID' names a missing file" in reasons["question_id '302-1' (test-00000-of-00001.parquet[2])"]
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(BenchmarkError, match="broken.parquet"):
        BENCHMARKS["video-mme"].load(tmp_path / "broken.parquet", tmp_path)


# LongVideoBench, as https://huggingface.co/datasets/longvideobench/LongVideoBench ships it and its own loader reads it
# (github.com/longvideobench/LongVideoBench, longvideobench/longvideobench_dataset.py): lvb_val.json, videos/,
# subtitles/ (a JSON list of {"start", "end", "line"} for YouTube videos, {"timestamp", "text"} for TikTok ones).
def _lvb_record(rid, choice, candidates=("a dog", "a cat", "a bird", "a fish"), **extra):
    return {"video_id": rid.split("_")[0], "question": f"What animal appears? ({rid})", "question_wo_referring_query":
            "What animal appears?", "candidates": list(candidates), "correct_choice": choice, "position": [120],
            "topic_category": "LV-Lifestyle-Life-Vlogs", "question_category": "S2E", "level": "L1-Perception",
            "id": rid, "video_path": f"{rid.split('_')[0]}.mp4", "subtitle_path": f"{rid.split('_')[0]}_en.json",
            "duration_group": 15, "starting_timestamp_for_subtitles": 60.0, "duration": 9.0, "view_count": 10,
            "type": "local", **extra}  # fmt: skip


def _lvb(root, records):
    (root / "videos").mkdir(parents=True)
    (root / "subtitles").mkdir()
    (root / "lvb_val.json").write_text(json.dumps(records))
    for video in {r["video_path"] for r in records}:
        write_video(root / "videos" / video, frames=8)
    youtube = [{"start": "00:00:10.000", "end": "00:00:12.000", "line": "before the clip"},
               {"start": "00:01:05.500", "end": "00:01:07.000", "line": "here is the dog"},
               {"start": "00:01:30.000", "end": "00:01:31.000", "line": "after the clip"}]  # fmt: skip
    tiktok = [{"timestamp": [59.0, 61.0], "text": " it starts"}, {"timestamp": [68.0, None], "text": " The"}]
    (root / "subtitles" / "86CxyhFV9MI_en.json").write_text(json.dumps(youtube))
    (root / "subtitles" / "@user-7311_en.json").write_text(json.dumps(tiktok))
    return root / "lvb_val.json"


def test_longvideobench_choices_are_zero_based_and_subtitles_follow_the_clip(tmp_path):
    data = _lvb(tmp_path, [_lvb_record("86CxyhFV9MI_0", 2), _lvb_record("@user-7311_1", 0)])
    rows, errors = BENCHMARKS["longvideobench"].load(data, None)
    assert errors == []
    # correct_choice 2 of [a dog, a cat, a bird, a fish] is the third option, "C" ("a bird"); 0 is "A"
    assert [r.answer for r in rows] == ["C", "A"] and rows[0].choices == ["a dog", "a cat", "a bird", "a fish"]
    assert rows[0].videos == [str(tmp_path / "videos" / "86CxyhFV9MI.mp4")]
    assert rows[0].extra["groups"] == {"duration_group": "15", "question_category": "S2E"}
    # subtitle times move to the clip (starting at 60 s of the source video); lines outside its 9 s are left out
    assert rows[0].question == ("This video's subtitles are listed below, each with the second it starts at:\n"
                                "[5.5s] here is the dog\nWhat animal appears? (86CxyhFV9MI_0)")  # fmt: skip
    assert "[0.0s] it starts\n[8.0s] The\nWhat animal" in rows[1].question  # a null end runs to the clip's end
    bare, errors = BENCHMARKS["longvideobench-nosub"].load(data, tmp_path)
    assert errors == [] and bare[0].question == "What animal appears? (86CxyhFV9MI_0)" and bare[0].answer == "C"


def test_longvideobench_bad_records_are_named_and_the_rest_loads(tmp_path):
    records = [_lvb_record("86CxyhFV9MI_0", 1), _lvb_record("86CxyhFV9MI_1", 4),
               {k: v for k, v in _lvb_record("86CxyhFV9MI_2", 0).items() if k != "correct_choice"},
               _lvb_record("86CxyhFV9MI_3", 0, subtitle_path="missing_en.json")]  # fmt: skip
    rows, errors = BENCHMARKS["longvideobench"].load(_lvb(tmp_path, records), None)
    assert [r.id for r in rows] == ["86CxyhFV9MI_0"] and rows[0].answer == "B"
    reasons = dict(errors)
    assert "field 'correct_choice' 4 is not an index" in reasons["id '86CxyhFV9MI_1' (lvb_val.json[1])"]
    assert "field 'correct_choice' is missing" in reasons["id '86CxyhFV9MI_2' (lvb_val.json[2])"]
    assert "field 'subtitle_path' names a missing file" in reasons["id '86CxyhFV9MI_3' (lvb_val.json[3])"]


# Charades-STA: charades_sta_test.txt as the TALL README (github.com/jiyanggao/TALL) describes it,
# "[video name] [start time] [end time]##[sentence]"; and https://huggingface.co/datasets/lmms-lab/charades_sta
# (README dataset_info: video string, caption string, timestamp sequence of float16; data/test-*.parquet,
# Charades_v1_480_part_*.zip -> Charades_v1_480/<video>, as lmms_eval/tasks/charades_sta/utils.py finds them).
CHARADES = [("3MSZA", 24.3, 30.4, "person turn a light on."), ("3MSZA", 0.0, 6.9, "person opening a door."),
            ("AO8RW", 97.1, 113.7, "a person is putting a book on a shelf.")]  # fmt: skip


def _charades(root):
    (root / "data").mkdir(parents=True)
    (root / "Charades_v1_480").mkdir()
    for video in {c[0] for c in CHARADES}:
        write_video(root / "Charades_v1_480" / f"{video}.mp4", frames=8)
    (root / "charades_sta_test.txt").write_text("".join(f"{v} {s} {e}##{q}\n" for v, s, e, q in CHARADES))
    table = pa.table({"video": [f"{c[0]}.mp4" for c in CHARADES], "caption": [c[3].rstrip(".") for c in CHARADES],
                      "timestamp": pa.array([[c[1], c[2]] for c in CHARADES], pa.list_(pa.float16()))})  # fmt: skip
    pq.write_table(table, root / "data" / "test-00000-of-00001.parquet")
    return root / "charades_sta_test.txt", root / "data" / "test-00000-of-00001.parquet"


def test_charades_sta_text_and_parquet_give_the_same_rows(tmp_path):
    txt, parquet = _charades(tmp_path)
    benchmark = BENCHMARKS["temporal-grounding"]
    from_txt, errors = benchmark.load(txt, tmp_path / "Charades_v1_480")
    assert errors == []
    from_parquet, errors = benchmark.load(parquet, None)  # videos default to Charades_v1_480/ beside data/
    assert errors == []
    assert [r.to_dict() for r in from_txt] == [r.to_dict() for r in from_parquet]
    first = from_txt[0]
    assert first.id == "3MSZA_0" and first.answer == [24.3, 30.4] and first.answer_type == "span"  # not 24.296875
    assert first.question.startswith('When does this happen in the video: "person turn a light on"?')
    assert first.videos == [str(tmp_path / "Charades_v1_480" / "3MSZA.mp4")] and from_txt[2].answer == [97.1, 113.7]


def test_charades_sta_bad_lines_are_named_by_line_and_field(tmp_path):
    txt, _ = _charades(tmp_path)
    txt.write_text("3MSZA 24.3 30.4##person turn a light on.\nAO8RW x 6.9##a person opens a door.\n"
                   "3MSZA 24.3 30.4 person sits.\nNOPE1 1.0 2.0##a missing video.\n3MSZA 9.0 3.0##backwards.\n")  # fmt: skip
    rows, errors = BENCHMARKS["temporal-grounding"].load(txt, tmp_path / "Charades_v1_480")
    assert [r.id for r in rows] == ["3MSZA_0"]
    reasons = dict(errors)
    assert "field 'start' is not a number" in reasons["charades_sta_test.txt:2"]
    assert "VIDEO START END##SENTENCE" in reasons["charades_sta_test.txt:3"]
    assert "field 'video' names a missing file" in reasons["video 'NOPE1.mp4' (charades_sta_test.txt:4)"]
    assert "start < end" in reasons["video '3MSZA.mp4' (charades_sta_test.txt:5)"]


def _canned(answer: str):
    def episodes(tasks, n_samples, progress):
        for task in tasks:
            for _ in range(n_samples):
                progress(Trajectory(task.id, [Message.text("assistant", f"<answer>{answer}</answer>")], answer=answer,
                                    stop_reason="answered"))  # fmt: skip

    return episodes


@pytest.mark.parametrize(("name", "answer", "expected"), [
    ("video-mme", "B", {"accuracy": 2 / 3, "by_duration": {"short": 0.5, "medium": 1.0}}),
    ("video-mme-sub", "B", {"accuracy": 2 / 3, "by_task_type": {"Counting Problem": 1.0, "Object Recognition": 0.0,
                                                    "Action Reasoning": 1.0}}),
    ("longvideobench", "B", {"accuracy": 1 / 2, "by_question_category": {"S2E": 0.5}}),
    ("longvideobench-nosub", "B", {"accuracy": 1 / 2, "by_duration_group": {"15": 0.5}}),
    ("temporal-grounding", "[24.3, 30.4]", {"iou": 1 / 3, "r@0.7": 1 / 3}),
])  # fmt: skip
def test_each_video_benchmark_runs_end_to_end(tmp_path, name, answer, expected):
    if name.startswith("video-mme"):
        data = _mme(tmp_path)
    elif name.startswith("longvideobench"):
        data = _lvb(tmp_path, [_lvb_record("86CxyhFV9MI_0", 1), _lvb_record("86CxyhFV9MI_1", 3)])
    else:
        data = _charades(tmp_path)[1]
    benchmark = BENCHMARKS[name]
    rows, errors = benchmark.load(data, None)
    assert errors == []
    out = tmp_path / "run"
    evaluate(None, benchmark, rows, out, tools=[], limits=RolloutLimits(), episodes=_canned(answer), progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == len(rows) and metrics["benchmark"] == name and metrics["tools"] == "none"
    for key, value in expected.items():
        if isinstance(value, dict):  # the benchmark's own split: each group's mean of the primary metric
            assert {g: m[benchmark.metrics[0]] for g, m in metrics[key].items()} == pytest.approx(value), key
        else:
            assert metrics[key] == pytest.approx(value), key


def test_video_mme_with_subtitles_refuses_a_dataset_whose_subtitles_were_never_unzipped(tmp_path):
    data = _mme(tmp_path)
    for srt in (tmp_path / "subtitle").iterdir():
        srt.unlink()
    (tmp_path / "subtitle").rmdir()
    assert BENCHMARKS["video-mme"].load(data, None)[0]  # without subtitles: fine
    with pytest.raises(BenchmarkError, match="unzip subtitle.zip"):
        BENCHMARKS["video-mme-sub"].load(data, None)

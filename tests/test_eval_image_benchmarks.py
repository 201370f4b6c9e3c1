"""High-resolution image benchmarks: each loader on a tiny file in the layout the benchmark ships (written here; the
source of each layout is cited where it is written), the records it must refuse, the scores, and one run each."""

from __future__ import annotations

import base64
import io
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vagent.eval import BENCHMARKS, BenchmarkError
from vagent.eval.benchmarks.visualprobe import match
from vagent.eval.benchmarks.vstar import convert_folder
from vagent.eval.runner import evaluate
from vagent.recipes.evaluate import order_options
from vagent.rollout import RolloutLimits
from vagent.types import Message, Trajectory


def _jpeg(color: tuple[int, int, int], path=None) -> str:
    """A 64x48 JPEG, saved to ``path`` if given; its base64."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buffer, format="JPEG")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buffer.getvalue())
    return base64.b64encode(buffer.getvalue()).decode()


def _fake(tasks, n_samples, progress):
    """Every episode answers "B" (the ``episodes=`` hook: no model)."""
    for task in tasks:
        for _ in range(n_samples):
            progress(Trajectory(task.id, [Message.text("assistant", "<answer>B</answer>")], answer="B",
                                stop_reason="answered"))  # fmt: skip


def _run(name, rows, out):
    evaluate(None, BENCHMARKS[name], rows, out, tools=[], limits=RolloutLimits(), episodes=_fake, progress=False)
    return json.loads((out / "metrics.json").read_text())


# ----------------------------------------------------------------------------------------------------------- V*

INSTRUCTION = "Answer with the option's letter from the given choices directly."


@pytest.fixture
def vstar(tmp_path):
    """V* as huggingface.co/datasets/craigwu/vstar_bench ships it: direct_attributes/ and relative_position/ of
    <name>.jpg + <name>.json (github.com/penghao-wu/vstar README "Benchmark": target_object, bbox as x, y, w, h,
    question, options with the correct one first), GPT4V-hard/ (not part of the bench), and test_questions.jsonl
    (question_id, image, text with "(A) ..." options and the instruction, category, label: the fields
    lmms_eval/tasks/vstar_bench/utils.py reads)."""
    root = tmp_path / "vstar_bench"
    annotations = {
        "direct_attributes/sa_1": {"target_object": ["cup"], "bbox": [[10, 20, 30, 40]],
                                   "question": "What is the color of the cup?",
                                   "options": ["red", "blue", "green", "white"]},
        "relative_position/sa_2": {"target_object": ["dog", "car"], "bbox": [[1, 2, 3, 4], [5, 6, 7, 8]],
                                   "question": "Is the dog on the left or right side of the car?",
                                   "options": ["The dog is on the left side of the car.",
                                               "The dog is on the right side of the car."]},
        "GPT4V-hard/1": {"question": "not in the bench", "options": ["a", "b"]},
    }  # fmt: skip
    for name, annotation in annotations.items():
        _jpeg((200, 30, 30), root / f"{name}.jpg")
        (root / f"{name}.json").write_text(json.dumps(annotation))
    questions = [
        {"question_id": 0, "image": "direct_attributes/sa_1.jpg", "category": "direct_attributes", "label": "B",
         "text": f"What is the color of the cup?\n(A) blue\n(B) red\n(C) green\n(D) white\n{INSTRUCTION}"},
        {"question_id": 1, "image": "relative_position/sa_2.jpg", "category": "relative_position", "label": "A",
         "text": "Is the dog on the left or right side of the car? (A) left (B) right"},  # inline, no instruction
    ]  # fmt: skip
    (root / "test_questions.jsonl").write_text("\n".join(json.dumps(q) for q in questions) + "\n")
    return root


def test_vstar_test_questions_jsonl_as_it_ships(vstar):
    rows, errors = BENCHMARKS["vstar"].load(vstar / "test_questions.jsonl", None)
    assert errors == [] and [r.id for r in rows] == ["0", "1"]
    cup, dog = rows
    assert cup.question == "What is the color of the cup?" and cup.choices == ["blue", "red", "green", "white"]
    assert cup.answer == "B" and cup.images == [str(vstar / "direct_attributes" / "sa_1.jpg")]
    assert cup.extra["groups"] == {"category": "direct_attributes"} and cup.extra["type"] == ["direct_attributes"]
    assert dog.question == "Is the dog on the left or right side of the car?" and dog.choices == ["left", "right"]


def test_vstar_folder_shuffles_by_id_and_keeps_the_stored_order_for_option_order_as_listed(vstar):
    rows, errors = BENCHMARKS["vstar"].load(vstar, None)
    assert errors == [] and [r.id for r in rows] == ["direct_attributes/sa_1", "relative_position/sa_2"]
    cup = rows[0]
    assert cup.choices[ord(cup.answer) - ord("A")] == "red" and sorted(cup.choices) == ["blue", "green", "red", "white"]
    assert cup.evidence.boxes == [[10, 20, 40, 60]]  # x, y, w, h -> x1, y1, x2, y2
    assert cup.extra["groups"] == {"category": "direct_attributes"} and cup.extra["target_object"] == ["cup"]
    again, _ = BENCHMARKS["vstar"].load(vstar, None)
    assert [(r.choices, r.answer) for r in again] == [(r.choices, r.answer) for r in rows]  # same order every load
    stored = order_options(rows, "as-listed")  # vagent eval --option-order as-listed: the JSON's order, answer at A
    assert [r.answer for r in stored] == ["A", "A"] and stored[0].choices == ["red", "blue", "green", "white"]
    # over many ids the seeded order puts the answer at every letter, not always at A
    record = {"question": "q", "options": ["right", "w1", "w2", "w3"], "_image": "x.jpg", "_category": "c"}
    assert {convert_folder(f"c/{i}.jpg", record).answer for i in range(40)} == set("ABCD")
    (vstar / "empty").mkdir()
    with pytest.raises(BenchmarkError, match="holds no V. images"):
        BENCHMARKS["vstar"].load(vstar / "empty", None)


def test_vstar_bad_records_name_their_index_and_field(vstar):
    (vstar / "relative_position" / "sa_3.jpg").write_bytes((vstar / "relative_position" / "sa_2.jpg").read_bytes())
    (vstar / "direct_attributes" / "sa_4.json").write_text(json.dumps({"question": "q", "options": ["only one"]}))
    _jpeg((0, 0, 0), vstar / "direct_attributes" / "sa_4.jpg")
    rows, errors = BENCHMARKS["vstar"].load(vstar, None)
    reasons = dict(errors)
    assert len(rows) == 2 and "annotation sa_3.json" in reasons["relative_position/sa_3.jpg"]
    assert "field 'options'" in reasons["direct_attributes/sa_4.jpg"]
    image = "direct_attributes/sa_1.jpg"
    bad = [{"question_id": 7, "image": image, "category": "c", "label": "A", "text": "no options"},
           {"question_id": 8, "image": image, "category": "c", "label": "E", "text": "Q? (A) x (B) y"}]  # fmt: skip
    (vstar / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    rows, errors = BENCHMARKS["vstar"].load(vstar / "bad.jsonl", None)
    reasons = dict(errors)
    assert rows == [] and "field 'text'" in reasons["question_id 7 (bad.jsonl:1)"]
    assert "field 'label'" in reasons["question_id 8 (bad.jsonl:2)"]


def test_vstar_runs_end_to_end(vstar, tmp_path):
    rows, _ = BENCHMARKS["vstar"].load(vstar / "test_questions.jsonl", None)
    metrics = _run("vstar", rows, tmp_path / "run")
    assert metrics["n"] == 2 and metrics["accuracy"] == 0.5 and metrics["parsed"] == 1.0  # "B" right for the cup


# ------------------------------------------------------------------------------------------------------ HR-Bench

COLUMNS = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]


def _hrbench(images: list[str]) -> list[dict]:
    """2 questions x 4 cycles (options rotated), in HR-Bench's columns. Q0 (single) has its answer at B in cycles 0-2
    and at C in cycle 3; Q1 (cross) at B in cycle 0 only. An episode answering "B" is right 3/4 on Q0, 1/4 on Q1."""
    rows = []
    for q, (category, gold_at) in enumerate([("single", "BBBC"), ("cross", "BACD")]):
        for cycle in range(4):
            options = ["w1", "w2", "w3"]
            options.insert("ABCD".index(gold_at[cycle]), "gold")
            rows.append({"index": q * 4 + cycle, "question": f"Question {q}?", "answer": gold_at[cycle],
                         "category": category, **dict(zip("ABCD", options, strict=True)),
                         "cycle_category": str(cycle), "image": images[q]})  # fmt: skip
    return rows


@pytest.fixture
def hrbench(tmp_path):
    """hr_bench_4k.tsv as VLMEvalKit reads it (pd.read_csv(sep="\\t"); written by pandas' to_csv, as the HF files
    were) and hr_bench_4k.parquet with the column types of huggingface.co/datasets/DreamMr/HR-Bench (index int64,
    the rest strings, the image a base64 string: lmms_eval/tasks/hrbench/utils.py decodes doc["image"])."""
    images = [_jpeg((10, 200, 10)), _jpeg((10, 10, 200))]
    records = _hrbench(images)
    pd.DataFrame(records, columns=COLUMNS).to_csv(tmp_path / "hr_bench_4k.tsv", sep="\t", index=False)
    schema = pa.schema([("index", pa.int64())] + [(c, pa.string()) for c in COLUMNS[1:]])
    pq.write_table(pa.Table.from_pylist(records, schema=schema), tmp_path / "hr_bench_8k.parquet")
    return tmp_path


@pytest.mark.parametrize("name", ["hr_bench_4k.tsv", "hr_bench_8k.parquet"])
def test_hrbench_loads_and_decodes_each_image_once(hrbench, name):
    rows, errors = BENCHMARKS["hr-bench"].load(hrbench / name, None)
    assert errors == [] and [r.id for r in rows] == [str(i) for i in range(8)]
    first = rows[3]
    assert first.question == "Question 0?" and first.answer == "C" and first.choices == ["w1", "w2", "gold", "w3"]
    assert first.extra["groups"] == {"category": "single", "cycle": "3"}
    folder = hrbench / f"{name.rsplit('.', 1)[0]}_images"
    assert sorted(p.name for p in folder.iterdir()) == sorted({p.rsplit("/", 1)[-1] for r in rows for p in r.images})
    assert len(list(folder.iterdir())) == 2 and len({r.images[0] for r in rows[:4]}) == 1  # the 4 cycles share one
    assert Image.open(first.images[0]).size == (64, 48)
    made = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    again, _ = BENCHMARKS["hr-bench"].load(hrbench / name, None)
    assert [r.images for r in again] == [r.images for r in rows]
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == made  # reused, not written again


def test_hrbench_image_cells_that_name_a_row_and_bad_records(hrbench, tmp_path):
    records = _hrbench([_jpeg((1, 2, 3)), _jpeg((4, 5, 6))])
    for r in records[1:4]:
        r["image"] = "0"  # VLMEvalKit's dedup: a short cell is the index of the row holding the image
    records[5]["answer"] = "E"
    records[6]["B"] = None  # an empty cell: the options stop at A
    records[7]["image"] = "99"
    pd.DataFrame(records, columns=COLUMNS).to_csv(tmp_path / "refs.tsv", sep="\t", index=False)
    rows, errors = BENCHMARKS["hr-bench"].load(tmp_path / "refs.tsv", None)
    assert [r.id for r in rows] == ["0", "1", "2", "3", "4"] and len({r.images[0] for r in rows[:4]}) == 1
    reasons = dict(errors)
    assert "field 'answer'" in reasons["index '5' (refs.tsv[5])"]
    assert "fields 'A' and 'B'" in reasons["index '6' (refs.tsv[6])"]
    assert "names row '99'" in reasons["id '7'"]


def test_hrbench_scores_the_mean_over_cycles_by_hand(hrbench, tmp_path):
    rows, _ = BENCHMARKS["hr-bench"].load(hrbench / "hr_bench_4k.tsv", None)
    metrics = _run("hr-bench", rows, tmp_path / "run")
    # per cycle (Q0, Q1 right?): c0 (1, 1) = 1, c1 (1, 0) = .5, c2 (1, 0) = .5, c3 (0, 0) = 0 -> mean over cycles 0.5;
    # "all four cycles right" (CircularEval) would be 0 of 2 questions
    assert metrics["cycle_mean"] == pytest.approx(0.5) and metrics["accuracy"] == pytest.approx(0.5)
    assert [metrics[f"cycle/{c}"] for c in "0123"] == pytest.approx([1.0, 0.5, 0.5, 0.0])
    assert metrics["cycle_mean/single"] == pytest.approx(0.75) and metrics["cycle_mean/cross"] == pytest.approx(0.25)


# ----------------------------------------------------------------------------------------------- MME-RealWorld


@pytest.fixture
def mme(tmp_path):
    """MME_RealWorld.json records as github.com/yfzhang114/MME-RealWorld evaluation/output_test_template.json shows
    them (no Output), both spellings of "Question Type", images under the image folder."""
    images = tmp_path / "images"
    _jpeg((9, 9, 9), images / "AutonomousDriving" / "a.jpg")
    _jpeg((8, 8, 8), images / "monitoring_images" / "b.jpg")
    records = [
        {"Question_id": "Perception/Autonomous_Driving/Objects_Identify/0000", "Question Type": "Multiple Choice",
         "Image": "AutonomousDriving/a.jpg", "Text": "What are objects to the front of the ego car?",
         "Answer choices": ["(A) many cars", "(B) one truck", "(C) two buses", "(D) nothing",
                            "(E) All the above answers are wrong."],
         "Ground truth": "B", "Task": "Perception", "Subtask": "Autonomous_Driving", "Category": "Objects_Identify"},
        {"Question_id": "perception/monitoring/Vehicle/counting/0310", "Question type": "Multiple Choice",
         "Image": "monitoring_images/b.jpg", "Text": "What is the number of buses in the image?",
         "Answer choices": ["(A) 13", "(B) 90", "(C) 77", "(D) 6", "(E) The image does not feature the buses"],
         "Ground truth": "E", "Task": "Perception", "Subtask": "Monitoring", "Category": "Vehicle/counting"},
        {"Question_id": "perception/monitoring/person/0001", "Question Type": "Multiple Choice",
         "Image": "monitoring_images/b.jpg", "Text": "What color is the coat?",
         "Answer choices": ["(A) red", "(B) blue", "(C) black", "(D) white", "(E) The image does not feature the coat"],
         "Ground truth": "B", "Task": "Perception", "Subtask": "Monitoring", "Category": "Person/attribute/color"},
    ]  # fmt: skip
    (tmp_path / "MME_RealWorld.json").write_text(json.dumps(records, indent=4))
    return tmp_path


def test_mme_realworld_json_as_it_ships_with_its_groups(mme):
    rows, errors = BENCHMARKS["mme-realworld"].load(mme / "MME_RealWorld.json", mme / "images")
    assert errors == [] and len(rows) == 3
    first = rows[0]
    assert first.question == "What are objects to the front of the ego car?" and first.answer == "B"
    assert first.choices == ["many cars", "one truck", "two buses", "nothing", "All the above answers are wrong."]
    assert first.images == [str(mme / "images" / "AutonomousDriving" / "a.jpg")]
    # eval_your_results.py: a category lowercased, every ".../attribute..." one merged; each level within its parent
    assert [r.extra["groups"] for r in rows] == [
        {"task": "Perception", "subtask": "Perception/Autonomous_Driving",
         "category": "Perception/Autonomous_Driving/objects_identify"},
        {"task": "Perception", "subtask": "Perception/Monitoring",
         "category": "Perception/Monitoring/vehicle/counting"},
        {"task": "Perception", "subtask": "Perception/Monitoring",
         "category": "Perception/Monitoring/person/attribute"},
    ]  # fmt: skip


def test_mme_realworld_vlmevalkit_tsv_and_lmms_eval_parquet(tmp_path):
    """mme_realworld_lite.tsv (huggingface.co/datasets/yifanzhang114/MME-RealWorld-Base64; VLMEvalKit's MMERealWorld
    eval()s its "multi-choice options" cell, a list literal) and the lmms-eval parquet (MME-RealWorld-lite-lmms-eval:
    the options a list, the base64 image in "bytes")."""
    image = _jpeg((50, 60, 70))
    options = ["(A) 458", "(B) 457", "(C) 456", "(D) 455", "(E) This image doesn't feature the data."]
    record = {"index": 12, "question": "What is the data of Interest in Feb-23 in the table?", "answer": "B",
              "category": "Perception/Diagram and Table", "l2-category": "diagram"}  # fmt: skip
    pd.DataFrame([{**record, "image": image, "multi-choice options": str(options)}]).to_csv(
        tmp_path / "mme_realworld_lite.tsv", sep="\t", index=False)  # fmt: skip
    pq.write_table(pa.Table.from_pylist([{**record, "multi-choice options": options, "bytes": image}]),
                   tmp_path / "lite.parquet")  # fmt: skip
    for name in ("mme_realworld_lite.tsv", "lite.parquet"):
        rows, errors = BENCHMARKS["mme-realworld"].load(tmp_path / name, None)
        assert errors == [] and len(rows) == 1
        row = rows[0]
        assert row.id == "12" and row.answer == "B" and row.choices[:2] == ["458", "457"] and len(row.choices) == 5
        assert row.extra["groups"]["category"] == "Perception/Diagram and Table/diagram"
        assert Image.open(row.images[0]).size == (64, 48)


def test_mme_realworld_bad_records_name_their_id_and_field(mme):
    records = json.loads((mme / "MME_RealWorld.json").read_text())
    records[0]["Ground truth"] = "F"
    records[1]["Answer choices"] = ["13", "90"]
    del records[2]["Task"]
    (mme / "bad.json").write_text(json.dumps(records))
    rows, errors = BENCHMARKS["mme-realworld"].load(mme / "bad.json", mme / "images")
    reasons = dict(errors)
    assert rows == [] and len(errors) == 3
    ids = [r["Question_id"] for r in records]
    assert "field 'Ground truth'" in reasons[f"Question_id {ids[0]!r} (bad.json[0])"]
    assert "field 'Answer choices'" in reasons[f"Question_id {ids[1]!r} (bad.json[1])"]
    assert "field 'Task'" in reasons[f"Question_id {ids[2]!r} (bad.json[2])"]


def test_mme_realworld_runs_end_to_end(mme, tmp_path):
    rows, _ = BENCHMARKS["mme-realworld"].load(mme / "MME_RealWorld.json", mme / "images")
    metrics = _run("mme-realworld", rows, tmp_path / "run")
    assert metrics["n"] == 3 and metrics["accuracy"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------------------- VisualProbe


@pytest.fixture
def visualprobe(tmp_path):
    """VisualProbe_Hard/val.json with its images under VisualProbe_Hard/data/ (huggingface.co/datasets/Mini-o3/
    VisualProbe_Hard), records in the format of github.com/Mini-o3/Mini-o3 docs/mini_o3_demo.md, image paths relative
    to BASE_IMAGE_DIR (the folder above VisualProbe_Hard/, as verl/utils/dataset/multimodal_dataset.py joins them)."""
    split = tmp_path / "VisualProbe_Hard"
    _jpeg((90, 90, 90), split / "data" / "0.jpg")
    records = [
        {"images": ["VisualProbe_Hard/data/0.jpg"], "doc_id": "hard_0", "problem": "<image>\nWhat does the sign say?",
         "solution": "Jptica.", "data_source": "visual_probe_hard"},
        {"images": ["VisualProbe_Hard/data/0.jpg"], "doc_id": "hard_1", "problem": "<image>\nWhich option? (A) x (B) y",
         "solution": "B", "data_source": "visual_probe_hard"},
    ]  # fmt: skip
    (split / "val.json").write_text(json.dumps(records, indent=4))
    return split


def test_visualprobe_loads_as_it_ships(visualprobe, tmp_path):
    rows, errors = BENCHMARKS["visualprobe"].load(visualprobe / "val.json", None)
    assert errors == [] and [r.id for r in rows] == ["hard_0", "hard_1"]
    assert rows[0].question == "What does the sign say?" and rows[0].answer == "Jptica."
    assert rows[0].images == [str(visualprobe / "data" / "0.jpg")] and rows[0].extra["groups"] == {"difficulty": "hard"}
    rooted, _ = BENCHMARKS["visualprobe"].load(visualprobe / "val.json", tmp_path)  # --image-root = BASE_IMAGE_DIR
    assert rooted[0].images == rows[0].images


def test_visualprobe_rule_scores_and_bad_records(visualprobe):
    assert match("The sign reads JPTICA", "Jptica.") == {"contains": 1.0, "em": 0.0}
    assert match("jptica", "Jptica.") == {"contains": 1.0, "em": 1.0}
    assert match("There are 12 cars", "2")["contains"] == 0.0  # whole words, not substrings
    assert match("(B) y", "B") == {"contains": 1.0, "em": 1.0} and match("A", "B")["contains"] == 0.0
    assert match(None, "x") == {"contains": 0.0, "em": 0.0}
    records = json.loads((visualprobe / "val.json").read_text())
    del records[0]["solution"]
    records[1]["images"] = ["VisualProbe_Hard/data/missing.jpg"]
    (visualprobe / "bad.json").write_text(json.dumps(records))
    rows, errors = BENCHMARKS["visualprobe"].load(visualprobe / "bad.json", None)
    reasons = dict(errors)
    assert rows == [] and "field 'solution'" in reasons["doc_id 'hard_0' (bad.json[0])"]
    assert "field 'images'" in reasons["doc_id 'hard_1' (bad.json[1])"]


def test_visualprobe_runs_end_to_end(visualprobe, tmp_path):
    rows, _ = BENCHMARKS["visualprobe"].load(visualprobe / "val.json", None)
    metrics = _run("visualprobe", rows, tmp_path / "run")
    assert metrics["n"] == 2 and metrics["contains"] == 0.5 and metrics["em"] == 0.5  # "B" is right on hard_1 only

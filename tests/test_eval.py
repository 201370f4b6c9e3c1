"""Evaluation: loaders for each published format, metrics by hand, the runner (resume, skip/fail), reports."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.videos import write_video
from vagent.cli import main
from vagent.eval import BENCHMARKS
from vagent.eval.metrics import f1_em_metrics, summarize, temporal_metrics
from vagent.eval.runner import evaluate, read_samples
from vagent.rollout import RolloutLimits

LIMITS = RolloutLimits(max_turns=2, max_new_tokens=8, temperature=0.0)


def test_metrics_by_hand():
    assert f1_em_metrics("北京大学", ["北京"]) == {"f1": pytest.approx(2 / 3), "em": 0.0}  # character-level F1
    assert f1_em_metrics("the Paris", ["paris", "paris france"]) == {"f1": 1.0, "em": 1.0}
    assert f1_em_metrics(None, ["x"]) == {"f1": 0.0, "em": 0.0}
    # [0, 10] vs [5, 15]: IoU 1/3; [5, 15] exact: 1; none: 0 -> mIoU 4/9, R@0.3 = 2/3, R@0.5 = R@0.7 = 1/3
    samples = [{"id": str(i), "sample": 0, **temporal_metrics(p, [5.0, 15.0])} for i, p in
               enumerate(["[0, 10]", "5 to 15", None])]  # fmt: skip
    m = summarize(samples, ["iou", "r@0.3", "r@0.5", "r@0.7"])
    assert (
        m["iou"] == pytest.approx(4 / 9) and m["r@0.3"] == pytest.approx(2 / 3) and m["r@0.5"] == pytest.approx(1 / 3)
    )
    by_type = summarize([{"id": "a", "sample": 0, "em": 1.0, "type": ["ocr"]},
                         {"id": "b", "sample": 0, "em": 0.0, "type": ["ocr", "rotate"]}], ["em"])["by_type"]  # fmt: skip
    assert by_type == {"ocr": {"n": 2, "em": 0.5}, "rotate": {"n": 1, "em": 0.0}}


@pytest.fixture
def files(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (320, 240), (120, 40, 40)).save(images / name)
    write_video(tmp_path / "clip.mp4", frames=24, fps=8.0, size=(96, 64))
    mat_coding = [{"id": 1, "question": "What does the sign say?", "answers": ["stop", "stop sign"], "type": ["rotate"],
                   "ori_image_path": "a.png", "processed_image_path": "a.png"},
                  {"id": 2, "question": "Which brand?", "answers": ["acme"], "type": ["blur"],
                   "ori_image_path": "b.png", "processed_image_path": "b.png"}]  # fmt: skip
    (tmp_path / "mat_coding.json").write_text(json.dumps(mat_coding))
    (tmp_path / "mat_search.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"id": "s1", "question": "Who built it?", "answer": "Eiffel", "image_path": "a.png"},
        {"id": "s2", "question": "When?", "answer": ["1889"], "image_path": "b.png"}]))  # fmt: skip
    (tmp_path / "vstar.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"id": "v1", "image": "a.png", "question": "What color is the cup?", "options": ["A. red", "B. blue"], "answer": "A"},
        {"id": "v2", "image": "b.png", "question": "Left or right?", "options": ["left", "right"], "answer": "right"}]))  # fmt: skip
    (tmp_path / "video_mc.jsonl").write_text(json.dumps(
        {"id": "m1", "video": "../clip.mp4", "question": "Does it get brighter?", "options": ["yes", "no"], "answer": "A"}))  # fmt: skip
    (tmp_path / "tg.jsonl").write_text(json.dumps({"id": "t1", "video": "../clip.mp4", "query": "it gets bright",
                                                   "timestamp": [1.0, 2.5]}))  # fmt: skip
    return tmp_path


@pytest.mark.parametrize(("name", "data", "n"), [("mat-coding", "mat_coding.json", 2), ("mat-search", "mat_search.jsonl", 2),
                                                  ("vstar", "vstar.jsonl", 2), ("video-mc", "video_mc.jsonl", 1),
                                                  ("temporal-grounding", "tg.jsonl", 1)])  # fmt: skip
def test_each_published_format_loads_and_runs(files, policy, name, data, n):
    benchmark = BENCHMARKS[name]
    rows, errors = benchmark.load(files / data, files / "images")
    assert errors == [] and len(rows) == n
    out = files / f"run-{name}"
    metrics = evaluate(policy, benchmark, rows, out, tools=None, limits=LIMITS, progress=False)
    samples = read_samples(out / "samples.jsonl")
    assert [s["id"] for s in samples] == [r.id for r in rows]
    for s in samples:
        assert {"id", "prediction", "gold", "tool_calls", "turns", *benchmark.metrics} <= set(s)
        assert isinstance(s["gold"], list)
    assert set(benchmark.metrics) <= set(metrics) and (out / "trajectories.html").is_file()
    assert "## Scores\n\n| run |" in (out / "metrics.md").read_text()


def test_vstar_options_lose_their_own_letters(files):
    rows, _ = BENCHMARKS["vstar"].load(files / "vstar.jsonl", files / "images")
    assert rows[0].choices == ["red", "blue"] and rows[1].answer == "right"


def test_corrupt_records_are_named_and_skipped_or_fail_the_run(files, tiny_qwen25, capsys):
    (files / "bad.jsonl").write_text("\n".join([
        json.dumps({"id": "ok", "image": "a.png", "question": "Q?", "options": ["x", "y"], "answer": "A"}),
        json.dumps({"id": "noimg", "image": "missing.png", "question": "Q?", "options": ["x", "y"], "answer": "A"}),
        "{not json",
        json.dumps({"id": "type", "image": "a.png", "question": 7, "options": ["x", "y"], "answer": "A"})]))  # fmt: skip
    rows, errors = BENCHMARKS["vstar"].load(files / "bad.jsonl", files / "images")
    assert [r.id for r in rows] == ["ok"]
    reasons = dict(errors)
    assert "missing file" in reasons["id 'noimg' (bad.jsonl:2)"]
    assert "not valid JSON" in reasons["bad.jsonl:3"]
    assert "'question' must be str" in reasons["id 'type' (bad.jsonl:4)"]
    args = ["eval", "--model", str(tiny_qwen25), "--benchmark", "vstar", "--data", str(files / "bad.jsonl"),
            "--image-root", str(files / "images"), "--out", str(files / "bad-run"), "--max-new-tokens", "4"]  # fmt: skip
    assert main(args) == 2 and "3 bad record(s)" in capsys.readouterr().err
    assert main([*args, "--skip-bad"]) == 0
    metrics = json.loads((files / "bad-run" / "metrics.json").read_text())
    assert metrics["n"] == 1 and len(metrics["skipped"]) == 3


def test_an_interrupted_run_finishes_without_repeating_samples(files, policy, monkeypatch):
    import vagent.eval.runner as runner

    benchmark = BENCHMARKS["mat-coding"]
    rows, _ = benchmark.load(files / "mat_coding.json", files / "images")
    rows = rows * 1 + [r.__class__(**{**r.__dict__, "id": r.id + "-copy"}) for r in rows]  # 4 rows
    real_run, ran = runner.run, []

    def run_then_die(policy, tasks, *args, **kwargs):
        ran.extend(t.id for t in tasks)
        result = real_run(policy, tasks, *args, **kwargs)
        if len(ran) >= 2:
            raise KeyboardInterrupt  # killed after the first chunk's samples reached the log
        return result

    monkeypatch.setattr(runner, "run", run_then_die)
    with pytest.raises(KeyboardInterrupt):
        evaluate(policy, benchmark, rows, files / "resume", tools=["crop"], limits=LIMITS, batch_size=2, progress=False)
    first = list(ran)
    monkeypatch.setattr(runner, "run", lambda *a, **k: (ran.extend(t.id for t in a[1]), real_run(*a, **k))[1])
    metrics = evaluate(policy, benchmark, rows, files / "resume", tools=["crop"], limits=LIMITS, batch_size=2,
                       progress=False)  # fmt: skip
    second = ran[len(first) :]
    assert sorted(first + second) == sorted(r.id for r in rows) and not set(first) & set(second)
    assert metrics["n"] == 4 and len(read_samples(files / "resume" / "samples.jsonl")) == 4


def test_no_tool_baseline_and_eval_report(files, policy, tmp_path):
    benchmark = BENCHMARKS["vstar"]
    rows, _ = benchmark.load(files / "vstar.jsonl", files / "images")
    evaluate(policy, benchmark, rows, tmp_path / "tools", tools=None, limits=LIMITS, progress=False)
    metrics = evaluate(policy, benchmark, rows, tmp_path / "no-tools", tools=[], limits=LIMITS, progress=False)
    assert metrics["tools"] == "none" and metrics["tool_calls_per_sample"] == 0.0
    assert (
        main(["eval-report", str(tmp_path / "tools"), str(tmp_path / "no-tools"), "--out", str(tmp_path / "cmp")]) == 0
    )
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| tools |" in table and "| no-tools |" in table
    assert Image.open(tmp_path / "cmp" / "comparison.png").size[0] > 300


def test_an_option_keeps_a_letter_of_its_own_unless_every_option_is_lettered():
    from vagent.eval.benchmarks.vstar import options

    assert options({"options": ["A. red", "B. blue"]}) == ["red", "blue"]
    assert options({"options": ["A. Lincoln", "Washington"]}) == ["A. Lincoln", "Washington"]  # a name, not a letter


def test_the_metrics_name_the_tools_each_row_was_offered():
    """``tools=None`` offers each row its own list where it has one, else the benchmark's defaults: the metrics'
    label says which (a video set whose rows offer crop_clip is not labelled with the default crop)."""
    from types import SimpleNamespace

    from vagent.eval.runner import _tools_label

    bench = SimpleNamespace(tools=["crop"])
    own, plain = SimpleNamespace(tools=["crop_clip"]), SimpleNamespace(tools=None)
    assert _tools_label(None, bench, [plain]) == "crop (default)"
    assert _tools_label(None, bench, [own, own]) == "the rows' own: crop_clip"
    assert _tools_label(None, bench, [own, plain]) == "the rows' own: crop_clip; else crop (default)"
    assert _tools_label([], bench, [own]) == "none" and _tools_label(["search", "code"], bench, [own]) == "search,code"
    assert _tools_label(None, bench, [SimpleNamespace(tools=[])]) == "none"  # rows that offer nothing


def test_sign_flip_p_is_the_exact_paired_permutation_test():
    import itertools
    from math import comb

    from vagent.eval.metrics import sign_flip_p

    # right/wrong rows: McNemar's exact test, the binomial tail of the rows that differ (4 better, 1 worse of 64)
    assert sign_flip_p([1, 1, 1, 1, -1] + [0] * 59) == pytest.approx((comb(5, 4) + comb(5, 5)) / 2**5)
    # row means of three samples: the differences are thirds, and tied sums stay tied (2/3 - 1/3 - 1/3 = 0)
    assert sign_flip_p([2 / 3, -1 / 3, -1 / 3]) == 0.625 and sign_flip_p([2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3]) == 0.5
    assert sign_flip_p([0, 0, 0]) == 1.0 and sign_flip_p([-1, -1]) == 1.0 and sign_flip_p([1, -1]) == 0.75
    # F1 differences: every one of the 2^k sign assignments counted
    diffs = [0.5, -0.25, 1 / 3, 0.2, -0.1, 0.75, 1.0]
    observed = sum(diffs)
    flips = [
        sum(s * abs(d) for s, d in zip(signs, diffs, strict=True))
        for signs in itertools.product((1, -1), repeat=len(diffs))
    ]
    assert sign_flip_p(diffs) == pytest.approx(sum(f >= observed - 1e-9 for f in flips) / len(flips))
    # past max_work: the normal approximation of the same null distribution
    assert sign_flip_p([1] * 30 + [-1] * 20, max_work=1) == pytest.approx(sign_flip_p([1] * 30 + [-1] * 20), abs=0.001)

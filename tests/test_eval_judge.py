"""``vagent eval --judge``: judged accuracy beside F1/EM, verdicts in samples.jsonl and the viewer."""

from __future__ import annotations

import json

from PIL import Image

from tests.test_judge import fake  # noqa: F401 (the scripted judge endpoint fixture)
from vagent.cli import main
from vagent.eval import BENCHMARKS
from vagent.eval.judged import judge_run
from vagent.eval.runner import read_samples
from vagent.judge import JudgeClient


def _mat_search(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 48), (10, 120, 10)).save(images / "a.png")
    records = [{"id": "s1", "question": "Who built it?", "answer": "Gustave Eiffel", "image_path": "a.png"},
               {"id": "s2", "question": "When?", "answer": ["1889"], "image_path": "a.png"},
               {"id": "s3", "question": "Where?", "answer": "Paris", "image_path": "a.png"}]  # fmt: skip
    (tmp_path / "mat_search.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    return BENCHMARKS["mat-search"].load(tmp_path / "mat_search.jsonl", images)[0]


def test_judge_run_grades_predictions_and_counts_failures(fake, tmp_path):  # noqa: F811
    server, url = fake
    rows = _mat_search(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    samples = [{"id": "s1", "sample": 0, "prediction": "Eiffel", "gold": ["Gustave Eiffel"], "f1": 0.67, "em": 0.0},
               {"id": "s2", "sample": 0, "prediction": "in 1890", "gold": ["1889"], "f1": 0.0, "em": 0.0},
               {"id": "s3", "sample": 0, "prediction": None, "gold": ["Paris"], "f1": 0.0, "em": 0.0}]  # fmt: skip
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (out / "metrics.json").write_text(
        json.dumps({"n": 3, "samples": 3, "f1": 0.22, "em": 0.0, "benchmark": "mat-search"})
    )
    server.script = [(200, "Same person.\nJudgement: 1", 0), (200, "hmm", 0)]
    metrics = judge_run(out, rows, JudgeClient(url, "judge", concurrency=1))
    judged = read_samples(out / "samples.jsonl")
    assert [s["judged"] for s in judged] == [1.0, None, 0.0]  # graded; unparseable; no prediction = wrong
    assert judged[0]["judge"]["reasoning"] == "Same person." and judged[1]["judge"]["error"] == "unparseable"
    assert metrics["judged_accuracy"] == 0.5 and metrics["judge_failures"] == 1
    assert metrics["f1"] == 0.22  # beside the F1/EM it already had
    assert "judged_accuracy" in (out / "metrics.md").read_text()
    assert "[Question]: Who built it?" in server.seen[0]["messages"][0]["content"][-1]["text"]


def test_eval_cli_with_judge(fake, tmp_path, tiny_qwen25):  # noqa: F811
    _, url = fake
    _mat_search(tmp_path)
    out = tmp_path / "cli-run"
    args = ["eval", "--model", str(tiny_qwen25), "--benchmark", "mat-search", "--data", str(tmp_path / "mat_search.jsonl"),
            "--image-root", str(tmp_path / "images"), "--out", str(out), "--max-new-tokens", "4", "--max-turns", "1",
            "--tools", "none", "--judge", url]  # fmt: skip
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"f1", "em", "judged_accuracy", "judge_failures"} <= set(metrics) and metrics["judge_model"] == "judge-model"
    assert all("judged" in s and "judge" in s for s in read_samples(out / "samples.jsonl"))
    assert (out / "trajectories.html").is_file()


def test_the_judge_sees_a_choice_rows_options_as_the_policy_did(fake, tmp_path):  # noqa: F811
    from vagent.data import Row

    server, url = fake
    out = tmp_path / "run"
    out.mkdir()
    (out / "samples.jsonl").write_text(json.dumps({"id": "c", "sample": 0, "prediction": "B", "gold": ["A"]}) + "\n")
    (out / "metrics.json").write_text(json.dumps({"n": 1, "samples": 1, "benchmark": "vstar"}))
    server.script = [(200, "Judgement: 0", 0)]
    judge_run(out, [Row("c", "What color is the cup?", "A", "choice", choices=["red", "blue"])],
              JudgeClient(url, "judge", concurrency=1))  # fmt: skip
    assert "[Question]: What color is the cup?\nA. red\nB. blue" in server.seen[0]["messages"][0]["content"][-1]["text"]

"""Test-time turn scaling: a 32-turn episode that crops every turn, per-turn records, the read-off of smaller budgets
(checked against runs made at those budgets), the report's table and figure, and the limits that guard it."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vagent.cli import main
from vagent.data import Judgment, Row, encode_messages
from vagent.eval import BENCHMARKS, BenchmarkError
from vagent.eval.runner import evaluate, read_samples
from vagent.eval.turns import budgets, turn_record, turn_scaling
from vagent.rollout import RolloutLimits, Task, run
from vagent.types import Trajectory

# A small prompt image and a 2x2-patch crop keep a 33-image episode near 3,600 tokens on the tiny checkpoint.
IMAGE = Image.new("RGB", (112, 84), (200, 100, 50))
CROP = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 56, 56]}}</tool_call>'
WIDE = RolloutLimits(max_turns=32, max_new_tokens=8, max_total_tokens=8192, max_images=40, temperature=0.0)


def test_a_32_turn_episode_that_crops_every_turn_holds_33_images_and_reencodes_to_its_ids(policy):
    tasks = [Task(id="crops", question="Where?", images=[IMAGE], scripted_turns=[CROP] * 32),
             Task(id="answers", question="Where?", images=[IMAGE], scripted_turns=[CROP] * 31 + ["<answer>A</answer>"])]  # fmt: skip
    cropped, answered = run(policy, tasks, 1, WIDE)
    assert cropped.stop_reason == "max_turns" and cropped.metrics["turns"] == 32 and cropped.metrics["tool_calls"] == 32
    assert answered.stop_reason == "answered" and answered.metrics["turns"] == 32
    assert len(cropped.images) == 33 and len(answered.images) == 32
    min_pixels, max_pixels = policy.pixel_budget
    for t in (cropped, answered):
        assert not any(r.error for r in t.tool_results)
        encoded = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
        assert encoded.input_ids.tolist() == t.token_ids  # the one encoder gives back what the engine built
        assert int(encoded.image_grid_thw.shape[0]) == len(t.images)
    assert turn_record(cropped) == {"answer_turn": None, "images": 33, "images_by_turn": list(range(1, 34))}
    assert turn_record(answered) == {"answer_turn": 32, "images": 32, "images_by_turn": [*range(1, 33), 32]}


def test_a_run_at_a_smaller_budget_is_the_larger_runs_episodes_cut_there(policy):
    """Greedy, with sampled turns between the scripted ones: every episode of a run at 4 turns is the run at 8's, its
    tokens a prefix and its per-turn record the same up to turn 4 (one row in flight, so batches cannot differ)."""
    tasks = [Task(id="a", question="Where?", images=[IMAGE], scripted_turns=[None, CROP, None, "<answer>A</answer>"]),
             Task(id="b", question="Where?", images=[IMAGE], scripted_turns=[CROP, None] * 3 + [CROP])]  # fmt: skip
    short = run(policy, tasks, 1, RolloutLimits(**{**WIDE.__dict__, "max_turns": 4}), batch_size=1)
    long = run(policy, tasks, 1, RolloutLimits(**{**WIDE.__dict__, "max_turns": 8}), batch_size=1)
    assert [t.metrics["sampled_tokens"] > 0 for t in long] == [True, True]
    for cut, whole in zip(short, long, strict=True):
        assert (
            cut.token_ids == whole.token_ids[: len(cut.token_ids)]
            and cut.loss_mask == whole.loss_mask[: len(cut.loss_mask)]
        )
        assert turn_record(cut)["images_by_turn"] == turn_record(whole)["images_by_turn"][:5]
    assert short[0].token_ids == long[0].token_ids and turn_record(long[0])["answer_turn"] == 4  # answered by 4
    assert short[1].stop_reason == "max_turns" and long[1].metrics["turns"] > 4


def test_read_off_by_hand():
    # answered right at 1, right at 3, wrong at 5, right at 9; one never answers in its 16 turns
    samples = [{"em": 1.0, "answer_turn": 1, "turns": 1}, {"em": 1.0, "answer_turn": 3, "turns": 3},
               {"em": 0.0, "answer_turn": 5, "turns": 5}, {"em": 1.0, "answer_turn": 9, "turns": 9},
               {"em": 0.0, "answer_turn": None, "turns": 16}]  # fmt: skip
    table = turn_scaling(samples, "em", budgets(16))
    assert [r["budget"] for r in table] == [1, 2, 4, 8, 16]
    assert [r["em"] for r in table] == pytest.approx([1 / 5, 1 / 5, 2 / 5, 2 / 5, 3 / 5])
    assert [r["answered"] for r in table] == pytest.approx([1 / 5, 1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert [r["turns"] for r in table] == pytest.approx([1, 9 / 5, 16 / 5, 25 / 5, 34 / 5])  # mean of min(turns, k)
    assert "images" not in table[0]  # no images_by_turn in these records
    assert budgets(6) == [1, 2, 4, 6] and budgets(1) == [1]
    with pytest.raises(ValueError, match="answer_turn"):
        turn_scaling([{"em": 1.0, "turns": 1}], "em", [1])


def test_every_benchmarks_primary_metric_is_zero_without_an_answer():
    """The read-off scores an episode cut before its answer as no answer: 0 for the metric it reads."""
    rows = {"mat-coding": Row("r", "q", ["stop"], "f1"), "mat-search": Row("r", "q", ["x"], "f1"),
            "vstar": Row("r", "q", "A", "choice", choices=["a", "b"]), "video-mc": Row("r", "q", "A", "choice", choices=["a", "b"]),
            "temporal-grounding": Row("r", "q", [1.0, 2.0], "span"), "synthetic": Row("r", "q", "x", "exact"),
            "synthetic-video": Row("r", "q", "x", "exact"), "synthetic-tools": Row("r", "q", ["x"], "f1"),
            **{name: Row("r", "q", "A", "choice", choices=["a", "b"])
               for name in ("video-mme", "video-mme-sub", "longvideobench", "longvideobench-nosub")},
            **{name: Row("r", "q", "A", "choice", choices=["a", "b"])
               for name in ("hr-bench", "mme-realworld")}, "visualprobe": Row("r", "q", "x", "exact"),
            "judge-pairs": Row("r", "q", "Answer 1 is better", "exact",
                               judgment=Judgment("pairwise", "answers", "Digit?", ["3", "7"], "3", 1))}  # fmt: skip
    assert set(rows) == set(BENCHMARKS)
    for name, benchmark in BENCHMARKS.items():
        cut = Trajectory(task_id="r", messages=[], answer=None, stop_reason="max_turns")
        assert benchmark.score(rows[name], cut)[benchmark.metrics[0]] == 0.0, name


# Each row's script: right at 1, right at 3, wrong at 7, right (by the option's text) at 12, cropping to the end.
SCRIPTS = {"r1": ["<answer>A</answer>"], "r2": [CROP] * 2 + ["<answer>A</answer>"],
           "r3": [CROP] * 6 + ["<answer>B</answer>"], "r4": [CROP] * 11 + ["<answer>red</answer>"], "r5": [CROP] * 32}  # fmt: skip


@pytest.fixture
def scripted(tmp_path, monkeypatch):
    """vstar rows whose episodes follow ``SCRIPTS`` (every turn forced), and the benchmark file's path."""
    import vagent.eval.runner as runner

    IMAGE.save(tmp_path / "a.png")
    records = [{"id": rid, "image": "a.png", "question": "What color?", "options": ["red", "blue"], "answer": "A"}
               for rid in SCRIPTS]  # fmt: skip
    (tmp_path / "vstar.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    real_run = runner.run

    def scripted_run(policy, tasks, *args, **kwargs):
        for task in tasks:
            task.scripted_turns = list(SCRIPTS[task.id])
        return real_run(policy, tasks, *args, **kwargs)

    monkeypatch.setattr(runner, "run", scripted_run)
    rows, errors = BENCHMARKS["vstar"].load(tmp_path / "vstar.jsonl", None)
    assert not errors
    return rows


def test_one_32_turn_run_reads_off_every_budget_as_runs_at_those_budgets_score(scripted, policy, tmp_path):
    benchmark = BENCHMARKS["vstar"]
    big = evaluate(policy, benchmark, scripted, tmp_path / "turns32", tools=None, limits=WIDE, progress=False)
    assert big["accuracy"] == pytest.approx(3 / 5) and big["limits"]["max_turns"] == 32
    samples = read_samples(tmp_path / "turns32" / "samples.jsonl")
    assert [s["answer_turn"] for s in samples] == [1, 3, 7, 12, None]
    assert [s["images"] for s in samples] == [1, 3, 7, 12, 33]
    table = {r["budget"]: r for r in turn_scaling(samples, "accuracy", budgets(32))}
    for k in (2, 4, 8):  # the same rows run at budget k: what the read-off claims, checked
        direct = evaluate(policy, benchmark, scripted, tmp_path / f"turns{k}", tools=None,
                          limits=RolloutLimits(**{**WIDE.__dict__, "max_turns": k}), progress=False)  # fmt: skip
        own = read_samples(tmp_path / f"turns{k}" / "samples.jsonl")
        assert table[k]["accuracy"] == pytest.approx(direct["accuracy"])
        assert table[k]["answered"] == pytest.approx(direct["answered"])
        assert table[k]["turns"] == pytest.approx(sum(s["turns"] for s in own) / len(own))
        assert table[k]["images"] == pytest.approx(sum(s["images"] for s in own) / len(own))

    assert (
        main(["eval-report", str(tmp_path / "turns32"), str(tmp_path / "turns4"), "--out", str(tmp_path / "report")])
        == 0
    )
    text = (tmp_path / "report" / "turns.md").read_text()
    assert "one rollout at 32 turns" in text and "exact: greedy decoding" in text
    # | budget | accuracy | answered | mean turns | mean images |, worked out from SCRIPTS
    for line in ("| 1 | 0.200 | 0.200 | 1.00 | 1.80 |", "| 2 | 0.200 | 0.200 | 1.80 | 2.60 |",
                 "| 4 | 0.400 | 0.400 | 3.20 | 3.80 |", "| 8 | 0.400 | 0.600 | 5.40 | 5.80 |",
                 "| 16 | 0.600 | 0.800 | 7.80 | 8.00 |", "| 32 | 0.600 | 0.800 | 11.00 | 11.20 |"):  # fmt: skip
        assert line in text
    assert text.count("| 4 | 0.400 | 0.400 | 3.20 | 3.80 |") == 2  # the budget-4 run's own row is the same
    figure = tmp_path / "report" / "turns.png"
    assert figure.stat().st_size > 20_000
    with Image.open(figure) as png:
        assert png.size[0] > 800 and len(png.convert("RGB").getcolors(1 << 16) or []) > 50  # drawn, not blank


def test_a_run_made_before_turn_records_is_skipped_by_the_report(scripted, policy, tmp_path):
    out = tmp_path / "old"
    evaluate(policy, BENCHMARKS["vstar"], scripted[:1], out, tools=None, limits=WIDE, progress=False)
    samples = read_samples(out / "samples.jsonl")
    (out / "samples.jsonl").write_text("".join(json.dumps({k: v for k, v in s.items() if k != "answer_turn"}) + "\n"
                                               for s in samples))  # fmt: skip
    assert main(["eval-report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "skipped: no per-turn records" in (tmp_path / "report" / "turns.md").read_text()
    assert not (tmp_path / "report" / "turns.png").exists()


def test_resuming_under_another_turn_budget_is_refused(scripted, policy, tmp_path):
    out = tmp_path / "run"
    evaluate(policy, BENCHMARKS["vstar"], scripted[:1], out, tools=None, limits=WIDE, progress=False)
    before = (out / "samples.jsonl").read_text()
    with pytest.raises(BenchmarkError, match="max_turns 32 \\(now 8\\)"):
        evaluate(policy, BENCHMARKS["vstar"], scripted, out, tools=None,
                 limits=RolloutLimits(**{**WIDE.__dict__, "max_turns": 8}), progress=False)  # fmt: skip
    assert (out / "samples.jsonl").read_text() == before  # nothing lost


def test_eval_checks_the_context_and_notes_too_few_images_for_its_turns(scripted, tiny_qwen25, tmp_path, capsys):
    base = ["eval", "--model", str(tiny_qwen25), "--benchmark", "vstar", "--data", str(tmp_path / "vstar.jsonl"),
            "--limit", "1", "--max-new-tokens", "2"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "long"), "--max-total-tokens", "40000"]) == 2
    assert "past the model's context of 32768 positions" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "many"), "--max-turns", "32"]) == 0
    err = capsys.readouterr().err
    assert "--max-turns 32 with --max-images 8" in err and "--max-images 33" in err
    assert json.loads((tmp_path / "many" / "metrics.json").read_text())["limits"]["max_turns"] == 32


def test_samples_record_parse_errors_and_the_run_its_well_formed_share(scripted, policy, tmp_path, monkeypatch):
    """An ``<answer>`` left open that swallows a call (what the quickstart's GRPO wrote at seed 0 without its KL term)
    is answered, yet not well formed; an unclosed call in an earlier turn that still ran, followed by a clean answer,
    is well formed (only the answer's own turn counts); a closed ``<answer>`` around a tag is not. Each record names
    its parse errors."""
    monkeypatch.setitem(SCRIPTS, "r1", ["<answer>A</think>\n" + CROP])
    monkeypatch.setitem(SCRIPTS, "r2", [CROP.removesuffix("</tool_call>"), "<answer>A</answer>"])
    monkeypatch.setitem(SCRIPTS, "r3", ["<answer>ris.</think>\n<answer>B</answer>"])
    metrics = evaluate(policy, BENCHMARKS["vstar"], scripted, tmp_path / "run", tools=None, limits=WIDE, progress=False)
    samples = read_samples(tmp_path / "run" / "samples.jsonl")
    assert samples[0]["parse_errors"] == {"unclosed_tag": 1} and samples[0]["prediction"].startswith("A</think>")
    assert samples[0]["malformed_answer"] and not samples[1]["malformed_answer"]
    assert samples[1]["parse_errors"] == {"unclosed_tag": 1} and samples[1]["tool_calls"] == ["crop"]
    assert samples[2]["parse_errors"] == {"tag_in_answer": 1} and samples[2]["malformed_answer"]
    assert [s["parse_errors"] for s in samples[3:]] == [{}] * 2
    assert metrics["answered"] == pytest.approx(4 / 5)  # r5 never answers
    assert metrics["well_formed"] == pytest.approx(2 / 5)

"""The judge pipeline end to end on a CPU (``python -m quickstart.judge`` at its defaults): the teacher's cold start,
rejection sampling, GRPO on the rows the judge still gets wrong, ``judge-pairs`` on held-out pairs after each stage,
then the final judge behind ``vagent serve`` driving a policy's GRPO step."""

from __future__ import annotations

import json

import pytest

from quickstart.judge import JudgeQuickstartConfig, run, toy_teacher_reply
from vagent.config import check_config
from vagent.data.judgment import Judgment, render
from vagent.rewards.judgment import read_verdict, verdict_matches

pytest.importorskip("fastapi")


def test_the_toy_teacher_names_the_answer_with_the_reference_digit():
    for preferred in (1, 2):
        responses = ["It is 4.", "It is 6."] if preferred == 1 else ["It is 6.", "It is 4."]
        judgment = Judgment("pairwise", "answers", "What digit?", responses, "4", preferred)
        verdict = read_verdict(toy_teacher_reply(render(judgment)))
        assert verdict.well_formed and verdict_matches(verdict, judgment)


@pytest.mark.slow
def test_train_a_judge_serve_it_and_train_a_policy_against_it(tmp_path):
    run(check_config(JudgeQuickstartConfig(out_dir=str(tmp_path), threads=1)))  # 1 thread: 2 cores shared
    report = json.loads((tmp_path / "report.json").read_text())
    cold, final = report["evals"]["cold start"], report["evals"]["grpo"]
    # 48 held-out pairs judged both ways (96 verdicts): the judge after rejection sampling and GRPO agrees with the
    # labels more often than the cold start, which learned the format (every verdict readable) but not the task.
    assert cold["samples"] == final["samples"] == 96
    assert cold["unparseable"] < 0.1
    assert final["agreement"] > cold["agreement"] + 0.1, (cold["agreement"], final["agreement"])
    assert final["consistency"] > cold["consistency"]
    # the served judge answered every comparison of the policy's step (no request failed or was cut at max_tokens),
    # no sample's judgement failed, and nearly every verdict was readable: the tiny policy's answers are often
    # garbage ("<think", "The tile<.</"), which the judge never saw in training
    (step,) = report["loop"]["steps"]
    assert step["reward/judge_failures"] == 0.0
    comparisons = {(c["answer1"], c["answer2"]): c["error"]
                   for path in (tmp_path / "policy-grpo" / "rollouts").glob("*.jsonl")
                   for line in path.read_text().splitlines()
                   for c in json.loads(line)["metrics"]["judge"]["comparisons"]}  # fmt: skip
    assert comparisons, "the judge was never called (every pair of answers tied)"
    assert set(comparisons.values()) <= {None, "unparseable"}, comparisons
    assert list(comparisons.values()).count(None) >= 0.9 * len(comparisons), comparisons

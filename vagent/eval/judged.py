"""Judged accuracy for open-ended benchmarks: a model judge grades each prediction against the gold answers.

Runs after the rollouts (``vagent eval ... --judge URL``): every sample of ``samples.jsonl`` gets ``judged`` (1, 0,
or None when the judge failed) and ``judge`` (its score, reasoning, raw reply, error); ``metrics.json`` gets
``judged_accuracy`` (mean over the samples the judge could grade, beside F1/EM) and ``judge_failures`` (how
many it could not); the trajectory viewer shows each verdict under the trajectory's metrics. Replies are cached
in ``out_dir/judge_cache.jsonl``, so rerunning after an interruption sends only what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.report import write_report
from vagent.eval.runner import read_samples
from vagent.judge import TEMPLATES, JudgeClient, Verdict, judge_messages, parse_verdict
from vagent.rollout import Task
from vagent.rollout.export import read_jsonl, write_html

__all__ = ["judge_run"]


def judge_run(out_dir: Path, rows: Sequence[Row], client: JudgeClient, *, mode: str = "correct",
              template: str | None = None, max_tokens: int = 512) -> dict[str, Any]:  # fmt: skip
    """Grade the predictions of a finished eval run in ``out_dir``; returns the updated metrics.

    Args:
        mode: ``correct`` (1/0, DeepEyes' protocol) or ``score`` (0-10, read as a fraction).
        template: Replaces the mode's default prompt (``{question}``, ``{gold}``, ``{answer}``).
    """
    if mode not in ("correct", "score"):
        raise ValueError("eval judging is pointwise: mode 'correct' or 'score'")
    samples = read_samples(out_dir / "samples.jsonl")
    by_id = {row.id: row for row in rows}
    asks = [s for s in samples if s.get("prediction") and s["id"] in by_id]
    # the question as the policy was asked it (a choice row's options listed): what its prediction answers
    requests = [judge_messages(template or TEMPLATES[mode], {"question": Task.from_row(by_id[s["id"]], []).question,
                                                             "gold": " / ".join(str(g) for g in s["gold"]),
                                                             "answer": s["prediction"]}) for s in asks]  # fmt: skip
    replies = client.complete_many(requests, max_tokens=max_tokens)
    verdicts = {id(s): _verdict(r, mode) for s, r in zip(asks, replies, strict=True)}
    for s in samples:
        verdict = verdicts.get(id(s), Verdict(0.0, "no prediction: not judged"))
        s["judge"] = verdict.to_dict()
        s["judged"] = verdict.score
    with open(out_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
    graded = [s["judged"] for s in samples if s["judged"] is not None]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    metrics["judged_accuracy"] = sum(graded) / len(graded) if graded else 0.0
    metrics["judge_failures"] = len(samples) - len(graded)
    metrics["judge_model"] = client.model
    write_report(out_dir, metrics)
    _viewer(out_dir, samples, metrics.get("benchmark", ""))
    return metrics


def _verdict(reply, mode: str) -> Verdict:
    return Verdict(None, raw=reply.text, error=reply.error) if reply.error else parse_verdict(reply.text, mode)


def _viewer(out_dir: Path, samples: list[dict[str, Any]], benchmark: str) -> None:
    """Rewrite the trajectory viewer with each sample's verdict among its metrics."""
    verdicts = {(s["id"], s["sample"]): s["judge"] for s in samples}
    trajectories = [t for path in sorted(out_dir.glob("trajectories.rank*.jsonl")) for t in read_jsonl(path)]
    counts: dict[str, int] = {}
    for t in trajectories:
        k = t.sample if t.sample is not None else counts.get(t.task_id, 0)
        counts[t.task_id] = counts.get(t.task_id, 0) + 1
        if (t.task_id, k) in verdicts:
            t.metrics["judge"] = verdicts[(t.task_id, k)]
    if trajectories:
        write_html(trajectories, out_dir / "trajectories.html", title=f"{benchmark}: {out_dir.name} (judged)")

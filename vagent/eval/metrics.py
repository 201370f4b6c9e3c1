"""Eval metrics: token F1 / EM over several golds (MAT), choice accuracy, temporal IoU with R@k, and the
per-sample -> overall / per-type / pass@k aggregation."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from vagent.data import Row
from vagent.eval.extract import extract_choice
from vagent.geometry import span_iou
from vagent.rewards.answer import choice_match, f1_em, parse_span
from vagent.types import Trajectory

__all__ = ["RECALL_AT", "choice_metrics", "choice_score", "f1_em_metrics", "summarize", "temporal_metrics"]

RECALL_AT = (0.3, 0.5, 0.7)


def f1_em_metrics(prediction: str | None, golds: Sequence[str]) -> dict[str, float]:
    """``{"f1", "em"}``: max over golds; F1 counts 1 when EM hits (Visual-ARFT's MAT metric).

    >>> f1_em_metrics("red car", ["a red sports car"])
    {'f1': 0.8, 'em': 0.0}
    """
    if prediction is None:
        return {"f1": 0.0, "em": 0.0}
    f1, em = f1_em(prediction, golds)
    return {"f1": round(f1, 10), "em": em}


def choice_metrics(prediction: str | None, gold: str, choices: Sequence[str]) -> dict[str, float]:
    return {"accuracy": choice_match(prediction, gold, choices) if prediction is not None else 0.0}


def choice_score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    """``{"accuracy", "parsed"}`` of a multiple-choice sample: the option ``rule`` reads off the reply
    (``vagent.eval.extract``) against the gold letter or text; ``parsed`` is 0 when the rule read no option (a parse
    failure, scored 0 and counted, never a guess)."""
    choices = row.choices or []
    picked = extract_choice(trajectory.last_reply, trajectory.answer, choices, rule)
    if picked is None:
        return {"accuracy": 0.0, "parsed": 0.0}
    return {"accuracy": choice_match(picked, str(row.answer), choices), "parsed": 1.0}


def temporal_metrics(prediction: str | None, gold: Sequence[float]) -> dict[str, float]:
    """``{"iou", "r@0.3", "r@0.5", "r@0.7"}`` of a predicted ``[start, end]`` (first two numbers) vs gold;
    means over samples are mIoU and R@k.

    >>> temporal_metrics("from 2 to 6 s", [4.0, 8.0])  # intersection 2, union 6
    {'iou': 0.3333333333333333, 'r@0.3': 1.0, 'r@0.5': 0.0, 'r@0.7': 0.0}
    """
    span = parse_span(prediction) if prediction else None
    value = span_iou(span, gold) if span is not None and span[1] > span[0] else 0.0
    return {"iou": value, **{f"r@{k}": float(value >= k) for k in RECALL_AT}}


def summarize(samples: Sequence[dict[str, Any]], metric_names: Sequence[str]) -> dict[str, Any]:
    """Aggregate per-sample records (``id``, ``sample``, metric values, optional ``type`` list).

    With several samples per id: ``<metric>`` is the mean over all samples (avg@k) and ``pass@k/<metric>``
    the mean over ids of the best sample. Per type: the same means over the ids of each type.

    >>> summarize([{"id": "a", "sample": 0, "em": 1.0}, {"id": "a", "sample": 1, "em": 0.0},
    ...            {"id": "b", "sample": 0, "em": 0.0}, {"id": "b", "sample": 1, "em": 0.0}], ["em"])
    {'n': 2, 'samples': 4, 'em': 0.25, 'pass@2/em': 0.5}
    """
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_id[s["id"]].append(s)
    k = max((len(v) for v in by_id.values()), default=0)
    out: dict[str, Any] = {"n": len(by_id), "samples": len(samples)}
    for name in metric_names:
        out[name] = sum(s[name] for s in samples) / len(samples) if samples else 0.0
        if k > 1:
            out[f"pass@{k}/{name}"] = sum(max(s[name] for s in v) for v in by_id.values()) / len(by_id)
    types = sorted({t for s in samples for t in s.get("type") or []})
    if types:
        out["by_type"] = {}
        for t in types:
            chosen = [s for s in samples if t in (s.get("type") or [])]
            out["by_type"][t] = {"n": len({s["id"] for s in chosen}),
                                 **{name: sum(s[name] for s in chosen) / len(chosen) for name in metric_names}}  # fmt: skip
    return out

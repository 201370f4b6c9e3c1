"""``judge-pairs``: a judge's agreement with the labels of pairwise judgment rows, each pair shown both ways.

The data is canonical judgment rows (``vagent.data.judgment``; what the converters and the synthetic builder
write). Every pair is judged as given and swapped (its candidates in the other order, the label following its
candidate), so a judge that prefers a position cannot hide it. Per sample: ``agreement`` (the verdict names the
labelled candidate), ``unparseable`` (no single verdict could be read), ``well_formed`` (one ``<think>``, then one
``<answer>``). Over the run (``report``):

* ``consistency``: share of pairs whose two verdicts name the same candidate (an unreadable verdict is not);
* ``first_preference``: share of readable verdicts naming position 1; both orders are judged, so the labels sit in
  each position equally often and a judge without position bias scores 0.5 whatever its accuracy;
* ``agreement_both_orders``: share of pairs judged right both ways.

Rows that cannot be swapped (a prompt kept as a converter found it, with text candidates) are judged as given
only and counted in ``single_order``. Pointwise rows are reported as skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vagent.data import Row, RowError, load_rows
from vagent.data.judgment import render, swapped, verdict_text
from vagent.eval.benchmarks import Benchmark
from vagent.rewards.judgment import read_verdict, verdict_matches
from vagent.types import Trajectory

SWAPPED = "~swapped"  # id suffix of a pair's second presentation


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    try:
        found = load_rows(path)
    except RowError as e:  # load_rows stops at the first bad row and names it
        return [], [(str(path), str(e))]
    rows, errors = [], []
    for row in found:
        if row.judgment is None or row.judgment.kind != "pairwise":
            errors.append((f"id {row.id!r}", "not a pairwise judgment row (no 'judgment' of kind 'pairwise')"))
            continue
        twin = swapped_row(row)
        rows.append(dataclasses.replace(row, extra={**row.extra, "pair": row.id, "order": "given"}))
        if twin is not None:
            rows.append(twin)
    return rows, errors


def swapped_row(row: Row) -> Row | None:
    """The pair with its candidates in the other order (images reversed, or the prompt re-rendered with the answers
    reversed), its answer the verdict that follows the labelled candidate; None when it cannot be swapped."""
    judgment = row.judgment
    assert judgment is not None and judgment.kind == "pairwise"
    other = swapped(judgment)
    if judgment.candidates == "images":
        question, images = row.question, list(reversed(row.images))
    elif judgment.question is not None:
        question, images = render(other), list(row.images)
    else:
        return None
    return dataclasses.replace(row, id=row.id + SWAPPED, question=question, images=images, answer=verdict_text(other),
                               judgment=other, messages=None, extra={**row.extra, "pair": row.id, "order": "swapped"})  # fmt: skip


def score(row: Row, trajectory: Trajectory) -> dict[str, float]:
    text = next((m.plain_text for m in reversed(trajectory.messages) if m.role == "assistant"), trajectory.answer or "")
    verdict = read_verdict(text)
    return {
        "agreement": float(row.judgment is not None and verdict_matches(verdict, row.judgment)),
        "unparseable": float(verdict.choice is None),
        "well_formed": float(verdict.well_formed),
    }


def report(rows: Sequence[Row], samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Position bias over the run's samples (see the module docstring). A sample's verdict is read back from its
    ``agreement``/``unparseable`` and its row's label, so the report needs nothing the samples log lacks."""
    by_id = {row.id: row for row in rows}
    # (pair id, sample) -> order -> (the candidate named, in the given order's numbering, or None; agreement)
    seen: dict[tuple[str, int], dict[str, tuple[int | None, float]]] = {}
    first = readable = 0
    for s in samples:
        row = by_id.get(s["id"])
        if row is None or row.judgment is None:
            continue
        label, order = row.judgment.preferred, row.extra.get("order", "given")
        position = None if s["unparseable"] else label if s["agreement"] else 3 - label
        if position is not None:
            readable += 1
            first += position == 1
        candidate = position if position is None or order == "given" else 3 - position
        seen.setdefault((row.extra.get("pair", row.id), s["sample"]), {})[order] = (candidate, s["agreement"])
    both = [p for p in seen.values() if len(p) == 2]
    return {
        "consistency": _mean([p["given"][0] is not None and p["given"][0] == p["swapped"][0] for p in both]),
        "first_preference": first / readable if readable else 0.0,
        "agreement_both_orders": _mean([bool(p["given"][1] and p["swapped"][1]) for p in both]),
        "pairs": len({pair for pair, _ in seen}),
        "single_order": len({pair for (pair, _), p in seen.items() if len(p) == 1}),
    }


def _mean(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


BENCHMARK = Benchmark("judge-pairs", load, score, ("agreement", "unparseable", "well_formed"), (), report=report)

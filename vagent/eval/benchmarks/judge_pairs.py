"""``judge-pairs``: a judge's agreement with the labels of pairwise judgment rows, each pair shown both ways.

The data is canonical judgment rows (``vagent.data.judgment``; what the converters and the synthetic builder
write). Every pair is judged as given and swapped (its candidates in the other order, the label following its
candidate), so a judge that prefers a position cannot hide it. Per sample: ``agreement`` (the verdict names the
labelled candidate), ``unparseable`` (no verdict could be read: ``vagent.rewards.judgment.read_verdict``, or the
episode did not answer, e.g. its reasoning was cut at the token limit), ``well_formed`` (one ``<think>``, then one
``<answer>``). Over the run (``report``):

* ``consistency``: share of pairs whose two verdicts name the same candidate (an unreadable verdict is not);
* ``first_preference``: share of the readable verdicts on pairs judged both ways that name position 1: there the
  labels sit in each position equally often, so a judge without position bias scores 0.5 whatever its accuracy;
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
from vagent.data.judgment import swapped_row
from vagent.eval.benchmarks import Benchmark
from vagent.rewards.judgment import Reading, read_verdict, verdict_matches
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
        rows.append(dataclasses.replace(row, extra={**row.extra, "pair": row.id, "order": "given"}))
        twin = swapped_row(row)  # the other order (images reversed or answers re-rendered), or None
        if twin is not None:
            rows.append(dataclasses.replace(twin, id=row.id + SWAPPED, extra={**row.extra, "pair": row.id,
                                                                               "order": "swapped"}))  # fmt: skip
    return rows, errors


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    candidates = row.judgment.candidates if row.judgment is not None else None
    if trajectory.stop_reason == "answered":
        verdict = read_verdict(trajectory.last_reply, candidates)
    else:  # cut at a limit or failed: whatever its unfinished reasoning says is not a verdict
        verdict = Reading(None, None, False)
    return {
        "agreement": float(row.judgment is not None and verdict_matches(verdict, row.judgment)),
        "unparseable": float(verdict.choice is None),
        "well_formed": float(verdict.well_formed),
    }


def report(rows: Sequence[Row], samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Position bias over the run's samples (see the module docstring). A sample's verdict is read back from its
    ``agreement``/``unparseable`` and its row's label, so the report needs nothing the samples log lacks."""
    by_id = {row.id: row for row in rows}
    # (pair id, sample) -> order -> (the position named, or None; agreement)
    seen: dict[tuple[str, int], dict[str, tuple[int | None, float]]] = {}
    for s in samples:
        row = by_id.get(s["id"])
        if row is None or row.judgment is None:
            continue
        label, order = row.judgment.preferred, row.extra.get("order", "given")
        position = None if s["unparseable"] else label if s["agreement"] else 3 - label
        seen.setdefault((row.extra.get("pair", row.id), s["sample"]), {})[order] = (position, s["agreement"])
    both = [p for p in seen.values() if len(p) == 2]
    # the candidate a verdict names, in the given order's numbering: a swapped verdict's position is the other one
    named = [(p["given"][0], None if p["swapped"][0] is None else 3 - p["swapped"][0]) for p in both]
    # only pairs judged both ways: a single-order row's label can sit in one position more often than the other
    positions = [q[0] for p in both for q in p.values() if q[0] is not None]
    return {
        "consistency": _mean([given is not None and given == other for given, other in named]),
        "first_preference": _mean([q == 1 for q in positions]),
        "agreement_both_orders": _mean([bool(p["given"][1] and p["swapped"][1]) for p in both]),
        "pairs": len({pair for pair, _ in seen}),
        "single_order": len({pair for (pair, _), p in seen.items() if len(p) == 1}),
    }


def _mean(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


BENCHMARK = Benchmark("judge-pairs", load, score, ("agreement", "unparseable", "well_formed"), (), report=report)

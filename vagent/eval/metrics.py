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

__all__ = [
    "RECALL_AT",
    "choice_metrics",
    "choice_score",
    "f1_em_metrics",
    "sign_flip_p",
    "span_metrics",
    "summarize",
    "temporal_metrics",
    "uncertainty",
    "wilson",
]

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
    picked = extract_choice(trajectory.last_reply, trajectory.answer, choices, rule, task=row.source)
    if picked is None:
        return {"accuracy": 0.0, "parsed": 0.0}
    return {"accuracy": choice_match(picked, str(row.answer), choices), "parsed": 1.0}


def temporal_metrics(prediction: str | None, gold: Sequence[float]) -> dict[str, float]:
    """``{"iou", "r@0.3", "r@0.5", "r@0.7"}`` of a predicted ``[start, end]`` (first two numbers) vs gold;
    means over samples are mIoU and R@k.

    >>> temporal_metrics("from 2 to 6 s", [4.0, 8.0])  # intersection 2, union 6
    {'iou': 0.3333333333333333, 'r@0.3': 1.0, 'r@0.5': 0.0, 'r@0.7': 0.0}
    """
    return span_metrics(parse_span(prediction) if prediction else None, gold)


def span_metrics(span: Sequence[float] | None, gold: Sequence[float]) -> dict[str, float]:
    """``temporal_metrics`` of a span already read off the answer (``vagent.eval.extract.extract_span``).

    >>> span_metrics([2.0, 6.0], [4.0, 8.0])["iou"], span_metrics(None, [4.0, 8.0])["iou"]
    (0.3333333333333333, 0.0)
    """
    value = span_iou(span, gold) if span is not None and span[1] > span[0] else 0.0
    return {"iou": value, **{f"r@{k}": float(value >= k) for k in RECALL_AT}}


def summarize(samples: Sequence[dict[str, Any]], metric_names: Sequence[str]) -> dict[str, Any]:
    """Aggregate per-sample records (``id``, ``sample``, metric values, optional ``type`` list and ``groups`` dict).

    With several samples per id: ``<metric>`` is the mean over all samples (avg@k) and ``pass@k/<metric>``
    the mean over ids of the best sample. Per type and per group (``by_<grouping>``): the same means over the ids
    of each type or group. ``intervals``, ``at_k`` and ``spread`` are added by ``uncertainty``.

    >>> summarize([{"id": "a", "sample": 0, "em": 1.0}, {"id": "a", "sample": 1, "em": 0.0},
    ...            {"id": "b", "sample": 0, "em": 0.0}, {"id": "b", "sample": 1, "em": 0.0}], ["em"])["pass@2/em"]
    0.5
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
    out.update(uncertainty(samples, metric_names))

    def means(chosen: list[dict[str, Any]]) -> dict[str, Any]:
        return {"n": len({s["id"] for s in chosen}), **{name: sum(s[name] for s in chosen) / len(chosen)
                                                         for name in metric_names}}  # fmt: skip

    types = sorted({t for s in samples for t in s.get("type") or []})
    if types:
        out["by_type"] = {t: means([s for s in samples if t in (s.get("type") or [])]) for t in types}
    for grouping in sorted({g for s in samples for g in s.get("groups") or {}}):
        values = sorted({str(s["groups"][grouping]) for s in samples if grouping in (s.get("groups") or {})})
        out[f"by_{grouping}"] = {
            v: means([s for s in samples if str((s.get("groups") or {}).get(grouping)) == v]) for v in values
        }
    return out


def uncertainty(samples: Sequence[dict[str, Any]], metric_names: Sequence[str], *, resamples: int = 2000,
                seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """How far each mean can be trusted, and what smaller ``k`` would have given, from ``k`` samples per record.

    * ``intervals[<metric>]``: a 95% interval of the avg@k: Wilson's binomial interval when every record has one
      sample of a 0/1 metric and its own image or video, else a percentile bootstrap over clusters (``resamples``
      draws with replacement of the samples' ``cluster``, the image or video asked about, each with all its records
      and their samples: questions about one video, HR-Bench's four cycles of one question, the samples of one
      record are not independent; lmms-eval clusters Video-MME's standard error by video the same way).
    * ``at_k[j]``: for j in 1, 2, 4, ... and k, ``avg`` and ``pass`` of each metric over each record's first j
      samples. A run asking for j samples draws these very samples (each sample's seed is its index), so these are
      the run at j, not an estimate. ``intervals`` also holds ``pass@k/<metric>``'s bootstrap interval.
    * ``spread[<metric>]``: the mean of each sample index across records (sample 0's, sample 1's, ...) and their
      standard deviation: how much a single-sample score moves from draw to draw.

    >>> u = uncertainty([{"id": str(i), "sample": 0, "acc": float(i < 8)} for i in range(10)], ["acc"])
    >>> [round(x, 3) for x in u["intervals"]["acc"]]  # Wilson, 8 of 10
    [0.49, 0.943]
    """
    import math

    import numpy as np

    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s["sample"]):
        by_id[s["id"]].append(s)
    records = list(by_id.values())
    if not records:
        return {}
    k = min(len(v) for v in records)
    out: dict[str, Any] = {"intervals": {}, "at_k": {}, "spread": {}}
    ladder = sorted({j for j in (1, 2, 4, 8, 16, 32, 64, 128) if j <= k} | {k})
    for j in ladder:
        out["at_k"][j] = {}
        for name in metric_names:
            firsts = [[s[name] for s in v[:j]] for v in records]
            out["at_k"][j][f"avg@{j}/{name}"] = sum(sum(f) / j for f in firsts) / len(firsts)
            out["at_k"][j][f"pass@{j}/{name}"] = sum(max(f) for f in firsts) / len(firsts)
    # resample clusters (the records about one image or video: not independent, lmms-eval clusters Video-MME by
    # video), each with all its records and their samples
    keys = [v[0].get("cluster") or v[0]["id"] for v in records]
    clusters = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # a dict: list.index made this O(N x C)
    member = np.array([clusters[key] for key in keys])  # (N,) record -> cluster
    counts = np.bincount(member, minlength=len(clusters))  # (C,)
    draws = []

    def bootstrap(per_record: list[float]) -> list[float]:
        if not draws:  # only when an interval needs them
            draws.append(np.random.default_rng(seed).integers(0, len(clusters), size=(resamples, len(clusters))))
        sums = np.bincount(member, weights=np.asarray(per_record, dtype=float), minlength=len(clusters))  # (C,)
        return _percentile_interval(sums[draws[0]].sum(axis=1) / counts[draws[0]].sum(axis=1))  # (R,) means

    for name in metric_names:
        values = [[s[name] for s in v] for v in records]
        binary = all(x in (0, 1) for v in values for x in v)
        if binary and all(len(v) == 1 for v in values) and len(clusters) == len(records):
            out["intervals"][name] = wilson(sum(v[0] for v in values), len(values))
        else:
            out["intervals"][name] = bootstrap([sum(v) / len(v) for v in values])  # each record's avg@k
        if k > 1:
            out["intervals"][f"pass@{k}/{name}"] = bootstrap([max(v) for v in values])
            by_index = [sum(v[i] for v in values) / len(values) for i in range(k)]
            mean = sum(by_index) / k
            out["spread"][name] = {"std": math.sqrt(sum((x - mean) ** 2 for x in by_index) / (k - 1)),
                                   "min": min(by_index), "max": max(by_index)}  # fmt: skip
    return out


def sign_flip_p(differences: Sequence[float], max_denominator: int = 1000, max_work: int = 50_000_000) -> float:
    """One-sided p-value of a paired sign-flip (permutation) test that the mean of per-row ``differences`` (one
    policy's score minus another's, row by row) is above 0: the share of the 2^k sign assignments of the k nonzero
    differences whose sum reaches the observed one. Each difference is read as the nearest fraction with a
    denominator up to ``max_denominator`` (1/3 of a row's three samples, 4/7 of an F1 stay exact, so tied sums stay
    tied; with too many unrelated denominators, continuous scores, it is rounded to 1/max_denominator instead) and the
    count is exact: on right/wrong rows this is the exact sign test (McNemar's); rows that do not differ
    weigh nothing; 1.0 when no row differs. Past ``max_work`` (rows x steps of their sum) it takes the normal
    approximation of the same null distribution, with a continuity correction."""
    import math
    from fractions import Fraction

    import numpy as np

    exact = [Fraction(float(x)).limit_denominator(max_denominator) for x in differences]
    scale = math.lcm(*(x.denominator for x in exact))  # 1 for no rows; a tie (0) has denominator 1
    if scale > max_denominator**2:  # many unrelated denominators (continuous scores): a grid of 1/max_denominator
        scale = max_denominator
    units = np.array([round(x * scale) for x in exact], dtype=np.int64)
    units = units[units != 0]  # rows that do not differ (or round to 0 on the grid) weigh nothing
    if not len(units):
        return 1.0
    units //= np.gcd.reduce(np.abs(units))  # right/wrong rows: every size 1
    sizes, total = np.abs(units), int(np.abs(units).sum())
    if len(sizes) * total > max_work:  # the signed sum moves in steps of 2: its tail from observed - 1
        spread = math.sqrt(float((sizes.astype(float) ** 2).sum()))
        return 0.5 * math.erfc((float(units.sum()) - 1.0) / (math.sqrt(2.0) * spread))
    dist = np.zeros(total + 1)  # dist[s]: probability that the positive-signed sizes sum to s, signs fair coins
    dist[0] = 1.0
    for size in sizes:
        dist[size:] = 0.5 * dist[size:] + 0.5 * dist[: total + 1 - size]
        dist[:size] *= 0.5
    observed = int(sizes[units > 0].sum())  # the sum of the signed sizes is 2 * observed - total
    return float(min(1.0, dist[observed:].sum()))


def wilson(successes: float, n: int, z: float = 1.959963984540054) -> list[float]:
    """Wilson's score interval of a binomial proportion (95% by default): unlike the normal one it stays in [0, 1]
    and is not empty at 0 or n successes.

    >>> [round(x, 3) for x in wilson(0, 20)]
    [0.0, 0.161]
    """
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def _percentile_interval(values, level: float = 0.95) -> list[float]:
    """The central ``level`` of the bootstrap means (R,): their (1 - level) / 2 and (1 + level) / 2 quantiles."""
    import numpy as np

    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]

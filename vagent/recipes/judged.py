"""The recipes' side of judged rewards: call the judge, hand its scores to the pure ``judge`` reward.

``JudgedRewards.combine`` is ``vagent.rewards.combine`` plus, when ``judge`` is weighted, one batch of judge calls
per rollout batch: pointwise (``correct``/``score``: each answer against the row's gold answer) or pairwise
(every pair of a GRPO group, turned into win rates). The verdicts (score, reasoning, raw reply, error) go into
``trajectory.metrics["judge"]`` so the trajectory viewer shows why a sample scored what it did, and
``reward/judge_failures`` (the share of samples whose judgement failed and got the neutral score) is logged
with the other components. A dead or slow judge costs at most ``timeout_s x (retries + 1)`` per call: the step
completes with neutral scores.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import requests

from vagent.config import ConfigError, JudgeConfig
from vagent.judge import TEMPLATES, JudgeClient, Verdict, judge_messages, parse_verdict
from vagent.rewards import combine, pairwise_win_rates
from vagent.rewards.answer import gold_answers, normalize_answer
from vagent.types import Trajectory

__all__ = ["JudgedRewards", "first_model", "judge_scores"]


def first_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id an OpenAI-compatible server lists (what ``judge.model: null`` means)."""
    try:
        response = requests.get(url.rstrip("/") + "/models", timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"cannot list the judge's models at {url}/models: {e}") from None


class JudgedRewards:
    """``combine`` with the judge's scores filled in (see the module docstring).

    Args:
        weights, options: ``rewards.weights`` / ``rewards.options``.
        judge: The ``judge`` config section; a client is built only when ``judge`` has a weight.
        out_dir: Where the default reply cache goes.
    """

    def __init__(self, weights: Mapping[str, float], options: Mapping[str, Mapping[str, Any]], judge: JudgeConfig,
                 out_dir: str | Path) -> None:  # fmt: skip
        self.weights, self.options, self.cfg = dict(weights), dict(options), judge
        self.client: JudgeClient | None = None
        if self.weights.get("judge"):
            api_key = os.environ.get(judge.api_key_env) if judge.api_key_env else None
            self.client = JudgeClient(judge.url, judge.model or first_model(judge.url), api_key=api_key,
                                      concurrency=judge.concurrency, timeout_s=judge.timeout_s,
                                      retries=judge.retries, backoff_s=judge.backoff_s,
                                      cache_path=judge.cache or Path(out_dir) / "judge_cache.jsonl")  # fmt: skip

    def combine(self, trajectories: Sequence[Trajectory], rows: Sequence[Any], group_size: int):
        """``vagent.rewards.combine`` (totals, components), with ``judge_failures`` among the components."""
        if self.client is None:
            return combine(trajectories, rows, self.weights, self.options)
        scores, failed = judge_scores(self.client, self.cfg, trajectories, rows, group_size)
        options = {**self.options, "judge": {**self.options.get("judge", {}), "scores": scores,
                                             "neutral": self.cfg.neutral}}  # fmt: skip
        totals, parts = combine(trajectories, rows, self.weights, options)
        parts["judge_failures"] = [float(f) for f in failed]
        return totals, parts


def judge_scores(client: JudgeClient, cfg: JudgeConfig, trajectories: Sequence[Trajectory], rows: Sequence[Any],
                 group_size: int) -> tuple[list[float | None], list[bool]]:  # fmt: skip
    """Each trajectory's judge score (None = failed) and whether its judgement failed; verdicts are stored in
    ``trajectory.metrics["judge"]``. A sample without an ``<answer>`` is judged on its last assistant turn, as
    DeepEyes does (its format reward, not the judge, punishes the missing tag); an empty one scores 0 without a
    call (it is wrong, not a failure)."""
    template = cfg.template or TEMPLATES[cfg.mode]
    params = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.mode != "pairwise":
        asks = [i for i, t in enumerate(trajectories) if _answer(t)]
        requests_ = [judge_messages(template, _fields(trajectories[i], rows[i]), _images(rows[i], cfg)) for i in asks]
        replies = client.complete_many(requests_, **params)
        verdicts = {i: _verdict(reply, cfg.mode) for i, reply in zip(asks, replies, strict=True)}
        scores: list[float | None] = []
        for i, t in enumerate(trajectories):
            verdict = verdicts.get(i, Verdict(0.0, "empty answer: not judged"))
            t.metrics["judge"] = verdict.to_dict()
            scores.append(verdict.score)
        return scores, [s is None for s in scores]
    return _pairwise(client, cfg, template, params, trajectories, rows, group_size)


def _pairwise(client, cfg, template, params, trajectories, rows, group_size):
    pairs, asks = [], []  # (group start, i, j) compared by the judge; ties are decided here
    outcomes: dict[int, list[tuple[int, int, float | None]]] = {}
    for start in range(0, len(trajectories), group_size):
        group = trajectories[start : start + group_size]
        outcomes[start] = []
        for i, j in itertools.combinations(range(len(group)), 2):
            a, b = _answer(group[i]), _answer(group[j])
            if not a or not b or normalize_answer(a) == normalize_answer(b):
                # Equal answers tie; an answer beats none; two missing answers tie. No call needed.
                outcomes[start].append((i, j, 0.5 if bool(a) == bool(b) else float(bool(a))))
                continue
            for first, second in ((i, j), (j, i)) if cfg.both_orders else ((i, j),):
                fields = {**_fields(group[first], rows[start + first]), "answer1": _answer(group[first]),
                          "answer2": _answer(group[second])}  # fmt: skip
                pairs.append((start, first, second))
                asks.append(judge_messages(template, fields, _images(rows[start], cfg)))
    replies = client.complete_many(asks, **params)
    notes: dict[int, list[dict]] = {}
    for (start, i, j), reply in zip(pairs, replies, strict=True):
        verdict = _verdict(reply, "pairwise")
        outcomes[start].append((i, j, verdict.score))
        for k in (i, j):
            notes.setdefault(start + k, []).append({"answer1": start + i, "answer2": start + j, **verdict.to_dict()})
    scores: list[float | None] = []
    for start, results in outcomes.items():
        n = min(group_size, len(trajectories) - start)
        for k, rate in enumerate(pairwise_win_rates(n, results)):
            trajectories[start + k].metrics["judge"] = {"win_rate": rate, "comparisons": notes.get(start + k, [])}
            scores.append(rate)
    return scores, [s is None for s in scores]


def _verdict(reply, mode: str) -> Verdict:
    if reply.error is not None:
        return Verdict(None, raw=reply.text, error=reply.error)
    return parse_verdict(reply.text, mode)


def _fields(trajectory: Trajectory, row: Any) -> dict[str, str]:
    golds = gold_answers(row.answer, row.answer_type)
    gold = " / ".join(str(g) for g in golds) if golds and golds[0] is not None else "(none given)"
    return {"question": getattr(row, "question", ""), "gold": gold, "answer": _answer(trajectory)}


def _answer(trajectory: Trajectory) -> str:
    """The ``<answer>``, else the last assistant turn's text (stripped)."""
    if trajectory.answer is not None:
        return trajectory.answer.strip()
    return next((m.plain_text for m in reversed(trajectory.messages) if m.role == "assistant"), "").strip()


def _images(row: Any, cfg: JudgeConfig) -> list[Any]:
    return list(getattr(row, "images", []) or []) if cfg.images else []

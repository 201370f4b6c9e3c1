"""The recipes' side of judged rewards: call the judge, hand its scores to the pure ``judge`` reward.

``JudgedRewards.combine`` is ``vagent.rewards.combine`` plus, when ``judge`` is weighted, one batch of judge calls
per rollout batch: pointwise (``correct``/``score``: each answer against the row's gold answer) or pairwise
(every pair of a GRPO group, turned into win rates). The verdicts (score, reasoning, raw reply, error) go into
``trajectory.metrics["judge"]`` so the trajectory viewer shows why a sample scored what it did, and
``reward/judge_failures`` (the share of samples whose judgement failed and got the neutral score: no reply, a reply
cut at ``judge.max_tokens``, or no verdict in it) is logged with the other components. A dead or slow judge costs
at most ``timeout_s x (retries + 1)`` per call: the step completes with neutral scores.

The judge is shown the question the policy was shown (``Task.from_row``: a choice row's options listed), and each
row's images are encoded once per call, however many pairs ask about them. Pairwise, sample ``i`` is not always
Answer 1: the order of a pair alternates (``pair_order``) so that each sample is shown first in half of its
comparisons (within one) and a judge's position bias does not follow the sample's index.

With ``judge.prompt: judgment`` the judge is one vagent trained on judgment rows: each call is
``vagent.eval.judges.judgment_request`` of the answers (the prompt its training rows rendered, system prompt and
images included) and its verdict is read by ``vagent.rewards.judgment.read_verdict``, as in its training.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import requests

from vagent.config import ConfigError, JudgeConfig
from vagent.data.judgment import Judgment
from vagent.eval.judges import judgment_request
from vagent.judge import TEMPLATES, JudgeClient, Verdict, judge_messages, parse_verdict
from vagent.rewards import combine, pairwise_win_rates
from vagent.rewards.answer import gold_answers, normalize_answer
from vagent.rewards.judgment import read_verdict
from vagent.rollout import Task
from vagent.types import Trajectory

__all__ = ["JudgedRewards", "first_model", "judge_scores", "pair_order"]


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
    template = cfg.template or TEMPLATES[cfg.mode]  # (prompt judgment: _request renders the judgment's own)
    params = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.prompt == "judgment":  # its turn ends where the rollout engine ended its training turns
        params["stop"] = ["</answer>"]
    urls: dict[Any, str] = {}  # image path -> data URL: the call's requests share one encoding of each image
    if cfg.mode != "pairwise":
        asks = [i for i, t in enumerate(trajectories) if _answer(t)]
        requests_ = [_request(cfg, template, rows[i], [_answer(trajectories[i])], urls) for i in asks]
        replies = client.complete_many(requests_, **params)
        verdicts = {i: _verdict(reply, cfg) for i, reply in zip(asks, replies, strict=True)}
        scores: list[float | None] = []
        for i, t in enumerate(trajectories):
            verdict = verdicts.get(i, Verdict(0.0, "empty answer: not judged"))
            t.metrics["judge"] = verdict.to_dict()
            scores.append(verdict.score)
        return scores, [s is None for s in scores]
    return _pairwise(client, cfg, template, params, trajectories, rows, group_size, urls)


def pair_order(i: int, j: int) -> tuple[int, int]:
    """The order samples ``i < j`` of a group are shown in (Answer 1, Answer 2): ``i`` first when ``i + j`` is even.
    Each sample of a group of n is then first in ``floor`` or ``ceil((n - 1) / 2)`` of its n - 1 comparisons, so a
    judge that prefers a position moves every sample's win rate alike, not sample 0's up and sample n-1's down.

    >>> [pair_order(i, j) for i, j in ((0, 1), (0, 2), (1, 2))]
    [(1, 0), (0, 2), (2, 1)]
    """
    return (i, j) if (i + j) % 2 == 0 else (j, i)


def _pairwise(client, cfg, template, params, trajectories, rows, group_size, urls):
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
            shown = pair_order(i, j)
            for first, second in (shown, shown[::-1]) if cfg.both_orders else (shown,):
                pairs.append((start, first, second))
                asks.append(_request(cfg, template, rows[start], [_answer(group[first]), _answer(group[second])],
                                     urls))  # fmt: skip
    replies = client.complete_many(asks, **params)
    notes: dict[int, list[dict]] = {}
    for (start, i, j), reply in zip(pairs, replies, strict=True):
        verdict = _verdict(reply, cfg)
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


def _request(cfg: JudgeConfig, template: str, row: Any, answers: list[str], urls: dict[Any, str]
             ) -> list[dict[str, Any]]:  # fmt: skip
    """One judge call on ``answers`` (one: pointwise; two: Answer 1 and Answer 2) to ``row``'s question, as the
    policy saw it (``Task.from_row``, the one place it is built: a choice row's options are part of it)."""
    question, gold = Task.from_row(row, []).question, _gold(row)
    if cfg.prompt == "judgment":
        judgment = Judgment("pairwise" if len(answers) == 2 else "pointwise", question=question, responses=answers,
                            reference=gold if cfg.reference and gold is not None else None,
                            scale=(cfg.scale[0], cfg.scale[1]), template=cfg.template)  # fmt: skip
        return judgment_request(judgment, list(row.images), urls=urls)
    fields = {"question": question, "gold": gold if gold is not None else "(none given)", "answer": answers[0]}
    if len(answers) == 2:
        fields |= {"answer1": answers[0], "answer2": answers[1]}
    return judge_messages(template, fields, _images(row, cfg), urls)


def _verdict(reply, cfg: JudgeConfig) -> Verdict:
    """The verdict of a reply as a score in [0, 1] (pairwise: 1 = Answer 1 won), None when it failed (no reply, a
    reply cut at ``max_tokens``: ``JudgeReply.error``; or no verdict in it)."""
    if reply.error is not None:
        return Verdict(None, raw=reply.text, error=reply.error)
    if cfg.prompt != "judgment":
        return parse_verdict(reply.text, cfg.mode)
    read = read_verdict(reply.text, "answers")
    if cfg.mode == "pairwise":
        score = None if read.choice is None else float(read.choice == 1)
    else:
        low, high = cfg.scale
        score = None if read.score is None else min(1.0, max(0.0, (read.score - low) / (high - low)))
    return Verdict(score, read.reasoning, reply.text, None if score is not None else "unparseable")


def _gold(row: Any) -> str | None:
    golds = gold_answers(row.answer, row.answer_type)
    return " / ".join(str(g) for g in golds) if golds and golds[0] is not None else None


def _answer(trajectory: Trajectory) -> str:
    """The ``<answer>``, else the last assistant turn's text (stripped)."""
    return (trajectory.answer if trajectory.answer is not None else trajectory.last_reply).strip()


def _images(row: Any, cfg: JudgeConfig) -> list[Any]:
    return list(row.images) if cfg.images else []

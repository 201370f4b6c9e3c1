"""The ``judgment`` reward of a judge in training, and how a judge's verdict is read. Pure: text in, numbers out.

A judge answers ``<think>reasoning</think><answer>verdict</answer>``: a pairwise verdict names the better candidate
(``Answer 1 is better``, ``Image 2 is better``), a pointwise verdict is a score. UnifiedReward-Think's GRPO rewards
a verdict equal to the label and, separately, the ``<think>...</think><answer>...</answer>`` format
(CodeGoat24/UnifiedReward ``UnifiedReward-Think/src/open_r1/grpo.py``: ``accuracy_reward``, ``format_reward``);
``judgment`` is their weighted mean, so 1 means right and well-formed. The label is read from the row's
``judgment`` field (``vagent.data.judgment``), never from the candidates' positions, so a swapped pair is scored
by its own label.

``read_verdict`` is the one reader of verdicts: the reward, the teacher filter of the cold start, the converters,
the ``judge-pairs`` benchmark and the ``judge`` reward's requests to a trained judge all use it. It is strict, as
UnifiedReward-Think's accuracy reward is (the ``<answer>`` body, or without one the whole reply, must equal the
label): a verdict is the whole ``<answer>`` body, exactly ``Answer N is better`` (``Image N is better`` for image
candidates; one trailing period allowed), or a bare number for a pointwise score. Without an ``<answer>`` block only
a reply that is a verdict as a whole (or whose text after ``</think>`` is) has one, so a chain of thought cut short
("<think>1. Answer 2 is better grounded ...") is never read as a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vagent.types import Trajectory

__all__ = ["NOUNS", "Reading", "judgment", "read_verdict", "verdict_matches"]

# The noun a pairwise verdict names its candidates with, by ``Judgment.candidates`` (vagent.data.judgment, a sibling
# this layer does not import, writes the same nouns).
NOUNS = {"answers": "Answer", "images": "Image"}
_CANDIDATES = {noun: candidates for candidates, noun in NOUNS.items()}
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
# Well-formed: one non-empty <think> block, then one <answer> block, nothing else around them.
_WELL_FORMED = re.compile(r"\s*<think>((?:(?!<think>|</think>).)*)</think>\s*<answer>(?:(?!<answer>).)*</answer>\s*",
                          re.DOTALL)  # fmt: skip
_PAIRWISE = re.compile(r"(Answer|Image) ([12]) is better\.?")
_SCORE = re.compile(r"[-+]?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Reading:
    """What a judge's reply says (``read_verdict``).

    Attributes:
        choice: Pairwise: the position named better (1 or 2), None without a pairwise verdict.
        score: Pointwise: the score the verdict is, or None (also for a pairwise verdict).
        well_formed: One non-empty ``<think>`` block, then one ``<answer>`` block, and nothing else.
        reasoning: The ``<think>`` text ("" without one).
        candidates: What a pairwise verdict names: ``answers`` (``Answer N``) or ``images`` (``Image N``); None
            without one.
    """

    choice: int | None
    score: float | None
    well_formed: bool
    reasoning: str = ""
    candidates: str | None = None


def read_verdict(text: str | None, candidates: str | None = None) -> Reading:
    """Read a judge's reply (see the module docstring for what counts as a verdict). Never raises; a reply with
    several ``<answer>`` blocks has no verdict.

    Args:
        text: The reply.
        candidates: ``answers`` or ``images``: only a pairwise verdict naming them is read (``Image 1 is better``
            is no verdict on two answers); None reads either.

    >>> read_verdict("<think>1 names the digit.</think>\\n<answer>Answer 1 is better</answer>")
    Reading(choice=1, score=None, well_formed=True, reasoning='1 names the digit.', candidates='answers')
    >>> [read_verdict(t).choice for t in ("Answer 2 is better", "<think>Answer 2 is better grounded",
    ...                                   "<answer>Answer 1 is better than Answer 2</answer>")]
    [2, None, None]
    """
    text = text or ""
    blocks = _ANSWER.findall(text)
    if blocks:
        body = blocks[0] if len(blocks) == 1 else ""  # several answers hedge: none is read
    else:  # no answer block: only a reply that is a verdict as a whole (after its reasoning, if closed) has one
        body = text.rsplit("</think>", 1)[1] if "</think>" in text else text
    body = body.strip()
    pair = _PAIRWISE.fullmatch(body)
    named = _CANDIDATES[pair.group(1)] if pair else None
    if candidates is not None and named != candidates:
        named = None
    think = _THINK.search(text)
    form = _WELL_FORMED.fullmatch(text)
    return Reading(
        choice=int(pair.group(2)) if named else None,
        score=float(body) if _SCORE.fullmatch(body) else None,
        well_formed=form is not None and bool(form.group(1).strip()),
        reasoning=think.group(1).strip() if think else "",
        candidates=named,
    )


def verdict_matches(verdict: Reading, label: Any, tolerance: float = 0.0) -> bool:
    """Whether a verdict agrees with a row's ``judgment`` label (pairwise: the preferred position, named with the
    row's noun; pointwise: the score within ``tolerance``)."""
    if label.kind == "pairwise":
        named = verdict.candidates == getattr(label, "candidates", "answers")
        return named and verdict.choice is not None and verdict.choice == label.preferred
    return verdict.score is not None and abs(verdict.score - label.score) <= tolerance


def judgment(trajectories: Sequence[Trajectory], rows: Sequence[Any], format_weight: float = 0.5,
             tolerance: float = 0.0) -> list[float]:  # fmt: skip
    """``(1 - format_weight) * [verdict matches the label] + format_weight * [well-formed]`` of each judge episode,
    read from its last assistant turn; 0 for a row without a ``judgment`` or an episode that did not answer (one
    cut at its token limit before ``<answer>`` has no verdict, whatever its reasoning says).

    Args:
        format_weight: The format's share; 0.5 weighs UnifiedReward-Think's accuracy and format rewards equally.
        tolerance: Pointwise: how far from the label a score still matches.

    >>> from vagent.types import Message
    >>> class Label: kind, candidates, preferred = "pairwise", "answers", 2  # a row's judgment (vagent.data.Judgment)
    >>> class Row: judgment = Label
    >>> def said(text): return Trajectory("j", [Message.text("assistant", text)], stop_reason="answered")
    >>> judgment([said("<think>b is right</think><answer>Answer 2 is better</answer>"),
    ...           said("<answer>Answer 2 is better</answer>"),
    ...           said("<think>a is right</think><answer>Answer 1 is better</answer>")], [Row()] * 3)
    [1.0, 0.5, 0.5]
    """
    if not 0 <= format_weight <= 1:
        raise ValueError(f"judgment: format_weight must be in [0, 1], got {format_weight}")
    out = []
    for t, row in zip(trajectories, rows, strict=True):
        label = getattr(row, "judgment", None)
        if label is None or t.stop_reason != "answered":
            out.append(0.0)
            continue
        verdict = read_verdict(t.last_reply, getattr(label, "candidates", None))
        clean = verdict.well_formed and not any(v for k, v in t.metrics.items() if k.startswith("parse_error/"))
        out.append((1 - format_weight) * verdict_matches(verdict, label, tolerance) + format_weight * clean)
    return out

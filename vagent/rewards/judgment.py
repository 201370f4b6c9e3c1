"""The ``judgment`` reward of a judge in training, and how a judge's verdict is read. Pure: text in, numbers out.

A judge answers ``<think>reasoning</think><answer>verdict</answer>``: a pairwise verdict names the better candidate
(``Answer 1 is better``, ``Image 2 is better``), a pointwise verdict is a score. UnifiedReward-Think's GRPO rewards
a verdict equal to the label and, separately, the ``<think>...</think><answer>...</answer>`` format
(CodeGoat24/UnifiedReward ``UnifiedReward-Think/src/open_r1/grpo.py``: ``accuracy_reward``, ``format_reward``);
``judgment`` is their weighted mean, so 1 means right and well-formed. The label is read from the row's
``judgment`` field (``vagent.data.judgment``), never from the candidates' positions, so a swapped pair is scored
by its own label.

``read_verdict`` is the one reader of verdicts: the reward, the teacher filter of the cold start, the
``judge-pairs`` benchmark and the ``judge`` reward's requests to a trained judge all use it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vagent.types import Trajectory

__all__ = ["Verdict", "judgment", "read_verdict", "verdict_matches"]

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
# Well-formed: one non-empty <think> block, then one <answer> block, nothing else around them.
_WELL_FORMED = re.compile(r"\s*<think>((?:(?!<think>|</think>).)*)</think>\s*<answer>(?:(?!<answer>).)*</answer>\s*",
                          re.DOTALL)  # fmt: skip
_BETTER = re.compile(r"\b(?:answer|image|video|response)\s*([12])\s+is\s+(?:the\s+)?better\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Verdict:
    """What a judge's reply says.

    Attributes:
        choice: Pairwise: the position named better (1 or 2), None when the answer names none or both.
        score: Pointwise: the first number of the answer, or None (also for a pairwise verdict).
        well_formed: One non-empty ``<think>`` block, then one ``<answer>`` block, and nothing else.
        reasoning: The ``<think>`` text ("" without one).
    """

    choice: int | None
    score: float | None
    well_formed: bool
    reasoning: str = ""


def read_verdict(text: str | None) -> Verdict:
    """Read a judge's reply. Never raises; the verdict is taken from the ``<answer>`` block (or, without one, from
    the whole reply, which is then not well-formed); a reply with several ``<answer>`` blocks has no verdict.

    >>> read_verdict("<think>1 names the digit.</think>\\n<answer>Answer 1 is better</answer>")
    Verdict(choice=1, score=None, well_formed=True, reasoning='1 names the digit.')
    >>> read_verdict("<answer>Answer 1 is better, Answer 2 is better</answer>").choice is None
    True
    """
    text = text or ""
    blocks = _ANSWER.findall(text)
    answer = blocks[0] if len(blocks) == 1 else "" if blocks else text  # several answers hedge: none is read
    choices = {m.group(1) for m in _BETTER.finditer(answer)}
    choices_seen = bool(choices)  # "Answer 1 is better" is a pairwise verdict, not the score 1
    number = _NUMBER.search(answer)
    think = _THINK.search(text)
    form = _WELL_FORMED.fullmatch(text)
    return Verdict(
        choice=int(choices.pop()) if len(choices) == 1 else None,
        score=float(number.group()) if number and not choices_seen else None,
        well_formed=form is not None and bool(form.group(1).strip()),
        reasoning=think.group(1).strip() if think else "",
    )


def verdict_matches(verdict: Verdict, label: Any, tolerance: float = 0.0) -> bool:
    """Whether a verdict agrees with a row's ``judgment`` label (pairwise: the preferred position; pointwise: the
    score within ``tolerance``)."""
    if label.kind == "pairwise":
        return verdict.choice is not None and verdict.choice == label.preferred
    return verdict.score is not None and abs(verdict.score - label.score) <= tolerance


def judgment(trajectories: Sequence[Trajectory], rows: Sequence[Any], format_weight: float = 0.5,
             tolerance: float = 0.0) -> list[float]:  # fmt: skip
    """``(1 - format_weight) * [verdict matches the label] + format_weight * [well-formed]`` of each judge episode,
    read from its last assistant turn; 0 for a row without a ``judgment`` or an episode that did not answer.

    Args:
        format_weight: The format's share; 0.5 weighs UnifiedReward-Think's accuracy and format rewards equally.
        tolerance: Pointwise: how far from the label a score still matches.

    >>> from vagent.types import Message
    >>> class Label: kind, preferred = "pairwise", 2  # a row's judgment (vagent.data.Judgment)
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
        text = next((m.plain_text for m in reversed(t.messages) if m.role == "assistant"), t.answer or "")
        verdict = read_verdict(text)
        clean = verdict.well_formed and not any(v for k, v in t.metrics.items() if k.startswith("parse_error/"))
        out.append((1 - format_weight) * verdict_matches(verdict, label, tolerance) + format_weight * clean)
    return out

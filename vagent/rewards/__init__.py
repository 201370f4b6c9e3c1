"""Verifiable rewards: pure functions ``(trajectories, rows, **options) -> list[float]`` and one REWARDS dict.

Every reward reads only the trajectory (answer, stop reason, counters, ``tool_results``, ``frames``) and
the canonical row (answer, answer type, choices, evidence); none does I/O or touches a model. The
trainer weights them from its config (``combine``) and logs every component on its own.

| name | value | what it rewards |
|---|---|---|
| ``accuracy`` | [0, 1] | the answer (``answer_score`` by the row's answer type; boxes by IoU >= ``iou_threshold``) |
| ``format`` | {0, 0.5, 1} | 1: answered with well-formed tags and calls; 0.5: answered with any parse error (repaired or not); 0: no answer |
| ``box_iou`` | [0, 1] | IoU (or GIoU mapped to [0, 1]) of an answered box with the gold box; ``threshold`` makes it 0/1 |
| ``crop_iou`` | [0, 1] | best IoU of a region the policy cropped/zoomed with an evidence box (not containment: see below) |
| ``temporal_iou`` | [0, 1] | best IoU of a span the policy sampled (sample_frames/crop_clip) with an evidence span |
| ``tool_bonus`` | {0, 1} | a successful tool call, only when the answer is right (DeepEyes/DeepSport gating) |
| ``invalid_calls`` | [-1, 0] | minus the share of calls that failed (bad JSON, unknown tool, bad arguments, ...) |
| ``call_budget`` | <= 0 | minus ``per_call`` for each call beyond ``budget`` |
| ``overlong`` | [-1, 0] | DAPO's soft overlong penalty on the sampled length |
| ``judge`` | [0, 1] | a model judge's score (pointwise verdict or pairwise win rate), handed in as ``scores`` |
| ``tool_star`` | {-1, 0} or (0, 1 + bonus] | Tool-Star: format violation -1, wrong 0, else F1 (+bonus with 2+ tool kinds) |
| ``judgment`` | [0, 1] | a judge in training: its verdict matches the row's label (half) and its CoT is well-formed (half) |

Why IoU and not containment for crops: a reward for "the crop contains the target" is maximized by
cropping the whole image; a GRPO run on a tiny model learned exactly that (containment 0.5% -> 97.5%
while IoU stayed 0.005 and accuracy fell). IoU is high only for a tight crop around the evidence.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from vagent.geometry import giou, iou, model_to_original, span_iou
from vagent.rewards.answer import answer_score, parse_box
from vagent.rewards.judged import judge, pairwise_win_rates, tool_star
from vagent.rewards.judgment import judgment
from vagent.types import Trajectory

__all__ = ["REWARDS", "RewardRow", "accuracy", "check_rewards", "combine", "pairwise_win_rates", "predicted_box"]

LOOK_TOOLS = ("crop", "zoom_in")
VIDEO_TOOLS = ("sample_frames", "crop_clip")


class RewardRow(Protocol):
    """What rewards read from a canonical row (``vagent.data.Row`` satisfies it)."""

    answer: Any
    answer_type: str
    choices: list[str] | None
    evidence: Any  # Evidence | None: .boxes [[x1, y1, x2, y2]] in original pixels, .spans [[t0, t1]] in seconds


def predicted_box(trajectory: Trajectory) -> list[float] | None:
    """The box in the answer, mapped from the frame the policy saw (first prompt image) to original pixels."""
    box = parse_box(trajectory.answer) if trajectory.answer else None
    if box is None or not trajectory.frames:
        return box
    frame = trajectory.frames[0]
    return list(model_to_original(box, frame.convention, frame.model_size, frame.original_size))


def _score(trajectory: Trajectory, row: RewardRow, iou_threshold: float) -> float:
    score = answer_score(trajectory.answer, row.answer, row.answer_type, row.choices, predicted_box(trajectory))
    if row.answer_type in ("box", "span"):  # accuracy of a localization = overlap above a threshold
        return float(score >= iou_threshold)
    return score


def accuracy(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], iou_threshold: float = 0.5) -> list[float]:
    """Answer correctness in [0, 1] (F1 for ``f1`` rows, 0/1 otherwise)."""
    return [_score(t, r, iou_threshold) for t, r in zip(trajectories, rows, strict=True)]


def format_reward(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow]) -> list[float]:
    """1 when the episode answered and every tag and call parsed as written, 0.5 when it answered with any
    ``parse_error/*`` (a repair, an unparseable call, several answers, a stray tag, a tag inside the answer), 0
    without an answer. The answer's own score is the accuracy reward's: an ``f1``, ``choice`` or ``number`` row can
    still find a right answer in text that swallowed tags, so this term is then the only penalty."""
    out = []
    for t in trajectories:
        errors = {k for k, v in t.metrics.items() if k.startswith("parse_error/") and v}
        if t.stop_reason != "answered" or t.answer is None or not t.answer.strip():
            out.append(0.0)
        else:
            out.append(1.0 if not errors else 0.5)
    return out


def box_iou(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], threshold: float | None = None,
            use_giou: bool = False) -> list[float]:  # fmt: skip
    """Overlap of the answered box with the gold box (``box`` rows; 0 for other rows). Continuous by default;
    with ``threshold``, 1 when the overlap reaches it. ``use_giou`` maps GIoU from [-1, 1] to [0, 1], which
    still ranks boxes that miss the target by their distance."""
    out = []
    for t, row in zip(trajectories, rows, strict=True):
        box = predicted_box(t) if row.answer_type == "box" else None
        if box is None or box[2] <= box[0] or box[3] <= box[1]:
            out.append(0.0)
            continue
        value = (giou(box, row.answer) + 1) / 2 if use_giou else iou(box, row.answer)
        out.append(float(value >= threshold) if threshold is not None else value)
    return out


def crop_iou(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow]) -> list[float]:
    """Best IoU between a region the policy cropped or zoomed on a prompt image (``box_original`` of a
    successful crop/zoom_in call) and an evidence box; 0 without such a call or without evidence boxes.
    Crops of tool outputs (a crop of a crop) are not scored: their boxes are in the output's pixels."""
    out = []
    for t, row in zip(trajectories, rows, strict=True):
        boxes = row.evidence.boxes if row.evidence is not None else []
        regions = [r.metadata["box_original"] for r in t.tool_results
                   if r.name in LOOK_TOOLS and not r.error and r.metadata.get("image_index", 0) < len(t.frames)]  # fmt: skip
        out.append(max((iou(a, b) for a in regions for b in boxes), default=0.0))
    return out


def temporal_iou(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow]) -> list[float]:
    """Best temporal IoU between a span a video tool sampled and an evidence span (LongVT); 0 without one."""
    out = []
    for t, row in zip(trajectories, rows, strict=True):
        spans = row.evidence.spans if row.evidence is not None else []
        sampled = [r.metadata["span"] for r in t.tool_results if r.name in VIDEO_TOOLS and not r.error]
        out.append(max((span_iou(a, b) for a in sampled for b in spans), default=0.0))
    return out


def tool_bonus(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], correct_at: float = 1.0,
               iou_threshold: float = 0.5) -> list[float]:  # fmt: skip
    """1 when at least one tool call succeeded AND the answer is right (score >= ``correct_at``); a bonus
    for tool use alone teaches calling tools for their own sake."""
    out = []
    for t, row in zip(trajectories, rows, strict=True):
        used = any(not r.error for r in t.tool_results)
        out.append(float(used and _score(t, row, iou_threshold) >= correct_at))
    return out


def invalid_calls(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow]) -> list[float]:
    """Minus the share of tool calls that failed (unparseable, unknown tool, bad arguments, tool error)."""
    return [-sum(1 for r in t.tool_results if r.error) / len(t.tool_results) if t.tool_results else 0.0
            for t in trajectories]  # fmt: skip


def call_budget(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], budget: int = 3,
                per_call: float = 0.1) -> list[float]:  # fmt: skip
    """Minus ``per_call`` for every tool call beyond ``budget``."""
    return [-per_call * max(0, len(t.tool_results) - budget) for t in trajectories]


def overlong(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], max_tokens: int = 1024,
             buffer: int = 256) -> list[float]:  # fmt: skip
    """DAPO's soft overlong punishment on the sampled tokens L: 0 up to ``max_tokens - buffer``, then
    falling linearly to -1 at ``max_tokens``, -1 beyond.

    >>> overlong([Trajectory("t", [], [0] * 896, [1] * 896)], [None], max_tokens=1024, buffer=256)
    [-0.5]
    """
    out = []
    for t in trajectories:
        length = sum(t.loss_mask)
        free = max_tokens - buffer
        out.append(0.0 if length <= free else max(-1.0, (free - length) / buffer))
    return out


REWARDS: dict[str, Callable[..., list[float]]] = {
    "accuracy": accuracy,
    "format": format_reward,
    "box_iou": box_iou,
    "crop_iou": crop_iou,
    "temporal_iou": temporal_iou,
    "tool_bonus": tool_bonus,
    "invalid_calls": invalid_calls,
    "call_budget": call_budget,
    "overlong": overlong,
    "judge": judge,
    "tool_star": tool_star,
    "judgment": judgment,
}


def check_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Fail before any rollout on what ``combine`` would fail on after one: a weight naming no reward, or an option
    that is not a keyword of its (weighted) reward. Options of rewards without a weight are not read.

    Raises:
        KeyError: an unknown reward name (with the known names).
        TypeError: a keyword the reward does not take (with the ones it does).
    """
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise KeyError(f"unknown reward(s) {unknown}; known: {sorted(REWARDS)}")
    for name, kwargs in (options or {}).items():
        if name not in weights:
            continue
        signature = inspect.signature(REWARDS[name])
        try:
            signature.bind_partial(None, None, **kwargs)  # (trajectories, rows, **options)
        except TypeError as e:
            raise TypeError(f"options of reward {name!r}: {e}; it takes {list(signature.parameters)[2:]}") from None


def combine(trajectories: Sequence[Trajectory], rows: Sequence[RewardRow], weights: Mapping[str, float],
            options: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[list[float], dict[str, list[float]]]:  # fmt: skip
    """Weighted sum of the named rewards. Returns (totals, {name: per-trajectory values}) so each component
    can be logged on its own. ``options[name]`` are keyword arguments of that reward.

    Raises:
        KeyError: a weight names no reward in REWARDS (with the known names).
    """
    check_rewards(weights, options)
    options = options or {}
    components = {name: REWARDS[name](trajectories, rows, **options.get(name, {})) for name in weights}
    totals = [sum(weights[name] * components[name][i] for name in weights) for i in range(len(trajectories))]
    return totals, components

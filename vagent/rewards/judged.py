"""Rewards graded by a model, and Tool-Star's hierarchical reward. Pure: the judge's scores come in as arguments.

The recipe (``vagent.recipes.judged``) calls the judge (``vagent.judge``) and passes the scores as the
``judge`` reward's ``scores`` option; nothing here opens a socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vagent.types import Trajectory

__all__ = ["judge", "pairwise_win_rates", "tool_star", "tool_star_format_ok"]

# Parse errors that make a trajectory ill-formed for Tool-Star (it has no repairs: any slip is a format violation).
_FORMAT_ERRORS = ("parse_error/",)


def judge(trajectories: Sequence[Trajectory], rows: Sequence[Any], scores: Sequence[float | None] | None = None,
          neutral: float = 0.5) -> list[float]:  # fmt: skip
    """The judge's score of each trajectory, in [0, 1]; ``neutral`` where the judge failed (``None``).

    Args:
        scores: One per trajectory (pointwise: the verdict; pairwise: the win rate), from the recipe's judge.
        neutral: The score of a failed judgement: the group's advantage then ignores it rather than punishing it.

    Raises:
        ValueError: no scores were handed in (the recipe builds the judge client when ``judge`` is weighted).

    >>> judge([None, None], [None, None], scores=[1.0, None])
    [1.0, 0.5]
    """
    if scores is None:
        raise ValueError("the judge reward needs scores: set the `judge` config section so the recipe can call one")
    if len(scores) != len(trajectories):
        raise ValueError(f"{len(scores)} judge scores for {len(trajectories)} trajectories")
    return [neutral if s is None else float(s) for s in scores]


def pairwise_win_rates(group_size: int, outcomes: Sequence[tuple[int, int, float | None]]) -> list[float | None]:
    """Per-sample scores of a group from pairwise comparisons (UnifiedReward-Think's "Answer 1 is better").

    Args:
        group_size: Samples in the group (k).
        outcomes: ``(i, j, s)``: sample i was shown as Answer 1 and j as Answer 2; ``s`` = 1 if i won, 0 if j
            won, 0.5 a tie, None a failed comparison (left out).

    Returns:
        Each sample's share of the comparisons it won (a tie counts half), or None when none of its
        comparisons succeeded.

    >>> pairwise_win_rates(3, [(0, 1, 1.0), (0, 2, 1.0), (1, 2, None), (2, 1, 0.0)])
    [1.0, 0.5, 0.0]
    """
    wins, played = [0.0] * group_size, [0] * group_size
    for i, j, s in outcomes:
        if s is None:
            continue
        wins[i] += s
        wins[j] += 1.0 - s
        played[i] += 1
        played[j] += 1
    return [w / p if p else None for w, p in zip(wins, played, strict=True)]


def tool_star_format_ok(trajectory: Trajectory) -> bool:
    """Well-formed for Tool-Star: the episode answered, non-empty, and nothing in its turns needed repair or
    failed to parse (its reward code has no repairs: unpaired tags or a missing answer are violations)."""
    if trajectory.stop_reason != "answered" or not (trajectory.answer or "").strip():
        return False
    return not any(v for k, v in trajectory.metrics.items() if k.startswith(_FORMAT_ERRORS))


def tool_star(trajectories: Sequence[Trajectory], rows: Sequence[Any], bonus: float = 0.1,
              correct_at: float = 0.0) -> list[float]:  # fmt: skip
    """Tool-Star's hierarchical reward (dongguanting/Tool-Star ``re_search.py`` ``compute_score``; read in the
    threegold116/Tool-Star-OCT fork): -1 for a format violation; 0 for a well-formed wrong answer; otherwise the
    answer's score (token F1 for ``f1`` rows, the row type's score otherwise) plus ``bonus`` when the answer is
    right and the trajectory used more than one kind of tool successfully (Tool-Star: search and python).

    Args:
        bonus: Added for a right answer reached with several kinds of tools (Tool-Star: 0.1).
        correct_at: A score above this is "right" (Tool-Star: F1 > 0).

    >>> from vagent.types import ToolResult, Trajectory
    >>> t = Trajectory("t", [], answer="Paris", stop_reason="answered",
    ...                tool_results=[ToolResult("search", {}), ToolResult("code", {})])
    >>> class Row: answer, answer_type, choices, evidence = "Paris", "f1", None, None
    >>> tool_star([t], [Row()])
    [1.1]
    """
    from vagent.rewards import accuracy  # the package's accuracy (answer types, boxes); imported late: no cycle

    scores = accuracy(trajectories, rows)
    out = []
    for t, score in zip(trajectories, scores, strict=True):
        if not tool_star_format_ok(t):
            out.append(-1.0)
        elif score <= correct_at:
            out.append(0.0)
        else:
            kinds = {r.name for r in t.tool_results if r.name and r.ok}
            out.append(score + (bonus if len(kinds) > 1 else 0.0))
    return out

"""Test-time turn scaling: accuracy and turns against the turn budget, read off one rollout at the largest budget.

An episode run under a budget of ``N`` turns that answered at turn ``t`` is, under any budget ``k >= t``, the same
episode: its first ``k`` turns are the same draws, and the budget only matters when a turn would open past it.
Under ``k < t`` (or when it never answered) the engine would have stopped it after turn ``k`` (``max_turns``, no
answer), so it scores what no answer scores (0 for every benchmark's primary metric). So one run at ``N`` gives
every smaller budget:

* **exactly** under greedy decoding: a run at budget ``k`` would make these very episodes, cut at ``k``;
* **in distribution** under sampling: each episode cut at ``k`` is a draw of a run at ``k``, so each budget's mean
  estimates that run's without bias (the budgets share their draws, so their differences are less noisy).

This holds because nothing the model sees depends on the budget: the engine alone reads ``max_turns``, no agent
profile is told it (``AgentProfile.prompt`` and ``prefill`` never receive the rollout's limits), and the other
limits (tokens, images, a profile's own call cap) bind the same way at every budget. A prompt that states the budget
("you have N turns"), or a loop that acts on the turns left, would break it; vagent has neither.

Per sample the runner records ``answer_turn`` (the turn that answered, or None), ``turns`` and ``images_by_turn``
(images in the episode after each turn's observations; index 0 = the prompt's), which is what is read back here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vagent.types import Trajectory

__all__ = ["BUDGETS", "budgets", "exactness", "turn_record", "turn_scaling"]

BUDGETS = (1, 2, 4, 8, 16, 32)  # Mini-o3's test-time budgets (it trains at 6 and answers with up to 32)


def turn_record(trajectory: Trajectory) -> dict[str, Any]:
    """What turn scaling reads of one episode: ``answer_turn``, ``images`` and ``images_by_turn``.

    ``images_by_turn[j]`` counts the episode's images once turn ``j``'s observations are in (``[0]``: the prompt's),
    which is what a run cut after turn ``j`` would hold.
    """
    by_turn = [0]
    for message in trajectory.messages:
        if message.role == "assistant":
            by_turn.append(by_turn[-1])
        by_turn[-1] += sum(1 for part in message.content if part.type == "image")
    turns = trajectory.metrics.get("turns", len(by_turn) - 1)
    return {"answer_turn": turns if trajectory.answer is not None else None, "images": by_turn[-1],
            "images_by_turn": by_turn}  # fmt: skip


def budgets(max_turns: int, ladder: Sequence[int] = BUDGETS) -> list[int]:
    """The budgets a run at ``max_turns`` can be read off at: the ladder's up to it, and ``max_turns`` itself.

    >>> budgets(32), budgets(6)
    ([1, 2, 4, 8, 16, 32], [1, 2, 4, 6])
    """
    return sorted({k for k in ladder if k <= max_turns} | {max_turns})


def turn_scaling(samples: Sequence[dict[str, Any]], metric: str, budget_list: Sequence[int]) -> list[dict[str, Any]]:
    """Per budget ``k``: the mean of ``metric`` (a sample counts only if it answered by turn ``k``, else 0), the
    share answered, mean turns and mean images, each as a run at budget ``k`` would have them.

    Args:
        samples: The run's sample records (``samples.jsonl``): ``metric``, ``answer_turn``, ``turns`` and, for the
            images column, ``images_by_turn``.
        metric: A metric read from the answer alone, 0 without one (a benchmark's primary metric).
        budget_list: Budgets no larger than the run's ``max_turns`` (``budgets``).

    >>> s = [{"em": 1.0, "answer_turn": 1, "turns": 1}, {"em": 1.0, "answer_turn": 3, "turns": 3},
    ...      {"em": 0.0, "answer_turn": None, "turns": 4}]
    >>> [(r["budget"], r["em"], r["turns"]) for r in turn_scaling(s, "em", [1, 2, 4])]
    [(1, 0.3333333333333333, 1.0), (2, 0.3333333333333333, 1.6666666666666667), (4, 0.6666666666666666, 2.6666666666666665)]
    """
    if missing := [s.get("id", i) for i, s in enumerate(samples) if "answer_turn" not in s]:
        raise ValueError(f"{len(missing)} sample(s) have no answer_turn (e.g. {missing[0]!r}): the run predates "
                         "turn records; rerun it")  # fmt: skip
    n = len(samples)
    table = []
    for k in budget_list:
        within = [s for s in samples if s["answer_turn"] is not None and s["answer_turn"] <= k]
        row: dict[str, Any] = {"budget": k, metric: sum(s[metric] for s in within) / n if n else 0.0,
                               "answered": len(within) / n if n else 0.0,
                               "turns": sum(min(s["turns"], k) for s in samples) / n if n else 0.0}  # fmt: skip
        if all("images_by_turn" in s for s in samples):
            row["images"] = (
                sum(s["images_by_turn"][min(k, len(s["images_by_turn"]) - 1)] for s in samples) / n if n else 0.0
            )
        table.append(row)
    return table


def exactness(temperature: float) -> str:
    """How a read-off budget relates to a run at that budget, for a run decoded at ``temperature``."""
    if temperature == 0:
        return "exact: greedy decoding, so a run at budget k makes these episodes cut at turn k"
    return (f"same distribution: sampled at temperature {temperature:g}, each budget's episodes are draws of a run at "
            "that budget (the budgets share their draws)")  # fmt: skip

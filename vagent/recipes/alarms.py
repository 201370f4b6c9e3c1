"""The alarms GRPO raises once per run, in the console and in the step's record: what users of RL agents most often
find too late (tool use collapsing, episodes that stop on a cap rather than an answer)."""

from __future__ import annotations

from typing import Any

from vagent.recipes.common import say
from vagent.training.distributed import DistEnv

__all__ = ["CAPS", "Alarms"]

CAPS = ("max_turns", "max_tokens", "max_images", "max_calls")  # stops that cut an episode rather than end it


class Alarms:
    """Say once, in the console and in the step's record (``alarm/*``), what users of RL agents most often find too
    late: tool use collapsing (the share of episodes that call a tool falls below ``alarm_tool_fraction`` of its
    mean over the first ``alarm_after_steps`` steps) and episodes that mostly stop on a cap rather than an answer
    (more than ``alarm_cap_share``). Every rank sees the same all-reduced record, so all decide alike."""

    def __init__(self, algo: Any, env: DistEnv) -> None:
        self.algo, self.env = algo, env
        self.first: list[float] = []
        self.said: set[str] = set()

    def check(self, step: int, record: dict[str, Any]) -> None:
        algo, rate = self.algo, record["tool_call_rate"]
        if len(self.first) < algo.alarm_after_steps:
            self.first.append(rate)
        elif algo.alarm_tool_fraction and "tool_collapse" not in self.said:
            reference = sum(self.first) / len(self.first)
            if reference > 0 and rate < algo.alarm_tool_fraction * reference:
                self._raise(record, "tool_collapse", f"step {step + 1}: {rate:.0%} of the episodes called a tool, "
                            f"against {reference:.0%} over the first {len(self.first)} steps: tool use is collapsing")  # fmt: skip
        capped = sum(record[f"stop/{reason}"] for reason in CAPS)
        if capped > algo.alarm_cap_share and "capped" not in self.said:
            self._raise(record, "capped", f"step {step + 1}: {capped:.0%} of the episodes stopped on a cap (turns "
                        f"{record['stop/max_turns']:.0%}, tokens {record['stop/max_tokens']:.0%}, images "
                        f"{record['stop/max_images']:.0%}, calls {record['stop/max_calls']:.0%}) instead of "
                        "answering: raise the caps or check the prompts")  # fmt: skip

    def _raise(self, record: dict[str, Any], name: str, message: str) -> None:
        self.said.add(name)
        record[f"alarm/{name}"] = 1.0
        say(self.env, f"warning: {message}")

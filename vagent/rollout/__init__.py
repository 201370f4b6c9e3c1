"""Multi-turn rollouts: a per-episode state machine over the policy and the toolbox."""

from vagent.rollout.engine import RolloutLimits, Task, act, prompt_messages, rollout, run

__all__ = ["RolloutLimits", "Task", "act", "prompt_messages", "rollout", "run"]

"""Multi-turn rollouts: a per-row state machine over a generation backend and the toolbox."""

from vagent.rollout.backend import GenerationBackend, Sampling, TurnBarrier, TurnRequest, TurnResult
from vagent.rollout.calls import act
from vagent.rollout.engine import RowState, rollout, run
from vagent.rollout.episode import RolloutLimits, Task, first_view_frames, prompt_messages
from vagent.rollout.generate import Generation, generate
from vagent.rollout.hf_backend import HFBackend

__all__ = [
    "Generation",
    "GenerationBackend",
    "HFBackend",
    "RolloutLimits",
    "RowState",
    "Sampling",
    "Task",
    "TurnBarrier",
    "TurnRequest",
    "TurnResult",
    "act",
    "first_view_frames",
    "generate",
    "prompt_messages",
    "rollout",
    "run",
]

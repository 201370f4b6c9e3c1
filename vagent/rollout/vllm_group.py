"""One request stream for the ranks of a vLLM tensor-parallel group (``rollout.tensor_parallel_size``).

Under torchrun each rank runs its own engine (vLLM's ``external_launcher`` executor), and the engines of a TP group
each hold a shard of every layer: they must schedule the same requests in the same order and step together, or
their collectives mismatch (a hang) or their batches differ (silently wrong tokens). The rollout engine's agent
loop cannot give them that by itself: each rank drives its own episodes, and tool calls return when they return.

So, as TRL gathers a TP group's prompts before a colocated ``generate`` (``vllm_tensor_parallel_size``), here the
group agrees on its requests before every engine step: each rank queues what its own loop submitted or aborted since
the last step, ``exchange`` gathers the queues of the whole group (gloo, a small pickle per rank), and every rank
applies all of them, in rank order, to its engine before stepping it. Each rank keeps only its own rows' results;
a rank whose episodes are all done keeps stepping with the others until every rank is done (``VLLMBackend.settle``).
Sampled turns carry a seed drawn by the submitting rank, so the engines draw the same numbers, whatever each
process's global generator holds.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["TPGroup"]

Op = tuple[Any, ...]  # ("add", request id, prompt, sampling kwargs) or ("abort", request id)


class TPGroup:
    """This rank's tensor-parallel group: consecutive ranks ``size`` at a time, the groups vLLM's external launcher
    makes. Made by every rank at the same point (``new_group`` is collective).

    Args:
        size: Ranks per group; must divide the world size.

    Raises:
        ValueError: Not under torch.distributed, or ``size`` does not divide its world.
    """

    def __init__(self, size: int) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"rollout.tensor_parallel_size={size} shards the engine over torchrun ranks: launch with torchrun "
                f"and a multiple of {size} ranks"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(f"rollout.tensor_parallel_size={size} must divide the number of ranks ({world})")
        # every rank makes every group, in the same order; gloo, whatever the trainer's backend: the ops are objects
        groups = [dist.new_group(list(range(first, first + size)), backend="gloo") for first in range(0, world, size)]
        self.size = size
        self.rank = rank % size  # this rank's place in its group
        self.index = rank // size  # which group (the engine's data-parallel index)
        self._group = groups[self.index]
        self._ops: list[Op] = []

    def queue(self, op: Op) -> None:
        """An op of this rank's loop, for the group's next ``exchange``."""
        self._ops.append(op)

    def exchange(self, done: bool) -> tuple[list[Op], bool]:
        """Every rank's queued ops, in rank order, and whether every rank is ``done`` (a collective: every rank of
        the group calls it once per engine step)."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (self._ops, done), group=self._group)
        self._ops = []
        return [op for ops, _ in gathered for op in ops], all(finished for _, finished in gathered)

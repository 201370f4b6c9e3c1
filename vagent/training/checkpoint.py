"""Checkpoints that survive a kill at any instant, and exact resume.

Layout under ``<out_dir>/checkpoints/``::

    step-00000040/                complete checkpoints only (renamed into place as a whole)
        model/                    full fine-tuning: HF model dir (+ processor), loadable by transformers and load_policy
        adapter/                  LoRA runs, instead of model/: the peft adapter alone (the run's final model/ and
                                  ``vagent merge-lora`` merge it into the base on the CPU: vagent.training.merge)
        optimizer.pt | deepspeed/ | optimizer/ + scheduler.pt
                                  optimizer + schedule (DDP: rank 0; DeepSpeed: every rank's shard; FSDP: a
                                  torch distributed checkpoint of every rank's shard, and the schedule)
        rng/rank{r}.pt            each rank's python/numpy/torch(/cuda) RNG states
        trainer_state.json        step, data position, config, data fingerprint; written LAST
    latest                        name of the newest complete checkpoint; replaced atomically after the rename
    .tmp-step-00000060/           a write in progress (or killed mid-way): ignored and removed

Why this is safe: a checkpoint is written into a temp dir and only renamed to ``step-N`` after every file
(``trainer_state.json`` last) is written and fsynced; ``rename`` is atomic on POSIX, so ``step-N`` either
exists complete or not at all. ``latest`` is a hint written after the rename; if a kill lands between the
two, ``find_resume`` still finds the newest complete dir by scanning. Not covered: a filesystem without
atomic rename (some network/object stores) or a disk that lies about fsync.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vagent.training.distributed import DistEnv, barrier
from vagent.training.merge import ADAPTER_DIR
from vagent.training.publish import set_config_dtype, weights_dtype

__all__ = [
    "STATE_FILE",
    "ResumeError",
    "begin_checkpoint",
    "changed_keys",
    "commit_checkpoint",
    "file_digest",
    "find_resume",
    "load_rng",
    "read_state",
    "save_adapter",
    "save_model",
    "save_rng",
]

STATE_FILE = "trainer_state.json"
_PREFIX = "step-"
_TMP = ".tmp-"


class ResumeError(RuntimeError):
    """The checkpoint cannot be resumed as asked (missing, incomplete, or trained on other settings)."""


def _name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def begin_checkpoint(root: Path, step: int, env: DistEnv) -> Path:
    """Create (on rank 0) the empty temp dir of the checkpoint of ``step``; every rank gets its path."""
    tmp = root / f"{_TMP}{_name(step)}"
    if env.is_main:
        if tmp.exists():  # left by a run killed while writing this very step
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    return tmp


def commit_checkpoint(root: Path, tmp: Path, step: int, state: dict[str, Any], env: DistEnv, keep_last: int) -> Path:
    """Finish a checkpoint once every rank has written its files into ``tmp``: write the state file last,
    fsync, rename into place, point ``latest`` at it, delete checkpoints beyond ``keep_last``."""
    barrier()  # every rank's files are in tmp
    final = root / _name(step)
    if env.is_main:
        _write_json(tmp / STATE_FILE, state)
        _fsync_tree(tmp)
        if final.exists():  # a checkpoint of this step from an earlier (diverged) attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", final.name + "\n")
        for old in _complete(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def find_resume(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` by step, else None: found by scanning, so a ``latest`` file
    that names another (or is stale) changes nothing. Temp dirs of interrupted writes are removed."""
    if not root.is_dir():
        return None
    for tmp in root.glob(f"{_TMP}*"):
        shutil.rmtree(tmp, ignore_errors=True)
    complete = _complete(root)
    return complete[-1] if complete else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"{checkpoint} is not a complete checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def save_model(
    model: torch.nn.Module, processor: Any, directory: Path, state_dict: dict[str, Any] | None = None
) -> None:
    """Write an HF model dir; a peft (LoRA) model writes its adapter only, to ``directory/../adapter``.

    No copy of the model is made for a LoRA save (merging a copy on the device doubled the model at every save):
    the adapter is what trains, and ``vagent.training.merge.merge_lora`` builds the merged model dir from it and the
    base checkpoint on the CPU (at the end of training, and ``vagent merge-lora``)."""
    if hasattr(model, "peft_config"):
        save_adapter(model, directory.parent / ADAPTER_DIR, state_dict)
        return
    model.save_pretrained(directory, state_dict=state_dict)
    dtype = weights_dtype(directory)
    if state_dict is not None and dtype is not None:  # save_pretrained names the module's dtype (bf16 under ZeRO)
        set_config_dtype(directory, dtype)
    if processor is not None:
        processor.save_pretrained(directory)


def save_adapter(model: torch.nn.Module, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
    """The peft model's adapter in peft's format (``PeftModel.from_pretrained(base, directory)`` loads it), its
    ``base_model_name_or_path`` made absolute when it is a local dir, so a merge from any working dir finds it.
    ``state_dict``: the adapters' whole weights when the model holds shards of them (FSDP2)."""
    model.save_pretrained(directory, **({"state_dict": state_dict} if state_dict is not None else {}))
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    base = config.get("base_model_name_or_path")
    if base and Path(base).is_dir():
        config["base_model_name_or_path"] = str(Path(base).resolve())
        _write_json(config_path, config)


def save_rng(directory: Path, rank: int) -> None:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, directory / "rng" / f"rank{rank}.pt")


def load_rng(directory: Path, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for this rank (world size changed)."""
    path = directory / "rng" / f"rank{rank}.pt"
    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def file_digest(path: str | Path | None) -> str | None:
    """sha256 of a file's bytes (the training rows), to detect a dataset swapped under a run."""
    if path is None:
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def changed_keys(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts.

    >>> changed_keys({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}, "d": 0})
    ['b.c', 'd']
    """
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{_TMP}{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))

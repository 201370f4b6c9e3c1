"""The checkpoint a rollout benchmark runs on: the command-line arguments that pick it, and the directory they name
(a tiny random checkpoint built in a temp dir, deleted at exit, unless ``--model`` names one); and how a table
names it and a ``--baseline`` checkout."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vagent.tiny_model import PRESETS, build_tiny_checkpoint  # as old checkouts have them (--baseline runs)


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``--size``, ``--vocab``, ``--model``, ``--checkpoint-dir``, ``--threads``, ``--device``, ``--dtype``."""
    parser.add_argument("--size", default="small", choices=sorted(PRESETS))
    parser.add_argument("--vocab", default="trained", choices=["trained", "qwen"],
                        help="The tiny checkpoint's vocabulary: the small BPE, or Qwen's 151,936 rows.")  # fmt: skip
    parser.add_argument("--model", help="A checkpoint dir instead of a tiny random one.")
    parser.add_argument("--checkpoint-dir", help="Build the tiny checkpoint in DIR/<size>-<vocab> and keep it; a later "
                        "run with the same --size and --vocab reuses it (a 3B one takes minutes to build).")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch CPU threads (on a shared CPU 1 avoids spin-waiting).")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")


def checkpoint_path(args: argparse.Namespace) -> str:
    """Apply ``--threads`` and return ``--model``, or the tiny checkpoint of ``--size`` and ``--vocab`` (built in a
    temp dir deleted at exit, or found or built under ``--checkpoint-dir``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        return args.model
    if getattr(args, "checkpoint_dir", None):  # old checkouts' baseline runs get --model
        kept = Path(args.checkpoint_dir) / f"{args.size}-{args.vocab}"
        if (kept / "vagent_tiny.json").is_file():  # renamed into place only when complete
            return str(kept)
        return str(build_tiny_checkpoint(kept, size=args.size, vocab=args.vocab))
    scratch = Path(tempfile.mkdtemp(prefix="vagent-bench-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return str(build_tiny_checkpoint(scratch / "ckpt", size=args.size, vocab=args.vocab))


def checkpoint_label(args: argparse.Namespace) -> str:
    """How a docs section key names the checkpoint: ``model`` for ``--model``, else the tiny one's ``--vocab``."""
    return "model" if args.model else args.vocab


def checkout_name(directory: str) -> str:
    """How a table names a ``--baseline`` checkout: ``at <short commit>`` (or its path when it is no git checkout)."""
    head = subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"at `{head.stdout.strip()}`" if head.returncode == 0 else f"`{directory}`"


def baseline_env(directory: str) -> dict[str, str]:
    """The environment of a ``--baseline`` subprocess: that checkout first on ``PYTHONPATH``, the rest kept (packages
    installed with ``pip --target`` stay importable), and JAX kept off the GPU: older checkouts import ``bm25s`` at
    startup, which runs a JAX op where JAX is installed, and JAX would reserve 75% of the GPU's memory."""
    path = [str(Path(directory).resolve()), os.environ.get("PYTHONPATH", "")]
    return {"JAX_PLATFORMS": "cpu", **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}

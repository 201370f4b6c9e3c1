"""SFT step throughput, peak memory and padding waste, measured side by side in one run.

    python benchmarks/train.py [--size tiny] [--rows 64] [--steps 12] [--device cpu|cuda] [--deepspeed zero2]

Workload: synthetic zoom rows (gold crop-then-answer and direct-answer trajectories) drawn at three image
sizes, so conversation lengths vary as in real data. Each configuration runs the real SFT recipe
(``vagent sft``) in its own process (peak memory is per process) for ``--steps`` optimizer steps and
reports the median step of the second half (the first steps warm up allocators and kernels):

* tokens/s = real (non-padding) tokens per second of the whole step: data encoding, forward, backward,
  optimizer;
* peak memory = max RSS of the process on CPU, ``torch.cuda.max_memory_allocated`` on GPU;
* MFU (GPU only) = 6 x trainable-and-frozen parameters x tokens/s / the device's peak bf16 FLOP/s
  (``--peak-tflops``, default 989 for an H100 SXM), a lower bound that ignores attention FLOPs;
* "system prompt per row" turns off ``train.share_prefix`` (the rows' common system prompt and tool schemas
  run once per micro-batch by default); gradient checkpointing turns it off as well;
* padding waste = padding slots / all slots, for one epoch's batches with and without length grouping
  (exact, from the conversations' encoded lengths) and as measured in the steps run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from data_pipelines.synthetic.zoom import zoom_rows
from vagent.data import load_rows, write_rows
from vagent.data.batching import epoch_batches, padding_waste
from vagent.model import load_policy
from vagent.tiny_model import PRESETS, build_tiny_checkpoint
from vagent.training.data import SFTDataset


def build_rows(out: Path, n: int, policy) -> Path:
    rows = []
    for seed, size in enumerate([(448, 336), (672, 504), (896, 672)]):
        rows += zoom_rows(out, n // 3, seed=seed, size=size, **policy.frame)
    return write_rows(rows, out / "train.jsonl")


def run_config(name: str, model: Path, rows: Path, out: Path, args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "vagent.cli", "sft", f"out_dir={out / name}", f"model.path={model}",
           f"data.train={rows}", f"data.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}",
           "train.tensorboard=false", "train.save_every=0", "optim.lr=1e-4", *extra]  # fmt: skip
    if args.device:
        cmd.append(f"model.device={args.device}")
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][args.steps // 2 :]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "step_s": statistics.median(r["step_s"] for r in steps),
        "peak_mem_gb": max(r["peak_mem_gb"] for r in steps),
        "padding_waste": statistics.mean(r["padding_waste"] for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--model", help="A checkpoint dir instead of a tiny random one.")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--device")
    parser.add_argument("--deepspeed", choices=["zero2", "zero3"], help="Also run with this DeepSpeed config (GPU).")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="Device peak bf16 TFLOP/s for MFU.")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vagent-bench-train-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model = Path(args.model) if args.model else build_tiny_checkpoint(work / "ckpt", size=args.size)
    policy = load_policy(model, device="cpu")
    n_params = sum(p.numel() for p in policy.model.parameters())
    rows = build_rows(work / "data", args.rows, policy)

    min_pixels, max_pixels = policy.pixel_budget
    data = SFTDataset(load_rows(rows), policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=policy.image_factor, default_tools=["crop"], max_length=10**6,
                      micro_batch_size=args.micro_batch, seed=0, group_by_length=True, group_batches=16)  # fmt: skip
    waste = {}
    for grouped in (False, True):
        batches = epoch_batches(data.lengths, args.micro_batch, seed=0, epoch=0, group_by_length=grouped)
        waste[grouped] = padding_waste(batches, data.lengths)
    del policy

    configs = {
        "length-grouped": ["data.group_by_length=true"],
        "random order": ["data.group_by_length=false"],
        "length-grouped, system prompt per row": ["data.group_by_length=true", "train.share_prefix=false"],
        "length-grouped + grad ckpt": ["data.group_by_length=true", "train.gradient_checkpointing=true"],
    }
    if args.deepspeed:
        root = Path(__file__).resolve().parent.parent
        configs[f"length-grouped + {args.deepspeed}"] = [
            "data.group_by_length=true", "train.gradient_checkpointing=true",
            f"train.deepspeed={root}/configs/deepspeed/{args.deepspeed}.json",
        ]  # fmt: skip
    results = {name: run_config(name, model, rows, work / "runs", args, extra) for name, extra in configs.items()}

    lengths = sorted(data.lengths)
    print(f"# SFT step on {args.model or args.size} ({n_params / 1e6:.2f}M params), micro-batch {args.micro_batch}, "
          f"{len(lengths)} conversations of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
          f"device {args.device or 'auto'}")  # fmt: skip
    print(f"padding waste over one epoch: random order {waste[False]:.1%}, length-grouped {waste[True]:.1%}\n")
    base = results["length-grouped"]["tokens_per_s"]
    cuda = args.device == "cuda" or (args.device is None and _cuda())
    print("| configuration | tokens/s | x | step (s) | peak memory (GiB) | padding waste (steps run) |"
          + (" MFU |" if cuda else ""))  # fmt: skip
    print("|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for name, r in results.items():
        mfu = f" {6 * n_params * r['tokens_per_s'] / (args.peak_tflops * 1e12):.1%} |" if cuda else ""
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f} | {r['step_s']:.3f} | "
              f"{r['peak_mem_gb']:.2f} | {r['padding_waste']:.1%} |{mfu}")  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()

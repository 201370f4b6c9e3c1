"""The quickstart's SFT step on CPU: its kernels, and two trainings side by side against one after the other.

    python benchmarks/cpu_step.py [--steps 30] [--rows 96] [--doc]

Workload: the quickstart's own rows (its tiny `small` Qwen2.5-VL, 672x504 zoom images with a 126-px tile,
micro-batches of 8): *perception* rows (a gold crop shown alone, the warm-up's longest phase) and the
crop-tool *SFT mix* (gold crop-then-answer trajectories). All numbers come from one run of this script:

* kernels, one process, the machine's threads: four setups, the vision patch embedding as torch's Conv3d or as
  the matmul vagent runs (``patch_embeds_as_matmul``), and AdamW as torch's default (for-each) or fused
  kernel. They take turns, one step each on the same batch; median step over ``--steps`` after 2 warm-up
  steps.
* the LM head, one process, the machine's threads: the output projection over every position, or only over the
  positions the loss trains (``policy_logits(..., positions=trained_positions(loss_mask))``, what vagent runs);
  taking turns, as above.
* micro-batch size, one process, the machine's threads: micro-batches of 8 (the quickstart's) and 16, taking
  turns; median seconds per row. Where 16 rows cost about twice 8, the step is compute, not per-step overhead,
  and fewer, larger steps would not make the same epochs sooner.
* side by side (the quickstart's ``parallel_baseline``): two trainings of ``--steps`` + 2 steps each, one after
  the other on all threads, against both at once in two processes on half the threads each. Wall time of the
  steps (each process loads and encodes its batches first, then waits for the go).

``--doc`` also writes the tables into docs/benchmarks.md (section ``cpu-step``) with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_pipelines.synthetic.zoom import zoom_rows
from quickstart.config import QuickstartConfig
from quickstart.data import support_rows
from quickstart.run import tiny_checkpoint
from vagent.algorithms import token_nll_sum, trained_positions
from vagent.data import load_rows, write_rows
from vagent.model import load_policy, policy_logits
from vagent.training.backend import build_optimizer
from vagent.training.data import SFTDataset


def build(work: Path, n: int) -> tuple[Path, dict[str, Path]]:
    cfg = QuickstartConfig()
    model = tiny_checkpoint(cfg, work)
    policy = load_policy(model, device="cpu")
    rows = zoom_rows(work / "data", n, seed=0, size=tuple(cfg.image_size), tile=cfg.tile, clutter=30, distractors=0,
                     direct_share=cfg.direct_share, grid=cfg.grid, margin=0, glyph=cfg.glyph, **policy.frame)  # fmt: skip
    support = support_rows(rows, policy)
    sets = {"perception": [r for r in support if r.source.endswith("perception")],
            "SFT mix": rows + [r for r in support if not r.source.endswith("reading")]}  # fmt: skip
    return model, {name: write_rows(r, work / f"{name.replace(' ', '_')}.jsonl") for name, r in sets.items()}


def batches(model: Path, rows: Path, n: int, size: int = 8) -> list[dict]:
    """``n`` encoded micro-batches of ``size`` rows (the epoch's, repeated as needed)."""
    policy = load_policy(model, device="cpu")
    min_pixels, max_pixels = policy.pixel_budget
    data = SFTDataset(load_rows(rows), policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=policy.image_factor, default_tools=["crop"], max_length=4096, micro_batch_size=size,
                      seed=0, group_by_length=True, group_batches=16)  # fmt: skip
    return [data[g % data.batches_per_epoch] for g in range(n)]


def setup(model: Path, *, matmul: bool = True, fused: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = load_policy(model, device="cpu").model.train()
    if not matmul:
        for module in net.modules():
            module.__dict__.pop("forward", None)  # back to the class's forward: torch's Conv3d
    return net, build_optimizer(net, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=fused)


def step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, trained_only: bool = True) -> float:
    """Seconds of one training step: forward, backward, clip, AdamW (the head on the trained positions only, or
    on every position)."""
    t = time.perf_counter()
    positions = trained_positions(batch["loss_mask"]) if trained_only else None
    logits = policy_logits(net, batch, share_prefix=True, positions=positions)
    token_nll_sum(logits, batch["input_ids"], batch["loss_mask"]).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def take_turns(runs: dict, todo: list[dict]) -> dict:
    """Median step of each run (key: (net, optimizer, ``step`` keywords)) over ``todo`` after 2 warm-up steps. The
    runs take turns, one step each on the same batch, so a machine that slows down or speeds up mid-run slows
    every run alike."""
    times: dict = {key: [] for key in runs}
    for batch in todo:
        for key, (net, optimizer, options) in runs.items():
            times[key].append(step(net, optimizer, batch, **options))
    return {key: statistics.median(t[2:]) for key, t in times.items()}


def kernels(model: Path, rows: Path, steps: int) -> dict[tuple[bool, bool], float]:
    """Median step of each (matmul, fused) setup, taking turns."""
    runs = {(m, f): (*setup(model, matmul=m, fused=f), {}) for m in (False, True) for f in (False, True)}
    return take_turns(runs, batches(model, rows, steps + 2))


def head(model: Path, rows: Path, steps: int) -> dict[bool, float]:
    """Median step with the LM head on the trained positions only (True) and on every position (False), taking
    turns."""
    runs = {only: (*setup(model), {"trained_only": only}) for only in (False, True)}
    return take_turns(runs, batches(model, rows, steps + 2))


def per_row(model: Path, rows: Path, steps: int, sizes: tuple[int, ...] = (8, 16)) -> dict[int, float]:
    """Median seconds per row of a step at each micro-batch size; the sizes take turns, as in ``take_turns`` (each
    on its own batches)."""
    setups = {size: setup(model) for size in sizes}
    todo = {size: batches(model, rows, steps + 2, size) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for i in range(steps + 2):
        for size, (net, optimizer) in setups.items():
            batch = todo[size][i]
            times[size].append(step(net, optimizer, batch) / batch["input_ids"].shape[0])
    return {size: statistics.median(t[2:]) for size, t in times.items()}


def worker(model: str, rows: str, steps: int, threads: int) -> None:
    """Load and encode, say so, wait for a line on stdin, then train: the parent times the steps alone."""
    torch.set_num_threads(threads)
    net, optimizer = setup(Path(model))
    todo = batches(Path(model), Path(rows), steps)
    print("ready", flush=True)
    sys.stdin.readline()
    for batch in todo:
        step(net, optimizer, batch)


def side_by_side(model: Path, rows: Path, steps: int, threads: int) -> tuple[float, float]:
    """(seconds of two trainings one after the other on ``threads``, seconds of both at once on half each)."""

    def start(n_threads: int) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--worker", str(model), str(rows), str(steps), str(n_threads)]
        job = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)  # fmt: skip
        if job.stdout.readline().strip() != "ready":
            raise SystemExit(f"worker failed: {' '.join(cmd)}")
        return job

    def run(jobs: list[subprocess.Popen]) -> float:
        t = time.perf_counter()
        for job in jobs:
            job.stdin.write("go\n")
            job.stdin.flush()
        for job in jobs:
            job.wait()
        return time.perf_counter() - t

    serial = sum(run([start(threads)]) for _ in range(2))
    return serial, run([start(threads // 2), start(threads - threads // 2)])


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, rows, steps, threads = sys.argv[2:6]
        return worker(model, rows, int(steps), int(threads))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--doc", action="store_true", help="Also write the tables into docs/benchmarks.md.")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    lines: list[str] = []

    def emit(*new: str) -> None:
        print(*new, sep="\n", flush=True)
        lines.extend(new)

    with tempfile.TemporaryDirectory(prefix="vagent-bench-cpu-") as tmp:
        model, sets = build(Path(tmp), args.rows)
        emit(f"The quickstart's SFT step on CPU: {threads} threads, micro-batch 8, {args.steps} steps each.", "")
        emit("| rows | patch embedding | AdamW | step (s) | x |", "|---|---|---|---:|---:|")
        for name, rows in sets.items():
            medians = kernels(model, rows, args.steps)
            base = medians[False, False]
            for (matmul, fused), median in medians.items():
                emit(f"| {name} | {'matmul' if matmul else 'Conv3d'} | {'fused' if fused else 'for-each'} | "
                     f"{median:.3f} | {base / median:.2f} |")  # fmt: skip
        emit(
            "",
            "| rows | LM head on every position, step (s) | on the trained positions only (s) | x |",
            "|---|---:|---:|---:|",
        )
        for name, rows in sets.items():
            medians = head(model, rows, args.steps)
            emit(f"| {name} | {medians[False]:.3f} | {medians[True]:.3f} | {medians[False] / medians[True]:.2f} |")
        emit("", "| rows | micro-batch 8, s per row | micro-batch 16, s per row | x |", "|---|---:|---:|---:|")
        for name, rows in sets.items():
            rates = per_row(model, rows, args.steps)
            emit(f"| {name} | {rates[8]:.4f} | {rates[16]:.4f} | {rates[8] / rates[16]:.2f} |")
        if threads >= 2:
            emit("", f"| rows | two trainings one after the other, {threads} threads | side by side, {threads // 2} + "
                 f"{threads - threads // 2} threads | x |", "|---|---:|---:|---:|")  # fmt: skip
            for name, rows in sets.items():
                serial, parallel = side_by_side(model, rows, args.steps, threads)
                emit(f"| {name} | {serial:.1f} s | {parallel:.1f} s | {serial / parallel:.2f} |")
        else:
            emit("", "(one thread: no side-by-side measurement)")
    if args.doc:
        from doc_table import write_section

        write_section("cpu-step", "\n".join(lines))


if __name__ == "__main__":
    main()

"""A DPO step beside an SFT step on the same rows, on CPU.

    python benchmarks/dpo_step.py [--steps 12] [--pairs 8] [--batch 4] [--doc]

Workload: the tiny random Qwen2.5-VL (``vagent.tiny_model`` preset ``tiny``), synthetic zoom rows (448x336 images,
crop-then-answer and direct-answer gold trajectories) and their preference pairs (``data_pipelines.synthetic.pairs``:
the gold trajectory chosen, the same turns ending in another row's answer rejected). Every setup trains its own copy
of the model on the same ``--batch`` rows or pairs at each step: forward, backward, clip, AdamW, with the LM head in
chunks of 1,024 positions as the recipes run it (``train.lm_head_chunk``). The setups take turns, one step each on the
same rows, so a machine that slows down mid-run slows every setup alike; median step over ``--steps`` after 2 warm-up
steps.

* SFT, chosen: the masked NLL of the pairs' chosen trajectories (B sequences), what ``vagent sft`` trains;
* SFT, chosen and rejected: the same loss over both sides (2B sequences), the policy forward DPO pays for;
* DPO, precomputed reference: ``preference_loss`` over the B pairs (2B sequences in one forward) with the reference's
  log-probs looked up (``dpo.precompute_ref``);
* DPO, frozen reference copy: the same, after the reference's no-grad forward of the 2B sequences.

``--doc`` also writes the table into docs/benchmarks.md (section ``dpo-step``) with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from data_pipelines.synthetic.pairs import wrong_answer_pairs
from data_pipelines.synthetic.zoom import zoom_rows
from vagent.algorithms import trained_token_count
from vagent.data import load_rows, write_rows
from vagent.data.batching import collate
from vagent.data.encode import encode_messages
from vagent.model import load_policy, masked_token_logprobs
from vagent.tiny_model import build_tiny_checkpoint
from vagent.training.backend import build_optimizer
from vagent.training.preference import PreferenceDataset, pair_logprobs, preference_loss

CHUNK = 1024  # the recipes' default train.lm_head_chunk
SETUPS = ("SFT, chosen", "SFT, chosen and rejected", "DPO, precomputed reference", "DPO, frozen reference copy")


def build(work: Path, n: int) -> tuple[Path, Path]:
    model = build_tiny_checkpoint(work / "tiny", family="qwen2_5_vl", size="tiny")
    frame = load_policy(model, device="cpu").frame
    rows = zoom_rows(work / "data", n, seed=0, size=(448, 336), clutter=20, **frame)
    pairs, _ = wrong_answer_pairs(rows, seed=0)
    return model, write_rows(pairs, work / "data" / "pairs.jsonl")


def batches(model: Path, pairs: Path, n: int, size: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """``n`` steps' inputs, each the same ``size`` pairs as a pair batch and as SFT batches of one or both sides."""
    policy = load_policy(model, device="cpu")
    min_pixels, max_pixels = policy.pixel_budget
    data = PreferenceDataset(load_rows(pairs), policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                             factor=policy.image_factor, default_tools=["crop"], max_length=4096,
                             micro_batch_size=size, seed=0, group_by_length=True, group_batches=16)  # fmt: skip
    out = []
    for g in range(n):
        pair_batch = data[g % data.batches_per_epoch]
        chosen = [encode_messages(data.pairs[i][0], policy.processor, **data.budget, forced_spans=data.forced_spans)
                  for i in pair_batch["pair_index"].tolist()]  # fmt: skip
        both = {k: v for k, v in pair_batch.items() if k != "pair_index"}
        out.append({"pairs": pair_batch, "chosen": collate(chosen, data.pad_id), "both": both})
    return out


def sft_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    t = time.perf_counter()
    logprobs, _ = masked_token_logprobs(net, batch, batch["loss_mask"], chunk_size=CHUNK)
    (-logprobs.sum() / trained_token_count(batch["loss_mask"])).backward()
    return _finish(net, optimizer, t)


def dpo_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
             reference: torch.nn.Module | None, table: tuple[torch.Tensor, torch.Tensor]) -> float:  # fmt: skip
    t = time.perf_counter()
    if reference is not None:
        with torch.no_grad():
            table = pair_logprobs(reference, batch, average=False, chunk_size=CHUNK)
    loss_sum, _ = preference_loss(net, batch, table, beta=0.1, loss_type="sigmoid", chunk_size=CHUNK)
    (loss_sum / batch["pair_index"].numel()).backward()
    return _finish(net, optimizer, t)


def _finish(net: torch.nn.Module, optimizer: torch.optim.Optimizer, t: float) -> float:
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def measure(model: Path, pairs: Path, steps: int, size: int) -> dict[str, float]:
    """Median step (s) of each setup, taking turns on the same pairs."""
    nets = {}
    for name in SETUPS:
        net = load_policy(model, device="cpu", dtype="float32").model.train()
        nets[name] = (net, build_optimizer(net, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8))
    reference = load_policy(model, device="cpu", dtype="float32").model.eval().requires_grad_(False)
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    for inputs in batches(model, pairs, steps + 2, size):
        with torch.no_grad():  # the precomputed table: scored once, outside the timed step
            table = pair_logprobs(reference, inputs["pairs"], average=False, chunk_size=CHUNK)
        times["SFT, chosen"].append(sft_step(*nets["SFT, chosen"], inputs["chosen"]))
        times["SFT, chosen and rejected"].append(sft_step(*nets["SFT, chosen and rejected"], inputs["both"]))
        times["DPO, precomputed reference"].append(
            dpo_step(*nets["DPO, precomputed reference"], inputs["pairs"], None, table)
        )
        times["DPO, frozen reference copy"].append(
            dpo_step(*nets["DPO, frozen reference copy"], inputs["pairs"], reference, table)
        )
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=8, help="zoom rows made into pairs")
    parser.add_argument("--batch", type=int, default=4, help="pairs (or SFT rows) per step")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vagent-bench-dpo-") as tmp:
        model, pairs = build(Path(tmp), args.pairs)
        medians = measure(model, pairs, args.steps, args.batch)
    base = medians["SFT, chosen"]
    sequences = {"SFT, chosen": args.batch}
    lines = [f"One training step on CPU: the tiny Qwen2.5-VL, {args.batch} zoom pairs (or their chosen rows) per step, "
             f"{torch.get_num_threads()} threads, median of {args.steps} steps each, the setups taking turns.", "",
             "| setup | sequences per step | step (s) | x SFT, chosen |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, median in medians.items():
        n = sequences.get(name, 2 * args.batch)
        forwards = f"{n}" + (f" (+ {n} reference, no grad)" if name.endswith("copy") else "")
        lines.append(f"| {name} | {forwards} | {median:.3f} | {median / base:.2f} |")
    print("\n".join(lines))
    if args.doc:
        from doc_table import write_section

        write_section("dpo-step", "\n".join(lines))


if __name__ == "__main__":
    main()

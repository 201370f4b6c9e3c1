"""``vagent memory``'s plan against the measured peak of one SFT, GRPO and DPO step on CPU, tiny and small shapes.

    python benchmarks/memory_plan.py [--sizes tiny,small] [--stages sft,grpo,dpo] [--seq-len 1024] [--out results.json] [--doc]

For each preset (on Qwen's 151,936-row vocabulary) and stage, the shipped tiny CPU config with the shape's
overrides is planned (``vagent.recipes.memory``, ``--device cpu --images 0``: the measured batches are text) and
one step of two micro-batches (gradient accumulation, as the configs run) is measured in a fresh process: the
recipe's own loss path (``masked_token_logprobs`` for SFT's summed
NLL, ``_scored_logprobs`` + PPO-clip for GRPO, ``preference_loss`` for DPO), backward, gradient clipping and the
fused AdamW step, fp32. Batches are ``micro_batch x seq_len`` random token ids, the rows after the first left-padded
by 10% (so attention runs masked, as real batches do), the loss on the last half of each row (``--trained-fraction
0.5``). DPO's micro-batch is ``micro_batch`` pairs, so ``2 x micro_batch`` rows (the chosen, then the rejected), and
its tiny config holds the reference as a frozen fp32 copy (``dpo.precompute_ref: false``, no LoRA): the measured
process loads that copy too and runs its no-grad forward of each micro-batch before the policy's, as the recipe does.

Peak memory on CPU: a first step allocates the optimizer's moments; then the kernel's resident-set high-water mark
is reset (``/proc/self/clear_refs``) and the second step runs; measured = ``VmHWM`` - the resident set after
importing torch and transformers (before the model is loaded). GRPO's step here is the update (the rollout's KV
cache of these shapes is a few MiB; the plan prints it but the update dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_memory import reset_peak, status_kib

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {stage: ROOT / f"configs/{stage}/qwen2_5_vl_tiny_cpu.yaml" for stage in ("sft", "grpo", "dpo")}


def overrides(stage: str, model: Path, micro_batch: int, seq_len: int) -> list[str]:
    # the plan reads the shape from model.path's config.json; data.train is required but never read here
    common = [f"model.path={model}", "data.train=unused.jsonl", "train.precision=fp32"]
    if stage in ("sft", "dpo"):  # DPO: micro_batch pairs
        return [*common, f"data.micro_batch_size={micro_batch}", f"data.max_length={seq_len}"]
    return [*common, f"grpo.micro_batch_size={micro_batch}", f"rollout.max_total_tokens={seq_len}"]


def worker(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from vagent.algorithms import aggregate, policy_loss
    from vagent.config import CONFIGS as SCHEMAS
    from vagent.config import load_config
    from vagent.model import masked_token_logprobs
    from vagent.recipes.grpo import _scored_logprobs
    from vagent.training.backend import build_optimizer
    from vagent.training.preference import pair_logprobs, preference_loss

    cfg = load_config(SCHEMAS[spec["stage"]], spec["config"], spec["overrides"])
    micro, length = spec["micro_batch"], spec["seq_len"]
    rows = 2 * micro if spec["stage"] == "dpo" else micro
    torch.manual_seed(0)
    base = status_kib("VmRSS")
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.float32).train()
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None
    if spec["stage"] == "dpo":  # the recipe's frozen copy: load_policy(dtype="float32"), no gradient
        assert not cfg.dpo.precompute_ref and not cfg.train.lora.enabled, "the DPO case measures a frozen copy"
        reference = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.float32).eval()
        reference.requires_grad_(False)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    ids = torch.randint(0, 1000, (rows, length))
    attention = torch.ones_like(ids)
    attention[1:, : length // 10] = 0  # left padding: attention runs masked
    mask = torch.zeros_like(ids)
    mask[:, length // 2 :] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": mask}

    def step() -> None:
        for _ in range(2):  # two micro-batches: from the second on, the gradients exist while the head runs
            if spec["stage"] == "sft":
                lp, _ = masked_token_logprobs(model, batch, mask, chunk_size=cfg.train.lm_head_chunk)
                loss = -lp.sum() / mask.sum()
            elif spec["stage"] == "dpo":
                head = dict(chunk_size=cfg.train.lm_head_chunk, share_prefix=cfg.train.share_prefix)
                with torch.no_grad():
                    ref = pair_logprobs(reference, batch, average=False, **head)
                summed, _ = preference_loss(model, batch, ref, beta=cfg.dpo.beta, loss_type=cfg.dpo.loss_type, **head)
                lp, loss = ref, summed / (2 * micro)  # the step's pair mean: 2 micro-batches of micro pairs
            else:
                lp, _ = _scored_logprobs(model, batch, True, cfg.train.lm_head_chunk)
                per_token, _ = policy_loss(lp, lp.detach() - 0.01, torch.linspace(-1, 1, micro), mask)
                loss = aggregate(per_token, mask, "token", float(mask.sum()))
            loss.backward()
            del lp, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as the training backend does

    step()
    reset_peak()
    step()
    return {"measured_gib": (status_kib("VmHWM") - base) / 2**20}


def plan_gib(stage: str, args: argparse.Namespace, model: Path) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "vagent.cli", "memory", "--config", str(CONFIGS[stage]), "--device", "cpu",
           "--images", "0", "--trained-fraction", "0.5", *overrides(stage, model, args.micro_batch, args.seq_len)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    last = done.stdout.strip().splitlines()[-1]
    return float(last.split(":")[1].split()[0]), done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--stages", default="sft,grpo,dpo")
    parser.add_argument("--micro-batch", type=int, default=2, help="Sequences per micro-batch (DPO: pairs).")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--show-plans", action="store_true", help="Print each plan's lines too.")
    parser.add_argument("--out")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from vagent.tiny_model import build_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="vagent-memory-plan-"))
    rows = []
    for size in args.sizes.split(","):
        model = build_tiny_checkpoint(root / size, size=size, vocab="qwen")
        for stage in args.stages.split(","):
            planned, text = plan_gib(stage, args, model)
            if args.show_plans:
                print(text)
            spec = {"stage": stage, "config": str(CONFIGS[stage]), "model": str(model), "micro_batch": args.micro_batch,
                    "seq_len": args.seq_len, "overrides": overrides(stage, model, args.micro_batch, args.seq_len)}  # fmt: skip
            done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                                  text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{size} {stage} failed:\n{done.stderr[-3000:]}")
            measured = json.loads(done.stdout.strip().splitlines()[-1])["measured_gib"]
            rows.append({"size": size, "stage": stage, "plan_gib": planned, "measured_gib": measured})
            print(f"{size:>6} {stage:>4}: plan {planned:.3f} GiB, measured {measured:.3f} GiB "
                  f"({(planned - measured) / measured:+.1%})", flush=True)  # fmt: skip
    summary = (f"{args.micro_batch} x {args.seq_len} tokens per micro-batch (DPO: {args.micro_batch} pairs, "
               f"{2 * args.micro_batch} x {args.seq_len}, and a frozen reference copy), Qwen's 151,936-row vocabulary, "
               "fp32, CPU")  # fmt: skip
    table = ["| shape | stage | plan | measured | plan vs measured |", "|---|---|---:|---:|---:|"]
    table += [f"| {r['size']} | {r['stage']} | {r['plan_gib']:.3f} GiB | {r['measured_gib']:.3f} GiB | "
              f"{(r['plan_gib'] - r['measured_gib']) / r['measured_gib']:+.1%} |" for r in rows]  # fmt: skip
    print(f"\n{summary}\n" + "\n".join(table))
    if args.doc:
        from doc_table import write_section

        write_section("memory-plan", f"{summary}.\n\n" + "\n".join(table))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

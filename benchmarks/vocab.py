"""Peak memory and time of one GRPO update at Qwen's 151,936-row vocabulary against a 2,048-row one, same shapes,
with the chunked language-model head and with today's whole-logits path, side by side in one run.

    python benchmarks/vocab.py [--size 7b-thin] [--micro-batches 1] [--micro-batch 4] [--prompt 96] [--response 96]
                               [--chunks 73] [--[no-]gradient-checkpointing] [--device cpu]

What the ratio says depends on the share of memory the vocabulary holds, so the default shape keeps the real
model's: ``7b-thin`` is Qwen2.5-VL-7B's text model 14x thinner and 14x deeper (``vagent.tiny_model.PRESETS``). Its
151,936-row embedding and untied head are 14% of its weights, as in the 7B, and its activations per token (hidden x
layers) are the 7B's. The defaults are ``configs/grpo/qwen2_5_vl_7b.yaml``'s micro-batch of 4 sequences at 1/14 of
the 7B's tokens (96 prompt + 96 sampled each, for 1,344 + 1,344), its gradient checkpointing and its 1,024-position
head chunk over 14 (73), so every term (weights, gradients, AdamW, checkpointed activations, the head's logits) is
about 1/14 of the 7B's. At a tiny preset (``--size tiny``) the vocabulary is 99% of the weights and the ratio only
measures the embedding's size.

Two random checkpoints of one preset differ only in their vocabulary: ``vocab="trained"`` (the project's default
small vocabulary: a BPE asked for 2,048 tokens, which its generated corpus fills to about 1,500 rows) and
``vocab="qwen"`` (Qwen's tokenizer, 151,936 rows). Each case is one GRPO update as the recipe runs it
(``vagent.recipes.grpo._scored_logprobs`` -> PPO-clip ``policy_loss`` -> token ``aggregate`` -> backward on
every micro-batch -> AdamW step, fp32), on sequences of random token ids (valid in both vocabularies, so the
shapes are the same) whose last ``--response`` tokens are the sampled ones.

How peak memory is measured on CPU (tracemalloc does not see torch's allocations): every case runs in a fresh
process. It first runs one whole update, so the persistent state exists (gradients, AdamW's two moments), then
resets the kernel's high-water mark of its resident set (``echo 5 > /proc/self/clear_refs``), runs the measured
update and reads ``VmHWM`` from ``/proc/self/status``. ``peak`` is that high-water mark minus the resident set
after importing torch and transformers (the interpreter and libraries, the same in every case); ``state`` is the
resident set just before the measured update (weights, gradients, optimizer) minus the same; ``step`` =
peak - state is what the update itself allocated on top (activations, the head's logits, their gradients).
glibc returns large freed blocks to the kernel, so the resident set follows torch's live tensors closely. On CUDA
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` gives the same three numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_memory import reset_peak, status_kib

from vagent.tiny_model import QWEN_VOCAB_ROWS


def worker(spec: dict) -> dict:
    """One case in this (fresh) process; returns MiB and seconds."""
    import torch

    from vagent.algorithms import aggregate, policy_loss
    from vagent.model import load_policy
    from vagent.recipes.grpo import _scored_logprobs
    from vagent.training.backend import build_optimizer

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    base_kib = status_kib("VmRSS")
    model = load_policy(spec["model"], device=device, dtype="float32").model.train()
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = build_optimizer(model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False)
    length = spec["prompt"] + spec["response"]
    batches = []
    for _ in range(spec["micro_batches"]):
        ids = torch.randint(0, 1000, (spec["micro_batch"], length), device=device)
        mask = torch.zeros_like(ids)
        mask[:, spec["prompt"] :] = 1  # 1 = sampled
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask})
    tokens = spec["micro_batches"] * spec["micro_batch"] * spec["response"]
    advantages = torch.linspace(-1, 1, spec["micro_batch"], device=device)

    def update() -> None:
        for batch in batches:
            lp, _ = _scored_logprobs(model, batch, True, spec["chunk"])
            per_token, _ = policy_loss(lp, lp.detach() - 0.01, advantages, batch["loss_mask"])
            aggregate(per_token, batch["loss_mask"], "token", float(tokens)).backward()
            del lp, per_token  # free outputs, or the next micro-batch's forward peaks on top of them
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: they are state, as in training

    update()  # warm-up: gradients and AdamW moments now exist
    if cuda:
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak()
        state = (status_kib("VmRSS") - base_kib) * 1024
    t0 = time.perf_counter()
    update()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if cuda else (status_kib("VmHWM") - base_kib) * 1024
    rows = model.get_output_embeddings().weight.shape[0]
    return {"rows": rows, "chunk": spec["chunk"], "state_mib": state / 2**20, "step_mib": (peak - state) / 2**20,
            "peak_mib": peak / 2**20, "seconds": seconds, "tokens": tokens}  # fmt: skip


def _table(results: list[dict], chunks: list[int]) -> str:
    """Markdown: peak, state and step memory and time per update at both vocabularies, one row per head."""
    small_rows = next(r["rows"] for r in results if r["rows"] != QWEN_VOCAB_ROWS)
    a, b = f"{small_rows:,}", f"{QWEN_VOCAB_ROWS:,}"
    lines = [f"| head | peak {a} rows | peak {b} rows | peak ratio | state {a} / {b} | step {a} / {b} | "
             f"s/update {a} / {b} |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for chunk in [0, *chunks]:
        small = next(r for r in results if r["rows"] != QWEN_VOCAB_ROWS and r["chunk"] == chunk)
        big = next(r for r in results if r["rows"] == QWEN_VOCAB_ROWS and r["chunk"] == chunk)
        lines.append(f"| {'whole logits' if not chunk else f'chunked ({chunk} positions)'} | "
                     f"{small['peak_mib']:,.0f} MiB | {big['peak_mib']:,.0f} MiB | "
                     f"**{big['peak_mib'] / small['peak_mib']:.2f}** | {small['state_mib']:,.0f} / "
                     f"{big['state_mib']:,.0f} MiB | {small['step_mib']:,.0f} / {big['step_mib']:,.0f} MiB | "
                     f"{small['seconds']:.1f} / {big['seconds']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="7b-thin", help="Preset of vagent.tiny_model.PRESETS.")
    parser.add_argument("--micro-batches", type=int, default=1, help="Micro-batches per update.")
    parser.add_argument("--micro-batch", type=int, default=4, help="Sequences per micro-batch.")
    parser.add_argument("--prompt", type=int, default=96, help="Forced (prompt) tokens per sequence.")
    parser.add_argument("--response", type=int, default=96, help="Sampled tokens per sequence.")
    parser.add_argument(
        "--chunks",
        default=[73],
        type=lambda s: [int(c) for c in s.split(",")],
        help="Chunk sizes of the chunked head to measure, comma-separated.",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Recompute each layer's activations in backward, as the 3B/7B configs do.",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="Also write the results as JSON here.")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    root = Path(tempfile.mkdtemp(prefix="vagent-vocab-bench-"))
    try:
        results = _measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # two checkpoints of up to a few GB
    table = _table(results, args.chunks)
    sampled = results[0]["tokens"]
    summary = (f"One GRPO update: {args.micro_batches} x {args.micro_batch} sequences of {args.prompt} + "
               f"{args.response} tokens ({sampled:,} sampled), preset `{args.size}`, fp32 on {args.device}, gradient "
               f"checkpointing {'on' if args.gradient_checkpointing else 'off'}. Target: peak ratio <= 1.3.")  # fmt: skip
    print(f"\n{summary}\n{table}")
    if args.doc:
        from doc_table import write_section

        write_section("vocab", f"{summary}\n\n{table}", device=args.device)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _measure(args: argparse.Namespace, root: Path) -> list[dict]:
    """Every case in a fresh process: (2,048-token BPE, Qwen's vocabulary) x (whole logits, each chunk size)."""
    from vagent.tiny_model import build_tiny_checkpoint

    models = {
        # the project default: a BPE asked for 2,048 tokens (its corpus yields fewer), then the 16 specials
        2048: build_tiny_checkpoint(root / "small-vocab", size=args.size, vocab_size=2048),
        151936: build_tiny_checkpoint(root / "qwen-vocab", size=args.size, vocab="qwen"),
    }
    shape = dict(micro_batches=args.micro_batches, micro_batch=args.micro_batch, prompt=args.prompt,
                 response=args.response, device=args.device,
                 gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip
    results = []
    for rows, model in models.items():
        for chunk in [0, *args.chunks]:
            spec = {**shape, "model": str(model), "chunk": chunk}
            done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                                  text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"case rows={rows} chunk={chunk} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(f"rows {r['rows']:>7,}  {'whole logits' if not chunk else f'chunk {chunk}':>12}:  peak "
                  f"{r['peak_mib']:7.0f} MiB = state {r['state_mib']:6.0f} + step {r['step_mib']:6.0f};  "
                  f"{r['seconds']:.2f} s/update", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    raise SystemExit(main())

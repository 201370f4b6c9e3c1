"""Peak memory and time of one GRPO update at Qwen's 151,936-row vocabulary against a 2,048-row one, same shapes,
with the chunked language-model head and with today's whole-logits path, side by side in one run.

    python benchmarks/vocab.py [--size tiny] [--micro-batches 2] [--micro-batch 2] [--prompt 256] [--response 768]
                               [--chunks 256,1024] [--device cpu]

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


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
    base_kib = _rss_kib("VmRSS")
    model = load_policy(spec["model"], device=device, dtype="float32").model.train()
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
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        state = (_rss_kib("VmRSS") - base_kib) * 1024
    t0 = time.perf_counter()
    update()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if cuda else (_rss_kib("VmHWM") - base_kib) * 1024
    rows = model.get_output_embeddings().weight.shape[0]
    return {"rows": rows, "chunk": spec["chunk"], "state_mib": state / 2**20, "step_mib": (peak - state) / 2**20,
            "peak_mib": peak / 2**20, "seconds": seconds, "tokens": tokens}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", help="Preset of vagent.tiny_model.PRESETS.")
    parser.add_argument("--micro-batches", type=int, default=2, help="Micro-batches per update.")
    parser.add_argument("--micro-batch", type=int, default=2, help="Sequences per micro-batch.")
    parser.add_argument("--prompt", type=int, default=256, help="Forced (prompt) tokens per sequence.")
    parser.add_argument("--response", type=int, default=768, help="Sampled tokens per sequence.")
    parser.add_argument("--chunks", default="256,1024", help="Chunk sizes of the chunked head to measure.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="Also write the results as JSON here.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from vagent.tiny_model import QWEN_VOCAB_ROWS, build_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="vagent-vocab-bench-"))
    models = {
        # the project default: a BPE asked for 2,048 tokens (its corpus yields fewer), then the 16 specials
        2048: build_tiny_checkpoint(root / "small-vocab", size=args.size, vocab_size=2048),
        151936: build_tiny_checkpoint(root / "qwen-vocab", size=args.size, vocab="qwen"),
    }
    chunks = [int(c) for c in args.chunks.split(",")]
    shape = dict(micro_batches=args.micro_batches, micro_batch=args.micro_batch, prompt=args.prompt,
                 response=args.response, device=args.device)  # fmt: skip
    results = []
    for rows, model in models.items():
        for chunk in [0, *chunks]:
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
    print(f"\none GRPO update: {args.micro_batches} x {args.micro_batch} sequences of {args.prompt} + {args.response} "
          f"tokens ({results[0]['tokens']:,} sampled), preset {args.size}, fp32 on {args.device}")  # fmt: skip
    a, b = f"{next(r['rows'] for r in results if r['rows'] != QWEN_VOCAB_ROWS):,}", f"{QWEN_VOCAB_ROWS:,}"
    print(f"| head | peak {a} rows | peak {b} rows | ratio | step {a} | step {b} | ratio | s/update {a} | "
          f"s/update {b} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for chunk in [0, *chunks]:
        small = next(r for r in results if r["rows"] != QWEN_VOCAB_ROWS and r["chunk"] == chunk)
        big = next(r for r in results if r["rows"] == QWEN_VOCAB_ROWS and r["chunk"] == chunk)
        print(f"| {'whole logits' if not chunk else f'chunked ({chunk})'} | {small['peak_mib']:.0f} MiB | "
              f"{big['peak_mib']:.0f} MiB | {big['peak_mib'] / small['peak_mib']:.2f} | {small['step_mib']:.0f} MiB | "
              f"{big['step_mib']:.0f} MiB | {big['step_mib'] / small['step_mib']:.2f} | {small['seconds']:.2f} | "
              f"{big['seconds']:.2f} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

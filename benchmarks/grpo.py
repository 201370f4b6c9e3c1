"""One GRPO step, vagent vs TRL's GRPOTrainer, side by side in one run on the same tiny checkpoint.

    pip install "trl>=1.16"          (not a vagent dependency; only this benchmark needs it)
    python benchmarks/grpo.py [--size small] [--prompts 4] [--group 4] [--tokens 32] [--steps 4] [--runs 1] [--doc]

Workload (identical for both): a tiny random Qwen2.5-VL, ``--prompts`` synthetic zoom images per step,
each with vagent's tool-free system prompt and "give the box of the small <color> tile" (the same prompt
tokens in both); ``--group`` samples per prompt; at most ``--tokens``
sampled tokens; single turn, no tools; temperature 1; reward = IoU of the answered box with the tile (in
the model's frame); one optimizer step per generation batch, no KL, token-level loss (TRL's "dapo"
default, vagent's ``aggregation: token``), fp32 on CPU. Each system runs in its own process (peak RSS is
per process) for ``--steps`` steps; the median step after the first is reported, with vagent's per-stage
split (gen / reward / logprob / update).

Multi-turn with a crop tool is not compared: TRL's tool calling runs Python functions that return text,
while the crop tool returns an image into the conversation.

``--runs N`` repeats the pair N times back to back (a row each); ``--doc`` writes the table into
docs/benchmarks.md (section ``grpo-trl``) with the command, the commit and the machine.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

QUESTION = "Where is the small {color} tile? Answer with its box [x1, y1, x2, y2]."


def build(work: Path, size: str, n_rows: int) -> tuple[Path, Path]:
    """The checkpoint and the rows (canonical JSONL: image, question, gold box in the model's frame)."""
    import random

    from data_pipelines.synthetic.zoom import COLORS, draw_task
    from vagent.geometry import original_to_model
    from vagent.media import smart_resize
    from vagent.tiny_model import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "ckpt", size=size, min_pixels=3136, max_pixels=50176)
    rng = random.Random(0)
    rows = []
    (work / "img").mkdir(exist_ok=True)
    for i in range(n_rows):
        color = rng.choice(list(COLORS))
        image, _, tile = draw_task(448, 336, rng, tile=28, clutter=30, distractors=0, color=color, grid=2)
        path = work / "img" / f"{i}.png"
        image.save(path)
        h, w = smart_resize(336, 448, min_pixels=3136, max_pixels=50176)
        box = [round(v) for v in original_to_model(tile, "absolute", (w, h), (448, 336))]
        rows.append({"id": str(i), "images": [str(path)], "question": QUESTION.format(color=color), "answer": box,
                     "answer_type": "box", "tools": []})  # fmt: skip
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data


def iou_reward(completion: str, gold: list[float]) -> float:
    from vagent.geometry import iou
    from vagent.rewards.answer import parse_box

    box = parse_box(completion)
    return iou(box, gold) if box and box[2] > box[0] and box[3] > box[1] else 0.0


def run_vagent(ckpt: Path, data: Path, out: Path, args) -> dict:
    import vagent.rewards as rewards
    from vagent.config import GRPOConfig, load_config
    from vagent.recipes import grpo
    from vagent.training.metrics import read_metrics

    def model_frame_iou(trajectories, rows):  # the same reward TRL gets: IoU in the model's frame
        return [iou_reward(t.answer or "", r.answer) for t, r in zip(trajectories, rows, strict=True)]

    rewards.REWARDS["iou_model_frame"] = model_frame_iou
    cfg = load_config(GRPOConfig, None, [
        f"out_dir={out}", f"model.path={ckpt}", "model.device=cpu", f"data.train={data}", "data.tools=[]",
        f"train.max_steps={args.steps}", "train.save_every=0", "train.tensorboard=false", "train.precision=fp32",
        "rewards.weights={iou_model_frame: 1.0}", "rewards.options={}", "rollout.max_turns=1",
        f"rollout.max_new_tokens={args.tokens}", "rollout.temperature=1.0", f"grpo.prompts_per_step={args.prompts}",
        f"grpo.group_size={args.group}", "grpo.dynamic_sampling=false", f"grpo.micro_batch_size={args.group * args.prompts}",
        f"grpo.rollout_batch_size={args.group * args.prompts}", "optim.lr=1e-5",
    ])  # fmt: skip
    grpo.train(cfg)
    records = read_metrics(out / "metrics.jsonl")[1:]
    stages = {
        k: statistics.median(r.get(f"time/{k}", 0.0) for r in records) for k in ("gen", "reward", "logprob", "update")
    }
    return {"step_s": statistics.median(r["time/step"] for r in records), "peak_gb": max(r["peak_mem_gb"] for r in records),
            "stages": stages, "tokens": statistics.median(r["response_len"] for r in records)}  # fmt: skip


def run_trl(ckpt: Path, data: Path, out: Path, args) -> dict:
    import resource
    import time

    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from vagent.chat import system_prompt

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    system = {"role": "system", "content": [{"type": "text", "text": system_prompt([])}]}  # vagent's, token for token
    dataset = Dataset.from_list([{
        "prompt": [system, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
        "image": Image.open(r["images"][0]).convert("RGB"), "gold": r["answer"]} for r in rows])  # fmt: skip

    def reward(completions, gold, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [iou_reward(t, g) for t, g in zip(texts, gold, strict=True)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.tokens, max_steps=args.steps, learning_rate=1e-5, beta=0.0, temperature=1.0,
        num_iterations=1, use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", seed=0,
        loss_type="dapo", gradient_checkpointing=False, dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype="float32")
    processor = AutoProcessor.from_pretrained(ckpt, padding_side="left")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=[Timer()])  # fmt: skip
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": statistics.median(times[1:]), "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "stages": {}, "tokens": statistics.median(lengths) if lengths else float("nan")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1, help="Pairs of runs, back to back; a table row each.")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    parser.add_argument("--child", choices=["vagent", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work = Path(args.work)
        run = run_vagent if args.child == "vagent" else run_trl
        result = run(work / "ckpt", work / "rows.jsonl", work / f"out-{args.child}", args)
        (work / f"{args.child}.json").write_text(json.dumps(result))
        return
    try:  # before building anything: the TRL child would fail only after the checkpoint and rows are made
        trl_version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit('benchmarks/grpo.py compares against TRL: pip install "trl>=1.16"') from None
    work = Path(tempfile.mkdtemp(prefix="vagent-bench-grpo-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    build(work, args.size, args.prompts * (args.steps + 1))
    lines = [f"Tiny `{args.size}` Qwen2.5-VL, {args.prompts} prompts x {args.group} samples, <= {args.tokens} tokens, "
             f"CPU fp32, TRL {trl_version}; median step of steps 2..{args.steps}.", "",
             "| run | vagent step | TRL step | vagent speed vs TRL | sampled tokens vagent / TRL | "
             "peak RSS vagent / TRL | vagent gen / reward / logprob / update |", "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    print("\n".join(lines), flush=True)
    for i in range(args.runs):
        r = {system: run_child(system, work) for system in ("vagent", "trl")}
        stages = " / ".join(f"{v:.2f}" for v in r["vagent"]["stages"].values()) + " s"
        lines.append(f"| {i + 1} | {r['vagent']['step_s']:.2f} s | {r['trl']['step_s']:.2f} s | "
                     f"**{r['trl']['step_s'] / r['vagent']['step_s']:.2f}x** | {r['vagent']['tokens']:.1f} / "
                     f"{r['trl']['tokens']:.1f} | {r['vagent']['peak_gb']:.2f} / {r['trl']['peak_gb']:.2f} GiB | {stages} |")  # fmt: skip
        print(lines[-1], flush=True)
    if args.doc:
        from doc_table import write_section

        write_section("grpo-trl", "\n".join(lines))


def run_child(system: str, work: Path) -> dict:
    """One system's steps in a process of its own (its peak RSS is its own); its result dict."""
    cmd = [sys.executable, __file__, "--child", system, "--work", str(work), *sys.argv[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode != 0:
        raise SystemExit(f"{system} failed:\n{done.stderr[-4000:]}")
    return json.loads((work / f"{system}.json").read_text())


if __name__ == "__main__":
    main()

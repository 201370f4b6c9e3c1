"""Host memory of a GRPO step per episode against the image patches the episode keeps, this code and an older
checkout side by side in one run.

    python benchmarks/episode_memory.py [--sizes tiny small] [--crops 1 4 12] [--rows 128] [--group 8]
                                        [--image 1000 750] [--baseline DIR] [--device cpu|cuda] [--doc]

Workload: ``--rows`` episodes (``--rows / --group`` prompts of one ``--image``-sized picture each, ``--group``
samples of each: a GRPO group), at Qwen2.5-VL's default pixel budget (min_pixels 3,136, max_pixels 12,845,056: the
prompt image is seen at about its own size), on a tiny random checkpoint of each ``--sizes`` preset. Every episode
crops ``k`` times for each of ``--crops``: the crop calls are scripted turns (``Task.scripted_turns``, forced, boxes
of 252 to 392 px at different places), each followed by a sampled turn of ``--new-tokens`` tokens in which the
backend prefills the crop's image, so a random policy crops every turn.

Each (size, crops, code) runs ``vagent grpo``'s own loop (``recipes.grpo.train``, two steps; the first warms up) in
a fresh process on the code under test (``--baseline DIR``: that checkout first on ``PYTHONPATH``), which reads its
resident set (``VmRSS``, and ``VmHWM`` reset before each stage) around the second step's stages: gen (the rollout,
with rewards), score (adv + old log-probs: on-policy, the re-encoding of the kept trajectories), update, and at the
start of the next step (what the step left behind). On CPU the update's forward and backward are not run (minutes
on 2 cores, and their activations are per micro-batch, not per episode: ``vagent memory`` plans them); the update
collates its micro-batches as it does and steps the optimizer. On CUDA the update runs, and the device's peak
allocated memory per stage is read too.

Reported per episode: the patch bytes kept (every distinct image of the step's episodes once, as the processor's
fp32 ``pixel_values``: a prompt image once per group, each crop once), and host RSS = the highest resident set of
the step's stages above the resident set when the step started, divided by the episodes, with its ratio to the
patch bytes kept; the RSS the step left (at the next step's start) and the seconds the score stage took. The
rollout's KV storage is sized once (``rollout.kv_cache_gb``) so it is in the baseline, not in the per-episode figure.
``--doc`` writes the table into docs/benchmarks.md (section ``episode-memory``) with the command, commit and machine.
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

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL's preprocessor_config.json
STAGES = ("gen", "score", "update")


def crop_script(crops: int, view: tuple[int, int]) -> list[str | None]:
    """``crops`` scripted crop calls in the model's view (``view``: its width and height), each followed by a sampled
    turn (``None``). Boxes are 252 to 392 px wide (3/4 as high), spread over the image."""
    width, height = view
    script: list[str | None] = []
    for k in range(crops):
        w = 252 + 28 * (k % 6)
        h = w * 3 // 4
        x, y = (97 * k) % (width - w), (61 * k) % (height - h)
        call = {"name": "crop", "arguments": {"bbox": [x, y, x + w, y + h]}}
        script += [f"<tool_call>{json.dumps(call)}</tool_call>", None]
    return script


# -- the worker: one GRPO run on the code first on the path -----------------------------------------------------


def worker(args: argparse.Namespace) -> dict:
    import torch
    from cpu_memory import reset_peak, status_kib

    import vagent
    from vagent.config import GRPOConfig, load_config
    from vagent.media import smart_resize
    from vagent.recipes import grpo
    from vagent.rollout import hf_backend

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    scripts = [crop_script(1, tuple(args.view)), crop_script(args.crops_one, tuple(args.view))]
    original_from_row = grpo.Task.from_row.__func__
    state = {"step": 0}

    def scripted(cls, row, tools):
        task = original_from_row(cls, row, tools)
        task.scripted_turns = list(scripts[min(state["step"], 1)])  # the warm-up step crops once
        return task

    grpo.Task.from_row = classmethod(scripted)
    rss = lambda: status_kib("VmRSS") * 1024  # noqa: E731
    hwm = lambda: status_kib("VmHWM") * 1024  # noqa: E731
    measured: dict = {"vagent": str(Path(vagent.__file__).parent.parent), "stages": {}}
    peaks = {"all": 0, "outside": 0}  # of the stage running, with and without the rollout's model forwards
    forward = hf_backend.HFBackend._forward

    def timed_forward(self, *a, **kw):  # the high-water mark is reset after each forward: its activations (the
        peaks["outside"] = max(peaks["outside"], hwm())  # device's memory on a GPU) stay out of "outside"
        try:
            return forward(self, *a, **kw)
        finally:
            peaks["all"] = max(peaks["all"], hwm())
            reset_peak()

    hf_backend.HFBackend._forward = timed_forward

    def staged(name, fn):
        def run(*a, **kw):
            if state["step"] != 1:  # the first step warms up (allocator, kernels, the KV storage)
                return fn(*a, **kw)
            if name == "gen":
                import gc

                gc.collect()
                measured["start"] = rss()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before_device = torch.cuda.memory_allocated()
            peaks.update(all=0, outside=0)
            reset_peak()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            end = hwm()
            stage = {"peak": max(peaks["all"], end), "outside": max(peaks["outside"], end), "after": rss(),
                     "s": time.perf_counter() - t0}  # fmt: skip
            if cuda:
                torch.cuda.synchronize()
                stage["device_peak"] = torch.cuda.max_memory_allocated() - before_device
            measured["stages"][name] = stage
            if name == "gen":
                measured.update(_kept_bytes(out.seen, a[0].policy, smart_resize))
            return out

        return run

    grpo._collect_groups = staged("gen", grpo._collect_groups)
    grpo._score_old_logprobs = staged("score", grpo._score_old_logprobs)
    grpo._update_policy = staged("update", grpo._update_policy)
    if not cuda:
        grpo._micro_batch_loss = _no_forward()

    class Done(Exception):
        pass

    def before_step(step, total):
        state["step"] = step
        if step == 2:
            import gc

            gc.collect()
            measured["left"] = rss()
            raise Done

    cfg = load_config(GRPOConfig, args.config, [])
    try:
        grpo.train(cfg, before_step=before_step)
    except Done:
        pass
    return measured


def _kept_bytes(trajectories, policy, smart_resize) -> dict:
    """Per episode: fp32 patch bytes and uint8 RGB bytes of every distinct image the step's episodes show (a prompt
    image shared by a group counts once), at the size the model sees it."""
    min_pixels, max_pixels = policy.pixel_budget
    factor = policy.image_factor
    patch_dim = 3 * 2 * (factor // 2) ** 2  # channels x temporal patch x patch^2 (1,176 for Qwen2.5-VL)
    seen, patch, rgb = set(), 0, 0
    for t in trajectories:
        for message in t.messages:
            for part in message.content:
                if part.type != "image" or id(part.image) in seen:
                    continue
                seen.add(id(part.image))
                w, h = part.image.size
                h, w = smart_resize(h, w, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
                patch += (h * w) // (factor // 2) ** 2 * patch_dim * 4
                rgb += h * w * 3
    n = len(trajectories)
    return {"episodes": n, "images": len(seen), "patch_bytes": patch / n, "rgb_bytes": rgb / n}


def _no_forward():
    """A stand-in for ``_micro_batch_loss`` on CPU: no forward or backward (the update still collates its
    micro-batches as it does, and steps an optimizer that got no gradient); the old log-probs are the sampler's."""
    import torch

    def loss(ctx, scored, idx, batch, normalizer, stats):
        for i in idx:
            scored.old[i] = torch.tensor(scored.trajectories[i].logprobs, device=ctx.env.device)
        for key in ("loss", "entropy", "clip_frac", "dual_clip_frac", "approx_kl"):  # what the step's record reads
            stats[key] += 0.0
        stats["tokens"] += float(batch["loss_mask"].sum())
        return torch.zeros((), requires_grad=True), 0.0

    return loss


# -- the driver -------------------------------------------------------------------------------------------------


def write_run(folder: Path, checkpoint: str, rows: int, group: int, crops: int, image: tuple[int, int],
              new_tokens: int, device: str) -> Path:  # fmt: skip
    """The rows (one random picture per prompt) and a GRPO config of one measurement; returns the config."""
    import numpy as np
    import yaml
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(folder / "rows.jsonl", "w") as f:
        for i in range(rows // group):
            name = f"img{i}.png"
            pixels = rng.integers(0, 256, (image[1] // 8, image[0] // 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).resize(image, Image.Resampling.BICUBIC).save(folder / name)
            f.write(json.dumps({"id": f"p{i}", "source": "bench", "images": [name], "question": f"What is in {i}?",
                                "answer": "a", "answer_type": "exact"}) + "\n")  # fmt: skip
    # prompt (its image's tokens and the system prompt) + per crop: the call, its image and a sampled turn
    tokens = image[0] * image[1] // 784 + 512 + crops * (392 * 294 // 784 + 160)
    cfg = {
        "out_dir": str(folder / "out"),
        "seed": 0,
        "model": {"path": checkpoint, "device": device, "min_pixels": DEFAULT_MIN_PIXELS,
                  "max_pixels": DEFAULT_MAX_PIXELS},
        "data": {"train": str(folder / "rows.jsonl"), "tools": ["crop"]},
        "rollout": {"max_turns": 2 * crops, "max_new_tokens": new_tokens, "max_total_tokens": tokens,
                    "max_images": crops + 1, "temperature": 1.0,
                    "kv_cache_gb": kv_gb(checkpoint, rows, tokens, 4 if device == "cpu" else 2)},
        "grpo": {"group_size": group, "prompts_per_step": rows // group, "rollout_batch_size": rows,
                 "micro_batch_size": 1, "inner_updates": 1, "mini_batches": 1, "kl_coef": 0.0,
                 "dynamic_sampling": False, "max_sampler_gap": 0.0},
        "rewards": {"weights": {"accuracy": 1.0}},
        "train": {"max_steps": 3, "save_every": 0, "precision": "fp32" if device == "cpu" else "bf16",
                  "lm_head_chunk": 1024},
    }  # fmt: skip
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def kv_gb(checkpoint: str, rows: int, tokens: int, dtype_bytes: int) -> float:
    """The KV storage of ``rows`` rows of ``tokens`` tokens, in GiB (sized once: in the baseline)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * dtype_bytes
    return rows * tokens * per_token / 2**30 * 1.05


def measure(code: str | None, config: Path, args: argparse.Namespace, crops: int, view: tuple[int, int]) -> dict:
    """One worker run on ``code`` (None: this checkout), as JSON."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    path = [str(Path(code).resolve()) if code else str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    command = [sys.executable, __file__, "--worker", "--config", str(config), "--crops-one", str(crops),
               "--view", *map(str, view), "--device", args.device]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def per_episode(m: dict) -> dict:
    """Per episode, above the resident set at the step's start: the most a stage left held (``held``), the highest
    resident set of the step (``peak``), what the step left (``left``); and the score stage's seconds."""
    n, start, stages = m["episodes"], m["start"], m["stages"]
    out = {"held": (max(stages[s]["after"] for s in STAGES) - start) / n,
           "outside": (max(stages[s]["outside"] for s in STAGES) - start) / n,
           "peak": (max(stages[s]["peak"] for s in STAGES) - start) / n,
           "left": (m["left"] - start) / n, "score_s": stages["score"]["s"]}  # fmt: skip
    if "device_peak" in stages["gen"]:
        out["device"] = max(stages[s]["device_peak"] for s in STAGES) / n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["tiny", "small"])
    parser.add_argument("--crops", type=int, nargs="*", default=[1, 4, 12])
    parser.add_argument("--rows", type=int, default=128, help="Episodes of the measured step.")
    parser.add_argument("--group", type=int, default=8, help="Samples per prompt (a GRPO group).")
    parser.add_argument("--image", type=int, nargs=2, default=[1000, 750], help="Prompt image width and height.")
    parser.add_argument("--new-tokens", type=int, default=2, help="Tokens of each sampled turn.")
    parser.add_argument("--baseline", help="A checkout of another vagent (e.g. `git worktree add /tmp/base e8c3201`).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads of each run.")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--crops-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--view", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.rows % args.group:
        raise SystemExit(f"--rows ({args.rows}) must be a multiple of --group ({args.group})")
    from vagent.media import smart_resize
    from vagent.tiny_model import build_tiny_checkpoint

    h, w = smart_resize(args.image[1], args.image[0], min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)
    view = (w, h)
    scratch = Path(tempfile.mkdtemp(prefix="vagent-episode-memory-"))
    codes = [("baseline", args.baseline)] if args.baseline else []
    codes.append(("this", None))
    results = []
    try:
        for size in args.sizes:
            checkpoint = str(build_tiny_checkpoint(scratch / size, size=size, min_pixels=DEFAULT_MIN_PIXELS,
                                                   max_pixels=DEFAULT_MAX_PIXELS))  # fmt: skip
            for crops in args.crops:
                config = write_run(scratch / f"{size}-{crops}", checkpoint, args.rows, args.group, crops,
                                   tuple(args.image), args.new_tokens, args.device)  # fmt: skip
                row = {"size": size, "crops": crops}
                for label, code in codes:
                    m = measure(code, config, args, crops, view)
                    row[label] = {**m, **per_episode(m)}
                    print(f"{size} {crops} crops {label}: {json.dumps(row[label])}", file=sys.stderr)
                results.append(row)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    lines = table(results, args)
    print("\n".join(lines))
    if args.doc:
        from doc_table import write_section

        write_section("episode-memory", "\n".join(lines), device=args.device)


def table(results: list[dict], args: argparse.Namespace) -> list[str]:
    from checkpoint_args import checkout_name

    mib = 2**20
    codes = ([("baseline", checkout_name(args.baseline))] if args.baseline else []) + [("this", "this code")]
    device = "cuda" in args.device
    lines = [f"{args.rows} episodes per step ({args.rows // args.group} prompts x {args.group} samples), a "
             f"{args.image[0]}x{args.image[1]} prompt image, Qwen2.5-VL's default pixel budget, on {args.device}. Host "
             "RSS per episode, above the resident set when the step started (x the patch bytes kept): held = the most "
             "a stage left resident (episodes, encodings); peak = the step's highest, without and with the rollout's "
             "model forwards (their activations: a GPU holds them in its own memory); left = what the step left "
             "for the next one.", "",
             "| shape | crops | code | patch bytes kept | held | peak without forwards | peak | left | score stage |"
             + (" device peak |" if device else ""),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if device else "")]  # fmt: skip
    for r in results:
        for label, name in codes:
            x, kept = r[label], r[label]["patch_bytes"]
            cells = [r["size"], str(r["crops"]), name, f"{kept / mib:.1f} MiB",
                     *(f"{x[key] / mib:.1f} MiB ({x[key] / kept:.2f}x)" for key in ("held", "outside", "peak")),
                     f"{x['left'] / mib:.1f} MiB",
                     f"{x['score_s']:.1f} s"]  # fmt: skip
            if device:
                cells.append(f"{x['device'] / mib:.1f} MiB")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()

"""The built-in default job: tiny local Qwen2.5-VL + a generated image + one multi-turn rollout.

    vagent quickstart [--config configs/quickstart/tiny_cpu.yaml] [key=value ...]

Steps: build (or reuse) a random tiny checkpoint, draw a cluttered image with one small digit
tile, run an episode in which the first assistant turn is scripted (a crop of the tile, since a
random model cannot yet call tools) and the policy samples the rest, then print the trajectory and
write it (JSONL + PNGs of every image) under ``out_dir``. The tiny model is untrained, so what it
samples is noise; everything around it (template, tool call, full-resolution crop, image tokens
of the tool turn, masks) is the real machinery.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from vagent.config import QuickstartConfig, config_to_dict, load_config
from vagent.geometry import original_to_model
from vagent.model import load_policy
from vagent.recipes.common import tiny_checkpoint, tool_services
from vagent.rollout import RolloutLimits, Task, rollout
from vagent.rollout.export import read_jsonl, write_html, write_jsonl
from vagent.types import Trajectory


def make_task_image(width: int, height: int, seed: int) -> tuple[Image.Image, int, tuple[int, int, int, int]]:
    """A cluttered canvas with one small tile showing a digit. Returns (image, digit, tile box)."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (235, 235, 228))
    draw = ImageDraw.Draw(image)
    for _ in range(60):  # clutter: shapes the global view can see, none of them the answer
        x, y = rng.randrange(width), rng.randrange(height)
        size = rng.randint(10, 80)
        color = tuple(rng.randint(40, 220) for _ in range(3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x, y, x + size, y + size), outline=color, width=3)
    tile = 28
    x1, y1 = rng.randint(0, width - tile), rng.randint(0, height - tile)
    digit = rng.randint(0, 9)
    draw.rectangle((x1, y1, x1 + tile, y1 + tile), fill=(200, 30, 30))
    draw.text((x1 + 8, y1 + 4), str(digit), fill=(255, 255, 255), font=ImageFont.load_default(size=18))
    return image, digit, (x1, y1, x1 + tile, y1 + tile)


def print_trajectory(trajectory: Trajectory) -> None:
    """Print a trajectory read back from its JSONL (images as paths on disk)."""
    sampled = sum(trajectory.loss_mask)
    print(f"\n=== trajectory {trajectory.task_id}: stop={trajectory.stop_reason} answer={trajectory.answer!r}")
    print(
        f"    tokens: {len(trajectory.token_ids)} total, {sampled} sampled (mask 1), "
        f"{len(trajectory.token_ids) - sampled} forced (mask 0); metrics {trajectory.metrics}"
    )
    for message in trajectory.messages:
        if message.role == "system":
            print(f"\n[system] {message.plain_text[:160]}...")
            continue
        images = [str(part.path) for part in message.content if part.type == "image"]
        print(f"\n[{message.role}]" + (f" images: {', '.join(images)}" if images else ""))
        print("  " + message.plain_text.replace("\n", "\n  "))
        for call in message.tool_calls:
            print(f"  -> tool call {call.name}({json.dumps(call.arguments)})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    cfg = load_config(QuickstartConfig, config_path, argv)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    policy = load_policy(
        tiny_checkpoint(cfg.model, cfg.out_dir),
        device=cfg.model.device,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
    )
    print(
        f"policy: {policy.family} from {policy.path} on {policy.device} ({policy.dtype}), "
        f"boxes in {policy.coord_convention} coordinates"
    )

    width, height = cfg.image_size
    image, digit, tile = make_task_image(width, height, cfg.seed)
    image_path = out_dir / "task.png"
    image.save(image_path)
    seen = policy.model_view(image).size
    margin = 20  # original pixels around the tile, so the crop shows some context
    box = (tile[0] - margin, tile[1] - margin, tile[2] + margin, tile[3] + margin)
    model_box = [round(v) for v in original_to_model(box, policy.coord_convention, seen, image.size)]
    scripted = (
        "<think>The red tile is too small to read at this resolution. I will crop it.</think>\n"
        f'<tool_call>\n{{"name": "crop", "arguments": {{"bbox": {model_box}}}}}\n</tool_call>'
    )
    task = Task(
        id=f"quickstart-{cfg.seed}",
        question="What digit is written on the small red tile?",
        images=[image],
        tools=cfg.rollout.tools,
        scripted_turns=[scripted],
    )
    limits = RolloutLimits(**{k: v for k, v in config_to_dict(cfg.rollout).items() if k != "tools"})
    print(
        f"task: {task.question} (gold answer {digit}; image {width}x{height}, model sees {seen[0]}x{seen[1]}; "
        f"first turn scripted: crop {model_box})"
    )

    import torch

    torch.manual_seed(cfg.seed)
    trajectory = rollout(policy, task, limits, **tool_services(cfg.toolbox))

    jsonl = write_jsonl([trajectory], out_dir / "trajectory.jsonl", extra=lambda t: {"gold": str(digit)})
    html = write_html([trajectory], out_dir / "trajectory.html", title=f"vagent quickstart (gold answer {digit})")
    saved = read_jsonl(jsonl)[0]  # what is on disk: the same turns, images as the PNGs written
    print_trajectory(saved)
    print(f"\nwrote {jsonl}, {len(saved.images)} image(s) under {jsonl.parent}/, and {html}")
    print(f"open {html} in a browser to see the turns with the crop inline")
    print(
        "note: the tiny model has random weights, so its sampled turns are noise; "
        "point model.path=DIR at a real Qwen2.5-VL checkpoint to see real reasoning."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Zoom tasks: a large cluttered image with one small tile whose digit is unreadable at the processor's global
resolution but readable after a crop. Each row carries the tile as evidence and a gold trajectory.

    python -m data_pipelines.synthetic.zoom --out data/zoom --rows 200 --seed 0

Knobs: ``tile`` (original pixels; smaller = harder), ``clutter`` (shapes), ``distractors`` (tiles of
other colors with other digits, so the question's color matters), ``direct_share`` (rows whose tile is
drawn large enough to read without a tool: tool use should be adaptive, not reflexive).

The gold trajectory's tool turn is what the rollout engine would show: the builder runs the real
``crop`` tool on the image with the policy's pixel budget and renders its observation with
``observation_content``, so SFT teaches exactly the tool round trip the policy meets in RL.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import random
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from data_pipelines.gold import crop_then_answer
from vagent.data import Evidence, Row, write_rows
from vagent.geometry import Convention

__all__ = ["COLORS", "GLYPHS", "STRIPES", "draw_task", "zoom_rows"]

COLORS = {"red": (200, 30, 30), "blue": (30, 60, 200), "green": (20, 140, 40), "purple": (130, 40, 160)}
# The look templates say which quarter the tile is in (``_where``), as a person would before cropping. Without it,
# the quickstart's policy tied its crop box to which template it sampled first. With it, the tiny policy still says
# one or two quarter words for every image, though the box that follows is right (docs/quickstart.md).
_LOOK = [
    "The {color} tile at the {where} is too small to read at this resolution. I will crop it.",
    "I can see a small {color} tile at the {where} but not its {what}. Let me zoom in on it.",
    "The {what} on the {color} square at the {where} {are} unreadable here; cropping that region should help.",
]
_READ = [
    "The crop shows the {what} clearly: {digit}.",
    "Now I can read it. The {color} tile shows {digit}.",
    "After cropping, the {what} {are} {digit}.",
]
_DIRECT = [
    "The {color} tile is large enough to read directly: {digit}.",
    "I can read the {color} tile without zooming; it shows {digit}.",
]
# glyph -> (what the question asks about, the question)
GLYPHS = {
    "digit": ("digit", "What digit is written on the small {color} tile?"),
    # 1-px lines 3 px apart blur to flat color when the image is downscaled well below 1:1, so only a crop
    # tells their direction (a visual read simpler than digit shapes for a model trained from scratch). All
    # four directions whiten about the same share of the tile, so its color in the view is the same.
    "stripes": (
        "stripes",
        "Which way do the stripes on the small {color} tile run: horizontal, vertical, rising or falling?",
    ),
}
STRIPES = ("horizontal", "vertical", "rising", "falling")  # rising: "/", falling: "\\"


def draw_task(width: int, height: int, rng: random.Random, *, tile: int, clutter: int, distractors: int,
              color: str, grid: int | None = None, glyph: str = "digit",
              stripe: int = 1) -> tuple[Image.Image, int | str, tuple[int, int, int, int]]:  # fmt: skip
    """Draw one task image. Returns (image, digit on the ``color`` tile, that tile's box in original pixels).
    With ``grid``, the target tile sits at the center of one of ``grid x grid`` cells (an easier layout).
    ``stripe``: width in pixels of each stripe (``glyph="stripes"``), with twice that between stripes; 1-px
    stripes blur away when the image is downscaled, wide ones stay readable. The stripes fill the tile's
    middle; a solid border of a fifth of its side keeps the tile a saturated color in the view (a tile
    striped to its edges looks pale there, and the quickstart's model did not learn to find it)."""
    image = Image.new("RGB", (width, height), (235, 235, 228))
    draw = ImageDraw.Draw(image)
    for _ in range(clutter):  # shapes the global view can see, none of them the answer
        x, y, size = rng.randrange(width), rng.randrange(height), rng.randint(10, 80)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x, y, x + size, y + size), outline=tuple(rng.randint(40, 220) for _ in range(3)), width=3)
    font = ImageFont.load_default(size=max(8, int(tile * 0.65)))
    placed: list[tuple[int, int, int, int]] = []
    others = [c for c in COLORS if c != color]
    answer, target = 0, (0, 0, 0, 0)
    for k in range(1 + distractors):
        for _ in range(100):  # tiles do not overlap
            x1, y1 = rng.randint(0, width - tile), rng.randint(0, height - tile)
            if grid and k == 0:
                cx, cy = (rng.randrange(grid) + 0.5) * width / grid, (rng.randrange(grid) + 0.5) * height / grid
                x1, y1 = int(cx - tile / 2), int(cy - tile / 2)
            box = (x1, y1, x1 + tile, y1 + tile)
            if all(box[2] < p[0] or box[0] > p[2] or box[3] < p[1] or box[1] > p[3] for p in placed):
                break
        placed.append(box)
        digit = rng.randint(0, 9) if glyph == "digit" else rng.choice(STRIPES)
        draw.rectangle(box, fill=COLORS[color if k == 0 else others[(k - 1) % len(others)]])
        if glyph == "digit":
            draw.text((box[0] + tile * 0.28, box[1] + tile * 0.1), str(digit), fill=(255, 255, 255), font=font)
        else:  # white stripes in the middle; the wide solid border keeps the tile a saturated color in the view
            border = max(3, tile // 5)
            image.paste(
                (255, 255, 255), (box[0] + border, box[1] + border), _stripes(str(digit), tile - 2 * border, stripe)
            )
        if k == 0:
            answer, target = digit, box
    return image, answer, target


def _stripes(direction: str, side: int, width: int) -> Image.Image:
    """A ``side`` x ``side`` mask of stripes ``width`` px wide, ``3 * width`` apart, running ``direction``."""
    y, x = np.mgrid[:side, :side]
    along = {"horizontal": y, "vertical": x, "rising": x + y, "falling": x - y + 3 * width * side}[direction]
    return Image.fromarray(np.where(along % (3 * width) < width, 255, 0).astype(np.uint8))


def zoom_rows(out_dir: str | Path, n: int, *, seed: int = 0, size: tuple[int, int] = (896, 672), tile: int = 28,
              clutter: int = 60, distractors: int = 1, direct_share: float = 0.2, grid: int | None = None,
              margin: int | None = None, glyph: str = "digit", min_pixels: int = 3136, max_pixels: int = 200704,
              factor: int = 28, convention: Convention = "absolute", workers: int = 1,
              pool: Executor | None = None) -> list[Row]:  # fmt: skip
    """Build ``n`` zoom rows with gold trajectories under ``out_dir`` (images in ``out_dir/images``).

    Row ``i`` draws from its own generator, seeded by ``(seed, i)``: the rows are the same whatever ``n`` and
    however many ``workers`` (processes) draw them. ``pool`` (``spawn_pool(workers)``) draws them in processes
    that are already up: several splits share one pool, and each worker pays its imports once.

    ``grid``: tiles on a grid x grid layout (see ``draw_task``); ``margin``: fixed context (original pixels)
    around the tile in the gold crop, else 8-24 at random; ``glyph``: what the tile shows (``GLYPHS``).
    ``min_pixels``/``max_pixels``/``factor``/``convention`` are the policy's (``Policy.pixel_budget``,
    ``image_factor``, ``coord_convention``): the crop box in the gold call is written in the frame that
    policy sees, and the crop observation is made with its budget.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    knobs = dict(size=size, tile=tile, clutter=clutter, distractors=distractors, direct_share=direct_share, grid=grid,
                 margin=margin, glyph=glyph, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor,
                 convention=convention)  # fmt: skip
    if workers <= 1 or n < 2 * workers:
        return _zoom_rows(out_dir, range(n), seed=seed, **knobs)
    chunks = [range(n * k // workers, n * (k + 1) // workers) for k in range(workers)]
    draw = functools.partial(_zoom_rows, out_dir, seed=seed, **knobs)
    if pool is not None:
        return [row for part in pool.map(draw, chunks) for row in part]
    with spawn_pool(workers) as own:
        return [row for part in own.map(draw, chunks) for row in part]


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    """Worker processes for ``zoom_rows``, spawned: a clean interpreter, not a fork of a caller that may hold
    torch's thread pools."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def _zoom_rows(out_dir: Path, indices: range, *, seed: int, size: tuple[int, int], tile: int, clutter: int,
               distractors: int, direct_share: float, grid: int | None, margin: int | None, glyph: str,
               min_pixels: int, max_pixels: int, factor: int, convention: Convention) -> list[Row]:  # fmt: skip
    rows = []
    for i in indices:
        rng = random.Random(f"zoom/{seed}/{i}")
        color = rng.choice(list(COLORS))
        direct = rng.random() < direct_share
        # A "direct" row's tile is large, and its stripes wide, so the global view shows the answer.
        image, digit, box = draw_task(*size, rng, tile=min(tile * 5, min(size) // 2) if direct else tile,
                                      clutter=clutter, distractors=distractors, color=color,
                                      grid=None if direct else grid, glyph=glyph, stripe=4 if direct else 1)  # fmt: skip
        image_path = out_dir / "images" / f"zoom-{seed}-{i}.png"
        image.save(image_path, compress_level=1)  # lossless all the same; encoding is most of a row's cost
        what, question = GLYPHS[glyph]
        are = "are" if what.endswith("s") else "is"  # "the stripes ... are", "the digit ... is"
        words = {"color": color, "digit": digit, "what": what, "where": _where(box, size), "are": are}
        if direct:
            messages = [{"role": "assistant",
                         "content": f"<think>{rng.choice(_DIRECT).format(**words)}</think>\n<answer>{digit}</answer>"}]  # fmt: skip
        else:
            messages = _crop_then_answer(image, box, rng, words, out_dir / "images" / f"zoom-{seed}-{i}-crop.png",
                                         margin, min_pixels, max_pixels, factor, convention)  # fmt: skip
        rows.append(Row(
            id=f"zoom-{seed}-{i}", source="synthetic/zoom", images=[str(image_path)],
            question=question.format(color=color), answer=str(digit), answer_type="exact",
            evidence=Evidence(boxes=[[float(v) for v in box]]), tools=["crop"], messages=messages,
            extra={"color": color, "difficulty": {"tile": tile, "clutter": clutter, "distractors": distractors,
                                                  "direct": direct, "glyph": glyph}},
        ))  # fmt: skip
    return rows


def _where(box: tuple[int, int, int, int], size: tuple[int, int]) -> str:
    """Which quarter of a ``size`` (width, height) image the center of ``box`` lies in: "top left" ... "bottom
    right"."""
    (x1, y1, x2, y2), (width, height) = box, size
    return f"{'top' if y1 + y2 < height else 'bottom'} {'left' if x1 + x2 < width else 'right'}"


def _crop_then_answer(image, box, rng, words, crop_path, margin, min_pixels, max_pixels, factor, convention):
    return crop_then_answer(image, box, crop_path, look=rng.choice(_LOOK).format(**words),
                            read=rng.choice(_READ).format(**words), answer=str(words["digit"]),
                            margin=margin if margin is not None else rng.randint(8, 24),  # context, varied
                            min_pixels=min_pixels, max_pixels=max_pixels, factor=factor, convention=convention)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    parser.add_argument("--out", required=True, help="output dir (rows.jsonl + images/)")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tile", type=int, default=28, help="tile side in original pixels")
    parser.add_argument("--distractors", type=int, default=1)
    parser.add_argument("--direct-share", type=float, default=0.2)
    parser.add_argument("--model", help="checkpoint dir whose pixel budget and coordinate convention the gold "
                                        "trajectories' crop boxes use (default: Qwen2.5-VL's pixels, 3136-200704)")  # fmt: skip
    parser.add_argument("--val-rows", type=int, default=0, help="also write val.jsonl: rows of other images")
    args = parser.parse_args(argv)
    frame = {}
    if args.model:
        from vagent.model import load_policy

        frame = load_policy(args.model, device="cpu").frame
    knobs = dict(tile=args.tile, distractors=args.distractors, direct_share=args.direct_share, **frame)
    rows = zoom_rows(args.out, args.rows, seed=args.seed, **knobs)
    path = write_rows(rows, Path(args.out) / "rows.jsonl")
    print(f"wrote {len(rows)} rows to {path}")
    if args.val_rows:
        val = zoom_rows(args.out, args.val_rows, seed=args.seed + 1, **knobs)
        print(f"wrote {len(val)} rows to {write_rows(val, Path(args.out) / 'val.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Grounding tasks (Visual-RFT style): "give the box of the small <color> tile", scored by IoU.

    python -m data_pipelines.synthetic.grounding --out data/grounding --rows 200 --seed 0

The images are the zoom task's (``zoom.draw_task``). The answer is the tile's box in original pixels
(answer_type ``box``; the ``box_iou`` reward and eval map the policy's answer back from its frame). The
gold trajectory answers directly with the box in the frame the policy sees, so the row needs the
policy's pixel budget and coordinate convention.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from data_pipelines.gold import model_box
from data_pipelines.synthetic.zoom import COLORS, draw_task
from vagent.data import Evidence, Row, write_rows
from vagent.geometry import Convention

__all__ = ["QUESTION", "grounding_rows"]

QUESTION = "Where is the small {color} tile? Give its box [x1, y1, x2, y2]."


def grounding_rows(out_dir: str | Path, n: int, *, seed: int = 0, size: tuple[int, int] = (448, 336), tile: int = 28,
                   clutter: int = 30, distractors: int = 1, grid: int | None = None, min_pixels: int = 3136,
                   max_pixels: int = 50176, factor: int = 28, convention: Convention = "absolute") -> list[Row]:  # fmt: skip
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        color = rng.choice(list(COLORS))
        image, _, box = draw_task(
            *size, rng, tile=tile, clutter=clutter, distractors=distractors, color=color, grid=grid
        )
        path = out / "images" / f"grounding-{seed}-{i}.png"
        image.save(path)
        answer = model_box(box, image.size, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor,
                           convention=convention)  # fmt: skip
        gold = [float(v) for v in box]
        rows.append(Row(id=f"grounding-{seed}-{i}", question=QUESTION.format(color=color), answer=gold, answer_type="box",
                        images=[str(path)], source="synthetic/grounding", evidence=Evidence(boxes=[gold]), tools=[],
                        messages=[{"role": "assistant", "content": f"<answer>{answer}</answer>"}]))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-pixels", type=int, default=3136)
    parser.add_argument("--max-pixels", type=int, default=50176)
    args = parser.parse_args(argv)
    rows = grounding_rows(args.out, args.rows, seed=args.seed, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    print(f"wrote {len(rows)} rows to {write_rows(rows, Path(args.out) / 'rows.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Synthetic pairwise judgments: which of two answers names the digit on the tile? And the same questions as plain
rows, for a policy that a judge trained on them then grades.

    python -m data_pipelines.synthetic.judgments --out data/judge --rows 200 --questions 64 --seed 0 [--no-reference]

Each image is one colored tile with a large digit. A judgment row asks "What digit is on the <color> tile?" with
two answers, one naming the tile's digit and one another digit, in random order; the label is the right one. With
a reference (the default) the judge is shown the true digit as the reference answer, so the task is reading the
two answers against it (a tiny model learns that within minutes on a CPU); ``--no-reference`` makes the judge read
the digit from the image. ``questions.jsonl`` holds the tile questions alone (answer: the digit), for a policy.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from data_pipelines.judgments import judgment_row
from data_pipelines.synthetic.zoom import COLORS
from vagent.data import Judgment, Row, write_rows

__all__ = ["QUESTION", "judgment_rows", "question_rows", "tile_image"]

QUESTION = "What digit is on the {color} tile?"
# How an answer names a digit; the right and the wrong answer of a pair are phrased independently.
PHRASES = ("The tile shows {digit}.", "It is {digit}.", "The digit is {digit}.", "{digit}", "I can see a {digit}.")
DIGITS = tuple(range(10))


def tile_image(digit: int, color: str, size: int) -> Image.Image:
    """A ``size`` x ``size`` tile of ``color`` with ``digit`` drawn large in white."""
    image = Image.new("RGB", (size, size), COLORS[color])
    font = ImageFont.load_default(size=int(size * 0.7))
    ImageDraw.Draw(image).text((size / 2, size / 2), str(digit), fill=(255, 255, 255), font=font, anchor="mm")
    return image


def _task(out: Path, name: str, rng: random.Random, size: int, digits: Sequence[int]) -> tuple[str, int, str]:
    digit, color = rng.choice(digits), rng.choice(list(COLORS))
    path = out / "images" / f"{name}.png"
    tile_image(digit, color, size).save(path)
    return str(path), digit, color


def judgment_rows(out_dir: str | Path, n: int, *, seed: int = 0, size: int = 56, reference: bool = True,
                  phrases: Sequence[str] = PHRASES, template: str | None = None,
                  digits: Sequence[int] = DIGITS) -> list[Row]:  # fmt: skip
    """``n`` pairwise judgment rows (images under ``out_dir/images``); the preferred answer's position is random.
    ``phrases``: how answers name their digit (``{digit}``); ``template``: the judge prompt's template (default:
    vagent's, ``vagent.data.judgment.TEMPLATES``); ``digits``: those the tiles show (the wrong answer names another
    of them)."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        path, digit, color = _task(out, f"judge-{seed}-{i}", rng, size, digits)
        wrong = rng.choice([d for d in digits if d != digit])
        right_text, wrong_text = (rng.choice(phrases).format(digit=d) for d in (digit, wrong))
        preferred = rng.choice((1, 2))
        responses = [right_text, wrong_text] if preferred == 1 else [wrong_text, right_text]
        judgment = Judgment("pairwise", "answers", QUESTION.format(color=color), responses,
                            str(digit) if reference else None, preferred, template=template)  # fmt: skip
        rows.append(judgment_row(f"judge-{seed}-{i}", judgment, images=[path], source="synthetic/judgments",
                                 extra={"digit": digit, "wrong": wrong}))  # fmt: skip
    return rows


def question_rows(out_dir: str | Path, n: int, *, seed: int = 0, size: int = 56,
                  digits: Sequence[int] = DIGITS) -> list[Row]:  # fmt: skip
    """``n`` plain rows asking for the tile's digit (answer type ``exact``; no tools), for a policy."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        path, digit, color = _task(out, f"question-{seed}-{i}", rng, size, digits)
        rows.append(Row(id=f"question-{seed}-{i}", question=QUESTION.format(color=color), answer=str(digit),
                        answer_type="exact", images=[path], source="synthetic/judgments", tools=[]))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    parser.add_argument("--out", required=True, help="Output dir: judgments.jsonl, images/, questions.jsonl.")
    parser.add_argument("--rows", type=int, default=200, help="Judgment rows.")
    parser.add_argument(
        "--questions", type=int, default=0, help="Tile questions for a policy (questions.jsonl; 0: none)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=56, help="Tile side in pixels.")
    parser.add_argument("--no-reference", action="store_true", help="Do not show the judge the true digit.")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = judgment_rows(out, args.rows, seed=args.seed, size=args.size, reference=not args.no_reference)
    print(f"wrote {len(rows)} judgment rows to {write_rows(rows, out / 'judgments.jsonl')}")
    if args.questions:
        questions = question_rows(out, args.questions, seed=args.seed + 1, size=args.size)
        print(f"wrote {len(questions)} questions to {write_rows(questions, out / 'questions.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

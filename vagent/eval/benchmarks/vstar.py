"""V* / HR-Bench-style high-resolution multiple-choice QA: small details in large images.

Format (JSON list or JSONL): ``{id, image, question, options: [...], answer}`` (``choices`` is accepted for
``options``; ``answer`` is the letter or the option's text; options may carry their own "A." prefix).
Metric: accuracy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, load_with, media_path, require
from vagent.eval.metrics import choice_score
from vagent.types import Trajectory

_PREFIX = re.compile(r"^\(?[A-Za-z][.)]\s+")


def options(record: dict[str, Any]) -> list[str]:
    value = require(record, "options" if "options" in record else "choices", list)
    if len(value) < 2 or not all(isinstance(v, str) and v.strip() for v in value):
        raise RecordError("field 'options' must list at least two non-empty strings")
    return [_PREFIX.sub("", v) for v in value]  # "A. red" -> "red": the prompt adds its own letters


def convert(where: str, record: dict[str, Any], root: Path | None, base: Path, media: str) -> Row:
    choices = options(record)
    answer = require(record, "answer", str)
    if (
        not (len(answer.strip()) == 1 and ord(answer.strip().upper()) - ord("A") < len(choices))
        and answer not in choices
    ):
        raise RecordError(f"field 'answer' {answer!r} is neither an option letter nor an option")
    rid = record.get("id", where)
    path = media_path(require(record, media, str), root, base, media)
    return Row(id=str(rid), question=require(record, "question", str), answer=answer.strip(), answer_type="choice",
               choices=choices, images=[path] if media == "image" else [], videos=[path] if media == "video" else [],
               source="vstar" if media == "image" else "video-mc",
               extra={"type": [record["category"]] if isinstance(record.get("category"), str) else []})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_with(path, lambda where, r: convert(where, r, image_root, path.parent, "image"))


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return choice_score(row, trajectory, rule)


BENCHMARK = Benchmark("vstar", load, score, ("accuracy", "parsed"), ("crop", "zoom_in"))

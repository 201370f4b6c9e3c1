"""MAT-Coding (Visual-ARFT): degraded images (rotated, blurred, cropped, ...) the agent fixes with code.

Published format: a JSON list of ``{id, question, answers: [...], type: [...], ori_image_path,
processed_image_path}``; paths relative to ``--image-root``. The model sees the processed image.
Metric: token F1 and EM, max over the gold answers (F1 counts 1 on EM), overall and per ``type``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, load_with, media_path, require
from vagent.eval.metrics import f1_em_metrics
from vagent.types import Trajectory


def _strings(record: dict[str, Any], name: str) -> list[str]:
    value = require(record, name, (list, str))
    values = [value] if isinstance(value, str) else value
    if not values or not all(isinstance(v, str) for v in values):
        raise RecordError(f"field {name!r} must be a non-empty list of strings")
    return values


def convert(record: dict[str, Any], root: Path | None, base: Path, image_field: str, source: str) -> Row:
    rid = require(record, "id", (str, int))
    answers = _strings(record, "answers" if "answers" in record else "answer")
    types = record.get("type") or []
    if isinstance(types, str):
        types = [types]
    if not all(isinstance(t, str) for t in types):
        raise RecordError("field 'type' must be a string or a list of strings")
    return Row(id=str(rid), question=require(record, "question", str), answer=answers, answer_type="f1",
               images=[media_path(require(record, image_field, str), root, base, image_field)], source=source,
               extra={"type": types})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_with(path, lambda where, r: convert(r, image_root, path.parent, "processed_image_path", "mat-coding"))


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return f1_em_metrics(trajectory.answer, row.answer)


BENCHMARK = Benchmark("mat-coding", load, score, ("f1", "em"), ("code", "crop", "rotate"))

"""Temporal grounding (Charades-STA-style): find when a described moment happens.

Format: ``{id, video, query, timestamp: [start, end]}`` (``span`` is accepted for ``timestamp``; seconds).
Metrics: IoU of the answered span (first two numbers of the answer), mean = mIoU, and R@{0.3, 0.5, 0.7}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vagent.data import Evidence, Row
from vagent.eval.benchmarks import Benchmark, RecordError, load_with, media_path, require
from vagent.eval.metrics import RECALL_AT, temporal_metrics
from vagent.types import Trajectory

PROMPT = 'When does this happen in the video: "{query}"? Answer with the start and end time in seconds as [start, end].'


def convert(where: str, record: dict[str, Any], root: Path | None, base: Path) -> Row:
    key = "timestamp" if "timestamp" in record else "span"
    span = require(record, key, list)
    if len(span) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in span):
        raise RecordError(f"field {key!r} must be [start, end] in seconds")
    if not 0 <= span[0] < span[1]:
        raise RecordError(f"field {key!r} must have 0 <= start < end, got {span}")
    gold = [float(span[0]), float(span[1])]
    return Row(id=str(record.get("id", where)), question=PROMPT.format(query=require(record, "query", str)),
               answer=gold, answer_type="span", videos=[media_path(require(record, "video", str), root, base, "video")],
               source="temporal-grounding", evidence=Evidence(spans=[gold]))  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_with(path, lambda where, r: convert(where, r, image_root, path.parent))


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return temporal_metrics(trajectory.answer, row.answer)


BENCHMARK = Benchmark("temporal-grounding", load, score, ("iou", *(f"r@{k}" for k in RECALL_AT)),
                      ("sample_frames", "crop_clip"))  # fmt: skip

"""The repo's own synthetic benchmarks (``data_pipelines/synthetic``): canonical rows JSONL.

Metrics: ``accuracy`` by the row's answer type (the reward's scorer) and ``crop_iou`` (best IoU of a crop
with the evidence box: did it look in the right place); ``synthetic-video`` (the video tasks, ``video.py``) scores
``temporal_iou`` instead (best IoU of a span the policy sampled or cut with the evidence span: did it look at the
right moment); ``synthetic-tools`` (the tool-choice rows, ``tools.py``, MAT's format) scores MAT's token ``f1`` and
``em`` as ``mat-search`` and ``mat-coding`` do (Visual-ARFT's metric), and ``crop_iou``. The runner adds the tool-use
statistics.
"""

from __future__ import annotations

from pathlib import Path

from vagent.data import Row, RowError, load_rows
from vagent.eval.benchmarks import Benchmark
from vagent.eval.metrics import f1_em_metrics
from vagent.rewards import accuracy, crop_iou, temporal_iou
from vagent.toolbox import TOOLS
from vagent.types import Trajectory


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    try:
        return load_rows(path, known_tools=TOOLS), []
    except RowError as e:  # load_rows stops at the first bad row and names it
        return [], [(str(path), str(e))]


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return {
        "accuracy": accuracy([trajectory], [row])[0],
        "crop_iou": crop_iou([trajectory], [row])[0],
    }


def score_video(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return {
        "accuracy": accuracy([trajectory], [row])[0],
        "temporal_iou": temporal_iou([trajectory], [row])[0],
    }


def score_tools(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    golds = row.answer if isinstance(row.answer, list) else [row.answer]
    return {
        **f1_em_metrics(trajectory.answer, [str(g) for g in golds]),
        "crop_iou": crop_iou([trajectory], [row])[0],
    }


VARIANTS = (
    Benchmark("synthetic", load, score, ("accuracy", "crop_iou"), ("crop",)),
    Benchmark("synthetic-video", load, score_video, ("accuracy", "temporal_iou"), ("sample_frames", "crop_clip")),
    Benchmark("synthetic-tools", load, score_tools, ("f1", "em", "crop_iou"), ("search", "code", "crop")),
)
BENCHMARK = VARIANTS[0]

"""MAT-Search (Visual-ARFT): questions that need the image and a web search.

Published format: ``{id, question, answer, image_path}`` records (``answer`` a string or a list), paths
relative to ``--image-root``; ``--search-corpus`` (offline BM25) or a search URL serves the ``search`` tool.
Metric: token F1 and EM, max over gold answers, overall and per ``type`` when records have one.
"""

from __future__ import annotations

from pathlib import Path

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, load_with
from vagent.eval.benchmarks.mat_coding import convert
from vagent.eval.metrics import f1_em_metrics
from vagent.types import Trajectory


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_with(path, lambda where, r: convert(r, image_root, path.parent, "image_path", "mat-search"))


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return f1_em_metrics(trajectory.answer, row.answer)


BENCHMARK = Benchmark("mat-search", load, score, ("f1", "em"), ("search",))

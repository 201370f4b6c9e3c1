"""Video multiple-choice QA (VideoMME-style): ``{id, video, question, options: [...], answer}``; accuracy.
The policy sees the video's length in the prompt and its frames through the video tools."""

from __future__ import annotations

from pathlib import Path

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, load_with
from vagent.eval.benchmarks.vstar import convert, score


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_with(path, lambda where, r: convert(where, r, image_root, path.parent, "video"))


BENCHMARK = Benchmark("video-mc", load, score, ("accuracy", "parsed"), ("sample_frames", "crop_clip"))

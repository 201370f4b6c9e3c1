"""LongVideoBench (Wu et al., NeurIPS 2024): multiple-choice referring-reasoning questions on web videos of 8 s to
1 h, asked with the video's subtitles (``longvideobench``, the benchmark's own protocol) or without them
(``longvideobench-nosub``, what lmms-eval's ``longvideobench_val_v`` task feeds a video model).

Format, as https://huggingface.co/datasets/longvideobench/LongVideoBench ships it, read the way the benchmark's own
loader reads it (github.com/longvideobench/LongVideoBench, ``longvideobench/longvideobench_dataset.py``)::

    lvb_val.json   a JSON list of {"id", "video_id", "question", "candidates": [...], "correct_choice": 0-based int
                   (0 = A), "video_path", "subtitle_path", "duration" (s), "starting_timestamp_for_subtitles" (s),
                   "duration_group" (15 | 60 | 600 | 3600), "question_category", "level", "topic_category", ...}
    videos/<video_path>         videos.tar (cat videos.tar.part.*) extracted
    subtitles/<subtitle_path>   subtitles.tar extracted: a JSON list of {"start": "HH:MM:SS.fff", "end", "line"}
                                (YouTube videos) or {"timestamp": [start, end or null], "text"} (TikTok videos)

The paths are relative to ``--image-root``, by default the folder of ``lvb_val.json`` (the dataset folder).
``lvb_test_wo_gt.json`` has no ``correct_choice``: its records are bad records here.

Subtitles: a clip's subtitle file covers the whole source video; ``starting_timestamp_for_subtitles`` is where the
clip starts on that timeline. The official loader interleaves the lines with its sampled frames by time, keeping a
line when a sampled frame falls inside it. An agent samples its own frames, so it gets every line of the clip (moved
to the clip's timeline, those outside ``[0, duration]`` left out), each with the second it starts at, before the
question: the same information in time order, without the frames. Metric: accuracy, by ``duration_group`` and
``question_category`` (lmms-eval's and the leaderboard's splits).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, load_with, media_path, require
from vagent.eval.benchmarks.formats import with_subtitles
from vagent.eval.benchmarks.vstar import score

GROUPS = ("duration_group", "question_category")


def convert(record: dict[str, Any], root: Path, subtitles: bool, name: str) -> Row:
    """One ``lvb_val.json`` record as a canonical row: ``correct_choice`` k becomes the letter ``chr(ord("A") + k)``.

    Raises:
        RecordError: A field is missing or wrong, or the video (or, with subtitles, the subtitle file) is missing.
    """
    candidates = require(record, "candidates", list)
    if len(candidates) < 2 or not all(isinstance(c, str) and c.strip() for c in candidates):
        raise RecordError("field 'candidates' must list at least two non-empty strings")
    choice = require(record, "correct_choice", int)
    if not 0 <= choice < len(candidates):
        raise RecordError(f"field 'correct_choice' {choice} is not an index of the {len(candidates)} candidates")
    question = require(record, "question", str)
    video = media_path(require(record, "video_path", str), root / "videos", root, "video_path")
    if subtitles:
        duration = float(require(record, "duration", (int, float)))
        offset = float(require(record, "starting_timestamp_for_subtitles", (int, float)))
        path = Path(media_path(require(record, "subtitle_path", str), root / "subtitles", root, "subtitle_path"))
        question = with_subtitles(question, _cues(path, offset, duration))
    groups = {"duration_group": str(require(record, "duration_group", (int, str))),
              "question_category": require(record, "question_category", str)}  # fmt: skip
    return Row(id=str(require(record, "id", (str, int))), question=question, answer=chr(ord("A") + choice),
               answer_type="choice", choices=list(candidates), videos=[video], source=name,
               extra={"groups": groups, "video_id": record.get("video_id")})  # fmt: skip


def _cues(path: Path, offset: float, duration: float) -> list[tuple[float, str]]:
    """``(start, text)`` of the subtitle lines inside the clip, on the clip's timeline (``offset`` subtracted)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"field 'subtitle_path': {path} is not readable JSON: {e}") from None
    if not isinstance(entries, list):
        raise RecordError(f"field 'subtitle_path': {path} is not a JSON list")
    cues = []
    for k, entry in enumerate(entries):
        try:
            if "timestamp" in entry:  # TikTok videos: seconds, the end may be null (until the clip's end)
                start, end = entry["timestamp"]
                text = entry["text"]
                end = offset + duration if end is None else float(end)
                start = float(start)
            else:  # YouTube videos
                start, end, text = _clock(entry["start"]), _clock(entry["end"]), entry["line"]
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise RecordError(f"field 'subtitle_path': entry {k} of {path} is not a subtitle line ({e!r})") from None
        start, end = start - offset, end - offset
        if end >= 0 and start <= duration and str(text).strip():
            cues.append((max(0.0, start), str(text).strip()))
    return cues


def _clock(value: str) -> float:
    """``"HH:MM:SS.fff"`` in seconds (the official loader's ``timestamp_to_seconds``)."""
    h, m, s = value.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def load(path: Path, image_root: Path | None, subtitles: bool = True, name: str = "longvideobench"
         ) -> tuple[list[Row], list[tuple[str, str]]]:  # fmt: skip
    """Rows of ``lvb_val.json``; a bad record is listed by its ``id`` (and index in the list) and field.

    Args:
        path: ``lvb_val.json``.
        image_root: The dataset folder holding ``videos/`` and ``subtitles/``; None = the folder of ``path``.
        subtitles: Put the clip's subtitle lines before each question.
        name: The benchmark name, the rows' ``source``.

    Raises:
        BenchmarkError: The file is not a JSON list or JSONL.
    """
    root = image_root or path.resolve().parent
    return load_with(path, lambda where, r: convert(r, root, subtitles, name))


VARIANTS = (
    Benchmark("longvideobench", partial(load, subtitles=True, name="longvideobench"), score, ("accuracy", "parsed"),
              ("sample_frames", "crop_clip")),
    Benchmark("longvideobench-nosub", partial(load, subtitles=False, name="longvideobench-nosub"), score,
              ("accuracy", "parsed"), ("sample_frames", "crop_clip")),
)  # fmt: skip
BENCHMARK = VARIANTS[0]  # _registry's getattr(m, "VARIANTS", (m.BENCHMARK,)) reads BENCHMARK even when VARIANTS is set

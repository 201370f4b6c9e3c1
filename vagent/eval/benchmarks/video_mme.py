"""Video-MME (Fu et al., CVPR 2025): 2,700 multiple-choice questions on 900 videos of 11 s to 1 h, asked without
(``video-mme``) or with (``video-mme-sub``) the video's subtitles.

Format, as https://huggingface.co/datasets/lmms-lab/Video-MME ships it, read the way lmms-eval reads it
(github.com/EvolvingLMMs-Lab/lmms-eval, ``lmms_eval/tasks/videomme/utils.py``)::

    videomme/test-00000-of-00001.parquet   one row a question, every column a string but ``options``:
        video_id ("001"), duration ("short" | "medium" | "long"), domain, sub_category, url, videoID (YouTube id),
        question_id ("001-1"), task_type, question, options (["A. ...", "B. ...", "C. ...", "D. ..."]), answer ("A")
    data/<videoID>.mp4        the videos (videos_chunked_*.zip unzipped; .MP4 and .mkv are looked for too)
    subtitle/<videoID>.srt    the subtitles (subtitle.zip unzipped); a video without one has no subtitles

The paths are relative to ``--image-root``, by default the dataset folder: the one holding ``videomme/``.

Subtitles: lmms-eval gives a model that sees N uniformly sampled frames the subtitle lines on screen at those frames.
An agent picks its own frames, so ``video-mme-sub`` gives every line (lmms-eval's "full subtitle" route, its Gemini
setting), each with the second it starts at so the agent can look there. A video with no ``.srt`` gets "No subtitles
available", as in lmms-eval. Metric: accuracy, by ``duration``, ``domain`` and ``task_type``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, BenchmarkError, RecordError, require
from vagent.eval.benchmarks.formats import load_records, parse_srt, read_parquet, with_subtitles
from vagent.eval.benchmarks.vstar import options, score

GROUPS = ("duration", "domain", "task_type")
_VIDEO_SUFFIXES = (".mp4", ".MP4", ".mkv")  # lmms-eval's videomme_doc_to_visual looks for these, in this order


def convert(record: dict[str, Any], root: Path, subtitles: dict[str, list[tuple[float, str]]] | None, name: str) -> Row:
    """One parquet row as a canonical row; ``subtitles`` caches each video's cues (None: asked without them).

    Raises:
        RecordError: A field is missing or wrong, or the video is not under ``root/data``.
    """
    choices = options(record)  # "A. Apples." -> "Apples.": the prompt writes its own letters
    answer = require(record, "answer", str).strip().upper()
    if not (len(answer) == 1 and 0 <= ord(answer) - ord("A") < len(choices)):
        raise RecordError(f"field 'answer' {record['answer']!r} is not the letter of one of the {len(choices)} options")
    video_id = require(record, "videoID", str)
    question = require(record, "question", str)
    groups = {key: require(record, key, str) for key in GROUPS}
    if subtitles is not None:
        if video_id not in subtitles:
            subtitles[video_id] = _subtitles(root / "subtitle" / f"{video_id}.srt")
        question = with_subtitles(question, subtitles[video_id])
    return Row(id=require(record, "question_id", str), question=question, answer=answer, answer_type="choice",
               choices=choices, videos=[_video(root, video_id)], source=name,
               extra={"groups": groups, "video_id": require(record, "video_id", str)})  # fmt: skip


def _video(root: Path, video_id: str) -> str:
    for suffix in _VIDEO_SUFFIXES:
        if (path := root / "data" / f"{video_id}{suffix}").is_file():
            return str(path)
    raise RecordError(f"field 'videoID' names a missing file: {root / 'data' / video_id}.mp4 (or .MP4, .mkv)")


def _subtitles(path: Path) -> list[tuple[float, str]]:
    if not path.is_file():
        return []  # lmms-eval: "No subtitles available"
    try:
        return [(start, text) for start, _, text in parse_srt(path.read_text(encoding="utf-8-sig"))]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"field 'videoID': its subtitles {path} cannot be read: {e}") from None


def load(path: Path, image_root: Path | None, subtitles: bool = False, name: str = "video-mme"
         ) -> tuple[list[Row], list[tuple[str, str]]]:  # fmt: skip
    """Rows of ``videomme/test-00000-of-00001.parquet``; a bad record is listed by its ``question_id`` and field.

    Args:
        path: The parquet file.
        image_root: The dataset folder holding ``data/`` and ``subtitle/``; None = the folder above the parquet's.
        subtitles: Put each video's subtitles before its question.
        name: The benchmark name, the rows' ``source``.

    Raises:
        BenchmarkError: The file cannot be read as parquet, or ``subtitles`` and no ``subtitle/`` folder (the
            subtitles were never unzipped: every question would go without them).
    """
    root = image_root or path.resolve().parent.parent
    if subtitles and not (root / "subtitle").is_dir():
        raise BenchmarkError(f"{name} reads the subtitles from {root / 'subtitle'}, which does not exist: unzip "
                             "subtitle.zip there (or evaluate video-mme, without subtitles)")  # fmt: skip
    cache: dict[str, list[tuple[float, str]]] | None = {} if subtitles else None
    return load_records(read_parquet(path), lambda where, r: convert(r, root, cache, name), id_key="question_id")


VARIANTS = (
    Benchmark("video-mme", partial(load, subtitles=False, name="video-mme"), score, ("accuracy", "parsed"),
              ("sample_frames", "crop_clip")),
    Benchmark("video-mme-sub", partial(load, subtitles=True, name="video-mme-sub"), score, ("accuracy", "parsed"),
              ("sample_frames", "crop_clip")),
)  # fmt: skip
BENCHMARK = VARIANTS[0]  # _registry's getattr(m, "VARIANTS", (m.BENCHMARK,)) reads BENCHMARK even when VARIANTS is set

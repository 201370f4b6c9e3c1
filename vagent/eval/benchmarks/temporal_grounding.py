"""Temporal grounding: find when a described moment happens in a video. Charades-STA as it ships, or JSON rows.

Formats, told apart by the file's suffix:

* ``.txt``: Charades-STA (Gao et al., TALL, ICCV 2017), ``charades_sta_test.txt`` as the TALL README
  (github.com/jiyanggao/TALL) links it: one moment a line, ``VIDEO START END##SENTENCE`` in seconds
  (``3MSZA 24.3 30.4##person turn a light on.``). The video is ``<VIDEO>.mp4`` under ``--image-root`` (default:
  the file's folder), i.e. point it at ``Charades_v1_480/``.
* ``.parquet``: https://huggingface.co/datasets/lmms-lab/charades_sta, ``data/test-00000-of-00001.parquet``, read the
  way lmms-eval reads it (``lmms_eval/tasks/charades_sta/utils.py``): ``video`` ("3MSZA.mp4"), ``caption``,
  ``timestamp`` ([start, end] as float16; a string "[start, end]" is read too). The video is ``<video>`` under
  ``--image-root`` (default: ``Charades_v1_480/`` beside ``data/``, where the shipped zips unzip). A float16 time is
  read as the shortest decimal that rounds to it (``formats.read_parquet``), so both files give the same rows.
* ``.json`` / ``.jsonl``: ``{id, video, query, timestamp: [start, end]}`` (``span`` is accepted for ``timestamp``).

Charades-STA rows are ``<video>_<k>``, k the record's 0-based place in the file (a video has several sentences).
Metrics: IoU of the answered span (first two numbers of the answer), mean = mIoU, and R@{0.3, 0.5, 0.7}.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vagent.data import Evidence, Row
from vagent.eval.benchmarks import Benchmark, BenchmarkError, RecordError, load_with, media_path, require
from vagent.eval.benchmarks.formats import load_records, read_parquet
from vagent.eval.extract import extract_span
from vagent.eval.metrics import RECALL_AT, span_metrics
from vagent.types import Trajectory

PROMPT = 'When does this happen in the video: "{query}"? Answer with the start and end time in seconds as [start, end].'


def row(rid: str, video: str, query: str, span: Any, key: str, source: str) -> Row:
    """The canonical row of one moment; ``span`` is checked as ``[start, end]`` seconds, 0 <= start < end.

    Raises:
        RecordError: ``span`` (field ``key``) is not such a pair, or ``query`` is empty.
    """
    if (
        not isinstance(span, list)
        or len(span) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in span)
    ):
        raise RecordError(f"field {key!r} must be [start, end] in seconds, got {span!r}")
    if not 0 <= span[0] < span[1]:
        raise RecordError(f"field {key!r} must have 0 <= start < end, got {span}")
    if not query.strip(" ."):
        raise RecordError("the query is empty")
    gold = [float(span[0]), float(span[1])]
    return Row(id=rid, question=PROMPT.format(query=query.strip().rstrip(".")), answer=gold, answer_type="span",
               videos=[video], source=source, evidence=Evidence(spans=[gold]))  # fmt: skip


def convert(where: str, record: dict[str, Any], root: Path | None, base: Path) -> Row:
    """A JSON record ``{id, video, query, timestamp | span}``."""
    key = "timestamp" if "timestamp" in record else "span"
    span, query = require(record, key, list), require(record, "query", str)
    video = media_path(require(record, "video", str), root, base, "video")
    return row(str(record.get("id", where)), video, query, span, key, "temporal-grounding")


def _txt(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(file:line, record)`` of each line ``VIDEO START END##SENTENCE``, as ``{video, caption, timestamp}``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchmarkError(f"cannot read {path}: {e}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        head, sep, sentence = line.partition("##")
        parts = head.split()
        if not sep or len(parts) != 3:
            yield f"{path.name}:{number}", RecordError("is not 'VIDEO START END##SENTENCE'")
            continue
        try:
            span = [_seconds(value, field) for field, value in zip(("start", "end"), parts[1:], strict=True)]
        except RecordError as e:
            yield f"{path.name}:{number}", e
            continue
        yield f"{path.name}:{number}", {"video": f"{parts[0]}.mp4", "caption": sentence, "timestamp": span}


def _seconds(value: str, field: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise RecordError(f"field {field!r} is not a number of seconds: {value!r}") from None


def _charades(record: dict[str, Any], index: int, root: Path) -> Row:
    """A Charades-STA moment (a TXT line or a parquet row) as ``<video stem>_<index>``."""
    name = require(record, "video", str)
    video = media_path(name if Path(name).suffix else f"{name}.mp4", root, root, "video")
    span = require(record, "timestamp", (list, str))
    if isinstance(span, str):  # "[24.3, 30.4]", as lmms-eval's _parse_ground_truth also accepts
        try:
            span = json.loads(span)
        except json.JSONDecodeError:
            raise RecordError(f"field 'timestamp' must be [start, end] in seconds, got {span!r}") from None
    return row(f"{Path(name).stem}_{index}", video, require(record, "caption", str), span, "timestamp", "charades-sta")


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    """Rows of a Charades-STA ``.txt``, lmms-lab's ``.parquet`` or a JSON / JSONL file (by suffix); a bad record is
    listed by its line (TXT), row (parquet) or id, and field.

    Raises:
        BenchmarkError: The file cannot be read at all.
    """
    if path.suffix.lower() not in (".txt", ".parquet"):
        return load_with(path, lambda where, r: convert(where, r, image_root, path.parent))
    if path.suffix.lower() == ".txt":
        root, records = image_root or path.parent, _txt(path)
    else:
        root, records = image_root or path.resolve().parent.parent / "Charades_v1_480", read_parquet(path)
    records = list(records)
    place = {where: k for k, (where, _) in enumerate(records)}  # the record's place in the file, for its id
    return load_records(records, lambda where, r: _charades(r, place[where], root), id_key="video")


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    span = extract_span(trajectory.last_reply, trajectory.answer, rule)  # the rule's reading (lmms-eval: mm:ss)
    return span_metrics(span, row.answer)


BENCHMARK = Benchmark("temporal-grounding", load, score, ("iou", *(f"r@{k}" for k in RECALL_AT)),
                      ("sample_frames", "crop_clip"))  # fmt: skip

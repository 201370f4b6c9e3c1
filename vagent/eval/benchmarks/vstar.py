"""``vstar``: V* Bench (Wu & Xie, "V*: Guided Visual Search", 2023), multiple choice about small details in large
images (github.com/penghao-wu/vstar; data: huggingface.co/datasets/craigwu/vstar_bench). ``--data`` takes any of:

* The benchmark folder as it ships: ``direct_attributes/`` and ``relative_position/``, each ``<name>.jpg`` with
  ``<name>.json`` = ``{"target_object": [...], "bbox": [[x, y, w, h], ...], "question", "options": [...]}``, the first
  option the correct one (README "Benchmark"; ``vstar_bench_eval.py`` reads these two folders and scores
  ``option_chosen == 0``). A folder holding the pairs directly is read as one category. The options are shown in an
  order shuffled by a generator seeded with the record id (``direct_attributes/sa_4690``): listed as stored, the
  answer would always be A and a model that always says A would score 100%; V*'s own scorer compared option
  likelihoods, so it had no letter positions, and DeepEyes' ``eval/eval_vstar.py`` (at cc3ff4d) shuffles unseeded, a
  different order each run. The seeded order is the same on every run and machine. The stored order (answer always A,
  as an earlier DeepEyes script listed them) is kept in ``row.extra["listed"]``: ``vagent eval --option-order
  as-listed`` shows that instead, for a harness that does so or to measure a position bias.
* ``test_questions.jsonl`` (same dataset): ``{"question_id", "image": "direct_attributes/sa_4690.jpg", "text":
  "What is ...?\\n(A) red\\n(B) blue\\n...\\nAnswer with the option's letter from the given choices directly.",
  "category", "label": "B"}``, read as lmms-eval's ``vstar_bench`` task reads it (``lmms_eval/tasks/vstar_bench``):
  the options parsed off ``text`` in its own order, the trailing instruction dropped (the agent profile states its
  own answer format).
* vagent's earlier layout, JSON list or JSONL: ``{id, image, question, options | choices, answer}`` (``answer`` a letter
  or an option's text; options may carry their own "A." prefix).

Image paths are relative to ``--image-root`` (default: the file's folder). Score: ``accuracy`` and ``parsed``
(``choice_score``). Group: ``category`` (``direct_attributes`` | ``relative_position``), also the per-type split.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vagent.data import Evidence, Row
from vagent.eval.benchmarks import Benchmark, BenchmarkError, RecordError, media_path, read_records, require
from vagent.eval.benchmarks.formats import load_records
from vagent.eval.metrics import choice_score
from vagent.types import Trajectory

SUBSETS = ("direct_attributes", "relative_position")  # vstar_bench_eval.py; GPT4V-hard/ and OCR/ are not the bench
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
INSTRUCTION = "Answer with the option's letter from the given choices directly."
_PREFIX = re.compile(r"^\(?[A-Za-z][.)]\s+")
_MARK = re.compile(r"(?<!\S)\(([A-Z])\)\s*")  # "(A) " at the start or after whitespace


def options(record: dict[str, Any]) -> list[str]:
    """``record["options"]`` (or ``choices``): at least two strings, each without its own "A." prefix."""
    value = require(record, "options" if "options" in record else "choices", list)
    if len(value) < 2 or not all(isinstance(v, str) and v.strip() for v in value):
        raise RecordError("field 'options' must list at least two non-empty strings")
    # "A. red", "B. blue" -> "red", "blue" (the prompt adds its own letters); only when every option carries its own
    # letter in order: "A. Lincoln" alone is an option's text
    lettered = all(re.match(rf"\(?{chr(ord('A') + i)}[.)]\s+", v, flags=re.I) for i, v in enumerate(value))
    return [_PREFIX.sub("", v) for v in value] if lettered else list(value)


def convert(where: str, record: dict[str, Any], root: Path | None, base: Path, media: str) -> Row:
    """A record of vagent's earlier layout (``video_mc`` reads the same with a video)."""
    choices = options(record)
    answer = require(record, "answer", str)
    if (
        not (len(answer.strip()) == 1 and ord(answer.strip().upper()) - ord("A") < len(choices))
        and answer not in choices
    ):
        raise RecordError(f"field 'answer' {answer!r} is neither an option letter nor an option")
    rid = record.get("id", where)
    path = media_path(require(record, media, str), root, base, media)
    category = record["category"] if isinstance(record.get("category"), str) else None
    return Row(id=str(rid), question=require(record, "question", str), answer=answer.strip(), answer_type="choice",
               choices=choices, images=[path] if media == "image" else [], videos=[path] if media == "video" else [],
               source="vstar" if media == "image" else "video-mc",
               extra={"type": [category] if category else [],
                      **({"groups": {"category": category}} if category else {})})  # fmt: skip


def split_text(text: str) -> tuple[str, list[str]]:
    """``"Q?\\n(A) red\\n(B) blue\\nAnswer with ..."`` -> ``("Q?", ["red", "blue"])``; options inline work too."""
    text = text.strip()
    if text.endswith(INSTRUCTION):
        text = text[: -len(INSTRUCTION)].rstrip()
    marks, expected = [], "A"
    for match in _MARK.finditer(text):
        if match.group(1) == expected:
            marks.append(match)
            expected = chr(ord(expected) + 1)
    if len(marks) < 2:
        raise RecordError("field 'text' does not list its options as '(A) ...', '(B) ...'")
    found = [text[m.end() : n.start()].strip() for m, n in itertools.pairwise(marks)]
    found.append(text[marks[-1].end() :].split("\n")[0].strip())  # a line after the last option is an instruction
    if not all(found):
        raise RecordError("field 'text' has an empty option")
    return text[: marks[0].start()].strip(), found


def convert_questions(record: dict[str, Any], root: Path | None, base: Path) -> Row:
    """A ``test_questions.jsonl`` record."""
    question, choices = split_text(require(record, "text", str))
    label = require(record, "label", str).strip().upper()
    if len(label) != 1 or not "A" <= label < chr(ord("A") + len(choices)):
        raise RecordError(f"field 'label' {label!r} is not one of the {len(choices)} option letters")
    rid = require(record, "question_id", (str, int))
    category = require(record, "category", str)
    return Row(id=str(rid), question=question, answer=label, answer_type="choice", choices=choices,
               images=[media_path(require(record, "image", str), root, base, "image")], source="vstar",
               extra={"type": [category], "groups": {"category": category}})  # fmt: skip


def read_folder(folder: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, annotation)`` of each image of the benchmark folder, the annotation with ``_image`` and ``_category``
    added; an image without a readable ``<name>.json`` comes back as a ``RecordError``."""
    subsets = [folder / s for s in SUBSETS if (folder / s).is_dir()] or [folder]
    found = False
    for subset in subsets:
        for image in sorted(p for p in subset.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            found = True
            where, annotation = f"{subset.name}/{image.name}", image.with_suffix(".json")
            try:
                record = json.loads(annotation.read_text(encoding="utf-8"))
            except OSError:
                yield where, RecordError(f"its annotation {annotation.name} cannot be read")
                continue
            except json.JSONDecodeError as e:
                yield where, RecordError(f"{annotation.name} is not valid JSON ({e.msg} at line {e.lineno})")
                continue
            if not isinstance(record, dict):
                yield where, RecordError(f"{annotation.name} is not a JSON object")
                continue
            yield where, {**record, "_image": str(image), "_category": subset.name}
    if not found:
        raise BenchmarkError(f"{folder} holds no V* images (<name>.jpg with <name>.json, in {' or '.join(SUBSETS)}/)")


def convert_folder(where: str, record: dict[str, Any]) -> Row:
    """A per-image annotation: ``options[0]`` is the answer, shown in an order seeded by the id; the stored order is
    ``extra["listed"]`` (``--option-order as-listed``)."""
    stored = options(record)
    rid, category = where.rsplit(".", 1)[0], record["_category"]
    order = list(range(len(stored)))
    random.Random(rid).shuffle(order)  # a str seed is hashed with SHA-512: the same on every run and platform
    boxes = []
    for box in require(record, "bbox", list, optional=True) or []:
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
            raise RecordError("field 'bbox' must list [x, y, w, h] boxes")
        boxes.append([box[0], box[1], box[0] + box[2], box[1] + box[3]])  # V*'s x, y, w, h -> x1, y1, x2, y2
    return Row(id=rid, question=require(record, "question", str).strip(), answer=chr(ord("A") + order.index(0)),
               answer_type="choice", choices=[stored[i] for i in order], images=[record["_image"]], source="vstar",
               evidence=Evidence(boxes=boxes) if boxes else None, extra={
                   "type": [category], "groups": {"category": category}, "target_object": record.get("target_object"),
                   "listed": {"choices": stored, "answer": "A"}})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    """A benchmark folder, ``test_questions.jsonl`` or vagent's earlier layout (module docstring)."""
    if path.is_dir():
        return load_records(read_folder(path), convert_folder)

    def one(where: str, record: dict[str, Any]) -> Row:
        if "text" in record and "label" in record:  # test_questions.jsonl
            return convert_questions(record, image_root, path.parent)
        return convert(where, record, image_root, path.parent, "image")

    records = list(read_records(path))  # a few hundred lines; the layout decides which field names a record
    layout = any(isinstance(r, dict) and "question_id" in r and "label" in r for _, r in records)
    return load_records(records, one, id_key="question_id" if layout else "id")


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return choice_score(row, trajectory, rule)


BENCHMARK = Benchmark("vstar", load, score, ("accuracy", "parsed"), ("crop", "zoom_in"))

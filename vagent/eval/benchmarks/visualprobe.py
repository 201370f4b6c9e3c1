"""``visualprobe``: VisualProbe (Lai et al., "Mini-o3", 2025), open-ended visual search questions whose targets are
small and surrounded by distractors, at three difficulties (github.com/Mini-o3/Mini-o3).

Published files: ``val.json`` of huggingface.co/datasets/Mini-o3/VisualProbe_Easy, ``VisualProbe_Medium`` and
``VisualProbe_Hard`` (one split a file, images under ``data/`` beside it). A JSON list of ``{"images": [path],
"doc_id", "problem": "<image>\\n...", "solution", "data_source": "visual_probe_easy|medium|hard"}`` (the format of
Mini-o3's ``docs/mini_o3_demo.md``, read by ``verl/utils/dataset/multimodal_dataset.py``). Mini-o3 joins an image
path to ``BASE_IMAGE_DIR``, the folder that holds ``VisualProbe_Hard/`` (README: ``${BASE_IMAGE_DIR}/
VisualProbe_Hard/val.json``): give that as ``--image-root``; without it a path is looked up under the parent of the
file's folder, then under the file's folder. ``<image>`` is dropped from the question (vagent places the image).
Mini-o3's ``Vstar_Bench/val.json`` has the same format and loads too (its group is then ``source: vstar_bench``).

Score: Mini-o3 judges answers with GPT-4o (``verl/utils/reward_score/general_qa_tool.py``); vagent scores by rule,
with no model call, over the text in ``<answer>`` (``vagent.eval.extract.extract_text``):

* ``contains`` (primary): the normalized gold answer (lowercased, punctuation and articles dropped:
  ``normalize_answer``) occurs in the normalized answer as whole words: "The sign reads Jptica." holds "Jptica";
  "12" does not hold "2". A single-letter gold is compared as Mini-o3's multiple-choice rule compares it
  (``general_qa_tool_mc.py``: the answer is the letter, "(B) ..." or "B. ...").
* ``em``: the normalized answer equals the normalized gold.

Both are stricter than a judge that accepts paraphrases and lenient on an answer that lists several candidates.
Group: ``difficulty`` (from ``data_source``, else from the ``VisualProbe_<Level>`` folder name).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, read_records, require
from vagent.eval.benchmarks.formats import load_records
from vagent.eval.benchmarks.images import text_field
from vagent.eval.extract import extract_text
from vagent.rewards.answer import normalize_answer, tokens
from vagent.types import Trajectory

_LEVEL = re.compile(r"visual_?probe_(easy|medium|hard)", re.IGNORECASE)
_LETTER_ANSWER = re.compile(r"^\s*\(?([A-Z])\)?(?:[.:)]|\s|$)")  # "B", "(B) red", "B. red"


def image_file(value: str, root: Path | None, table: Path) -> str:
    """``value`` under ``--image-root``, else under the parent of the table's folder, else under its folder."""
    bases = [root] if root is not None else [table.parent.parent, table.parent]
    candidates = [Path(value)] if os.path.isabs(value) else [base / value for base in bases]
    for path in candidates:
        if path.is_file():
            return str(path)
    raise RecordError(f"field 'images' names a missing file: {' or '.join(str(p) for p in candidates)}")


def convert(record: dict[str, Any], root: Path | None, table: Path) -> Row:
    images = require(record, "images", list)
    if not images or not all(isinstance(p, str) and p for p in images):
        raise RecordError("field 'images' must list at least one image path")
    question = require(record, "problem", str).replace("<image>", "").strip()
    if not question:
        raise RecordError("field 'problem' holds no question")
    solution = require(record, "solution", str).strip()
    if not normalize_answer(solution) and not _letter(solution):
        raise RecordError(f"field 'solution' {solution!r} holds no answer")
    source = record.get("data_source") if isinstance(record.get("data_source"), str) else ""
    level = _LEVEL.search(source) or _LEVEL.search(table.parent.name)
    groups = {"difficulty": level.group(1).lower()} if level else {"source": source} if source else {}
    return Row(id=text_field(record, "doc_id"), question=question, answer=solution, answer_type="exact",
               images=[image_file(p, root, table) for p in images], source="visualprobe",
               extra={"groups": groups})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    return load_records(read_records(path), lambda where, r: convert(r, image_root, path), id_key="doc_id")


def match(prediction: str | None, gold: str) -> dict[str, float]:
    """``{"contains", "em"}`` of one answer (see the module docstring).

    >>> match("The sign reads Jptica.", "Jptica"), match("12", "2")["contains"], match("(B) red", "B.")["em"]
    ({'contains': 1.0, 'em': 0.0}, 0.0, 1.0)
    """
    if prediction is None:
        return {"contains": 0.0, "em": 0.0}
    letter = _letter(gold)
    if letter is not None:  # a multiple-choice gold: Mini-o3's general_qa_tool_mc rule
        picked = _LETTER_ANSWER.match(prediction)
        hit = float(picked is not None and picked.group(1) == letter)
        return {"contains": hit, "em": hit}
    pred, ref = tokens(prediction), tokens(gold)
    contains = any(pred[i : i + len(ref)] == ref for i in range(len(pred) - len(ref) + 1))
    return {"contains": float(contains), "em": float(normalize_answer(prediction) == normalize_answer(gold))}


def _letter(gold: str) -> str | None:
    text = gold.strip().rstrip(".").strip()
    return text if len(text) == 1 and "A" <= text <= "Z" else None


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return match(extract_text(trajectory.last_reply, trajectory.answer, rule), str(row.answer))


BENCHMARK = Benchmark("visualprobe", load, score, ("contains", "em"), ("crop", "zoom_in"))

"""``mme-realworld``: MME-RealWorld and MME-RealWorld-Lite (Zhang et al., 2024), five-option multiple choice on
high-resolution real-world images (github.com/yfzhang114/MME-RealWorld). One loader reads every published layout:

* The authors' JSON list (``MME_RealWorld.json``, huggingface.co/datasets/yifanzhang114/MME-RealWorld; the record
  format of ``evaluation/output_test_template.json``): ``Question_id``, ``Image`` (a path under the image folder:
  ``--image-root``, default the JSON's folder), ``Text``, ``Question Type`` (also spelled ``Question type``),
  ``Answer choices`` (five ``"(A) ..."`` strings; E is "The image does not feature ..."), ``Ground truth`` (the
  letter), ``Task`` (Perception | Reasoning), ``Subtask``, ``Category``.
* VLMEvalKit's tables (``MMERealWorld`` in ``vlmeval/dataset/image_mcq.py``; ``mme_realworld_lite.tsv`` of
  huggingface.co/datasets/yifanzhang114/MME-RealWorld-Base64, and the JSON files there it builds its TSV from):
  ``index``, ``image`` (base64), ``question``, ``multi-choice options`` (a list, the list's Python literal, or
  "The choices are listed below:" and one option a line; ``A``-``E`` columns when present), ``answer``, ``category``
  (``Task/Subtask``) and ``l2-category`` (the category).
* lmms-eval's parquet (huggingface.co/datasets/yifanzhang114/MME-RealWorld-lite-lmms-eval): the same columns with
  the base64 image in ``bytes`` (``lmms_eval/tasks/mme_realworld/utils.py``).

Base64 images are decoded once into ``<file stem>_images/`` (or ``--image-root``): ``vagent.eval.benchmarks.images``.
Score: ``accuracy`` and ``parsed`` (``choice_score``). Groups: ``task``, ``subtask`` and ``category``, each qualified by
the levels above it (``Perception/Monitoring/vehicle/counting``): the official script
(``evaluation/eval_your_results.py``) reports categories within subtasks within tasks, a category lowercased and
every ``.../attribute...`` category merged into ``<first part>/attribute``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, media_path, require
from vagent.eval.benchmarks.formats import load_records
from vagent.eval.benchmarks.hr_bench import answer_letter, letter_options
from vagent.eval.benchmarks.images import ImageStore, read_table, text_field
from vagent.eval.metrics import choice_score
from vagent.types import Trajectory

_LETTERED = re.compile(r"^\s*\(([A-Z])\)\s?")  # "(A) 458"


def strip_letters(options: list[Any], field: str) -> list[str]:
    """``["(A) 458", "(B) 457", ...]`` -> ``["458", "457", ...]``; the letters must run A, B, C, ..."""
    if len(options) < 2 or not all(isinstance(o, str) for o in options):
        raise RecordError(f"field {field!r} must list at least two option strings")
    choices = []
    for i, option in enumerate(options):
        match = _LETTERED.match(option)
        if match is None or match.group(1) != chr(ord("A") + i):
            raise RecordError(f"field {field!r}: option {i + 1} {option[:40]!r} does not start with ({chr(65 + i)})")
        choices.append(option[match.end() :].strip())
    return choices


def groups(task: str, subtask: str, category: str) -> dict[str, str]:
    """The official script's levels (module docstring): task, then subtask and category qualified by their parents."""
    category = category.strip().lower()
    if "attribute" in category:
        category = category.split("/")[0] + "/attribute"
    task, subtask = task.strip(), subtask.strip()
    return {"task": task, "subtask": f"{task}/{subtask}", "category": f"{task}/{subtask}/{category}"}


def convert_official(record: dict[str, Any], root: Path | None, base: Path) -> Row:
    choices = strip_letters(require(record, "Answer choices", list), "Answer choices")
    return Row(id=text_field(record, "Question_id"), question=require(record, "Text", str).strip(),
               answer=answer_letter(record, choices, "Ground truth"), answer_type="choice", choices=choices,
               images=[media_path(require(record, "Image", str), root, base, "Image")], source="mme-realworld",
               extra={"groups": groups(require(record, "Task", str), require(record, "Subtask", str),
                                       require(record, "Category", str))})  # fmt: skip


def table_options(record: dict[str, Any]) -> list[str]:
    """The options of a VLMEvalKit / lmms-eval record: ``A``-``E`` if present, else ``multi-choice options``."""
    if record.get("A") is not None:
        return letter_options(record)
    field = "multi-choice options"
    value = require(record, field, (str, list))
    if isinstance(value, str) and value.lstrip().startswith("["):  # mme_realworld_lite.tsv: the list's literal
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise RecordError(f"field {field!r} is not a list literal") from None
        if not isinstance(value, list):
            raise RecordError(f"field {field!r} is not a list literal")
    elif isinstance(value, str):  # "The choices are listed below:\n(A) ...\n(B) ..."
        value = [line for line in value.splitlines() if _LETTERED.match(line)]
    return strip_letters(value, field)


def convert_table(record: dict[str, Any], store: ImageStore) -> Row:
    index = text_field(record, "index")
    choices = table_options(record)
    task, _, subtask = require(record, "category", str).partition("/")
    if not subtask:
        raise RecordError(f"field 'category' {record['category']!r} is not 'Task/Subtask'")
    image = store.image(record, index, "bytes" if "image" not in record and "bytes" in record else "image")
    return Row(id=index, question=require(record, "question", str).strip(), answer=answer_letter(record, choices),
               answer_type="choice", choices=choices, images=[image], source="mme-realworld",
               extra={"groups": groups(task, subtask, require(record, "l2-category", str))})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    store = ImageStore(path, image_root)

    def convert(where: str, record: dict[str, Any]) -> Row:
        if "Question_id" in record:
            return convert_official(record, image_root, path.parent)
        return convert_table(record, store)

    id_key = "index" if path.suffix.lower() in (".tsv", ".parquet") else "Question_id"
    rows, errors = load_records(read_table(path), convert, id_key=id_key)
    store.check()
    return store.resolve(rows, errors), errors


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return choice_score(row, trajectory, rule)


BENCHMARK = Benchmark("mme-realworld", load, score, ("accuracy", "parsed"), ("crop", "zoom_in"))

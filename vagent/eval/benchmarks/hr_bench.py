"""``hr-bench``: HR-Bench 4K and 8K (Wang et al., "Divide, Conquer and Combine", AAAI 2025), multiple choice about
details in 4K / 8K images (github.com/DreamMr/HR-Bench).

Published files (huggingface.co/datasets/DreamMr/HR-Bench): ``hr_bench_4k.tsv`` / ``hr_bench_8k.tsv``, the tables
VLMEvalKit's ``HRBenchDataset`` reads (``vlmeval/dataset/image_mcq.py``), and ``hr_bench_4k.parquet`` /
``hr_bench_8k.parquet`` with the same columns (lmms-eval's ``hrbench`` task, ``lmms_eval/tasks/hrbench/utils.py``).
800 rows each: 200 questions, each asked in 4 cycles whose options are rotated. Columns: ``index`` (an integer),
``question``, ``answer`` (the letter), ``category`` (``single``: fine-grained single-instance perception, ``cross``:
cross-instance), ``A``-``D``, ``cycle_category`` (which cycle) and ``image`` (base64 JPEG; the 4 cycles carry the same
image, decoded once: ``vagent.eval.benchmarks.images``). ``--image-root`` names where the decoded images go (default:
``<file stem>_images/`` beside the file).

Score: per sample ``accuracy`` (the option read off the reply, ``choice_score``; the authors' scorer asks an LLM
whether the reply matches the answer) and ``parsed``. Over the run (``report``), HR-Bench's number: the accuracy of
each cycle, then their mean (``cycle_mean``), overall and per category (the authors' ``HRBenchDataset.evaluate``,
``hrbench/vlmeval/dataset/image_mcq.py``; VLMEvalKit ``vlmeval/dataset/utils/hrbench.py:report_acc_hrbench``;
lmms-eval ``hrbench_aggregate_results``). It is not CircularEval's "right in all four cycles". With the published
files' 200 rows a cycle it equals the plain mean ``accuracy``. Groups: ``category`` and ``cycle``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, RecordError, require
from vagent.eval.benchmarks.formats import load_records
from vagent.eval.benchmarks.images import ImageStore, read_table, text_field
from vagent.eval.metrics import choice_score
from vagent.types import Trajectory

LETTERS = "ABCDEFGH"


def letter_options(record: dict[str, Any]) -> list[str]:
    """The options in columns ``A``, ``B``, ... up to the first missing one (an empty TSV cell is NaN in pandas)."""
    choices = []
    for letter in LETTERS:
        value = record.get(letter)
        if value is None or (isinstance(value, float) and value != value) or not str(value).strip():
            break
        choices.append(str(value).strip())
    if len(choices) < 2:
        raise RecordError("fields 'A' and 'B' must hold at least two options")
    return choices


def answer_letter(record: dict[str, Any], choices: Sequence[str], field: str = "answer") -> str:
    """``record[field]``: an option letter within ``choices``."""
    answer = require(record, field, str).strip().upper()
    if len(answer) != 1 or not "A" <= answer < chr(ord("A") + len(choices)):
        raise RecordError(f"field {field!r} {answer!r} is not an option letter A-{chr(ord('A') + len(choices) - 1)}")
    return answer


def convert(record: dict[str, Any], store: ImageStore) -> Row:
    index = text_field(record, "index")
    choices = letter_options(record)
    groups = {"category": require(record, "category", str).strip(), "cycle": text_field(record, "cycle_category")}
    return Row(id=index, question=require(record, "question", str).strip(), answer=answer_letter(record, choices),
               answer_type="choice", choices=choices, images=[store.image(record, index)], source="hr-bench",
               extra={"groups": groups})  # fmt: skip


def load(path: Path, image_root: Path | None) -> tuple[list[Row], list[tuple[str, str]]]:
    store = ImageStore(path, image_root)
    rows, errors = load_records(read_table(path), lambda where, r: convert(r, store), id_key="index")
    store.check()
    return store.resolve(rows, errors), errors


def score(row: Row, trajectory: Trajectory, rule: str = "vagent") -> dict[str, float]:
    return choice_score(row, trajectory, rule)


def report(rows: Sequence[Row], samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """HR-Bench's accuracy: per cycle, then the mean over cycles, overall and per category.

    ``cycle_mean`` is the published number; ``cycle/<c>`` each cycle's accuracy; ``cycle_mean/<category>`` the mean
    over cycles of a category's accuracy within each cycle. A cycle's accuracy is the mean over its samples.
    """
    groups = {row.id: row.extra.get("groups") or {} for row in rows}
    by_cycle: dict[str, list[float]] = defaultdict(list)
    by_both: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in samples:
        g = groups.get(s["id"])
        if g is None or "cycle" not in g:
            continue
        by_cycle[g["cycle"]].append(s["accuracy"])
        by_both[(g.get("category", ""), g["cycle"])].append(s["accuracy"])
    if not by_cycle:
        return {}
    per_cycle = {c: _mean(v) for c, v in sorted(by_cycle.items())}
    out: dict[str, Any] = {"cycle_mean": _mean(list(per_cycle.values()))}
    for category in sorted({c for c, _ in by_both}):
        out[f"cycle_mean/{category}"] = _mean([_mean(v) for (c, _), v in sorted(by_both.items()) if c == category])
    out.update({f"cycle/{c}": acc for c, acc in per_cycle.items()})
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


BENCHMARK = Benchmark("hr-bench", load, score, ("accuracy", "parsed"), ("crop", "zoom_in"), report=report)

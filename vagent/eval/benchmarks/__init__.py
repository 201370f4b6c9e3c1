"""The benchmark registry and what loaders share: reading JSON / JSONL records, checking fields, resolving
media, and the ``Benchmark`` record each module exports."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vagent.data import Row

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkError",
    "RecordError",
    "load_records",
    "load_with",
    "media_path",
    "read_records",
    "require",
]


class BenchmarkError(ValueError):
    """A benchmark file that cannot be read at all, or (without ``skip_bad``) a record that is wrong."""


class RecordError(ValueError):
    """One record is wrong; the message names the field."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: how to read its published file and how to score a sample.

    Attributes:
        name: The ``--benchmark`` name.
        load: ``(path, image_root) -> (rows, errors)``; ``errors`` lists ``(record id or line, reason)``.
        score: ``(row, trajectory, rule) -> {metric: value}`` for one sample; ``rule`` is how the answer is read
            off the reply (``vagent.eval.extract.EXTRACTORS``), which modules without options may ignore.
        metrics: The metric names ``score`` returns, in table order.
        tools: Tools offered by default (``--tools`` overrides; ``none`` = the no-tool baseline).
        report: ``(rows, samples) -> {metric: value}``: metrics over several samples (a pair judged both ways),
            added to the per-sample means; None = none.
    """

    name: str
    load: Callable[[Path, Path | None], tuple[list[Row], list[tuple[str, str]]]]
    score: Callable[..., dict[str, float]]
    metrics: tuple[str, ...]
    tools: tuple[str, ...]
    report: Callable[[Sequence[Row], Sequence[dict[str, Any]]], dict[str, Any]] | None = None


def read_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, record)`` for each record of a JSON list or a JSONL file; a JSONL line that is not a JSON
    object comes back as a ``RecordError`` (so it is reported and the rest still loads)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchmarkError(f"cannot read {path}: {e.strerror or e}") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        for i, record in enumerate(records):
            yield f"{path.name}[{i}]", record if isinstance(record, dict) else RecordError("is not a JSON object")
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path.name}:{number}", RecordError(f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield f"{path.name}:{number}", record if isinstance(record, dict) else RecordError("is not a JSON object")


def require(record: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """``record[name]`` checked against ``kind``; raises ``RecordError`` naming the field."""
    if name not in record or record[name] is None:
        if optional:
            return None
        raise RecordError(f"field {name!r} is missing")
    value = record[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise RecordError(
            f"field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    return value


def media_path(value: str, root: Path | None, base: Path, field: str) -> str:
    """Resolve a media path against ``--image-root`` (or the data file's folder); it must exist."""
    path = Path(value) if os.path.isabs(value) else (root or base) / value
    if not path.is_file():
        raise RecordError(f"field {field!r} names a missing file: {path}")
    return str(path)


def load_records(records: Iterable[tuple[str, Any]], convert: Callable[[str, Any], Row], id_key: str = "id"
                 ) -> tuple[list[Row], list[tuple[str, str]]]:  # fmt: skip
    """Run ``convert(where, record)`` over ``records`` (a JSON file's through ``load_with``; a parquet's or a TSV's rows): the rows,
    and ``(label, reason)`` for each record that raised, labelled by its ``id_key`` value when it has one."""
    rows, errors, seen = [], [], set()
    for where, record in records:
        rid = record.get(id_key) if isinstance(record, dict) else None
        label = f"{id_key} {rid!r} ({where})" if rid is not None else where
        try:
            if isinstance(record, RecordError):
                raise record
            row = convert(where, record)
            if row.id in seen:
                raise RecordError(f"duplicate id {row.id!r}")
            seen.add(row.id)
            rows.append(row)
        except (RecordError, ValueError) as e:
            errors.append((label, str(e)))
    return rows, errors


def load_with(path: Path, convert: Callable[[str, dict[str, Any]], Row]) -> tuple[list[Row], list[tuple[str, str]]]:
    """Run ``convert(where, record)`` over the JSON or JSONL file's records, collecting rows and errors (by id)."""
    return load_records(read_records(path), convert)


def _registry() -> dict[str, Benchmark]:
    """Every module's ``BENCHMARK`` (or its ``VARIANTS``, several names read by one loader), by name."""
    import importlib

    names = [
        "mat_coding",
        "mat_search",
        "vstar",
        "hr_bench",
        "mme_realworld",
        "visualprobe",
        "video_mc",
        "temporal_grounding",
        "video_mme",
        "longvideobench",
        "synthetic",
        "judge_pairs",
    ]
    modules = [importlib.import_module(f"vagent.eval.benchmarks.{name}") for name in names]
    return {b.name: b for m in modules for b in (m.VARIANTS if hasattr(m, "VARIANTS") else (m.BENCHMARK,))}


BENCHMARKS: dict[str, Benchmark] = _registry()

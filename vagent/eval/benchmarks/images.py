"""Benchmark tables that carry their images inline as base64 (VLMEvalKit's TSVs and their parquet copies): read a
record at a time, never the whole file (HR-Bench 8K's TSV is 4.6 GB), and each distinct image decoded once into a file
the rollout can open. No benchmark lives here.

* ``read_table``: ``(where, record)`` of a ``.tsv`` (VLMEvalKit's layout: a header row, tab-separated, pandas
  quoting, an empty cell = NaN = missing), a ``.parquet`` (column types as written) or a JSON list / JSONL.
* ``ImageStore``: writes ``<table stem>_images/<sha1 of the base64>.<jpg|png|...>`` beside the table (or into
  ``--image-root``), whole or not at all, and reuses it on the next load: the four cycles of an HR-Bench question
  carry the same image and share one file. A cell of 64 characters or fewer names the row that holds the image
  (VLMEvalKit's dedup, ``vlmeval/smp/file.py:localize_df``); ``resolve`` fills those in once every row is read.
"""

from __future__ import annotations

import base64
import binascii
import csv
import dataclasses
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vagent.data import Row
from vagent.eval.benchmarks import BenchmarkError, RecordError, read_records, require

__all__ = ["ImageStore", "read_table", "text_field"]

REF_MAX = 64  # VLMEvalKit (localize_df): an image cell this short is the index of the row holding the image
_REF = "@row:"  # a placeholder path until resolve() finds the row it names
_MAGIC = ((b"\xff\xd8\xff", ".jpg"), (b"\x89PNG", ".png"), (b"GIF8", ".gif"), (b"BM", ".bmp"))


def read_table(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    """``(where, record)`` of each row, ``where`` = ``name[row]`` (0-based, header excluded); by suffix: ``.tsv``,
    ``.parquet``, else a JSON list or JSONL (``read_records``).

    Raises:
        BenchmarkError: The file cannot be read at all.
    """
    if not path.is_file():
        raise BenchmarkError(f"{path} is not a file")
    suffix = path.suffix.lower()
    if suffix == ".tsv":
        yield from _tsv(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    else:
        yield from read_records(path)


def _tsv(path: Path) -> Iterator[tuple[str, dict[str, Any] | RecordError]]:
    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # one base64 8K image is megabytes; csv's cap is 128 KB
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter="\t")  # pandas' to_csv quoting: '"', doubled inside a field
            header = next(reader, None)
            if not header:
                raise BenchmarkError(f"{path} is empty (no header row)")
            for i, cells in enumerate(reader):
                if not cells:
                    continue
                if len(cells) != len(header):
                    yield f"{path.name}[{i}]", RecordError(f"has {len(cells)} cells, the header {len(header)}")
                    continue
                yield f"{path.name}[{i}]", {k: v if v != "" else None for k, v in zip(header, cells, strict=True)}
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise BenchmarkError(f"cannot read {path} as TSV: {e}") from None
    finally:
        csv.field_size_limit(limit)


def _parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=16)  # a few rows at a time: GBs of images
        i = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield f"{path.name}[{i}]", record
                i += 1
    except (OSError, pa.ArrowException) as e:
        raise BenchmarkError(f"cannot read {path} as parquet: {e}") from None


def text_field(record: dict[str, Any], name: str) -> str:
    """A field that is a string in a TSV and may be an integer in parquet or JSON (``index``), as a string."""
    value = require(record, name, (str, int))
    if isinstance(value, str) and not value.strip():
        raise RecordError(f"field {name!r} is empty")
    return str(value).strip()


class ImageStore:
    """Base64 images decoded once to files (see the module docstring).

    Args:
        table: The benchmark file; the images go to ``<its stem>_images/`` beside it.
        folder: Where the images go instead (``--image-root``), or None.
    """

    def __init__(self, table: Path, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else table.parent / f"{table.stem}_images"
        self.by_row: dict[str, str] = {}  # row index -> its image file, for the cells that name a row
        self.failed: str | None = None  # why the folder cannot be written (the whole load fails: see check)

    def image(self, record: dict[str, Any], row: str, field: str = "image") -> str:
        """The file of ``record[field]``: decoded (once), or the row it names; ``row`` is this record's index."""
        value = require(record, field, str).strip()
        if len(value) <= REF_MAX:
            return self.by_row.get(value, _REF + value)
        self.by_row[row] = path = self.save(value, field)
        return path

    def save(self, data: str, field: str = "image") -> str:
        """The file holding the base64 image ``data``, written if it is not there yet."""
        head = _decode(data[:16], field)  # 12 bytes: enough for every signature below
        ext = next((e for magic, e in _MAGIC if head.startswith(magic)), None)
        if ext is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            ext = ".webp"
        if ext is None:
            raise RecordError(f"field {field!r} is not a base64 JPEG, PNG, GIF, BMP or WebP image")
        path = self.folder / f"{hashlib.sha1(data.encode()).hexdigest()[:24]}{ext}"
        if path.is_file():
            return str(path)
        if self.failed:
            raise RecordError(self.failed)
        raw = _decode(data, field)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:  # whole or not at all: another rank may be loading the same table
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(raw)
            os.replace(tmp, path)
        except OSError as e:
            self.failed = f"cannot write the decoded images to {self.folder}: {e.strerror or e}"
            raise RecordError(self.failed) from None
        return str(path)

    def resolve(self, rows: list[Row], errors: list[tuple[str, str]]) -> list[Row]:
        """``rows`` with every image that names a row replaced by that row's file; a row whose named row has no
        image is dropped and reported in ``errors``."""
        kept = []
        for row in rows:
            named = [p[len(_REF) :] for p in row.images if p.startswith(_REF)]
            if missing := [n for n in named if n not in self.by_row]:
                errors.append((f"id {row.id!r}", f"field 'image' names row {missing[0]!r}, which holds no image"))
                continue
            images = [self.by_row[p[len(_REF) :]] if p.startswith(_REF) else p for p in row.images]
            kept.append(dataclasses.replace(row, images=images) if named else row)
        return kept

    def check(self) -> None:
        """Raises ``BenchmarkError`` if the images could not be written (every record would fail alike)."""
        if self.failed:
            raise BenchmarkError(f"{self.failed}; pass --image-root DIR, a folder you can write")


def _decode(data: str, field: str) -> bytes:
    try:
        return base64.b64decode(data + "=" * (-len(data) % 4))
    except (binascii.Error, ValueError):
        raise RecordError(f"field {field!r} is not valid base64") from None

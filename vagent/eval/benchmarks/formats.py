"""What the published video benchmark files need beyond JSON: parquet tables read record by record (lmms-lab's
Video-MME and Charades-STA), SRT subtitles (Video-MME's ``subtitle/<videoID>.srt``), a video's subtitles written
before its question, and the loader loop over any ``(where, record)`` pairs. No benchmark lives here."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vagent.eval.benchmarks import BenchmarkError, load_records

__all__ = ["load_records", "parse_srt", "read_parquet", "with_subtitles"]

_SRT_TIME = re.compile(r"(\d+):(\d{1,2}):(\d{1,2})(?:[,.](\d{1,3}))?")
_TAG = re.compile(r"<[^>]*>")  # Video-MME wraps every line in <font color="white" size=".72c">...</font>


def read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for each row of a parquet file, ``where`` = ``name[row index]``.

    A float16 value (Charades-STA's ``timestamp``, and any other half-float column or list of them) comes back as the
    shortest decimal that rounds to it: 24.296875 -> 24.3, the 0.1 s annotation the half float was made from (for any
    value under 128 s, where half floats are 1/16 s apart or closer).

    Raises:
        BenchmarkError: The file cannot be read as parquet.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise BenchmarkError("reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise BenchmarkError(f"cannot read {path} as parquet: {e}") from None
    half = [f.name for f in table.schema if _is_half(f.type, pa)]
    for i, record in enumerate(table.to_pylist()):
        for name in half:
            record[name] = _decimal(record[name])
        yield f"{path.name}[{i}]", record


def _is_half(kind, pa) -> bool:
    return pa.types.is_float16(kind) or (pa.types.is_list(kind) and pa.types.is_float16(kind.value_type))


def _decimal(value):
    import numpy as np

    if isinstance(value, list):
        return [_decimal(v) for v in value]
    return None if value is None else float(str(np.float16(value)))


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    """``(start, end, text)`` of each cue of an SRT file, in seconds, markup (``<font ...>``) removed; a block with no
    ``-->`` line is skipped, a cue with no text dropped.

    >>> parse_srt('1\\n00:00:01,240 --> 00:00:06,879\\n<font color="white" size=".72c">when we are</font>\\n\\n2\\n')
    [(1.24, 6.879, 'when we are')]

    Raises:
        ValueError: A ``-->`` line whose times are not ``HH:MM:SS,mmm``.
    """
    cues = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n").replace("\r", "\n").strip()):
        lines = block.split("\n")
        at = next((i for i, line in enumerate(lines) if "-->" in line), None)
        if at is None:
            continue
        start, end = (_srt_seconds(part) for part in lines[at].split("-->")[:2])
        words = " ".join(_TAG.sub("", line).strip() for line in lines[at + 1 :]).strip()
        if words:
            cues.append((start, end, words))
    return cues


def _srt_seconds(value: str) -> float:
    match = _SRT_TIME.search(value)
    if match is None:
        raise ValueError(f"not an SRT time: {value.strip()!r}")
    h, m, s, ms = match.groups()
    return int(h) * 3600 + int(m) * 60 + int(s) + int((ms or "0").ljust(3, "0")) / 1000


def with_subtitles(question: str, cues: Sequence[tuple[float, str]]) -> str:
    """``question`` after the video's subtitles, one line each with the second it starts at; "No subtitles available"
    when there are none (lmms-eval's Video-MME wording).

    >>> print(with_subtitles("Who speaks?", [(1.24, "hello"), (65.0, "bye")]))
    This video's subtitles are listed below, each with the second it starts at:
    [1.2s] hello
    [65.0s] bye
    Who speaks?
    """
    lines = "\n".join(f"[{start:.1f}s] {text}" for start, text in cues) or "No subtitles available"
    return f"This video's subtitles are listed below, each with the second it starts at:\n{lines}\n{question}"

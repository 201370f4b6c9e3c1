"""Preference pairs from gold rows: the gold trajectory is chosen; the same turns ending in a wrong answer are rejected.

    python -m data_pipelines.synthetic.pairs --rows data/zoom/rows.jsonl --out data/zoom/pairs.jsonl [--seed 0]

The two trajectories differ only inside the final ``<answer>...</answer>``, so DPO's contrast is the answer's tokens
alone: which answer the evidence the trajectory gathered (the crop it saw) supports. The wrong answer is the gold
answer of another row of the same ``answer_type``, a plausible one the model might give. Rows without a gold
``messages`` trajectory, without an ``<answer>`` in its last assistant turn, or without another answer to draw are
left out (counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
from collections.abc import Sequence
from pathlib import Path

from vagent.data import Row, load_rows, write_rows
from vagent.types import ContentPart, Message

__all__ = ["wrong_answer_pairs"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _last_answer(messages: Sequence[Message]) -> tuple[int, int, str] | None:
    """(index of the last assistant turn, of its last text part holding an ``<answer>``, that answer's text), or
    None."""
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        return None
    for j in reversed(range(len(messages[last].content))):
        part = messages[last].content[j]
        if part.type == "text" and (found := _ANSWER.findall(part.text or "")):
            return last, j, found[-1]
    return None


def _with_answer(message: Message, j: int, answer: str) -> Message:
    """``message`` with the text of the last ``<answer>`` of its part ``j`` replaced by ``answer``."""
    text = message.content[j].text or ""
    start = text.rindex("<answer>") + len("<answer>")
    end = text.index("</answer>", start)
    content = list(message.content)
    content[j] = ContentPart("text", text=text[:start] + answer + text[end:])
    return dataclasses.replace(message, content=content)


def wrong_answer_pairs(rows: Sequence[Row], seed: int = 0) -> tuple[list[Row], list[tuple[str, str]]]:
    """A preference row per usable gold row (``chosen`` = its ``messages``, ``rejected`` = the same turns with another
    row's answer), and the ``(id, reason)`` of the rows left out."""
    rng = random.Random(seed)
    answers: dict[str, list[str]] = {}
    found = {}
    for row in rows:
        if row.messages and (last := _last_answer(row.messages)) is not None:
            found[row.id] = last
            answers.setdefault(row.answer_type, []).append(last[2])
    out, skipped = [], []
    for row in rows:
        if row.id not in found:
            skipped.append((row.id, "no gold messages ending in an <answer>"))
            continue
        index, part, gold = found[row.id]
        others = sorted({a for a in answers[row.answer_type] if a.strip() != gold.strip()})
        if not others:
            skipped.append((row.id, f"no other {row.answer_type!r} answer to draw a wrong one from"))
            continue
        rejected = list(row.messages)
        rejected[index] = _with_answer(rejected[index], part, rng.choice(others))
        out.append(dataclasses.replace(row, messages=None, chosen=list(row.messages), rejected=rejected))
    return out, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help="canonical rows with gold `messages` (e.g. the zoom builder's)")
    parser.add_argument("--out", required=True, help="the preference rows' JSONL (media paths stay valid)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pairs, skipped = wrong_answer_pairs(load_rows(args.rows), seed=args.seed)
    path = write_rows(pairs, Path(args.out))
    print(f"wrote {len(pairs)} preference rows to {path} ({len(skipped)} rows left out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

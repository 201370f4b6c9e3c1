"""Judgment rows, and the cold start of a CoT judge distilled from a teacher (UnifiedReward-Think's stage 1).

    python -m data_pipelines.judgments --data judgments.jsonl --teacher http://host:8000/v1 --out DIR \
        [--teacher-model M] [--samples 1] [--temperature 0] [--max-tokens 1024] [--api-key-env VAR]

The teacher is any OpenAI-compatible endpoint (``vllm serve``, a hosted API, ``vagent serve``), called through
``vagent.judge.JudgeClient`` (concurrent, retried, cached in ``DIR/teacher_cache.jsonl``). Each row is sent as the
prompt the judge will be trained on (``vagent.eval.judges.row_request``: system prompt, images, the rendered
judgment), and a reply is kept only when it is well-formed (``<think>...</think><answer>...</answer>``) and its
verdict matches the row's label: UnifiedReward-Think's cold-start set is the teacher's judgments that agree with
the preference labels. Kept replies become the rows' gold ``messages`` in ``DIR/rows.jsonl`` (ids ``<id>-t<k>``),
ready for ``vagent sft``.

``judgment_row`` builds a judgment row from a ``vagent.data.Judgment``; the converters and the synthetic builder
use it. ``balanced`` and ``position_report`` are the converters' check on where the labels sit: a dump of
(chosen, rejected) pairs converted as given labels every row 1, and a judge trained on it learns the position.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vagent.data import Judgment, Row, load_rows, write_rows
from vagent.data.judgment import render, swapped_row, verdict_text

__all__ = [
    "BALANCED",
    "add_balance_argument",
    "balanced",
    "judgment_row",
    "position_report",
    "record_images",
    "teach",
    "write_converted",
]

BALANCED = (0.4, 0.6)  # shares of rows labelled 1 that position_report accepts without a warning


def judgment_row(rid: str, judgment: Judgment, *, images: Sequence[str] = (), source: str = "judgment",
                 messages: list[dict[str, Any]] | None = None, question: str | None = None,
                 extra: dict[str, Any] | None = None) -> Row:  # fmt: skip
    """A canonical judgment row: the prompt rendered from ``judgment`` (or ``question`` as written, for a judgment
    whose prompt cannot be re-rendered), the verdict as answer, no tools (a judge answers in one turn, and a
    served judge is asked without tools), and ``messages`` when a gold judgment (CoT + verdict) is known."""
    if judgment.question is not None:
        question = render(judgment)
    if question is None:
        raise ValueError("a judgment without 'question' needs the prompt as written (question=...)")
    answer = verdict_text(judgment)
    row = Row(id=rid, question=question, answer=answer, answer_type="number" if judgment.kind == "pointwise" else "exact",
              images=list(images), source=source, tools=[], messages=messages, judgment=judgment,
              extra=dict(extra or {}))  # fmt: skip
    Row.from_dict(row.to_dict())  # a builder bug fails here, naming the field
    return row


def record_images(record: dict[str, Any]) -> list[Any]:
    """A source record's images: ``images`` (a list), or ``image``: one image, or a list of them (LLaVA's
    conversation format allows both)."""
    images = record.get("images") or record.get("image") or []
    return list(images) if isinstance(images, list) else [images]


def balanced(rows: Sequence[Row]) -> tuple[list[Row], int]:
    """``rows`` with about half of the pairwise ones shown the other way round (``vagent.data.judgment.swapped_row``:
    the label follows its candidate), and how many were swapped. A row is swapped when a hash of its id is odd: the
    same rows on every run, whatever the source's order. A swapped row loses its gold ``messages`` (its chain of
    thought names positions); a pointwise row, or one whose prompt was kept as written with text candidates, stays
    as it is."""
    out, n = [], 0
    for row in rows:
        odd = hashlib.blake2b(row.id.encode(), digest_size=1).digest()[0] % 2
        twin = swapped_row(row) if odd and row.judgment is not None and row.judgment.kind == "pairwise" else None
        out.append(twin or row)
        n += twin is not None
    return out, n


def position_report(rows: Sequence[Row]) -> list[str]:
    """Lines to print after a conversion: the share of pairwise rows labelled 1, and of those with a gold judgment
    (what SFT trains on: ``balanced`` swaps only rows it can drop the gold of, so its SFT share stays the source's),
    each with a warning when it lies outside ``BALANCED``."""
    pairwise = [row for row in rows if row.judgment is not None and row.judgment.kind == "pairwise"]
    lines = []
    for label, group, fix in (
        ("pairwise rows", pairwise, "--balance shows about half of them the other way round"),
        ("pairwise rows with a gold judgment (the SFT set)", [r for r in pairwise if r.messages is not None],
         "--balance cannot fix these (a swapped row drops its gold, which names positions): drop or regenerate "
         "the gold of the majority position, or train on rows without it (distill a teacher's judgments)"),
    ):  # fmt: skip
        if not group:
            continue
        share = sum(row.judgment.preferred == 1 for row in group) / len(group)
        lines.append(f"preferred == 1 in {share:.1%} of {len(group)} {label}")
        if not BALANCED[0] <= share <= BALANCED[1]:
            lines.append(f"warning: {share:.1%} of the labels name position 1, outside [{BALANCED[0]:.0%}, "
                         f"{BALANCED[1]:.0%}]: a judge trained on these rows can learn the position instead of "
                         f"the judgment; {fix}")  # fmt: skip
    return lines


def add_balance_argument(parser: argparse.ArgumentParser, gold: str) -> None:
    """``--balance`` of a judgment converter whose rows carry their gold judgment as ``gold``."""
    parser.add_argument("--balance", action="store_true", help="Show about half of the pairs the other way round "
                        f"(chosen by a hash of the row id; a swapped row drops its {gold}, which names positions, "
                        "so the SFT set keeps the source's positions).")  # fmt: skip


def write_converted(rows: list[Row], skipped: Sequence[str], data: Path, out: Path, balance: bool) -> int:
    """A judgment converter's ending: say what was skipped, balance (``--balance``), print the position report,
    write ``out/rows.jsonl``. Raises SystemExit when no record converted."""
    for why in skipped:
        print(f"skipped {why}")
    if not rows:
        raise SystemExit(f"no record of {data} could be converted")
    if balance:
        rows, n = balanced(rows)
        print(f"--balance: swapped {n} of {len(rows)} rows")
    for line in position_report(rows):
        print(line)
    print(f"wrote {len(rows)} rows to {write_rows(rows, out / 'rows.jsonl')}")
    return 0


def teach(rows: Sequence[Row], client, *, samples: int = 1, temperature: float = 0.0, max_tokens: int = 1024
          ) -> tuple[list[Row], dict[str, int]]:  # fmt: skip
    """The teacher's well-formed judgments that agree with each row's label, as SFT rows; and counts of what was
    asked, kept, disagreed, malformed and failed (no reply, or one cut at ``max_tokens``)."""
    # imported here: the converters import this module for judgment_row, and need neither torch nor the engine
    from vagent.eval.judges import row_request
    from vagent.rewards.judgment import read_verdict, verdict_matches

    requests = [row_request(row) for row in rows]
    kept: list[Row] = []
    counts = {"asked": 0, "kept": 0, "disagreed": 0, "malformed": 0, "failed": 0}
    for k in range(samples):  # one seed per sample: the replies differ at temperature > 0 and are cached apart
        replies = client.complete_many(requests, temperature=temperature, max_tokens=max_tokens, seed=k)
        for row, reply in zip(rows, replies, strict=True):
            counts["asked"] += 1
            verdict = read_verdict(reply.text, row.judgment.candidates)
            if reply.error is not None:
                counts["failed"] += 1
            elif not verdict.well_formed:
                counts["malformed"] += 1
            elif not verdict_matches(verdict, row.judgment):
                counts["disagreed"] += 1
            else:
                counts["kept"] += 1
                kept.append(Row(**{**row.__dict__, "id": f"{row.id}-t{k}", "source": f"teacher/{row.source}",
                                   "messages": [{"role": "assistant", "content": reply.text.strip()}]}))  # fmt: skip
    return kept, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="Judgment rows (JSONL).")
    parser.add_argument("--teacher", required=True, help="OpenAI-compatible API root of the teacher, e.g. .../v1.")
    parser.add_argument("--teacher-model", help="Model id at --teacher (default: the first one it lists).")
    parser.add_argument("--api-key-env", help="Environment variable holding the teacher's API key.")
    parser.add_argument("--out", required=True, help="Output dir: rows.jsonl, teacher_cache.jsonl.")
    parser.add_argument("--samples", type=int, default=1, help="Replies asked per row (temperature > 0 for > 1).")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)

    from vagent.judge import JudgeClient
    from vagent.recipes.judged import first_model

    rows = [row for row in load_rows(args.data) if row.judgment is not None]
    if not rows:
        raise SystemExit(f"{args.data} holds no judgment rows")
    out = Path(args.out)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    client = JudgeClient(args.teacher, args.teacher_model or first_model(args.teacher), api_key=api_key,
                         concurrency=args.concurrency, cache_path=out / "teacher_cache.jsonl")  # fmt: skip
    try:
        kept, counts = teach(rows, client, samples=args.samples, temperature=args.temperature,
                             max_tokens=args.max_tokens)  # fmt: skip
    finally:
        client.close()
    if not kept:
        raise SystemExit(f"the teacher's judgments kept none of {counts['asked']} replies: {counts}")
    path = write_rows(kept, out / "rows.jsonl")
    print(f"kept {counts['kept']} of {counts['asked']} teacher judgments ({counts}) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

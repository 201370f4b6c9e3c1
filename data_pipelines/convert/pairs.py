"""Generic preference records -> canonical judgment rows (pairwise, or pointwise with a score).

    python -m data_pipelines.convert.pairs --data pairs.jsonl --out DIR [--image-root IMAGES] [--template FILE] \
        [--balance]

One JSON object per line (or a JSON list), images as paths relative to ``--image-root`` (default: the file's
folder)::

    {"question": "What is on the sign?", "image": "a.png", "response_a": "STOP", "response_b": "YIELD",
     "preferred": "a", "reference": "STOP"}                               two answers (reference optional)
    {"question": "a red cube on a table", "image_a": "x.png", "image_b": "y.png", "preferred": "b"}
                                                                          two images for a prompt
    {"question": "...", "images": ["f0.png", "f1.png"], "response": "...", "score": 7, "scale": [1, 10]}
                                                                          one answer, graded (pointwise)

``image`` may be ``images`` (a list: several images or video frames), or itself a list. ``preferred`` is ``a``/``b`` or 1/2. ``id``
is optional (the line number otherwise). ``cot`` (optional) is a gold judgment, ``<think>...</think><answer>...
</answer>``, kept as the row's ``messages`` for SFT. The prompt is ``vagent.data.judgment.render`` of the record with
vagent's default template, or with ``--template`` (a text file with ``{question}``, ``{response1}``, ``{response2}``,
``{reference_line}``, ...): whatever it is, a judge trained on these rows is asked the same way in a GRPO loop by
``judge.prompt: judgment`` (with ``judge.template`` set to the same text when it is not the default).

Positions are kept as the records give them. The share of pairwise rows labelled 1 is printed, with a warning
outside [0.4, 0.6]: a dump of (chosen, rejected) pairs written as ``response_a``/``response_b`` labels every row
``a``, and a judge trained on it learns the position. ``--balance`` shows about half of the pairs the other way
round (``data_pipelines.judgments.balanced``: chosen by a hash of the row id; a swapped row drops its ``cot``,
which names positions).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from data_pipelines.convert.deepeyes import convert_each, image_path, read_records
from data_pipelines.judgments import add_balance_argument, judgment_row, record_images, write_converted
from vagent.data import Judgment, Row

__all__ = ["convert", "convert_record"]


def _preferred(value: Any) -> int:
    choice = {"a": 1, "b": 2, "1": 1, "2": 2}.get(str(value).strip().lower())
    if choice is None:
        raise ValueError(f"'preferred' must be 'a'/'b' or 1/2, got {value!r}")
    return choice


def convert_record(record: dict[str, Any], index: int, image_root: Path, out_images: Path,
                   template: str | None = None) -> Row:  # fmt: skip
    """One record -> a judgment row (see the module docstring). Raises ``ValueError``/``KeyError`` with the reason."""
    question = record["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")
    images = record_images(record)
    reference = record.get("reference")
    if "image_a" in record or "image_b" in record:
        images = [record["image_a"], record["image_b"]]
        judgment = Judgment("pairwise", "images", question, [], reference, _preferred(record["preferred"]),
                            template=template)  # fmt: skip
    elif "response_a" in record or "response_b" in record:
        responses = [record["response_a"], record["response_b"]]
        if not all(isinstance(r, str) for r in responses):
            raise ValueError("'response_a' and 'response_b' must be strings")
        judgment = Judgment("pairwise", "answers", question, responses, reference, _preferred(record["preferred"]),
                            template=template)  # fmt: skip
    elif "response" in record:
        low, high = record.get("scale", [1, 10])
        judgment = Judgment("pointwise", "answers", question, [record["response"]], reference,
                            score=record["score"], scale=(low, high), template=template)  # fmt: skip
    else:
        raise KeyError("response_a/response_b, image_a/image_b or response (with score)")
    paths = [image_path(img, image_root, out_images) for img in images]
    messages = [{"role": "assistant", "content": record["cot"].strip()}] if record.get("cot") else None
    return judgment_row(str(record.get("id", index)), judgment, images=paths, source=record.get("source", "pairs"),
                        messages=messages)  # fmt: skip


def convert(records: list[dict[str, Any]], image_root: Path, out_images: Path,
            template: str | None = None) -> tuple[list[Row], list[str]]:  # fmt: skip
    """Rows and the reasons records were skipped."""
    return convert_each(records, convert_record, image_root, out_images, template)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="Preference records (.jsonl, .json list or .parquet).")
    parser.add_argument("--image-root", help="Folder image paths are relative to (default: the data file's).")
    parser.add_argument("--template", help="Text file: the judge prompt template (default: vagent's).")
    parser.add_argument("--out", required=True, help="Output dir: rows.jsonl.")
    add_balance_argument(parser, "cot")
    args = parser.parse_args(argv)
    data, out = Path(args.data), Path(args.out)
    template = Path(args.template).read_text(encoding="utf-8") if args.template else None
    rows, skipped = convert(read_records(data), Path(args.image_root) if args.image_root else data.parent,
                            out / "images", template)  # fmt: skip
    return write_converted(rows, skipped, data, out, args.balance)


if __name__ == "__main__":
    raise SystemExit(main())

"""Pixel-Reasoner SFT records -> canonical rows with gold Pixel-Reasoner trajectories.

    python -m data_pipelines.convert.pixel_reasoner --data sft.json --out rows.jsonl [--image-root IMAGES]

The layout is the one Pixel-Reasoner's instruction tuning reads (github.com/TIGER-AI-Lab/Pixel-Reasoner
``instruction_tuning/sft_tool.py``: a JSON list; ``sft_tooltrainer.py`` / ``vlm_modules/qwen_module.py``: each
record's ``message_list`` is a qwen-vl-utils chat, images as ``{"type": "image", "image": path}``, a video as
``{"video": [frame paths]}``):

    [{"qid": "q1", "message_list": [{"role": "system", "content": [{"type": "text", "text": "..."}]},
                                    {"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                                                 {"type": "text", "text": "Question..."}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "...<tool_call>..."}]},
                                    {"role": "user", "content": [{"type": "text", "text": "\\nHere is the cropped ..."},
                                                                 {"type": "image", "image": "crop.jpg"}]},
                                    {"role": "assistant", "content": [{"type": "text", "text": "... \\boxed{B}"}]}],
      "answer": "B"}]

The conversation is kept verbatim as the gold trajectory (run ``sft`` with ``data.agent=pixel-reasoner``); a
video's frames become image parts (vagent shows videos as frames, as Pixel-Reasoner does). The question is the
first user text without Pixel-Reasoner's guidelines; the answer is ``answer``/``solution`` when given, else the
last ``\\boxed{}`` of the last assistant turn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vagent.agents.pixel_reasoner import GUIDELINES
from vagent.agents.profile import last_boxed
from vagent.data import Row, write_rows


def _parts(content: Any, image_root: Path) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for item in content:
        if "text" in item and item.get("type", "text") == "text":
            parts.append({"type": "text", "text": item["text"]})
        elif "image" in item:
            parts.append({"type": "image", "path": str(image_root / item["image"])})
        elif "video" in item:
            frames = item["video"] if isinstance(item["video"], list) else [item["video"]]
            parts += [{"type": "image", "path": str(image_root / frame)} for frame in frames]
        else:
            raise ValueError(f"unknown content item {sorted(item)}")
    return parts


def convert_record(record: dict[str, Any], index: int, image_root: Path) -> Row:
    """One record -> a row. Raises ``ValueError``/``KeyError`` with the reason."""
    chat = record["message_list"]
    if chat and isinstance(chat[0], list):  # a batch of one conversation, as the trainer indexes it
        chat = chat[0]
    messages = [{"role": m["role"], "content": _parts(m["content"], image_root)} for m in chat]
    user = next(m for m in messages if m["role"] == "user")
    text = "".join(p["text"] for p in user["content"] if p["type"] == "text")
    question = text.split(GUIDELINES)[0].split("\n\nGuidelines:")[0].strip()
    finals = [m for m in messages if m["role"] == "assistant"]
    if not finals:
        raise ValueError("no assistant turn")
    answer = record.get("answer", record.get("solution"))
    if answer is None:
        answer = last_boxed("".join(p.get("text", "") for p in finals[-1]["content"]))
    if answer is None or not question:
        raise ValueError("no answer (no answer/solution field and no \\boxed{} in the last turn)" if question
                         else "the first user turn has no question text")  # fmt: skip
    images = [p["path"] for p in user["content"] if p["type"] == "image"]
    return Row(id=str(record.get("qid", index)), question=question, answer=answer, answer_type="exact",
               images=images, source="pixel-reasoner", messages=messages)  # fmt: skip


def convert(records: list[dict[str, Any]], image_root: Path) -> tuple[list[Row], list[str]]:
    """Rows and the reasons records were skipped."""
    rows, skipped = [], []
    for i, record in enumerate(records):
        try:
            rows.append(convert_record(record, i, image_root))
        except (KeyError, ValueError, TypeError, StopIteration) as e:
            skipped.append(f"record {i}: {type(e).__name__}: {e}")
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="Pixel-Reasoner SFT JSON (a list of records) or JSONL.")
    parser.add_argument("--image-root", help="Folder image paths are relative to (default: the data file's).")
    parser.add_argument("--out", required=True, help="Canonical rows JSONL to write.")
    args = parser.parse_args(argv)
    data = Path(args.data)
    text = data.read_text(encoding="utf-8")
    records = json.loads(text) if data.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    rows, skipped = convert(records, Path(args.image_root) if args.image_root else data.parent)
    for why in skipped:
        print(f"skipped {why}")
    print(f"wrote {len(rows)} rows to {write_rows(rows, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

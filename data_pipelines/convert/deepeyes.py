"""DeepEyes-format records (verl RL layout) -> canonical rows; with a conversation, a gold DeepEyes trajectory.

    python -m data_pipelines.convert.deepeyes --data train.jsonl --out DIR [--image-root IMAGES]

The layout is the one DeepEyes' trainer reads (github.com/Visual-Agent/DeepEyes ``verl/utils/dataset/rl_dataset.py``:
``prompt`` is a chat whose string contents hold ``<image>`` markers, filled in order from ``images``;
``reward_model.ground_truth`` is the answer; ``env_name`` names the tool env, ``visual_toolbox_v2`` for DeepEyes):

    {"data_source": "vstar", "prompt": [{"role": "system", "content": "..."},
                                        {"role": "user", "content": "<image>\\nWhat is the color of the cup?..."}],
     "images": [{"bytes": ..., "path": "a.jpg"} | "a.jpg", ...], "reward_model": {"ground_truth": "red"},
     "env_name": "visual_toolbox_v2", "extra_info": {...}}

A record whose chat goes on past the question (``prompt`` + optional ``response`` turns: assistant turns with
``<tool_call>``, user turns ``<tool_response><image>...</tool_response>``) becomes a gold trajectory in DeepEyes'
protocol, so ``sft`` with ``data.agent=deepeyes`` cold-starts on it; the crops are the record's later images.
The question is the first user text without its ``<image>`` marker and DeepEyes' format instruction. Images
given as bytes are written under ``DIR/images``. Parquet needs ``pyarrow`` (JSON/JSONL do not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vagent.agents.deepeyes import USER_PROMPT
from vagent.data import Row, write_rows

MARKER = "<image>"


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(
                "reading parquet needs pyarrow (pip install pyarrow), or export the records as JSONL"
            ) from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def image_path(image: Any, image_root: Path, out_images: Path) -> str:
    """A record's image as a path: a path (relative to ``image_root``), or ``{"bytes", "path"}`` written out."""
    if isinstance(image, str):
        return str(image_root / image)
    if isinstance(image, dict) and image.get("bytes"):
        data = image["bytes"]
        out_images.mkdir(parents=True, exist_ok=True)
        target = out_images / (hashlib.sha1(data).hexdigest()[:16] + Path(image.get("path") or "x.png").suffix)
        if not target.exists():
            target.write_bytes(data)
        return str(target)
    if isinstance(image, dict) and image.get("path"):
        return str(image_root / image["path"])
    raise ValueError(f"an image must be a path or {{'bytes', 'path'}}, got {type(image).__name__}")


def _parts(content: str, paths: list[str]) -> list[dict[str, Any]]:
    """A string content with ``<image>`` markers -> parts, taking the next path for each marker."""
    parts: list[dict[str, Any]] = []
    for piece in re.split(f"({re.escape(MARKER)})", content):
        if piece == MARKER:
            if not paths:
                raise ValueError("more <image> markers than images")
            parts.append({"type": "image", "path": paths.pop(0)})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def convert_record(record: dict[str, Any], index: int, image_root: Path, out_images: Path) -> Row:
    """One record -> a row (see the module docstring). Raises ``ValueError``/``KeyError`` with the reason."""
    chat = list(record["prompt"]) + list(record.get("response") or [])
    paths = [image_path(img, image_root, out_images) for img in record.get("images") or []]
    user = next(m for m in chat if m["role"] == "user")
    question = user["content"].replace(MARKER, "").removesuffix(USER_PROMPT).strip()
    if not question:
        raise ValueError("the user turn has no question text")
    answer = (record.get("reward_model") or {}).get("ground_truth")
    if answer is None:
        raise KeyError("reward_model.ground_truth")
    n_prompt = user["content"].count(MARKER)
    if n_prompt > len(paths):
        raise ValueError(f"more <image> markers than images ({n_prompt} > {len(paths)})")
    messages = None
    if any(m["role"] == "assistant" for m in chat):
        pool = list(paths)
        messages = [{"role": m["role"], "content": _parts(m["content"], pool)} for m in chat]
        if pool:
            raise ValueError(f"{len(pool)} image(s) left over: fewer <image> markers than images")
    source = record.get("data_source") or "deepeyes"
    return Row(id=str(record.get("id") or (record.get("extra_info") or {}).get("index", index)), question=question,
               answer=answer, answer_type="exact", images=paths[:n_prompt], source=f"deepeyes:{source}",
               messages=messages, extra={"env_name": record.get("env_name")})  # fmt: skip


def convert_each(records: list[dict[str, Any]], convert_record: Callable[..., Row], *args: Any
                 ) -> tuple[list[Row], list[str]]:  # fmt: skip
    """``convert_record(record, index, *args)`` of every record: the rows, and why the others were skipped (a
    record's KeyError, ValueError, TypeError or StopIteration skips it, naming it)."""
    rows, skipped = [], []
    for i, record in enumerate(records):
        try:
            rows.append(convert_record(record, i, *args))
        except (KeyError, ValueError, TypeError, StopIteration) as e:
            skipped.append(f"record {i}: {type(e).__name__}: {e}")
    return rows, skipped


def convert(records: list[dict[str, Any]], image_root: Path, out_images: Path) -> tuple[list[Row], list[str]]:
    """Rows and the reasons records were skipped."""
    return convert_each(records, convert_record, image_root, out_images)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="DeepEyes records (.jsonl, .json or .parquet).")
    parser.add_argument("--image-root", help="Folder image paths are relative to (default: the data file's).")
    parser.add_argument("--out", required=True, help="Output dir: rows.jsonl and images/.")
    args = parser.parse_args(argv)
    data, out = Path(args.data), Path(args.out)
    rows, skipped = convert(
        read_records(data), Path(args.image_root) if args.image_root else data.parent, out / "images"
    )
    for why in skipped:
        print(f"skipped {why}")
    print(f"wrote {len(rows)} rows to {write_rows(rows, out / 'rows.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

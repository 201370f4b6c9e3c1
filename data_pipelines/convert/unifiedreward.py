"""UnifiedReward-Think's training data -> canonical pairwise judgment rows.

    python -m data_pipelines.convert.unifiedreward --data train_data.json --out DIR [--image-root IMAGES] [--balance]

Two layouts, both read from the CodeGoat24/UnifiedReward repository:

* cold start and rejection sampling (``UnifiedReward-Think/README.md``, "Stage 2"; LLaVA's conversation format as
  ``UnifiedReward-Think/llava_think/train/train.py`` reads it, ``image``/``images`` joined to the dataset's
  ``image_folder`` as ``UnifiedReward-Think/dataset/*.yaml`` set it)::

      {"conversations": [{"from": "human", "value": "<image>\\n<the judge prompt>"},
                         {"from": "gpt", "value": "<think>...</think>\\n<answer>Image 1 is better</answer>"}],
       "images": ["a.png", "b.png"]}

  The gpt turn becomes the row's gold ``messages`` (a cold-start SFT row) and its verdict the label.
* GRPO (``UnifiedReward-Think/README.md``, "Stage 3"; ``UnifiedReward-Think/src/open_r1/grpo.py`` reads
  ``problem``, ``solution``, ``image``/``images``)::

      {"problem": "<the judge prompt>", "solution": "Answer 2 is better", "images": ["frame0.jpg", ...]}

The verdict's noun says what is compared: ``Image N`` (two images for a caption: the row's two images are the
candidates) or ``Answer N`` (two answers about the images). The prompt is kept as written. Where it ends the way
UnifiedReward-Think's inference scripts end it (``UnifiedReward-Think/inference_qwen/image_understanding/`` and
``.../image_generation/``: ``Question: [..]\\nAnswer 1: [..]\\nAnswer 2: [..]`` or ``Text Caption: [..]``), the fields
are read back and the row carries its prompt as a template (``judgment.template``), so it can be shown swapped
(``vagent eval --benchmark judge-pairs``) and a GRPO loop can ask the trained judge with the same template
(``judge.template``). ``<image>`` markers are dropped (vagent shows the row's images before the prompt). Video
records (``video``, ``Video N is better``) are skipped: vagent's judge sees images (extract frames into
``images`` first, as UnifiedReward's GRPO data does). The verdict is read by ``vagent.rewards.judgment.read_verdict``,
the reader of the reward that will train on it, so a record whose verdict the reward could not read is skipped
(``Answer 1 is better`` exactly, inside ``<answer>`` or as the whole text).

The share of rows labelled 1 is printed, with a warning outside [0.4, 0.6]; ``--balance`` shows about half of the
rows the other way round (``data_pipelines.judgments.balanced``; rows whose prompt was kept as written, with text
candidates, cannot be swapped).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from data_pipelines.convert.deepeyes import convert_each, image_path, read_records
from data_pipelines.judgments import add_balance_argument, judgment_row, record_images, write_converted
from vagent.data import Judgment, Row
from vagent.rewards.judgment import read_verdict

__all__ = ["convert", "convert_record"]

MARKER = "<image>"
_ANSWERS_TAIL = re.compile(r"Question: \[(?P<question>.*?)\]\nAnswer 1: \[(?P<response1>.*?)\]\n"
                           r"Answer 2: \[(?P<response2>.*)\]\s*$", re.DOTALL)  # fmt: skip
_CAPTION_TAIL = re.compile(r"Text Caption: \[(?P<question>.*)\]\s*$", re.DOTALL)


def _judgment(prompt: str, candidates: str, preferred: int) -> Judgment:
    """The judgment of a UnifiedReward prompt: its fields and template where its tail can be read back."""
    tail = (_CAPTION_TAIL if candidates == "images" else _ANSWERS_TAIL).search(prompt)
    if tail is None:
        return Judgment("pairwise", candidates, None, [], None, preferred)
    # the prompt with the fields replaced by placeholders, so render() gives it back exactly
    template, last = [], 0
    for name in tail.groupdict():
        template += [prompt[last : tail.start(name)], "{" + name + "}"]
        last = tail.end(name)
    template.append(prompt[last:])
    fields = tail.groupdict()
    responses = [fields["response1"], fields["response2"]] if candidates == "answers" else []
    return Judgment("pairwise", candidates, fields["question"], responses, None, preferred, template="".join(template))


def convert_record(record: dict[str, Any], index: int, image_root: Path, out_images: Path) -> Row:
    """One record -> a judgment row (see the module docstring). Raises ``ValueError``/``KeyError`` with the reason."""
    if record.get("video"):
        raise ValueError("a video record: vagent's judge sees images (extract frames into 'images' first)")
    paths = [image_path(img, image_root, out_images) for img in record_images(record)]
    if "conversations" in record:
        turns = record["conversations"]
        human = next(t["value"] for t in turns if t.get("from") == "human")
        gold = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if gold is None:
            raise KeyError("conversations: no 'gpt' turn (the judgment to learn)")
        prompt, verdict_from = human, gold
        messages = [{"role": "assistant", "content": gold.strip()}]
    else:
        prompt, verdict_from, messages = record["problem"], record["solution"], None
    verdict = read_verdict(verdict_from)
    if verdict.choice is None:
        raise ValueError(f"no verdict 'Answer N is better' or 'Image N is better' (video verdicts are not "
                         f"converted) in {verdict_from[-120:]!r}")  # fmt: skip
    prompt = re.sub(r"<image>\s*", "", prompt).strip()
    if not prompt:
        raise ValueError("the prompt is empty")
    judgment = _judgment(prompt, verdict.candidates, verdict.choice)
    rid = str(record.get("id", index))
    return judgment_row(rid, judgment, images=paths, source="unifiedreward", messages=messages, question=prompt)


def convert(records: list[dict[str, Any]], image_root: Path, out_images: Path) -> tuple[list[Row], list[str]]:
    """Rows and the reasons records were skipped."""
    return convert_each(records, convert_record, image_root, out_images)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="UnifiedReward-Think records (.json list, .jsonl, .parquet).")
    parser.add_argument("--image-root", help="The dataset's image_folder (default: the data file's folder).")
    parser.add_argument("--out", required=True, help="Output dir: rows.jsonl (and images/ for inline bytes).")
    add_balance_argument(parser, "gold judgment")
    args = parser.parse_args(argv)
    data, out = Path(args.data), Path(args.out)
    rows, skipped = convert(
        read_records(data), Path(args.image_root) if args.image_root else data.parent, out / "images"
    )
    return write_converted(rows, skipped, data, out, args.balance)


if __name__ == "__main__":
    raise SystemExit(main())

"""COCO / RefCOCO-style grounding annotations -> grounding rows, optionally with crop-then-answer gold trajectories.

    python -m data_pipelines.convert.refcoco --instances instances.json [--refs refs.json] --image-root IMAGES \
        --out DIR [--trajectories] [--split val] [--min-pixels 3136 --max-pixels 12845056]

Input: COCO ``instances`` JSON (``images`` with ``id``/``file_name``, ``annotations`` with ``id``/``image_id``/
``bbox`` as [x, y, w, h], ``categories`` with ``id``/``name``). With RefCOCO ``refs`` (a JSON list of
``{ref_id, ann_id, image_id, split, sentences: [{sent}]}``) each referring expression becomes a row; without,
each annotation becomes "the <category>". Rows ask for the box (answer_type ``box``, original pixels,
evidence = the box). ``--trajectories`` adds a gold trajectory (crop the region with the real tool, then
answer with the box in the policy's frame), so the rows serve SFT as well as GRPO/eval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image

from data_pipelines.gold import crop_then_answer, model_box
from vagent.data import Evidence, Row, write_rows

QUESTION = 'Give the bounding box of "{expr}" as [x1, y1, x2, y2].'


def convert(instances: dict, refs: list[dict] | None, image_root: Path, out: Path, *, trajectories: bool,
            split: str | None, budget: dict) -> tuple[list[Row], list[str]]:  # fmt: skip
    """Rows and the reasons records were skipped (missing image, degenerate box)."""
    images = {img["id"]: img for img in instances["images"]}
    anns = {ann["id"]: ann for ann in instances["annotations"]}
    names = {c["id"]: c["name"] for c in instances.get("categories", [])}
    items = []
    if refs is not None:
        for ref in refs:
            if split and ref.get("split") != split:
                continue
            for k, sentence in enumerate(ref.get("sentences", [])):
                items.append((f"ref{ref['ref_id']}-{k}", anns.get(ref["ann_id"]), sentence["sent"]))
    else:
        for ann in instances["annotations"]:
            items.append((f"ann{ann['id']}", ann, f"the {names.get(ann.get('category_id'), 'object')}"))
    rows, skipped = [], []
    (out / "crops").mkdir(parents=True, exist_ok=True)
    for rid, ann, expr in items:
        if ann is None or ann["image_id"] not in images:
            skipped.append(f"{rid}: no annotation or image record")
            continue
        path = image_root / images[ann["image_id"]]["file_name"]
        x, y, w, h = ann["bbox"]
        if not path.is_file() or w <= 1 or h <= 1:
            skipped.append(f"{rid}: {'missing image ' + str(path) if not path.is_file() else 'degenerate box'}")
            continue
        box = [float(x), float(y), float(x + w), float(y + h)]
        messages = None
        if trajectories:
            with Image.open(path) as img:
                image = img.convert("RGB")
            answer = model_box(box, image.size, **budget)
            messages = crop_then_answer(image, box, out / "crops" / f"{rid}.png", look=f"Let me look closer at {expr}.",
                                        read=f"The crop shows {expr}.", answer=str(answer), margin=8, **budget)  # fmt: skip
        rows.append(Row(id=rid, question=QUESTION.format(expr=expr), answer=box, answer_type="box", images=[str(path)],
                        source="refcoco", evidence=Evidence(boxes=[box]), tools=["crop"], messages=messages))  # fmt: skip
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", required=True)
    parser.add_argument("--refs")
    parser.add_argument("--image-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--split")
    parser.add_argument("--trajectories", action="store_true")
    parser.add_argument("--min-pixels", type=int, default=3136)
    parser.add_argument("--max-pixels", type=int, default=12845056)
    parser.add_argument("--factor", type=int, default=28)
    parser.add_argument("--convention", default="absolute", choices=["absolute", "norm1000"])
    args = parser.parse_args(argv)
    budget = dict(
        min_pixels=args.min_pixels, max_pixels=args.max_pixels, factor=args.factor, convention=args.convention
    )
    refs = json.loads(Path(args.refs).read_text()) if args.refs else None
    rows, skipped = convert(json.loads(Path(args.instances).read_text()), refs, Path(args.image_root), Path(args.out),
                            trajectories=args.trajectories, split=args.split, budget=budget)  # fmt: skip
    for reason in skipped:
        print(f"skipped {reason}")
    print(f"wrote {len(rows)} rows to {write_rows(rows, Path(args.out) / 'rows.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

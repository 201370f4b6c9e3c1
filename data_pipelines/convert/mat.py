"""MAT-Coding / MAT-Search (Visual-ARFT) JSON -> canonical rows (for SFT distillation, GRPO or eval).

    python -m data_pipelines.convert.mat --kind coding --data MAT-Coding.json --image-root IMAGES --out rows.jsonl

Reads the published records with the eval loaders (one definition of the format), so a record the
evaluation would reject is reported here the same way: by id and field, and skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vagent.data import write_rows
from vagent.eval import BENCHMARKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["coding", "search"], required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--image-root")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows, errors = BENCHMARKS[f"mat-{args.kind}"].load(
        Path(args.data), Path(args.image_root) if args.image_root else None
    )
    for record, why in errors:
        print(f"skipped {record}: {why}")
    print(f"wrote {len(rows)} rows to {write_rows(rows, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

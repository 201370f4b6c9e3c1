"""Charades-STA temporal grounding annotations -> canonical span rows.

    python -m data_pipelines.convert.charades --annotations charades_sta_test.txt --video-root VIDEOS --out rows.jsonl

Input: the published text format, one moment per line: ``VIDEO_ID START END##description`` (seconds).
Each line becomes a row asking when the description happens (answer_type ``span``, evidence = the span);
lines that do not parse or name a missing video are reported with their line number and skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vagent.data import Evidence, Row, write_rows
from vagent.eval.benchmarks.temporal_grounding import PROMPT


def convert(text: str, video_root: Path, ext: str) -> tuple[list[Row], list[str]]:
    rows, skipped = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            head, query = line.split("##", 1)
            video_id, start, end = head.split()
            span = [float(start), float(end)]
        except ValueError:
            skipped.append(f"line {number}: expected 'VIDEO START END##description', got {line[:60]!r}")
            continue
        video = video_root / f"{video_id}.{ext}"
        if not video.is_file() or not 0 <= span[0] < span[1]:
            skipped.append(f"line {number}: {'missing video ' + str(video) if not video.is_file() else 'bad span'}")
            continue
        rows.append(Row(id=f"{video_id}-{number}", question=PROMPT.format(query=query.strip()), answer=span,
                        answer_type="span", videos=[str(video)], source="charades-sta",
                        evidence=Evidence(spans=[span]), tools=["sample_frames", "crop_clip"]))  # fmt: skip
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--annotations", required=True)
    parser.add_argument("--video-root", required=True)
    parser.add_argument("--ext", default="mp4")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows, skipped = convert(Path(args.annotations).read_text(), Path(args.video_root), args.ext)
    for reason in skipped:
        print(f"skipped {reason}")
    print(f"wrote {len(rows)} rows to {write_rows(rows, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

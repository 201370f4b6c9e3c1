"""Latency of the agent's tools: p50/p99 per call, measured side by side in one run.

    python benchmarks/tools.py [--repeat 50] [--markdown]

Each row times ``call_tool`` end to end (argument check, the tool, resizing its output), which is
what a rollout pays per call. ``sample_frames`` is compared with a naive OpenCV loop (open, seek,
read per frame) on the same generated video, and ``code`` is a cold call: a fresh sandbox process
per call, as in a rollout. Results go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from vagent.media import smart_resize, uniform_timestamps
from vagent.toolbox import TOOLS, ToolContext, call_tool
from vagent.types import ToolCall


def timed(fn: Callable[[], object], repeat: int, warmup: int = 2) -> list[float]:
    """Wall-clock milliseconds of ``repeat`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def write_video(path: Path, seconds: float, fps: float, size: tuple[int, int]) -> None:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    for i in range(int(seconds * fps)):
        writer.write(np.roll(base, i * 4, axis=1))  # moving texture: a realistic inter-frame codec load
    writer.release()


def opencv_seek_frames(path: str, timestamps: list[float]) -> list[Image.Image]:
    """The naive way: open the file, seek to each frame, read it, convert."""
    import cv2

    cap = cv2.VideoCapture(path)
    fps = cap.get(cv2.CAP_PROP_FPS)
    frames = []
    for t in timestamps:
        cap.set(cv2.CAP_PROP_POS_FRAMES, int(t * fps))
        ok, frame = cap.read()
        if ok:
            frames.append(Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)))
    cap.release()
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--markdown", action="store_true", help="Print a markdown table for docs/PERFORMANCE.md.")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vagent-bench-"))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (1536, 2048, 3), dtype=np.uint8))
    min_pixels, max_pixels = 28 * 28 * 4, 28 * 28 * 1280
    h, w = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
    video = tmp / "clip.mp4"
    write_video(video, seconds=60, fps=30, size=(640, 360))
    context = ToolContext(
        images=[image], model_sizes=[(w, h)], min_pixels=min_pixels, max_pixels=max_pixels, videos=[str(video)]
    )
    if "search" in TOOLS:
        from vagent.toolbox.search import BM25Backend

        words = [f"w{i}" for i in range(5000)]
        rng = np.random.default_rng(0)
        records = [
            {"title": f"doc {i}", "text": " ".join(rng.choice(words, 60)), "url": f"https://example.org/{i}"}
            for i in range(10_000)
        ]
        context.search = BM25Backend.from_records(records)

    def tool(name: str, arguments: dict) -> Callable[[], object]:
        def run() -> object:
            observation = call_tool(ToolCall(name, arguments), context)
            assert observation.ok, observation.text
            return observation

        return run

    stamps = uniform_timestamps(10.0, 50.0, 8)
    rows: list[tuple[str, str, Callable[[], object]]] = [
        ("crop", "300x300 box of a 2048x1536 image", tool("crop", {"bbox": [100, 100, 400, 400]})),
        ("zoom_in", "same box, factor 2", tool("zoom_in", {"bbox": [100, 100, 400, 400], "factor": 2})),
        (
            "sample_frames",
            "8 frames of a 60 s 640x360 clip (decord)",
            tool("sample_frames", {"start": 10, "end": 50, "num_frames": 8}),
        ),
        ("opencv seek loop", "same 8 frames, open + seek + read each", lambda: opencv_seek_frames(str(video), stamps)),
        ("code", "cold call, `print(1)` in the bubblewrap sandbox", tool("code", {"code": "print(1)"})),
        ("search", "BM25 top-5 over 10k documents", tool("search", {"query": "w1 w22 w333", "k": 5})),
    ]
    results = []
    for name, what, fn in rows:
        if name in ("zoom_in", "sample_frames", "code", "search") and name not in TOOLS:
            continue
        ms = timed(fn, args.repeat)
        results.append((name, what, statistics.median(ms), percentile(ms, 99)))

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, repeat={args.repeat}")
    if args.markdown:
        print("| tool | what | p50 ms | p99 ms |\n|---|---|---:|---:|")
        for name, what, p50, p99 in results:
            print(f"| {name} | {what} | {p50:.1f} | {p99:.1f} |")
    else:
        for name, what, p50, p99 in results:
            print(f"{name:18s} p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   ({what})")
    by_name = {r[0]: r for r in results}
    if "sample_frames" in by_name:
        ratio = by_name["opencv seek loop"][2] / by_name["sample_frames"][2]
        print(f"\ndecord sample_frames is {ratio:.1f}x faster than the OpenCV seek loop (p50).")


if __name__ == "__main__":
    main()

"""Latency of the agent's tools: p50/p99 per call, measured side by side in one run.

    python benchmarks/tools.py [--repeat 50] [--markdown] [--doc]

Each row times ``call_tool`` end to end (argument check, the tool, resizing its output), which is
what a rollout pays per call. ``sample_frames`` is compared with a naive OpenCV loop (open, seek,
read per frame) on the same generated video, and ``code`` is a cold call: a fresh sandbox process
per call, as in a rollout. ``--doc`` writes the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
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


def photo_like(width: int, height: int) -> Image.Image:
    """Smooth gradients, shapes and mild sensor noise: compresses like a photo (pure noise would not)."""
    from PIL import ImageDraw

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width * 200, y / height * 200, (x + y) / (width + height) * 255], axis=-1)
    noisy = np.clip(base + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy)
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 200))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        draw.rectangle((x0, y0, x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 200))), fill=color)
    return image


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
    parser.add_argument("--markdown", action="store_true", help="Print the results as a markdown table.")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vagent-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    image = photo_like(2048, 1536)
    min_pixels, max_pixels = 28 * 28 * 4, 28 * 28 * 1280
    h, w = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
    video = tmp / "clip.mp4"
    write_video(video, seconds=60, fps=30, size=(640, 360))
    context = ToolContext(
        images=[image],
        model_sizes=[(w, h)],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        videos=[str(video)],
        max_frames=32,  # above the default 16, so the 32-frame row really decodes 32
    )
    bare = ToolContext()
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
            assert "num_frames" not in arguments or len(observation.images) == arguments["num_frames"]
            return observation

        return run

    stamps, stamps32 = uniform_timestamps(10.0, 50.0, 8), uniform_timestamps(10.0, 50.0, 32)
    rows: list[tuple[str, str, Callable[[], object]]] = [
        ("crop", "300x300 box of a 2048x1536 image", tool("crop", {"bbox": [100, 100, 400, 400]})),
        ("zoom_in", "same box, factor 2", tool("zoom_in", {"bbox": [100, 100, 400, 400], "factor": 2})),
        (
            "sample_frames",
            "8 frames of a 60 s 640x360 clip (decord)",
            tool("sample_frames", {"start": 10, "end": 50, "num_frames": 8}),
        ),
        ("OpenCV seek loop", "same 8 frames, open + seek + read each", lambda: opencv_seek_frames(str(video), stamps)),
        (
            "sample_frames",
            "32 frames of the same clip (decord)",
            tool("sample_frames", {"start": 10, "end": 50, "num_frames": 32}),
        ),
        ("OpenCV seek loop", "same 32 frames", lambda: opencv_seek_frames(str(video), stamps32)),
        ("code", "cold call, `print(1)`, no images", lambda: call_tool(ToolCall("code", {"code": "print(1)"}), bare)),
        (
            "code",
            "cold call, `print(images[0].size)`, the 2048x1536 image in the episode",
            tool("code", {"code": "print(images[0].size)"}),
        ),
        (
            "code",
            "same, first call of an episode (the image is encoded for the sandbox)",
            lambda: call_tool(ToolCall("code", {"code": "print(1)"}), ToolContext(images=[image.copy()])),
        ),
        ("search", "BM25 top-5 over 10k documents", tool("search", {"query": "w1 w22 w333", "k": 5})),
    ]
    results = []
    for name, what, fn in rows:
        if name in ("zoom_in", "sample_frames", "code", "search") and name not in TOOLS:
            continue
        ms = timed(fn, args.repeat)
        results.append((name, what, statistics.median(ms), percentile(ms, 99)))

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, repeat={args.repeat}")
    table = ["| tool | what | p50 ms | p99 ms |", "|---|---|---:|---:|"]
    table += [f"| {name} | {what} | {p50:.1f} | {p99:.1f} |" for name, what, p50, p99 in results]
    if args.markdown or args.doc:
        print("\n".join(table))
    else:
        for name, what, p50, p99 in results:
            print(f"{name:18s} p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   ({what})")
    decord = [r[2] for r in results if r[0] == "sample_frames"]
    opencv = [r[2] for r in results if r[0] == "OpenCV seek loop"]
    ratios = [f"{n} frames: the OpenCV seek loop takes {b / a:.2f}x decord's `sample_frames` (p50)"
              for n, a, b in zip((8, 32), decord, opencv, strict=False)]  # fmt: skip
    print("\n".join(ratios))
    if args.doc:
        from doc_table import write_section

        write_section("tools", "\n".join(table) + "\n\n" + "; ".join(ratios) + ".")


if __name__ == "__main__":
    main()

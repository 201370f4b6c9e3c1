"""Video tasks: a generated clip where the answer is on screen only for a short window.

    python -m data_pipelines.synthetic.video --out data/video --rows 100 --seed 0 [--task glimpse --frames 8]

Each clip (``duration`` s at ``fps``) shows drifting grey shapes; during one window of ``window`` seconds a
colored square appears. The question asks its color, so the answer is visible only inside the window:
the global overview (8 frames spread over the clip, ``sample_frames``' default) usually misses a short
window, and looking at the window more densely finds it. Rows carry the window as the evidence span and
a gold trajectory: an overview with ``sample_frames``, then ``crop_clip`` on the window (both run with the
real tools, rendered as the engine renders them), then the answer.
Knobs: ``duration``, ``window`` (shorter = harder), ``fps``, ``size``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from data_pipelines.gold import tool_turn
from vagent.data import Evidence, Row, write_rows
from vagent.toolbox import ToolContext

__all__ = ["COLORS", "MARKER", "glimpse_rows", "video_rows", "write_clip"]

COLORS = {"red": (30, 30, 220), "green": (40, 170, 40), "blue": (220, 70, 30), "yellow": (30, 210, 230)}  # BGR
MARKER = (60, 60, 60)  # the glimpse task's square when not colored (BGR)


def write_clip(path: Path, rng: random.Random, *, duration: float, fps: float, size: tuple[int, int], window: tuple[float, float],
               color: str, marker: tuple[float, float] | None = None) -> None:  # fmt: skip
    """Write the clip with OpenCV (mp4v): grey drifting circles, the colored square only during ``window``; where
    ``marker`` is given, the same square in dark grey during that span (around ``window``) when not colored."""
    import cv2

    width, height = size
    shapes = [(rng.uniform(0, width), rng.uniform(0, height), rng.uniform(-3, 3), rng.uniform(-3, 3), rng.randint(6, 16))
              for _ in range(6)]  # fmt: skip
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    side = min(width, height) // 3
    x0, y0 = rng.randint(0, width - side), rng.randint(0, height - side)
    for i in range(int(duration * fps)):
        t = i / fps
        frame = np.full((height, width, 3), 235, dtype=np.uint8)
        for x, y, dx, dy, r in shapes:
            cv2.circle(frame, (int(x + dx * i) % width, int(y + dy * i) % height), r, (120, 120, 120), 2)
        if window[0] <= t < window[1]:
            cv2.rectangle(frame, (x0, y0), (x0 + side, y0 + side), COLORS[color], -1)
        elif marker is not None and marker[0] <= t < marker[1]:
            cv2.rectangle(frame, (x0, y0), (x0 + side, y0 + side), MARKER, -1)
        writer.write(frame)
    writer.release()


def video_rows(out_dir: str | Path, n: int, *, seed: int = 0, duration: float = 12.0, window: float = 1.0,
               fps: float = 8.0, size: tuple[int, int] = (160, 120)) -> list[Row]:  # fmt: skip
    """Build ``n`` video rows with clips and gold trajectories under ``out_dir``."""
    out = Path(out_dir)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        color = rng.choice(list(COLORS))
        t0 = round(rng.uniform(0.5, duration - window - 0.5), 2)
        span = (t0, round(t0 + window, 2))
        path = out / "clips" / f"video-{seed}-{i}.mp4"
        write_clip(path, rng, duration=duration, fps=fps, size=size, window=span, color=color)
        context = ToolContext(videos=[str(path)])  # the engine's frame budget: the gold frames are the rollout's
        stem = f"video-{seed}-{i}"
        overview_call, overview = tool_turn("sample_frames", {"num_frames": 8}, context,
                                            out / "frames" / f"{stem}-sample_frames")  # fmt: skip
        overview_images = sum(part["type"] == "image" for part in overview["content"])  # the clip's come after them
        clip_call, clip = tool_turn("crop_clip", {"start": max(0.0, span[0] - 0.5), "end": span[1] + 0.5}, context,
                                    out / "frames" / f"{stem}-crop_clip", first_image=overview_images)  # fmt: skip
        messages = [
            {"role": "assistant", "content": f"<think>Let me get an overview of the video.</think>\n{overview_call}"},
            overview,
            {"role": "assistant", "content": f"<think>Something seems to flash around {span[0]:.1f} s; I will look at that "
                                             f"moment frame by frame.</think>\n{clip_call}"},
            clip,
            {"role": "assistant", "content": f"<think>The square is {color}.</think>\n<answer>{color}</answer>"},
        ]  # fmt: skip
        rows.append(Row(id=stem, question="A colored square appears briefly. What color is it?", answer=color,
                        answer_type="exact", videos=[str(path)], source="synthetic/video",
                        evidence=Evidence(spans=[list(span)]), tools=["sample_frames", "crop_clip"], messages=messages,
                        extra={"difficulty": {"duration": duration, "window": window, "fps": fps}}))  # fmt: skip
    return rows


def glimpse_rows(out_dir: str | Path, n: int, *, seed: int = 0, duration: float = 12.0, frames: int = 8,
                 fps: float = 8.0, flash_frames: int = 2, size: tuple[int, int] = (160, 120)) -> list[Row]:  # fmt: skip
    """``n`` rows of the glimpse task, learnable by design (the video proof's data): the prompt shows a first view of
    ``frames`` frames (``rollout.frame_budget`` [frames, frames], at segment centres), and exactly one of them shows a
    dark square: the marker, on screen from 0.2 of a segment before that frame's time to 0.8 after it. For
    ``flash_frames`` frames after the shown one, inside the marker's span, the square is colored; the question asks
    the color. So the first view says *when* to look and never *what*: without a tool the answer is a guess among
    ``COLORS``; ``crop_clip`` from the marked frame's time, one segment long (every frame of it), shows the color: its
    arguments are the times the prompt prints (the marked frame's, and the next one's or the video's length), copied
    rather than computed. Rows carry the marker's span as evidence (``temporal_iou``: the gold clip's is 0.67) and a
    gold trajectory: that ``crop_clip`` (run with the real tool), then the answer; SFT shows them the same first view
    with ``data.frame_budget`` [frames, frames]."""
    from vagent.media import uniform_timestamps

    out = Path(out_dir)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    segment = duration / frames
    room = int(0.8 * segment * fps) - flash_frames  # flash starts after the shown frame and ends inside the marker
    if room < 1:
        raise ValueError(
            f"a segment of {segment:.2f} s at {fps} frames/s leaves no room for {flash_frames} flash frames"
        )
    rows = []
    for i in range(n):
        color, k = rng.choice(list(COLORS)), rng.randrange(frames)
        shown = round(uniform_timestamps(0.0, duration, frames)[k] * fps)  # the first view's frame of segment k
        at = shown / fps  # its time, as the prompt prints it
        marker = (at - 0.2 * segment, min(at + 0.8 * segment, duration))
        first = shown + rng.randint(1, min(room, round(duration * fps) - shown - flash_frames))  # in the video
        flash = (first / fps - 0.5 / fps, (first + flash_frames) / fps - 0.5 / fps)
        stem = f"glimpse-{seed}-{i}"
        path = out / "clips" / f"{stem}.mp4"
        write_clip(path, rng, duration=duration, fps=fps, size=size, window=flash, color=color, marker=marker)
        context = ToolContext(videos=[str(path)])  # the engine's frame budget: the gold frames are the rollout's
        window = {"start": round(at, 2), "end": round(min(at + segment, duration), 2)}
        call, clip = tool_turn("crop_clip", window, context, out / "frames" / f"{stem}-crop_clip",
                               first_image=frames)  # fmt: skip
        messages = [
            {"role": "assistant", "content": f"<think>The square shows at t={at:.2f}s; I will look from there frame "
                                             f"by frame.</think>\n{call}"},
            clip,
            {"role": "assistant", "content": f"<think>The square is {color}.</think>\n<answer>{color}</answer>"},
        ]  # fmt: skip
        span = [round(marker[0], 3), round(marker[1], 3)]
        rows.append(Row(id=stem, question="A dark square appears once, and for a moment it is colored. What color is "
                        f"it? Answer with one of: {', '.join(COLORS)}.", answer=color, answer_type="exact",
                        videos=[str(path)], source="synthetic/video-glimpse", evidence=Evidence(spans=[span]),
                        tools=["crop_clip"], messages=messages,
                        extra={"difficulty": {"duration": duration, "frames": frames, "fps": fps,
                                              "flash_frames": flash_frames}, "marked": round(at, 2)}))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--window", type=float, default=1.0, help="--task window: seconds the color is on screen.")
    parser.add_argument("--task", choices=["window", "glimpse"], default="window",
                        help="window: a color shown in a short window (video_rows); glimpse: the first view marks "
                        "when, crop_clip shows what (glimpse_rows; SFT and rollout with frame_budget [frames, frames]).")  # fmt: skip
    parser.add_argument("--frames", type=int, default=8, help="--task glimpse: frames of the first view.")
    parser.add_argument("--fps", type=float, default=8.0, help="Frame rate of the clips.")
    args = parser.parse_args(argv)
    if args.task == "glimpse":
        rows = glimpse_rows(args.out, args.rows, seed=args.seed, duration=args.duration, frames=args.frames,
                            fps=args.fps)  # fmt: skip
    else:
        rows = video_rows(args.out, args.rows, seed=args.seed, duration=args.duration, window=args.window,
                          fps=args.fps)  # fmt: skip
    print(f"wrote {len(rows)} rows to {write_rows(rows, Path(args.out) / 'rows.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

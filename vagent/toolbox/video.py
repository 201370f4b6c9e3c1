"""What ``sample_frames`` and ``crop_clip`` share: picking the video, checking the time span, choosing
distinct frames, and the observation that carries them back with their timestamps.

Guards against: a ``video_index`` past the episode's videos; missing, junk, truncated or otherwise
undecodable videos (the file is opened once per call and any decode failure is reported); NaN/inf
times; spans partly outside the video (clipped, and said) or reversed (swapped, and said); spans
entirely outside the video or empty after clipping (rejected); several requested times landing on
the same decoded frame (each frame returned once, and said). Does not guard against: variable
frame-rate videos (times are ``index / average fps``, so they can drift from the true presentation
time), a stream that decodes into garbage without an error, or the cost of decoding a huge video
(callers bound the number of frames with ``ToolContext.max_frames``).

Helpers raise ``Refusal``; each tool's ``call`` turns it into an error ``Observation``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vagent.geometry import Span, clamp_span
from vagent.media import MediaError, OpenVideo, resize_to_budget, uniform_timestamps
from vagent.toolbox.context import ToolContext
from vagent.types import Observation

# A time that lands this close above a frame boundary counts as that boundary (float noise in t * fps).
_EPS = 1e-6


class Refusal(Exception):
    """A call the tool cannot serve; ``kind`` becomes ``Observation.error`` and the message its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def observation(self, tool: str) -> Observation:
        return Observation(text=f"{tool} failed: {self}", error=self.kind)


# The same argument in both video tools' schemas.
VIDEO_INDEX = {"type": "integer", "minimum": 0, "description": "Which video (0 = the first). Default 0."}


def check_fps(arguments: Mapping[str, Any]) -> float | None:
    """The ``fps`` argument, or None. NaN and inf pass the schema's bound (every comparison with NaN is
    False), so they are refused here."""
    fps = arguments.get("fps")
    if fps is not None and not math.isfinite(fps):
        raise Refusal("bad_arguments", f"fps must be a finite number of frames per second, got {fps}.")
    return fps


def open_video(arguments: Mapping[str, Any], context: ToolContext) -> tuple[int, OpenVideo]:
    """The ``video_index`` argument (default 0) and that video, opened once for probing and decoding."""
    index = int(arguments.get("video_index", 0))  # the schema allows 2.0 as an integer
    if not 0 <= index < len(context.videos):
        raise Refusal(
            "bad_arguments", f"video_index {index} does not exist; this episode has {len(context.videos)} video(s)."
        )
    try:
        return index, OpenVideo(context.videos[index])
    except MediaError as e:
        raise Refusal("bad_video", f"video {index} cannot be read: {e}.") from None


def check_span(arguments: Mapping[str, Any], duration: float) -> tuple[Span, list[str]]:
    """``[start, end]`` in seconds (defaults: the whole video), clipped to ``[0, duration]``, with notes."""
    start, end = arguments.get("start", 0.0), arguments.get("end", duration)
    if not (math.isfinite(start) and math.isfinite(end)):
        raise Refusal("bad_span", f"start and end must be finite numbers of seconds, got start={start}, end={end}.")
    try:
        span, notes = clamp_span((start, end), duration)
    except ValueError as e:
        raise Refusal("bad_span", f"{e}.") from None
    if span[1] - span[0] <= 0:
        raise Refusal(
            "bad_span",
            f"the span [{start:g}, {end:g}] s is empty within the video (duration {duration:.2f} s); "
            f"give start < end, inside [0, {duration:.2f}] s.",
        )
    if notes:
        notes = [f"requested span [{start:g}, {end:g}] s: " + "; ".join(notes) + "."]
    return span, notes


def frames_in_span(video: OpenVideo, span: Span) -> range:
    """Indices of every frame shown during ``span``: the one at ``start`` up to the last one starting before ``end``."""
    first = video.index_at(span[0])
    last = min(video.num_frames - 1, math.ceil(span[1] * video.fps - _EPS) - 1)
    return range(first, max(first, last) + 1)


def choose_frames(video: OpenVideo, span: Span, count: int) -> tuple[list[int], list[str]]:
    """``count`` distinct frame indices spread over ``span`` (at segment centres), in time order, with notes."""
    every = frames_in_span(video, span)
    if count >= len(every):
        notes = []
        if count > len(every):
            notes.append(
                f"{span[0]:.2f}–{span[1]:.2f} s holds only {len(every)} distinct frame(s) of this "
                f"{video.fps:g} fps video, so {len(every)} frame(s) are returned instead of {count}."
            )
        return list(every), notes
    wanted = [video.index_at(t) for t in uniform_timestamps(span[0], span[1], count)]
    indices = sorted(set(wanted))
    notes = []
    if len(indices) < len(wanted):
        notes.append(
            f"{len(wanted) - len(indices)} requested time(s) fell on the same frame as another; each frame is sent once."
        )
    return indices, notes


def frames_observation(
    video_index: int, video: OpenVideo, indices: list[int], span: Span, how: str, notes: list[str], context: ToolContext
) -> Observation:
    """Decode ``indices`` in one batch, size them for the model, and say what they are and where they land.

    Args:
        how: Words after the span saying how it was sampled (e.g. ``"at 2 fps"``).
    """
    try:
        frames = [
            resize_to_budget(
                frame, min_pixels=context.min_pixels, max_pixels=context.frame_max_pixels, factor=context.image_factor
            )
            for frame in video.decode(indices)
        ]
    except MediaError as e:
        raise Refusal("bad_video", f"video {video_index} cannot be decoded: {e}.") from None
    times = [i / video.fps for i in indices]
    # No image indices here: the engine labels the frames with theirs ("Images 3–5: ...") when it appends them.
    text = (
        f"{len(frames)} frame(s) of video {video_index} (duration {video.duration:.2f} s) from "
        f"{span[0]:.2f}–{span[1]:.2f} s {how}, at t = {', '.join(f'{t:.2f}' for t in times)} s (in that order)."
    )
    if notes:
        text += " Note: " + " ".join(notes)
    metadata = {"video_index": video_index, "span": [span[0], span[1]], "timestamps": times, "frame_indices": indices}
    return Observation(text=text, images=frames, timestamps=times, metadata=metadata)

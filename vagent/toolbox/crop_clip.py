"""``crop_clip``: zoom in on time. Re-sample a short window of a video densely (LongVT-style), by default
every frame the video has there, so a fast action or an exact moment seen in a coarse overview can be
checked frame by frame.

The rate is ``fps`` or, by default, the video's own frame rate (then every frame in the window is
returned). A rate above the video's is lowered to it; a window too long for that rate within
``ToolContext.max_frames`` is sampled at the best rate the cap allows. Both are said in the text, with
the effective rate. Guards against what ``vagent.toolbox.video`` lists, plus a non-finite ``fps``.
Does not guard against: a window chosen in the wrong place (the tool shows it; the model must move it).
"""

from __future__ import annotations

import math
from typing import Any

from vagent.toolbox.context import ToolContext
from vagent.toolbox.video import (
    VIDEO_INDEX,
    Refusal,
    check_fps,
    check_span,
    choose_frames,
    frames_in_span,
    frames_observation,
    open_video,
)
from vagent.types import Observation

NAME = "crop_clip"
SCHEMA = {
    "name": NAME,
    "description": "Zoom in on a short time window of a video: re-sample [start, end] densely, by default every "
    "frame at the video's own frame rate, to see a fast action or an exact moment in detail. Returns the frames as "
    "images with their timestamps in seconds. A call returns at most a fixed number of frames, so keep the window "
    "short (a few seconds); longer windows are sampled less densely. For an overview of a long range, use "
    "sample_frames first.",
    "parameters": {
        "type": "object",
        "properties": {
            "start": {"type": "number", "description": "Start of the window in seconds."},
            "end": {"type": "number", "description": "End of the window in seconds."},
            "fps": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "Frames per second to sample. Default: the video's frame rate (every frame).",
            },
            "video_index": VIDEO_INDEX,
        },
        "required": ["start", "end"],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    try:
        return _crop(arguments, context)
    except Refusal as refusal:
        return refusal.observation(NAME)


def _crop(arguments: dict[str, Any], context: ToolContext) -> Observation:
    fps = check_fps(arguments)
    limit = max(1, context.max_frames)
    video_index, video = open_video(arguments, context)
    span, notes = check_span(arguments, video.duration)
    length = span[1] - span[0]
    if fps is not None and fps > video.fps:
        notes.append(f"fps {fps:g} is above the video's frame rate; used its {video.fps:g} fps.")
    rate = video.fps if fps is None else min(fps, video.fps)
    # At the native rate "every frame" is exact: counting frames avoids rounding a partly covered one away.
    wanted = len(frames_in_span(video, span)) if rate == video.fps else math.ceil(rate * length - 1e-9)
    if wanted > limit:
        notes.append(
            f"{length:.2f} s at {rate:g} fps needs {wanted} frames, more than the {limit} one call may return; "
            f"sampled {limit} frames evenly instead (about {limit / length:.3g} fps). Use a shorter window to see "
            "every frame."
        )
    count = max(1, min(wanted, limit))
    indices, more_notes = choose_frames(video, span, count)
    dense = len(indices) == len(frames_in_span(video, span))
    how = f"at {video.fps:g} fps (every frame)" if dense else f"at about {len(indices) / length:.3g} fps"
    return frames_observation(video_index, video, indices, span, how, notes + more_notes, context)

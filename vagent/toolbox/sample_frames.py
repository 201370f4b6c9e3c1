"""``sample_frames``: look at a few frames spread over a stretch of a video (default: all of it), each
with its timestamp: the overview that tells the model *when* something happens.

Frames sit at the centres of equal segments of ``[start, end]``, so they cover the span evenly and
never land on its very edges. The count is ``num_frames`` (default 8) or ``ceil(fps x span)``,
capped at ``ToolContext.max_frames`` (said in the text). Guards against what ``vagent.toolbox.video``
lists, plus: ``num_frames`` and ``fps`` given together (rejected: which one wins would be a guess)
and a non-finite ``fps``. Does not guard against: asking for an overview of a span so long that
evenly spread frames miss a brief event (that is what ``crop_clip`` on a short window is for).
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
    frames_observation,
    open_video,
)
from vagent.types import Observation

NAME = "sample_frames"
DEFAULT_NUM_FRAMES = 8
SCHEMA = {
    "name": NAME,
    "description": "Look at frames spread evenly over a time range of a video (default: the whole video), to get "
    "an overview or find when something happens. Returns the frames as images with their timestamps in seconds. "
    f"Give num_frames (default {DEFAULT_NUM_FRAMES}) or fps, not both; a call returns at most a fixed number of "
    "frames. To see a short moment frame by frame, use crop_clip instead.",
    "parameters": {
        "type": "object",
        "properties": {
            "start": {"type": "number", "description": "Start of the range in seconds. Default 0."},
            "end": {"type": "number", "description": "End of the range in seconds. Default: the end of the video."},
            "num_frames": {
                "type": "integer",
                "minimum": 1,
                "description": f"How many frames to spread over the range. Default {DEFAULT_NUM_FRAMES}.",
            },
            "fps": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "Frames per second to sample instead of num_frames (e.g. 0.5 = one every 2 s).",
            },
            "video_index": VIDEO_INDEX,
        },
        "required": [],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    try:
        return _sample(arguments, context)
    except Refusal as refusal:
        return refusal.observation(NAME)


def _sample(arguments: dict[str, Any], context: ToolContext) -> Observation:
    if "num_frames" in arguments and "fps" in arguments:
        raise Refusal("bad_arguments", "give either num_frames or fps, not both.")
    fps = check_fps(arguments)
    limit = max(1, context.max_frames)
    video_index, video = open_video(arguments, context)
    span, notes = check_span(arguments, video.duration)
    length = span[1] - span[0]
    # Compare as floats before ceil: a huge fps times the span can be inf, which ceil cannot take.
    wanted = int(arguments.get("num_frames", min(DEFAULT_NUM_FRAMES, limit))) if fps is None else fps * length
    if wanted > limit:
        asked = f"{int(wanted)} frames" if fps is None else f"{fps:g} fps over {length:.2f} s"
        notes.append(f"{asked} is more than the {limit} frames one call may return; sampled {limit}.")
        count = limit
    else:
        count = max(1, math.ceil(wanted - 1e-9))  # 1e-9: 2 fps x 1.5 s must be 3 frames, not 4 from float noise
    indices, more_notes = choose_frames(video, span, count)
    how = f"spread evenly (one every {length / len(indices):.2f} s)"
    return frames_observation(video_index, video, indices, span, how, notes + more_notes, context)

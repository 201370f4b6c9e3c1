"""``longvt``: LongVT (EvolvingLMMs-Lab/LongVT), long-video reasoning with native ``crop_video`` tool calls.

Taken from the agent's own code (github.com/EvolvingLMMs-Lab/LongVT):

* ``examples/eval/single_inference.py`` (the published inference path, "parameters align with eval
  benchmark settings"): the tool ``crop_video(video_path, start_time, end_time)`` in seconds; the video goes
  to the model as frames at 1 fps (at most 512, each at most 224x224 pixels) followed by the text
  ``"{question} {TOOL_PROMPT} The Video path for this video is: {video_path}"``; no system message (the chat
  template writes the tool block); every tool call of a turn runs; each result is a ``tool`` message: the
  clip's frames (1 fps, at most 128, 224x224 pixels, ``qwen_vl_utils.fetch_video``) then
  ``"Cropped {start_time}s-{end_time}s, got {n} frames."``, or ``"Error: <message>"``; an ``end_time`` past
  the end is clipped, a ``start_time`` at or past it is an error; at most 5 tool rounds; the answer is in
  ``<answer>``. A turn whose calls the Hermes parser cannot read has no calls, so it ends the episode.
* ``examples/video_tools/mcp_server.py``: the argument checks (``start_time must be non-negative``,
  ``end_time (...) must be greater than start_time (...)``).
* ``examples/eval/tool_call_qwen2_5_vl.jinja``: how a tool message is rendered: ``<|im_start|>user<tool_response>\\n``
  + frames + text + ``</tool_response><|im_end|>``.

Mapping: ``crop_video`` -> vagent ``sample_frames`` at ``fps=1`` on the video whose path the call names.
Differences (all where vagent keeps one chat template for every profile): the tool turn is a user turn of the
checkpoint's template (``<|im_start|>user\\n<tool_response>\\n...</tool_response><|im_end|>\\n``: one newline
after ``user`` and after ``<|im_end|>`` that LongVT's compact template leaves out), and several calls in one turn
become several user turns where LongVT's template merges them into one. Frames sit at the centres of 1 s
segments (``ceil(length)`` of them) where qwen-vl-utils takes an even count spread from start to end.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.media import MediaError, probe_video, read_frames, resize_to_budget, uniform_timestamps
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "LongVTProfile"]

CROP_VIDEO_TOOL = {
    "type": "function",
    "function": {
        "name": "crop_video",
        "description": "Crop a video to a specified duration. Use this tool to zoom in on specific time segments for "
        "detailed analysis.",
        "parameters": {
            "type": "object",
            "properties": {
                "video_path": {"type": "string", "description": "Path to the video file"},
                "start_time": {"type": "number", "description": "Start time in seconds"},
                "end_time": {"type": "number", "description": "End time in seconds"},
            },
            "required": ["video_path", "start_time", "end_time"],
        },
    },
}
# tool_call_qwen2_5_vl.jinja with tools and no system message (HF's tojson: ", " and ": " separators).
SYSTEM_PROMPT = (
    "You are a helpful assistant.\n# Tools\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    + json.dumps(CROP_VIDEO_TOOL, ensure_ascii=False)
    + "</tools>\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call>"
)
TOOL_PROMPT = (
    "Think first, call **crop_video** if needed, then answer. "
    "Format strictly as: <think>...</think> <tool_call>...</tool_call> (if needed) <answer>...</answer>."
)
PROMPT_FPS, PROMPT_MAX_FRAMES, FRAME_MAX_PIXELS, FRAME_MIN_PIXELS = 1.0, 512, 224 * 224, 28 * 28
CLIP_MAX_FRAMES = 128

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class LongVTProfile:
    """LongVT's protocol (see the module docstring)."""

    name = "longvt"
    stop_strings: tuple[str, ...] = ()  # the OpenAI-style loop reads whole turns
    inline = False
    # the prompt's frames plus 5 rounds of at most 128 frames each
    limits = AgentLimits(max_turns=6, max_images=PROMPT_MAX_FRAMES + 5 * CLIP_MAX_FRAMES, frame_max_pixels=FRAME_MAX_PIXELS,
                         max_frames=CLIP_MAX_FRAMES)  # fmt: skip
    tools = ("sample_frames",)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        shown = [frame for path in videos[:1] for frame in _video_frames(path, frames)]
        path = videos[0] if videos else ""
        text = f"{question} {TOOL_PROMPT} The Video path for this video is: {path}"
        user = Message("user", [*image_parts([*images, *shown]), ContentPart("text", text)])
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        bodies = _TOOL_CALL.findall(text)
        calls = []
        for body in bodies:
            try:
                data = json.loads(body.strip())
                calls.append(ToolCall(data["name"], data.get("arguments", {}), body.strip()))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                # vLLM's Hermes parser: an unreadable call leaves the whole turn as plain text (no calls).
                turn.errors.append(ParseError("bad_json", f"the Hermes parser cannot read {body.strip()!r}: {e}"))
                calls = []
                break
        if calls and not turn.errors:
            turn.actions, turn.tool_calls = list(calls), calls
            return turn
        answers = _ANSWER.findall(text)
        turn.answer = answers[-1].strip() if answers else None
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return "sample_frames" if call.name == "crop_video" else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._crop_video(a, context) if isinstance(a, ToolCall) else Observation(f"Error: {a.message}", error=a.kind)
                for a in parsed.actions]  # fmt: skip

    def _crop_video(self, call: ToolCall, context: ToolContext) -> Observation:
        if call.name != "crop_video":
            return Observation(text=f"Unknown tool: {call.name}", error="unknown_tool")
        args = call.arguments
        for key in ("video_path", "start_time", "end_time"):
            if args.get(key) is None:
                return Observation(text=f"Error: {key} parameter is required", error="bad_arguments")
        start, end, path = args["start_time"], args["end_time"], args["video_path"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (start, end)):
            return Observation(text="Error: start_time and end_time must be numbers of seconds", error="bad_arguments")
        index = _video_index(str(path), context.videos)
        if index is None:
            return Observation(text=f"Error: Video file not found: {path}", error="bad_arguments")
        if start < 0:
            return Observation(text=f"Error: start_time must be non-negative, got {start}", error="bad_span")
        if end <= start:
            return Observation(text=f"Error: end_time ({end}) must be greater than start_time ({start})",
                               error="bad_span")  # fmt: skip
        try:
            duration = probe_video(context.videos[index]).duration
        except MediaError as e:
            return Observation(text=f"Error: Cannot open video: {path} ({e})", error="bad_video")
        if start >= duration:
            return Observation(text=f"Error: start_time ({start}s) exceeds video duration ({duration:.2f}s)",
                               error="bad_span")  # fmt: skip
        clipped = min(end, duration)
        request = {"start": start, "end": clipped, "fps": 1.0, "video_index": index}
        result = run_tool("sample_frames", request, original_context(context, self.limits))
        if not result.ok:
            return Observation(text=f"Error: {result.text}", error=result.error, metadata=result.metadata)
        # The text quotes the arguments as the model wrote them (single_inference.py's f-string).
        text = f"Cropped {start}s-{end}s, got {len(result.images)} frames."
        return Observation(text=text, images=result.images, timestamps=result.timestamps, metadata=result.metadata)

    def observation_message(self, observation: Observation) -> Message:
        parts = [ContentPart("text", "<tool_response>\n"), *image_parts(observation.images)]
        return Message("user", [*parts, ContentPart("text", observation.text), ContentPart("text", "</tool_response>")])

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def _video_index(path: str, videos: Sequence[str]) -> int | None:
    """The episode video a call's ``video_path`` names: the same path, else the same file name."""
    for i, video in enumerate(videos):
        if path == video or os.path.normpath(path) == os.path.normpath(video):
            return i
    names = [os.path.basename(v) for v in videos]
    return names.index(os.path.basename(path)) if os.path.basename(path) in names else None


def _video_frames(path: str, count: int | None = None) -> list[Image.Image]:
    """The prompt's view of a video: ``count`` frames spread evenly (a frame budget's draw), by default 1 fps (at
    most 512 frames); each within 224x224 pixels."""
    try:
        duration = probe_video(path).duration
        if count is None:
            count = max(1, min(PROMPT_MAX_FRAMES, round(duration * PROMPT_FPS)))
        frames, _ = read_frames(path, uniform_timestamps(0.0, duration, count))
    except MediaError:
        return []
    return [resize_to_budget(f, min_pixels=FRAME_MIN_PIXELS, max_pixels=FRAME_MAX_PIXELS) for f in frames]


PROFILE = LongVTProfile()

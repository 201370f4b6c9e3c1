"""``vagent``: vagent's own protocol (``vagent.chat``): Hermes ``<tool_call>`` JSON naming vagent's tools directly,
boxes in the frame the model sees (``Policy.coord_convention``), every call of a turn runs, one ``tool`` turn
per call (images, then text), answers in ``<answer>``. This profile only forwards to ``vagent.chat`` and
``vagent.toolbox``, so choosing it changes nothing against the engine before profiles existed.

A video reaches the prompt as its name and length only, or, under a frame budget, as that many frames with their
times (sized like the video tools' frames): the first view, after which the video tools show the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts
from vagent.chat import ParsedTurn, ParseError, observation_content, parse_turn, system_prompt
from vagent.media import MediaError, probe_video, read_frames, resize_to_budget, uniform_timestamps
from vagent.toolbox import TOOLS as _TOOLS
from vagent.toolbox import ToolContext, call_tool, tool_schemas
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "VagentProfile"]


class VagentProfile:
    """vagent's own protocol (see the module docstring)."""

    name = "vagent"
    stop_strings = ("</tool_call>", "</answer>")
    inline = False
    limits = AgentLimits(max_turns=4)
    tools = tuple(_TOOLS)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        if frames is None:
            content = [*image_parts(images), ContentPart("text", video_lines(videos) + question)]
        else:
            views = [part for index, path in enumerate(videos) for part in first_view(index, path, frames)]
            content = [*image_parts(images), *views, ContentPart("text", question)]
        return [Message.text("system", system_prompt(tool_schemas(list(tools)))), Message("user", content)]

    def parse(self, text: str) -> ParsedTurn:
        return parse_turn(text)

    def tool_for(self, call: ToolCall) -> str | None:
        return call.name if call.name in _TOOLS else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        observations = []
        for action in parsed.actions:
            if isinstance(action, ParseError):
                observations.append(Observation(text=action.message + ".", error=action.kind))
            else:
                observations.append(call_tool(action, context, offered=list(offered)))
        return observations

    def observation_message(self, observation: Observation) -> Message:
        """A ``tool`` turn exactly as ``observation_content`` lays it out (frames preceded by their time)."""
        images = iter(observation.images)
        stamps = iter(observation.timestamps or [])
        parts = []
        for item in observation_content(observation):
            if item["type"] == "image":
                stamp = next(stamps, None)
                parts.append(ContentPart("image", image=next(images), timestamps=None if stamp is None else [stamp]))
            else:
                parts.append(ContentPart("text", item["text"]))
        return Message("tool", parts)

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def video_lines(videos: Sequence[str]) -> str:
    """Tell the policy which videos its video tools can read, and how long they are. The frames themselves
    come only through the tools (the prompt holds no video tokens)."""
    lines = []
    for index, path in enumerate(videos):
        try:
            lines.append(f"Video {index}: {probe_video(path).duration:.1f} s long.\n")
        except MediaError:
            lines.append(f"Video {index}: unreadable.\n")  # the video tools will say why, as observations
    return "".join(lines)


def first_view(index: int, path: str, frames: int) -> list[ContentPart]:
    """Video ``index`` as a frame budget shows it in the prompt: its length, then ``frames`` frames spread evenly
    (at segment centres), each preceded by its time and sized like a video tool's frames, as a tool turn lays out
    the frames it returns."""
    try:
        duration = probe_video(path).duration
        images, times = read_frames(path, uniform_timestamps(0.0, duration, frames))
    except MediaError:
        return [ContentPart("text", f"Video {index}: unreadable.\n")]  # the video tools will say why
    parts = [ContentPart("text", f"Video {index}: {duration:.1f} s long; {len(images)} frames of it:\n")]
    for image, time in zip(images, times, strict=True):
        sized = resize_to_budget(image, min_pixels=ToolContext.min_pixels, max_pixels=ToolContext.frame_max_pixels)
        parts += [ContentPart("text", f"t={time:.2f}s"), ContentPart("image", image=sized, timestamps=[time])]
    return [*parts, ContentPart("text", "\n")]


PROFILE = VagentProfile()

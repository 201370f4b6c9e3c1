"""The interface every agent profile implements, and the helpers several profiles share.

A profile is one published agent's protocol: how its prompt reads, how its model writes calls, which
vagent tool each call runs (with the agent's coordinates converted to original pixels by
``vagent.geometry``), how the result goes back to the model, how the answer is read, and its limits.
The engine, the encoder and the toolbox are the same for every profile, so token-in/token-out holds
for all of them: a profile only decides text (what is parsed, what is forced), never tokens.

Parsing never raises: what a profile cannot read becomes a ``ParseError`` in ``ParsedTurn.actions``,
which ``act`` turns into an error observation written the way the agent's own code writes its errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from vagent.chat import ParsedTurn, ParseError
from vagent.media import resize_to_budget
from vagent.toolbox import ToolContext, call_tool
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = [
    "AgentLimits",
    "AgentProfile",
    "image_parts",
    "last_boxed",
    "original_context",
    "run_tool",
    "sized",
]


@dataclass(frozen=True)
class AgentLimits:
    """An agent's own limits, from its code (each profile cites where).

    Attributes:
        max_turns: Assistant turns per episode the agent's loop allows (the rollout's default for the profile).
        max_images: Images per episode, prompt included (the rollout's default for the profile).
        max_calls: Tool calls per episode; a turn that would exceed it ends the episode (stop reason ``max_calls``;
            with the rollout's ``max_tool_calls`` the smaller applies). None = no cap.
        tool_max_pixels: Pixel cap of an image a tool returns (crop, rotation); None = the policy's budget.
        tool_min_pixels: Smallest region a crop cuts (vagent grows smaller boxes to this area); None = the policy's
            minimum. Agents that validate box sizes themselves (DeepEyes, Pixel-Reasoner) set 28x28, so the region
            is exactly the box they accepted.
        frame_max_pixels: Pixel cap of each video frame a tool returns; None = the toolbox default.
        max_frames: Most frames one video call returns; None = the toolbox default.
    """

    max_turns: int = 4
    max_images: int = 8
    max_calls: int | None = None
    tool_max_pixels: int | None = None
    tool_min_pixels: int | None = None
    frame_max_pixels: int | None = None
    max_frames: int | None = None


class AgentProfile(Protocol):
    """One agent's protocol. A new profile is one module implementing this plus one entry in ``PROFILES``.

    Attributes:
        name: The profile's name (``--agent NAME``).
        stop_strings: Besides EOS, texts that end a sampled turn (``</tool_call>`` for vagent; none for agents
            whose loop reads a whole turn, e.g. DeepEyes, where only the last call of a turn runs).
        inline: Tool results continue the same assistant turn (Tool-Star's ``<result>``) instead of a new turn.
        limits: The agent's own limits.
        tools: The vagent tools the profile's calls can run (for docs and ``vagent tools parse``).
    """

    name: str
    stop_strings: tuple[str, ...]
    inline: bool
    limits: AgentLimits
    tools: tuple[str, ...]

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        """The system/user messages an episode starts from (image parts in the order the model sees them).
        ``frames``: how many frames of each video the prompt shows (the rollout's frame budget); None = the agent's
        own view. Profiles that show no video frames ignore it; one whose tools cannot show the frames it would
        leave out raises ``ValueError``."""
        ...

    def parse(self, text: str) -> ParsedTurn:
        """One assistant turn (including any pre-filled text). ``actions`` holds only the calls that run,
        each named as the agent wrote it; never raises."""
        ...

    def tool_for(self, call: ToolCall) -> str | None:
        """The vagent tool a native call runs, or None (not available in vagent, e.g. OCR)."""
        ...

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        """Run the turn's actions; one observation each, its text already in the agent's wording. Never raises.
        Reads only ``parsed.actions`` and never changes ``context``: the engine runs a turn's calls concurrently, one
        action per ``act``, every one on the images from before the turn."""
        ...

    def observation_message(self, observation: Observation) -> Message:
        """The turn that carries an observation back (role, wrapper tags, text around images)."""
        ...

    def prefill(self, turn: int) -> str:
        """Text forced at the start of assistant turn ``turn`` (1-based), e.g. DeepEyesV2's ``<think>``."""
        ...

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        """Character spans of gold assistant turn ``turn`` (1-based) that the agent's loop forces, not the model
        (pre-filled text, inline results): the encoder masks them out of the SFT loss."""
        ...


def original_context(context: ToolContext, limits: AgentLimits) -> ToolContext:
    """A copy of ``context`` whose tools read boxes in original pixels, with the agent's output caps."""
    changes: dict[str, Any] = {"convention": "original"}
    if limits.tool_min_pixels is not None:
        changes["min_pixels"] = limits.tool_min_pixels
    if limits.tool_max_pixels is not None:
        changes["max_pixels"] = max(context.min_pixels, min(context.max_pixels, limits.tool_max_pixels))
    if limits.frame_max_pixels is not None:
        changes["frame_max_pixels"] = max(context.min_pixels, min(context.frame_max_pixels, limits.frame_max_pixels))
    if limits.max_frames is not None:
        changes["max_frames"] = limits.max_frames
    return dataclasses.replace(context, **changes)


def run_tool(name: str, arguments: dict[str, Any], context: ToolContext, raw: str = "") -> Observation:
    """Run vagent tool ``name`` (schema-checked; never raises). The caller converted coordinates already."""
    return call_tool(ToolCall(name=name, arguments=arguments, raw=raw), context)


def sized(image: Image.Image, min_pixels: int, max_pixels: int, factor: int = 28) -> Image.Image:
    """``image`` resized the way the agent's code resizes a tool output before the processor sees it."""
    return resize_to_budget(image, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)


def image_parts(images: Sequence[Image.Image | str]) -> list[ContentPart]:
    """Image content parts for in-memory images or paths."""
    return [ContentPart("image", image=img) if isinstance(img, Image.Image) else ContentPart("image", path=str(img))
            for img in images]  # fmt: skip


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (braces balanced), or None.

    >>> last_boxed(r"so \boxed{a} no, \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unclosed


def error_action(kind: str, message: str) -> ParseError:
    """A call that could not be read, to be answered with the agent's error text."""
    return ParseError(kind, message)


def tag_spans(text: str, open_tag: str, close_tag: str) -> list[tuple[int, int]]:
    """Spans ``[start, end)`` of every ``open_tag ... close_tag`` block, tags included."""
    pattern = re.compile(re.escape(open_tag) + r".*?" + re.escape(close_tag), re.DOTALL)
    return [m.span() for m in pattern.finditer(text)]

"""Gold trajectories built with the real tools, so SFT teaches exactly the round trip the policy meets in RL."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PIL import Image

from vagent.chat import observation_content
from vagent.geometry import Convention, original_to_model
from vagent.media import smart_resize
from vagent.toolbox import ToolContext, call_tool
from vagent.types import ToolCall

__all__ = ["crop_then_answer", "model_box", "tool_turn"]


def model_box(box, image_size: tuple[int, int], *, min_pixels: int, max_pixels: int, factor: int,
              convention: Convention) -> list[int]:  # fmt: skip
    """An original-pixel box in the frame the policy sees (what it writes in a tool call or an answer)."""
    width, height = image_size
    seen_height, seen_width = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
    return [round(v) for v in original_to_model(box, convention, (seen_width, seen_height), image_size)]


def crop_then_answer(image: Image.Image, box, crop_path: Path, *, look: str, read: str, answer: str, margin: int,
                     min_pixels: int, max_pixels: int, factor: int, convention: Convention) -> list[dict]:  # fmt: skip
    """Three gold turns: think ``look`` and crop ``box`` (original pixels, grown by ``margin``), the tool turn the
    engine would show (the real ``crop`` output, saved next to ``crop_path`` as ``<stem>-0.png``), then think
    ``read`` and answer."""
    region = (box[0] - margin, box[1] - margin, box[2] + margin, box[3] + margin)
    height, width = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
    seen = (width, height)  # the frame the policy sees; only its size matters here
    bbox = [round(v) for v in original_to_model(region, convention, seen, image.size)]
    context = ToolContext(images=[image], model_sizes=[seen], convention=convention, min_pixels=min_pixels,
                          max_pixels=max_pixels, image_factor=factor)  # fmt: skip
    call, tool = tool_turn("crop", {"bbox": bbox}, context, crop_path.with_suffix(""))
    return [
        {"role": "assistant", "content": f"<think>{look}</think>\n{call}"},
        tool,
        {"role": "assistant", "content": f"<think>{read}</think>\n<answer>{answer}</answer>"},
    ]


def tool_turn(name: str, arguments: dict, context: ToolContext, image_stem: Path,
              first_image: int | None = None) -> tuple[str, dict]:  # fmt: skip
    """Run a real tool call and return (the ``<tool_call>`` text, the tool turn as row ``messages`` render it):
    the parts in ``observation_content`` order (frame times included, the images labelled with their indices as the
    engine labels them), each image saved as ``<image_stem>-<k>.png`` (k = the part's position). ``first_image``: the
    episode's index of the call's first image (default: right after ``context.images``). A failing call is a builder
    bug and raises."""
    observation = call_tool(ToolCall(name, arguments), context)
    if observation.error:
        raise RuntimeError(f"the gold {name} call failed: {observation.text}")
    observation = dataclasses.replace(
        observation, first_image=len(context.images) if first_image is None else first_image
    )
    images = iter(observation.images)
    content = []
    for k, part in enumerate(observation_content(observation)):
        if part["type"] == "image":
            path = image_stem.with_name(f"{image_stem.name}-{k}.png")
            next(images).save(path)
            part = {"type": "image", "path": str(path)}
        content.append(part)
    return call_text(name, arguments), {"role": "tool", "content": content}


def call_text(name: str, arguments: dict) -> str:
    """A gold call as the policy writes it: its JSON (``call_json``) inside ``<tool_call>`` tags."""
    return f"<tool_call>\n{call_json(name, arguments)}\n</tool_call>"


def call_json(name: str, arguments: dict) -> str:
    """A gold call's JSON, as ``<tool_call>`` holds it."""
    return json.dumps({"name": name, "arguments": arguments})

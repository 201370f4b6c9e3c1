"""Gold trajectories built with the real tools, so SFT teaches exactly the round trip the policy meets in RL."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from vagent.chat import observation_content
from vagent.geometry import Convention, original_to_model
from vagent.media import resize_to_budget
from vagent.toolbox import ToolContext, call_tool
from vagent.types import ToolCall

__all__ = ["crop_then_answer", "model_box"]


def model_box(box, image_size: tuple[int, int], *, min_pixels: int, max_pixels: int, factor: int,
              convention: Convention) -> list[int]:  # fmt: skip
    """An original-pixel box in the frame the policy sees (what it writes in a tool call or an answer)."""
    width, height = image_size
    probe = Image.new("RGB", (width, height))  # only the size matters for the resize rule
    seen = resize_to_budget(probe, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor).size
    return [round(v) for v in original_to_model(box, convention, seen, image_size)]


def crop_then_answer(image: Image.Image, box, crop_path: Path, *, look: str, read: str, answer: str, margin: int,
                     min_pixels: int, max_pixels: int, factor: int, convention: Convention) -> list[dict]:  # fmt: skip
    """Three gold turns: think ``look`` and crop ``box`` (original pixels, grown by ``margin``), the tool turn the
    engine would show (the real ``crop`` output saved to ``crop_path``), then think ``read`` and answer."""
    region = (box[0] - margin, box[1] - margin, box[2] + margin, box[3] + margin)
    seen = resize_to_budget(image, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor).size
    bbox = [round(v) for v in original_to_model(region, convention, seen, image.size)]
    context = ToolContext(images=[image], model_sizes=[seen], convention=convention, min_pixels=min_pixels,
                          max_pixels=max_pixels, image_factor=factor)  # fmt: skip
    observation = call_tool(ToolCall("crop", {"bbox": bbox}), context)
    if observation.error:  # a builder bug, not a data property: fail loudly
        raise RuntimeError(f"the gold crop failed: {observation.text}")
    observation.images[0].save(crop_path)
    content = [{"type": "image", "path": str(crop_path)} if part["type"] == "image" else part
               for part in observation_content(observation)]  # fmt: skip
    call = f'<tool_call>\n{{"name": "crop", "arguments": {{"bbox": {bbox}}}}}\n</tool_call>'
    return [
        {"role": "assistant", "content": f"<think>{look}</think>\n{call}"},
        {"role": "tool", "content": content},
        {"role": "assistant", "content": f"<think>{read}</think>\n<answer>{answer}</answer>"},
    ]

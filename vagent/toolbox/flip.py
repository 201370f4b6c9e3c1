"""``flip``: mirror an image left-right or top-bottom, e.g. to read mirrored text.

An exact pixel transpose, then resized within the model's pixel budget. Guards against: a bad
``image_index``; an unknown direction is rejected by the schema's enum. Does not guard against:
the resolution lost when a huge original is reduced to fit the model's pixel budget.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import fit, pick_image, workable
from vagent.types import Observation

NAME = "flip"
_TRANSPOSES = {"horizontal": Image.Transpose.FLIP_LEFT_RIGHT, "vertical": Image.Transpose.FLIP_TOP_BOTTOM}
SCHEMA = {
    "name": NAME,
    "description": "Mirror an image: `horizontal` swaps left and right, `vertical` swaps top and bottom. "
    "The result is a new image.",
    "parameters": {
        "type": "object",
        "properties": {
            "direction": {"type": "string", "enum": list(_TRANSPOSES), "description": "horizontal or vertical."},
            "image_index": {"type": "integer", "description": "Which image to flip (0 = the first). Default 0."},
        },
        "required": ["direction"],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    direction = arguments["direction"]
    out = fit(workable(image, context).transpose(_TRANSPOSES[direction]), context)
    swapped = "left and right" if direction == "horizontal" else "top and bottom"
    text = f"image {index} flipped {direction}ly ({swapped} swapped); {out.width}x{out.height} pixels."
    return Observation(text=text, images=[out], metadata={"image_index": index, "direction": direction})

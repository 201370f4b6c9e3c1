"""``crop``: cut a region out of an image at full resolution, so looking closer reveals real detail.

The box is in the frame the model sees (see ``vagent.geometry``); it is mapped to original pixels
and cut there, then resized within the model's pixel budget. Guards against: reversed corners
(swapped), boxes past the edges (clipped), NaN/inf, boxes outside the image or with zero area
(rejected with a message), and boxes smaller than the processor's minimum (grown around their
centre, and said). Does not guard against: a box that is valid but pointless (e.g. the whole image).
"""

from __future__ import annotations

import math
from typing import Any

from vagent.geometry import BoxError, expand_box, model_to_original, original_to_model, sanitize_box, to_pixel_box
from vagent.media import resize_to_budget
from vagent.toolbox.context import ToolContext
from vagent.types import Observation

NAME = "crop"
SCHEMA = {
    "name": NAME,
    "description": "Crop a region of an image to look at it closer. The box is [x1, y1, x2, y2] in the "
    "coordinates of the image as you see it.",
    "parameters": {
        "type": "object",
        "properties": {
            "bbox": {"type": "array", "items": {"type": "number"}, "description": "[x1, y1, x2, y2]"},
            "image_index": {"type": "integer", "description": "Which image to crop (0 = the first). Default 0."},
        },
        "required": ["bbox"],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    index = arguments.get("image_index", 0)
    if not 0 <= index < len(context.images):
        return Observation(
            text=f"image_index {index} does not exist; this episode has {len(context.images)} image(s).",
            error="bad_arguments",
        )
    image = context.images[index]
    model_w, model_h = context.model_sizes[index]
    frame_w, frame_h = (model_w, model_h) if context.convention == "absolute" else (1000, 1000)
    try:
        box, notes = sanitize_box(arguments["bbox"], frame_w, frame_h)
    except BoxError as e:
        return Observation(text=f"crop failed: {e}.", error="bad_box")
    original = model_to_original(box, context.convention, (model_w, model_h), image.size)
    # The crop is resized to at least min_pixels; demand that much source area so it is not upsampled from a speck.
    side = math.sqrt(context.min_pixels)
    grown = expand_box(original, side, side, image.width, image.height)
    if grown != original:
        notes.append(f"grown to the minimum size of {int(side)}x{int(side)} original pixels")
    pixel_box = to_pixel_box(grown, image.width, image.height)
    region = image.crop(pixel_box)
    out = resize_to_budget(
        region, min_pixels=context.min_pixels, max_pixels=context.max_pixels, factor=context.image_factor
    )
    shown = [round(v) for v in original_to_model(pixel_box, context.convention, (model_w, model_h), image.size)]
    text = f"Cropped region {shown} of image {index} ({region.width}x{region.height} original pixels)."
    if notes:
        text += " Note: box " + "; ".join(notes) + "."
    return Observation(text=text, images=[out], metadata={"box_original": list(pixel_box), "image_index": index})

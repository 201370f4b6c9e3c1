"""``crop``: cut a region out of an image at full resolution, so looking closer reveals real detail.

The box is in the frame the model sees (see ``vagent.geometry``); it is mapped to original pixels
and cut there, then resized within the model's pixel budget. Guards against: reversed corners
(swapped), boxes past the edges (clipped), NaN/inf, boxes outside the image or with zero area
(rejected with a message), and boxes smaller than the processor's minimum (grown around their
centre, and said). Does not guard against: a box that is valid but pointless (e.g. the whole image).
"""

from __future__ import annotations

from typing import Any

from vagent.geometry import BoxError
from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import fit, grown_pixel_box, pick_image, shown_box
from vagent.types import Observation

NAME = "crop"
SCHEMA = {
    "name": NAME,
    "description": "Crop a region of an image to look at it closer. The box is [x1, y1, x2, y2] in the "
    "coordinates of the image as you see it.",
    "parameters": {
        "type": "object",
        "properties": {
            "bbox": {
                "type": "array",
                "items": {"type": "number"},
                "minItems": 4,
                "maxItems": 4,
                "description": "[x1, y1, x2, y2]",
            },
            "image_index": {"type": "integer", "description": "Which image to crop (0 = the first). Default 0."},
        },
        "required": ["bbox"],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    try:
        pixel_box, notes = grown_pixel_box(arguments["bbox"], index, image, context)
    except BoxError as e:
        return Observation(text=f"crop failed: {e}.", error="bad_box")
    region = image.crop(pixel_box)
    out = fit(region, context)
    shown = shown_box(pixel_box, index, image, context)
    text = f"cropped region {shown} of image {index} ({region.width}x{region.height} original pixels)."
    if notes:
        text += " Note: box " + "; ".join(notes) + "."
    return Observation(text=text, images=[out], metadata={"box_original": list(pixel_box), "image_index": index})

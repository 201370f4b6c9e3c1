"""``zoom_in``: cut a region from the full-resolution image and show it ``factor`` times larger than it
appeared in the model's view, so small text and objects become legible.

The box is in the frame the model sees (see ``vagent.geometry``); it is mapped to original pixels and cut
there. Guards against: reversed corners (swapped), boxes past the edges (clipped), NaN/inf, boxes outside
the image or with zero area (rejected), boxes smaller than the processor's minimum (grown around their
centre), NaN factors (rejected), and factors that would exceed the pixel budget (limited, and said).
Does not guard against: zooming past the original's resolution (allowed: the result is interpolated and
the text says so), or a valid but pointless box.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from vagent.geometry import BoxError, original_to_model
from vagent.media import MediaError, smart_resize
from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import grown_pixel_box, pick_image, shown_box
from vagent.types import Observation

NAME = "zoom_in"
MAX_FACTOR = 8.0
SCHEMA = {
    "name": NAME,
    "description": "Zoom into a region of an image: the region is cut from the full-resolution image and shown "
    "`factor` times larger than it appears to you. The box is [x1, y1, x2, y2] in the coordinates of the image "
    "as you see it.",
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
            "factor": {
                "type": "number",
                "minimum": 1,
                "maximum": MAX_FACTOR,
                "description": f"Magnification, 1 to {MAX_FACTOR:g}. Default 2.",
            },
            "image_index": {"type": "integer", "description": "Which image to zoom into (0 = the first). Default 0."},
        },
        "required": ["bbox"],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    factor = float(arguments.get("factor", 2.0))
    if not math.isfinite(factor):  # NaN passes the schema's minimum/maximum (every comparison is False)
        return Observation(
            text=f"factor must be a number from 1 to {MAX_FACTOR:g}, got {factor}.", error="bad_arguments"
        )
    try:
        pixel_box, box_notes = grown_pixel_box(arguments["bbox"], index, image, context)
    except BoxError as e:
        return Observation(text=f"zoom_in failed: {e}.", error="bad_box")
    notes = ["box " + "; ".join(box_notes)] if box_notes else []
    region = image.crop(pixel_box)
    # How large the region looked to the model, in pixels of its view, whatever the box convention.
    vx1, vy1, vx2, vy2 = original_to_model(pixel_box, "absolute", context.model_sizes[index], image.size)
    want_w, want_h = (vx2 - vx1) * factor, (vy2 - vy1) * factor
    try:
        out_h, out_w = smart_resize(
            max(1, round(want_h)),
            max(1, round(want_w)),
            min_pixels=context.min_pixels,
            max_pixels=context.max_pixels,
            factor=context.image_factor,
        )
    except MediaError as e:
        return Observation(text=f"zoom_in failed: the region is too thin to show ({e}).", error="bad_box")
    out = region.resize((out_w, out_h), Image.Resampling.LANCZOS)
    achieved = out_w / (vx2 - vx1)
    if want_w * want_h > context.max_pixels:
        notes.append(f"factor {factor:g} limited to {achieved:.1f} by the image size limit")
    if out_w > region.width * 1.05:
        notes.append(f"the region has only {region.width}x{region.height} original pixels, so the zoom interpolates")
    shown = shown_box(pixel_box, index, image, context)
    text = (
        f"region {shown} of image {index} zoomed {achieved:.1f}x "
        f"({region.width}x{region.height} original pixels shown at {out_w}x{out_h})."
    )
    if notes:
        text += " Note: " + "; ".join(notes) + "."
    metadata = {"box_original": list(pixel_box), "image_index": index, "factor": achieved}
    return Observation(text=text, images=[out], metadata=metadata)

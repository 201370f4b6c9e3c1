"""What the image tools share: picking the image a call names, mapping its box to original pixels, and
sizing results for the model.

Guards against: an ``image_index`` that does not exist, boxes the model wrote badly (via
``geometry.sanitize_box``: reversed, past the edges, NaN, outside, zero area) and boxes smaller than the
processor's minimum (grown, and said). Does not guard against: ``model_sizes`` out of step with
``images`` (a rollout bug; the tool fails and ``call_tool`` reports it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from PIL import Image

from vagent.geometry import expand_box, model_to_original, original_to_model, sanitize_box, to_pixel_box
from vagent.media import resize_to_budget
from vagent.toolbox.context import ToolContext
from vagent.types import Observation

__all__ = ["fit", "grown_pixel_box", "model_frame", "pick_image", "shown_box", "to_original", "workable"]

# rotate/flip/draw work on at most this many times the output's pixels: finer detail would be thrown away by
# the final downscale anyway, and a 178-megapixel original would otherwise cost seconds and gigabytes per call.
WORK_PIXELS_PER_OUTPUT_PIXEL = 16


def pick_image(arguments: dict[str, Any], context: ToolContext) -> tuple[int, Image.Image] | Observation:
    """The ``(index, RGB original)`` a call's ``image_index`` (default 0) names, or an error observation."""
    index = arguments.get("image_index", 0)
    if not 0 <= index < len(context.images):
        return Observation(
            text=f"image_index {index} does not exist; this episode has {len(context.images)} image(s) "
            f"(0 to {len(context.images) - 1}).",
            error="bad_arguments",
        )
    index = int(index)  # JSON schema lets 1.0 pass as an integer; a list index must be an int
    image = context.images[index]
    return index, image if image.mode == "RGB" else image.convert("RGB")


def _pixel_frame(index: int, context: ToolContext) -> tuple[int, int]:
    """Size of the pixel frame boxes are written in: the model's view, or the original (``"original"``: the
    agent profiles that address original pixels, e.g. DeepEyes)."""
    return context.images[index].size if context.convention == "original" else context.model_sizes[index]


def model_frame(index: int, context: ToolContext) -> tuple[float, float]:
    """Width and height of the frame the model writes coordinates in for image ``index``."""
    if context.convention in ("absolute", "original"):
        width, height = _pixel_frame(index, context)
        return float(width), float(height)
    return 1000.0, 1000.0


def to_original(box: Sequence[float], index: int, context: ToolContext, size: tuple[int, int]) -> tuple[float, ...]:
    """Map a model-frame box (or a line ``x1, y1, x2, y2``) onto an image of ``size`` (the original, or a copy
    of it at another scale)."""
    # An original-pixel frame is a pixel frame like the model's view, only of the original's size.
    convention = "absolute" if context.convention == "original" else context.convention
    return model_to_original(box, convention, _pixel_frame(index, context), size)


def grown_pixel_box(
    bbox: object, index: int, image: Image.Image, context: ToolContext
) -> tuple[tuple[int, int, int, int], list[str]]:
    """Sanitize a model-written box, map it to original pixels and grow it to the processor's minimum side.

    Raises:
        BoxError: the box cannot be repaired (its message is for the model).
    """
    box, notes = sanitize_box(bbox, *model_frame(index, context))
    original = to_original(box, index, context, image.size)
    # The result is resized to at least min_pixels; demand that much source area so it is not upsampled from a speck.
    side = math.sqrt(context.min_pixels)
    grown = expand_box(original, side, side, image.width, image.height)
    if grown != original:
        notes.append(f"grown to the minimum size of {int(side)}x{int(side)} original pixels")
    return to_pixel_box(grown, image.width, image.height), notes


def shown_box(pixel_box: Sequence[float], index: int, image: Image.Image, context: ToolContext) -> list[int]:
    """An original-pixel box written back in the model's frame, rounded, for the observation text."""
    convention = "absolute" if context.convention == "original" else context.convention
    return [round(v) for v in original_to_model(pixel_box, convention, _pixel_frame(index, context), image.size)]


def fit(image: Image.Image, context: ToolContext) -> Image.Image:
    """Resize ``image`` the way the processor will, within the context's pixel budget and patch grid."""
    return resize_to_budget(
        image, min_pixels=context.min_pixels, max_pixels=context.max_pixels, factor=context.image_factor
    )


def workable(image: Image.Image, context: ToolContext) -> Image.Image:
    """``image``, box-reduced by an integer factor when it is far larger than any output (see the constant)."""
    k = math.isqrt(image.width * image.height // (WORK_PIXELS_PER_OUTPUT_PIXEL * context.max_pixels))
    return image.reduce(k) if k >= 2 else image

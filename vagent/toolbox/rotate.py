"""``rotate``: turn an image counter-clockwise, e.g. to read sideways or upside-down text.

Multiples of 90 degrees are exact pixel transposes (nothing lost, the whole image kept); other angles are
resampled (bicubic) with the uncovered corners filled black, and either grow the canvas to keep the whole
image (``expand``, the default) or keep the old size and cut the corners off. Guards against: NaN/inf
angles (rejected), angles outside [0, 360) (taken modulo 360), a bad ``image_index``. Does not guard
against: the resolution lost when a huge original is reduced to fit the model's pixel budget.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import fit, pick_image, workable
from vagent.types import Observation

NAME = "rotate"
SCHEMA = {
    "name": NAME,
    "description": "Rotate an image counter-clockwise by `angle` degrees (use a negative angle for clockwise), "
    "e.g. to read rotated or upside-down text. The result is a new image.",
    "parameters": {
        "type": "object",
        "properties": {
            "angle": {"type": "number", "description": "Degrees, counter-clockwise (90 = quarter turn left)."},
            "image_index": {"type": "integer", "description": "Which image to rotate (0 = the first). Default 0."},
            "expand": {
                "type": "boolean",
                "description": "For angles that are not multiples of 90: true (default) enlarges the canvas to keep "
                "the whole image; false keeps the original size and cuts off the corners.",
            },
        },
        "required": ["angle"],
    },
}
# PIL's ROTATE_* transposes turn counter-clockwise, like ``angle``.
_QUARTER_TURNS = {1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180, 3: Image.Transpose.ROTATE_270}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    angle = float(arguments["angle"])
    if not math.isfinite(angle):
        return Observation(text=f"angle must be a finite number of degrees, got {angle}.", error="bad_arguments")
    expand = bool(arguments.get("expand", True))
    angle %= 360.0
    work = workable(image, context)
    quarters = round(angle / 90.0)
    if abs(angle - 90.0 * quarters) < 1e-6:  # 90, 180, 270 (and 360 == 0): exact, lossless
        quarters %= 4
        rotated = work.transpose(_QUARTER_TURNS[quarters]) if quarters else work
        angle, how = 90.0 * quarters, "exact"
    else:
        rotated = work.rotate(angle, resample=Image.Resampling.BICUBIC, expand=expand, fillcolor=(0, 0, 0))
        how = "corners filled black" + ("" if expand else "; canvas kept at the old size, corners cut off")
    out = fit(rotated, context)
    signed = angle - 360.0 if angle > 180.0 else angle  # say 270 counter-clockwise as 90 clockwise
    turned = f"rotated {abs(signed):g} degrees {'counter-clockwise' if signed > 0 else 'clockwise'} ({how})"
    turned = turned if angle else "unchanged (the angle is a whole number of turns)"
    text = f"image {index} {turned}; {out.width}x{out.height} pixels."
    return Observation(text=text, images=[out], metadata={"image_index": index, "angle": angle})

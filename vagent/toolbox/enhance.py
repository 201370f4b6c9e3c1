"""``enhance``: adjust contrast, brightness and sharpness (and optionally stretch or equalize the histogram),
e.g. to read faint text or see into shadows.

Applied at the resolution the model will see (the image is resized within the pixel budget first):
sharpening a full-resolution original would be undone by the downscale that follows. Guards against:
NaN factors (rejected; the schema bounds the rest to [0, 4]), a bad ``image_index``, and a request that
changes nothing (answered "no change", still with the image). Does not guard against: settings that wash
the image out (brightness 4) or black it out (brightness 0); the model sees the result and can retry.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import ImageEnhance, ImageOps

from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import fit, pick_image
from vagent.types import Observation

NAME = "enhance"
MAX_ENHANCE = 4.0
_FACTORS = {
    "contrast": ImageEnhance.Contrast,
    "brightness": ImageEnhance.Brightness,
    "sharpness": ImageEnhance.Sharpness,
}
_FACTOR_HELP = {
    "contrast": "0 = flat grey, 1 = unchanged, 2 = twice the contrast.",
    "brightness": "0 = black, 1 = unchanged, 2 = twice as bright.",
    "sharpness": "0 = blurred, 1 = unchanged, 2 = sharpened.",
}
SCHEMA = {
    "name": NAME,
    "description": "Adjust an image's contrast, brightness and sharpness (1 = unchanged for each), optionally "
    "after stretching (autocontrast) or equalizing its histogram. The result is a new image.",
    "parameters": {
        "type": "object",
        "properties": {
            **{
                key: {"type": "number", "minimum": 0, "maximum": MAX_ENHANCE, "description": f"{help_} Default 1."}
                for key, help_ in _FACTOR_HELP.items()
            },
            "autocontrast": {
                "type": "boolean",
                "description": "Stretch the darkest pixel to black and the brightest to white first. Default false.",
            },
            "equalize": {
                "type": "boolean",
                "description": "Equalize the histogram first (strong; shows faint detail in dark or bright areas). "
                "Default false.",
            },
            "image_index": {"type": "integer", "description": "Which image to enhance (0 = the first). Default 0."},
        },
        "required": [],
    },
}


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    factors = {key: float(arguments.get(key, 1.0)) for key in _FACTORS}
    bad = [key for key, value in factors.items() if not math.isfinite(value)]
    if bad:  # NaN passes the schema's minimum/maximum (every comparison with NaN is False)
        return Observation(text=f"{', '.join(bad)} must be numbers from 0 to {MAX_ENHANCE:g}.", error="bad_arguments")
    out = fit(image, context)
    done = []
    # Histogram operations first, so the explicit factors fine-tune their result rather than being undone by it.
    for key, operation in (("autocontrast", ImageOps.autocontrast), ("equalize", ImageOps.equalize)):
        if arguments.get(key, False):
            out = operation(out)
            done.append(key)
    for key, value in factors.items():
        if value != 1.0:
            out = _FACTORS[key](out).enhance(value)
            done.append(f"{key} x{value:g}")
    what = ", ".join(done) if done else "no change (every setting was neutral)"
    text = f"image {index} enhanced: {what}; {out.width}x{out.height} pixels."
    return Observation(text=text, images=[out], metadata={"image_index": index, "applied": done})

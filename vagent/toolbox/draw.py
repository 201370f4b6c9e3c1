"""``draw``: annotate an image with boxes, points and lines (e.g. to mark counted objects or trace a path).

Coordinates are in the frame the model sees; ``vagent.geometry`` maps them onto a copy of the original, which
is drawn on (strokes ``STROKE`` pixels wide in the model's view) and resized within the pixel budget. Guards
against, per shape: wrong arity, NaN/inf, reversed or overhanging boxes (repaired, and said), shapes outside
the image or of zero size (skipped, and said); nothing drawable is an error; the schema caps each list at
``MAX_SHAPES``. Does not guard against: shapes hiding what the model wanted to see (the undrawn image stays).
"""

from __future__ import annotations

import math
from typing import Any

from PIL import ImageDraw, ImageFont

from vagent.geometry import BoxError, sanitize_box
from vagent.toolbox.context import ToolContext
from vagent.toolbox.image_args import fit, model_frame, pick_image, to_original, workable
from vagent.types import Observation

NAME = "draw"
MAX_SHAPES = 32
STROKE = 3  # stroke width in pixels of the model's view: thinner lines vanish in the downscale
COLORS = ["red", "green", "blue", "yellow", "cyan", "magenta", "white", "black"]  # names PIL knows


def _shapes(what: str) -> dict[str, Any]:
    # Arity is checked per shape in code, so one malformed shape is skipped instead of failing the whole call.
    item = {"type": "array", "items": {"type": "number"}}
    return {"type": "array", "maxItems": MAX_SHAPES, "items": item, "description": what}


SCHEMA = {
    "name": NAME,
    "description": "Draw boxes, points and lines on an image to annotate it; coordinates are in the image as you "
    "see it. The result is a new image.",
    "parameters": {
        "type": "object",
        "properties": {
            "boxes": _shapes("Rectangles [[x1, y1, x2, y2], ...]."),
            "points": _shapes("Dots [[x, y], ...]."),
            "lines": _shapes("Segments [[x1, y1, x2, y2], ...]."),
            "labels": {
                **_shapes("Text written at each box, in the order of `boxes`."),
                "items": {"type": "string", "maxLength": 40},
            },
            "color": {"type": "string", "enum": COLORS, "description": "Colour of all shapes. Default red."},
            "image_index": {"type": "integer", "description": "Which image to draw on (0 = the first). Default 0."},
        },
        "required": [],
    },
}


def _place(kind: str, shape: list[float], frame: tuple[float, float]) -> tuple[list[float] | None, list[str]]:
    """A shape as ``[x1, y1, x2, y2]`` in the model's frame (or ``None``) and notes on what was done to it."""
    if kind == "box":
        try:
            box, repairs = sanitize_box(shape, *frame)
        except BoxError as e:
            return None, [f"skipped: {e}"]
        return list(box), repairs
    n = 2 if kind == "point" else 4
    if len(shape) != n or not all(math.isfinite(v) for v in shape):
        return None, [f"skipped: needs {n} finite numbers, got {shape}"]
    if not all(0 <= x <= frame[0] and 0 <= y <= frame[1] for x, y in zip(shape[::2], shape[1::2], strict=True)):
        return None, [f"skipped: lies outside the image (width {frame[0]:g}, height {frame[1]:g})"]
    if kind == "line" and shape[:2] == shape[2:]:
        return None, ["skipped: has zero length"]
    return (shape * 2 if kind == "point" else list(shape)), []


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    picked = pick_image(arguments, context)
    if isinstance(picked, Observation):
        return picked
    index, image = picked
    boxes, points, lines = (arguments.get(k, []) for k in ("boxes", "points", "lines"))
    labels, color = arguments.get("labels", []), arguments.get("color", "red")
    if not (boxes or points or lines):
        return Observation(text="draw needs at least one of boxes, points or lines.", error="bad_arguments")
    canvas = workable(image, context).copy()  # never draw on the episode's own image
    # The result is shown at about the size the model saw this image at: scale strokes to that view.
    width = max(1, round(STROKE * canvas.width / context.model_sizes[index][0]))
    font = ImageFont.load_default(size=max(10, 5 * width))  # about 15 pixels tall in the model's view
    pen, frame, notes = ImageDraw.Draw(canvas), model_frame(index, context), []
    drawn = {"box": 0, "point": 0, "line": 0}
    for kind, shapes in (("box", boxes), ("point", points), ("line", lines)):
        for i, shape in enumerate(shapes):
            placed, remarks = _place(kind, shape, frame)
            notes += [f"{kind} {i} {r}" for r in remarks]
            if placed is None:
                continue
            x1, y1, x2, y2 = to_original(placed, index, context, canvas.size)
            if kind == "box":
                pen.rectangle((x1, y1, x2, y2), outline=color, width=width)
                if i < len(labels) and labels[i]:
                    # Above the box when there is room, else just inside it; the outline keeps it legible anywhere.
                    lift = font.getbbox(labels[i])[3] + 2 * width
                    at = (x1 + width, y1 - lift if y1 >= lift else y1 + width)
                    halo = "white" if color == "black" else "black"
                    pen.text(at, labels[i], fill=color, font=font, stroke_width=max(1, width // 2), stroke_fill=halo)
            elif kind == "point":
                r = 2 * width + 1
                pen.ellipse((x1 - r, y1 - r, x1 + r, y1 + r), fill=color, outline="black")
            else:
                pen.line((x1, y1, x2, y2), fill=color, width=width)
            drawn[kind] += 1
    if len(labels) > len(boxes):
        notes.append(f"{len(labels) - len(boxes)} label(s) beyond the {len(boxes)} box(es) ignored")
    if not any(drawn.values()):
        return Observation(text="draw failed: nothing could be drawn: " + "; ".join(notes) + ".", error="bad_shapes")
    out = fit(canvas, context)
    counts = ", ".join(f"{v} {k}{'' if v == 1 else 'es' if k == 'box' else 's'}" for k, v in drawn.items() if v)
    text = f"drew {counts} in {color} on image {index}; {out.width}x{out.height} pixels."
    if notes:
        text += " Note: " + "; ".join(notes) + "."
    return Observation(text=text, images=[out], metadata={"image_index": index, "drawn": drawn})

"""Boxes and time spans: overlap measures, clamping, and the one place coordinates change frame.

Conventions used everywhere in vagent:

* A box is ``(x1, y1, x2, y2)`` in continuous pixel coordinates: ``x2``/``y2`` are the right/bottom
  *edges*, so a box covering pixel columns 0..9 is ``(0, 0, 10, ...)`` and its width is ``x2 - x1``.
* The model sees a resized image. Qwen2.5-VL writes boxes in pixels of that resized image
  (``"absolute"``); Qwen2-VL and Qwen3-VL write them on a 0-1000 grid (``"norm1000"``).
  ``model_to_original`` / ``original_to_model`` are the only functions that convert between the
  frame the model sees and the original image, so a crop is always cut from full resolution.
* A span is ``(t0, t1)`` in seconds with ``t0 <= t1``.
* Published agents (``vagent.agents``) write coordinates in their own frames: ``"original"`` pixels of the
  unresized image (DeepEyes), 0-1 fractions with padding (Pixel-Reasoner, ``normalized_to_original``),
  a 0-1000 grid (Visual-ARFT, ``norm1000_to_original``) and 0-100 percent points (OpenThinkIMG,
  ``percent_to_original``). They are converted here too, never in the profiles.

Everything here is pure: floats in, floats out, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "Box",
    "BoxError",
    "Convention",
    "Span",
    "box_area",
    "clamp_box",
    "clamp_span",
    "expand_box",
    "giou",
    "iou",
    "model_to_original",
    "norm1000_to_original",
    "normalized_to_original",
    "original_to_model",
    "percent_to_original",
    "pixels_as_fractions",
    "sanitize_box",
    "span_iou",
    "to_pixel_box",
]

Box = tuple[float, float, float, float]
Span = tuple[float, float]
Convention = Literal["absolute", "norm1000", "original"]


class BoxError(ValueError):
    """A box that cannot be repaired (NaN, wrong length, entirely outside the image, zero area)."""


def box_area(box: Sequence[float]) -> float:
    """Area of ``box``; 0 for degenerate or reversed boxes. ``box_area((0, 0, 4, 2)) == 8``."""
    x1, y1, x2, y2 = box
    return max(0.0, x2 - x1) * max(0.0, y2 - y1)


def _intersection(a: Sequence[float], b: Sequence[float]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return max(0.0, w) * max(0.0, h)


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union in [0, 1]; 0 when either box is empty.

    >>> iou((0, 0, 2, 2), (1, 1, 3, 3))  # 1 / (4 + 4 - 1)
    0.14285714285714285
    """
    inter = _intersection(a, b)
    union = box_area(a) + box_area(b) - inter
    return inter / union if union > 0 else 0.0


def giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalized IoU in [-1, 1]: IoU minus the share of the enclosing box covered by neither box.

    Unlike IoU it still ranks disjoint boxes by distance, which gives a reward signal before overlap.

    >>> giou((0, 0, 1, 1), (2, 0, 3, 1))  # enclosing area 3, union 2
    -0.3333333333333333
    """
    inter = _intersection(a, b)
    union = box_area(a) + box_area(b) - inter
    enclose = box_area((min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])))
    if union <= 0 or enclose <= 0:
        return 0.0 if union <= 0 else inter / union
    return inter / union - (enclose - union) / enclose


def clamp_box(box: Sequence[float], width: float, height: float) -> Box:
    """Clip ``box`` to the image ``[0, width] x [0, height]`` (corners not reordered)."""
    x1, y1, x2, y2 = (float(v) for v in box)
    return (
        min(max(x1, 0.0), width),
        min(max(y1, 0.0), height),
        min(max(x2, 0.0), width),
        min(max(y2, 0.0), height),
    )


def sanitize_box(box: object, width: float, height: float) -> tuple[Box, list[str]]:
    """Repair a model-written box where that is unambiguous, and say what was done.

    Swaps reversed corners and clips to the image. Rejects (``BoxError``) what cannot be repaired:
    not four numbers, NaN/inf, no overlap with the image, or zero width/height.

    Args:
        box: Whatever the model wrote for a box.
        width: Image width in the same frame as ``box``.
        height: Image height in the same frame as ``box``.

    Returns:
        The repaired box and a list of notes (empty when the box was already valid).
    """
    if isinstance(box, (str, bytes)) or not isinstance(box, Sequence) or len(box) != 4:
        raise BoxError(f"a box must be 4 numbers [x1, y1, x2, y2], got {box!r}")
    try:
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError):
        raise BoxError(f"a box must be 4 numbers [x1, y1, x2, y2], got {box!r}") from None
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        raise BoxError(f"box coordinates must be finite numbers, got {list(box)!r}")
    notes = []
    if x1 > x2 or y1 > y2:
        x1, x2 = min(x1, x2), max(x1, x2)
        y1, y2 = min(y1, y2), max(y1, y2)
        notes.append("swapped reversed corners")
    if x2 <= 0 or y2 <= 0 or x1 >= width or y1 >= height:
        raise BoxError(f"box {[x1, y1, x2, y2]} lies outside the image (width {width:g}, height {height:g})")
    clamped = clamp_box((x1, y1, x2, y2), width, height)
    if clamped != (x1, y1, x2, y2):
        notes.append(f"clipped to the image bounds (width {width:g}, height {height:g})")
    if box_area(clamped) <= 0:
        raise BoxError(f"box {list(clamped)} has zero width or height")
    return clamped, notes


def expand_box(box: Sequence[float], min_width: float, min_height: float, width: float, height: float) -> Box:
    """Grow ``box`` around its centre to at least ``min_width`` x ``min_height``, staying inside the image.

    The box is shifted (not shrunk) when growing would cross an edge; if the image itself is smaller
    than the minimum, the whole image is returned.
    """
    x1, y1, x2, y2 = box

    def grow(lo: float, hi: float, need: float, limit: float) -> tuple[float, float]:
        need = min(need, limit)
        if hi - lo >= need:
            return lo, hi
        centre = (lo + hi) / 2
        lo, hi = centre - need / 2, centre + need / 2
        if lo < 0:
            lo, hi = 0.0, need
        if hi > limit:
            lo, hi = limit - need, limit
        return lo, hi

    x1, x2 = grow(x1, x2, min_width, width)
    y1, y2 = grow(y1, y2, min_height, height)
    return (x1, y1, x2, y2)


def to_pixel_box(box: Sequence[float], width: int, height: int) -> tuple[int, int, int, int]:
    """Smallest integer pixel box covering ``box`` (floor the top-left, ceil the bottom-right), clipped."""
    x1, y1, x2, y2 = clamp_box(box, width, height)
    return (math.floor(x1), math.floor(y1), math.ceil(x2), math.ceil(y2))


def model_to_original(
    box: Sequence[float], convention: Convention, model_size: tuple[int, int], original_size: tuple[int, int]
) -> Box:
    """Map a box from the frame the model sees to original-image pixels.

    Args:
        box: ``(x1, y1, x2, y2)`` as the model wrote it.
        convention: ``"absolute"`` (pixels of the resized image the model saw), ``"norm1000"``, or
            ``"original"`` (already in original pixels: returned unchanged).
        model_size: ``(width, height)`` of the image the model saw (after smart resize).
        original_size: ``(width, height)`` of the original image.

    >>> model_to_original((28, 56, 84, 112), "absolute", (448, 336), (1000, 750))
    (62.5, 125.0, 187.5, 250.0)
    """
    ow, oh = original_size
    if convention == "absolute":
        sx, sy = ow / model_size[0], oh / model_size[1]
    elif convention == "norm1000":
        sx, sy = ow / 1000.0, oh / 1000.0
    elif convention == "original":
        sx = sy = 1.0
    else:
        raise ValueError(f"unknown coordinate convention {convention!r}; expected 'absolute', 'norm1000' or 'original'")
    x1, y1, x2, y2 = box
    return (x1 * sx, y1 * sy, x2 * sx, y2 * sy)


def original_to_model(
    box: Sequence[float], convention: Convention, model_size: tuple[int, int], original_size: tuple[int, int]
) -> Box:
    """Inverse of ``model_to_original``: original-image pixels to the frame the model sees."""
    ow, oh = original_size
    if convention == "absolute":
        sx, sy = model_size[0] / ow, model_size[1] / oh
    elif convention == "norm1000":
        sx, sy = 1000.0 / ow, 1000.0 / oh
    elif convention == "original":
        sx = sy = 1.0
    else:
        raise ValueError(f"unknown coordinate convention {convention!r}; expected 'absolute', 'norm1000' or 'original'")
    x1, y1, x2, y2 = box
    return (x1 * sx, y1 * sy, x2 * sx, y2 * sy)


def normalized_to_original(
    box: Sequence[float], original_size: tuple[int, int], padding: tuple[float, float] = (0.0, 0.0)
) -> Box:
    """A box of 0-1 fractions of the image, grown by ``padding`` (fractions) on every side and clipped to
    ``[0, 1]``, in original pixels (Pixel-Reasoner's ``crop_image_normalized``: padding 0.1).

    Pixel-Reasoner reads a box whose four numbers are all below 1 as fractions and any other box as
    pixels of the image it crops, padded by the same fractions; both readings are this function
    (``pixels_as_fractions`` turns the second into the first).

    >>> normalized_to_original((0.2, 0.2, 0.4, 0.5), (1000, 500), (0.1, 0.1))
    (100.0, 50.0, 500.0, 300.0)
    """
    ow, oh = original_size
    px, py = padding
    x1, y1, x2, y2 = (float(v) for v in box)
    frac = (x1 - px, y1 - py, x2 + px, y2 + py)
    x1, y1, x2, y2 = (min(max(v, 0.0), 1.0) for v in frac)
    return (x1 * ow, y1 * oh, x2 * ow, y2 * oh)


def pixels_as_fractions(box: Sequence[float], size: tuple[int, int]) -> Box:
    """A pixel box of an image of ``size`` as 0-1 fractions. ``pixels_as_fractions((50, 0, 100, 25), (100, 50))
    == (0.5, 0.0, 1.0, 0.5)``."""
    w, h = size
    x1, y1, x2, y2 = (float(v) for v in box)
    return (x1 / w, y1 / h, x2 / w, y2 / h)


def norm1000_to_original(box: Sequence[float], original_size: tuple[int, int]) -> Box:
    """A box on the 0-1000 grid (Qwen2-VL, Visual-ARFT's questions) in original pixels.

    >>> norm1000_to_original((100, 200, 500, 1000), (640, 480))
    (64.0, 96.0, 320.0, 480.0)
    """
    return model_to_original(box, "norm1000", original_size, original_size)


def percent_to_original(point: Sequence[float], original_size: tuple[int, int]) -> tuple[float, float]:
    """A point ``(x, y)`` in 0-100 percent of the image's width and height (OpenThinkIMG's line tools and
    Molmo-style points) in original pixels.

    >>> percent_to_original((25, 50), (640, 480))
    (160.0, 240.0)
    """
    x, y = (float(v) for v in point)
    return (x / 100.0 * original_size[0], y / 100.0 * original_size[1])


def span_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Temporal IoU of two ``(t0, t1)`` spans in seconds; 0 when the union is empty.

    >>> span_iou((0, 10), (5, 15))
    0.3333333333333333
    """
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(0.0, a[1] - a[0]) + max(0.0, b[1] - b[0]) - inter
    return inter / union if union > 0 else 0.0


def clamp_span(span: Sequence[float], duration: float) -> tuple[Span, list[str]]:
    """Order and clip a ``(t0, t1)`` span to ``[0, duration]``; say what was done.

    Raises:
        ValueError: for non-finite times or a span entirely outside the video.
    """
    if isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2:
        raise ValueError(f"a time span must be 2 numbers [start, end] in seconds, got {span!r}")
    t0, t1 = (float(v) for v in span)
    if not (math.isfinite(t0) and math.isfinite(t1)):
        raise ValueError(f"times must be finite numbers of seconds, got {list(span)!r}")
    notes = []
    if t0 > t1:
        t0, t1 = t1, t0
        notes.append("swapped start and end")
    if t1 < 0 or t0 > duration:
        raise ValueError(f"span [{t0:g}, {t1:g}] s lies outside the video (duration {duration:g} s)")
    c0, c1 = max(0.0, t0), min(duration, t1)
    if (c0, c1) != (t0, t1):
        notes.append(f"clipped to the video's duration [0, {duration:g}] s")
    return (c0, c1), notes

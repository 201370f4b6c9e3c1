import dataclasses
import math

import pytest
from PIL import Image, ImageStat

from vagent.chat import observation_text
from vagent.media import resize_to_budget, smart_resize
from vagent.toolbox import ToolContext, call_tool
from vagent.types import ToolCall

RED, WHITE = (255, 0, 0), (255, 255, 255)
# Qwen2.5-VL's smallest image (2x2 merged patches of 28) and a small max budget (256 merged patches), so tests are fast.
MIN_PIXELS, MAX_PIXELS = 3136, 200704


def _image() -> Image.Image:
    # 1000x750 white with a red 100x100 marker centred at (150, 150): fractions (0.15, 0.2) of the image.
    image = Image.new("RGB", (1000, 750), WHITE)
    image.paste(RED, (100, 100, 200, 200))
    return image


def _context(image: Image.Image | None = None, convention: str = "absolute", factor: int = 28) -> ToolContext:
    image = image or _image()
    h, w = smart_resize(image.height, image.width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, factor=factor)
    return ToolContext(
        images=[image],
        model_sizes=[(w, h)],  # 504x364 for the default image and factor 28
        convention=convention,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        image_factor=factor,
    )


def _call(name: str, arguments: dict, context: ToolContext | None = None):
    return call_tool(ToolCall(name, arguments), context or _context())


def _at(image: Image.Image, fx: float, fy: float) -> tuple[int, ...]:
    """The pixel at fractions ``(fx, fy)`` of the image's width and height."""
    return image.getpixel((int(fx * image.width), int(fy * image.height)))


def _on_grid(image: Image.Image, factor: int) -> bool:
    return (
        image.width % factor == 0
        and image.height % factor == 0
        and MIN_PIXELS <= image.width * image.height <= MAX_PIXELS
    )


def test_zoom_in_cuts_the_marker_from_the_original_and_magnifies():
    # Marker (100..200, 100..200) original = (50.4..100.8, 48.53..97.07) in the 504x364 view; y rounds inwards.
    obs = _call("zoom_in", {"bbox": [50.4, 48.6, 100.8, 97.0], "factor": 3})
    assert obs.ok, obs.text
    assert obs.metadata["box_original"] == [100, 100, 200, 200]
    out = obs.images[0]
    assert _at(out, 0.5, 0.5) == RED and _at(out, 0.05, 0.05) == RED  # the region is all marker
    assert abs(out.width - 3 * 50.4) <= 28 and _on_grid(out, 28)  # 3x its size in the model's view, on the grid
    assert abs(obs.metadata["factor"] - 3) < 28 / 50.4  # one grid step
    # the tool does not number its output (only the engine knows where it lands); vagent's rendering labels it
    assert obs.text.startswith("region [50, 49, 101, 97] of image 0 zoomed") and obs.first_image is None
    assert observation_text(dataclasses.replace(obs, first_image=1)).startswith("Image 1: region [50, 49, 101, 97]")


def test_zoom_in_reveals_detail_the_global_view_lost():
    # 1-pixel black/white stripes over 400x400 of a 4000x3000 image: the model's 504x364 view averages them to grey.
    image = Image.new("L", (4000, 3000), 255)
    for x in range(1000, 1400, 2):
        image.paste(0, (x, 1000, x + 1, 1400))
    image = image.convert("RGB")
    context = _context(image)
    view = resize_to_budget(image, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    sx, sy = view.width / 4000, view.height / 3000
    stripes_in_view = view.crop((int(1050 * sx), int(1050 * sy), int(1350 * sx), int(1350 * sy))).convert("L")
    obs = _call("zoom_in", {"bbox": [1050 * sx, 1050 * sy, 1350 * sx, 1350 * sy], "factor": 8}, context)
    assert obs.ok, obs.text
    zoomed = obs.images[0].convert("L")
    assert ImageStat.Stat(stripes_in_view).stddev[0] < 25  # grey mush
    assert ImageStat.Stat(zoomed).stddev[0] > 80  # distinct black and white stripes


def test_zoom_in_norm1000_and_budget_limit():
    # The marker on the 0-1000 grid: x 100..200 of 1000, y 100..200 of 750 -> 133.3..266.7.
    obs = _call("zoom_in", {"bbox": [100, 133.34, 200, 266.66]}, _context(convention="norm1000"))
    assert obs.ok and obs.metadata["box_original"] == [100, 100, 200, 200], obs.text
    big = _call("zoom_in", {"bbox": [0, 0, 504, 364], "factor": 8})
    assert big.ok and "limited" in big.text and _on_grid(big.images[0], 28)
    assert big.metadata["factor"] < 1.5  # the whole image at 8x cannot fit the budget


def test_zoom_in_repairs_boxes_and_reports():
    swapped = _call("zoom_in", {"bbox": [100.8, 97.1, 50.4, 48.5]})
    assert swapped.ok and "swapped" in swapped.text
    clipped = _call("zoom_in", {"bbox": [-50, -50, 100, 100]})
    assert clipped.ok and "clipped" in clipped.text
    tiny = _call("zoom_in", {"bbox": [100, 100, 100.5, 100.5]})
    assert tiny.ok and "grown" in tiny.text
    x1, y1, x2, y2 = tiny.metadata["box_original"]
    assert x2 - x1 >= 56 and y2 - y1 >= 56  # sqrt(MIN_PIXELS): never smaller than the processor's minimum


@pytest.mark.parametrize(
    ("angle", "where"), [(90, (0.2, 0.85)), (-90, (0.8, 0.15)), (180, (0.85, 0.8)), (450, (0.2, 0.85))]
)
def test_rotate_moves_the_marker_counter_clockwise(angle, where):
    obs = _call("rotate", {"angle": angle})
    assert obs.ok, obs.text
    out = obs.images[0]
    # A quarter turn swaps the sides: 750x1000 is sized to 364x504 (or near it) by the budget.
    assert (out.width < out.height) == (angle % 180 == 90)
    assert _at(out, *where) == RED and _at(out, 0.15, 0.2) != RED


def test_rotate_arbitrary_angle_expands_and_fills():
    obs = _call("rotate", {"angle": 45})
    assert obs.ok and "corners filled black" in obs.text
    out = obs.images[0]
    assert out.width / out.height < 1000 / 750  # a 45-degree turn of a 4:3 image is nearly square
    assert _at(out, 0.01, 0.01) == (0, 0, 0)
    kept = _call("rotate", {"angle": 45, "expand": False}).images[0]
    assert kept.size == (504, 364)  # the old canvas, corners cut off
    assert "unchanged" in _call("rotate", {"angle": 720}).text
    assert "30 degrees clockwise" in _call("rotate", {"angle": -30}).text


def test_flip_mirrors_the_marker():
    horizontal = _call("flip", {"direction": "horizontal"}).images[0]
    assert _at(horizontal, 0.85, 0.2) == RED and _at(horizontal, 0.15, 0.2) == WHITE
    vertical = _call("flip", {"direction": "vertical"}).images[0]
    assert _at(vertical, 0.15, 0.8) == RED and _at(vertical, 0.15, 0.2) == WHITE


def test_enhance_changes_what_it_says():
    grey = Image.new("RGB", (600, 400), (100, 100, 100))
    grey.paste((150, 150, 150), (0, 0, 300, 400))
    context = _context(grey)
    base = ImageStat.Stat(grey.convert("L"))
    contrast = _call("enhance", {"contrast": 2}, context)
    assert contrast.ok and "contrast x2" in contrast.text
    assert ImageStat.Stat(contrast.images[0].convert("L")).stddev[0] > 1.5 * base.stddev[0]
    darker = _call("enhance", {"brightness": 0.5, "sharpness": 2}, context)
    assert ImageStat.Stat(darker.images[0].convert("L")).mean[0] < 0.6 * base.mean[0]
    stretched = _call("enhance", {"autocontrast": True}, context).images[0].convert("L")
    assert stretched.getextrema() == (0, 255)
    same = _call("enhance", {}, context)
    assert same.ok and "no change" in same.text


def test_draw_marks_shapes_in_the_models_frame():
    context = _context(convention="norm1000")
    before = context.images[0].copy()
    # A box around the marker's region on the 0-1000 grid, a point and a line in the empty lower right.
    obs = _call("draw", {"boxes": [[50, 50, 300, 400]], "points": [[700, 700]], "lines": [[500, 900, 900, 900]],
                         "labels": ["marker"], "color": "blue"}, context)  # fmt: skip
    assert obs.ok and "1 box, 1 point, 1 line" in obs.text, obs.text
    out = obs.images[0]
    assert _at(out, 0.05, 0.3)[2] > 200 and _at(out, 0.05, 0.3)[0] < 80  # left edge of the box is blue
    assert _at(out, 0.7, 0.7)[2] > 200 and _at(out, 0.7, 0.9)[2] > 200  # the point and the line
    assert _at(out, 0.15, 0.2) == RED and _at(out, 0.6, 0.5) == WHITE  # inside and outside untouched
    assert context.images[0].tobytes() == before.tobytes()  # drew on a copy


def test_huge_originals_are_reduced_first_and_shapes_still_land_in_place():
    image = Image.new("RGB", (4200, 3150), WHITE)  # 13 MP, over 16x MAX_PIXELS: worked on at half size
    image.paste(RED, (420, 420, 840, 840))  # centred at fractions (0.15, 0.2) like the small marker
    context = _context(image)
    w, h = context.model_sizes[0]
    drawn = _call("draw", {"boxes": [[0.1 * w, 0.1 * h, 0.5 * w, 0.5 * h]], "color": "blue"}, context).images[0]
    assert _at(drawn, 0.103, 0.3)[2] > 200 and _at(drawn, 0.103, 0.3)[0] < 80 and _at(drawn, 0.15, 0.2) == RED
    assert _at(_call("rotate", {"angle": 90}, context).images[0], 0.2, 0.85) == RED


def test_draw_skips_bad_shapes_and_says_why():
    shapes = {"boxes": [[10, 10, 60, 60], [600, 600, 700, 700], [5, 5, 5, 30]], "points": [[1, 2, 3], [math.nan, 4]],
              "lines": [[10, 10, 10, 10]], "labels": ["a", "b", "c", "d"]}  # fmt: skip
    obs = _call("draw", shapes)
    assert obs.ok and "1 box" in obs.text, obs.text
    for reason in ("box 1 skipped", "box 2 skipped", "point 0 skipped", "point 1 skipped", "line 0 skipped",
                   "1 label(s) beyond"):  # fmt: skip
        assert reason in obs.text
    nothing = _call("draw", {"points": [[999, 999]]})
    assert nothing.error == "bad_shapes" and "outside" in nothing.text


@pytest.mark.parametrize(
    ("name", "arguments", "kind"),
    [
        ("zoom_in", {"bbox": [math.nan, 0, 10, 10]}, "bad_box"),
        ("zoom_in", {"bbox": [10, 10, 10, 50]}, "bad_box"),  # zero width
        ("zoom_in", {"bbox": [600, 400, 700, 500]}, "bad_box"),  # outside the 504x364 view
        ("zoom_in", {"bbox": [1, 2, 3]}, "bad_arguments"),  # the schema wants exactly 4 numbers
        ("zoom_in", {"bbox": [1, 2, 30, 40], "factor": 9}, "bad_arguments"),
        ("zoom_in", {"bbox": [1, 2, 30, 40], "factor": 0.5}, "bad_arguments"),
        ("zoom_in", {"bbox": [1, 2, 30, 40], "factor": math.nan}, "bad_arguments"),
        ("zoom_in", {"bbox": [1, 2, 30, 40], "zoom": 2}, "bad_arguments"),
        ("zoom_in", {"bbox": [1, 2, 30, 40], "image_index": 1}, "bad_arguments"),
        ("rotate", {"angle": math.inf}, "bad_arguments"),
        ("rotate", {"angle": "90"}, "bad_arguments"),
        ("rotate", {"angle": 90, "image_index": -1}, "bad_arguments"),
        ("flip", {"direction": "diagonal"}, "bad_arguments"),
        ("flip", {}, "bad_arguments"),
        ("enhance", {"contrast": 5}, "bad_arguments"),
        ("enhance", {"brightness": -1}, "bad_arguments"),
        ("enhance", {"sharpness": math.nan}, "bad_arguments"),
        ("draw", {}, "bad_arguments"),
        ("draw", {"points": [[1, 1]], "color": "mauve"}, "bad_arguments"),
        ("draw", {"points": [[1, 1]] * 33}, "bad_arguments"),
        ("draw", {"boxes": [[math.nan, 1, 2, 3]]}, "bad_shapes"),
    ],
)
def test_bad_calls_become_error_observations(name, arguments, kind):
    obs = _call(name, arguments)
    assert obs.error == kind, obs.text
    assert obs.text and not obs.images


@pytest.mark.parametrize("factor", [28, 32])
@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("zoom_in", {"bbox": [0.1, 0.1, 3, 3], "factor": 8}),
        ("zoom_in", {"bbox": [0, 0, 400, 300], "factor": 8}),
        ("rotate", {"angle": 30}),
        ("rotate", {"angle": 270}),
        ("flip", {"direction": "vertical"}),
        ("enhance", {"equalize": True}),
        ("draw", {"boxes": [[1, 1, 50, 50]]}),
    ],
)
def test_outputs_fit_the_budget_on_the_grid(name, arguments, factor):
    obs = _call(name, arguments, _context(factor=factor))
    assert obs.ok, obs.text
    assert len(obs.images) == 1 and _on_grid(obs.images[0], factor)

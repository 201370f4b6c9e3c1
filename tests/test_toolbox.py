import pytest
from PIL import Image

from vagent.toolbox import TOOLS, ToolContext, call_tool, tool_schemas
from vagent.types import ToolCall


def _context():
    # Original 1000x750; the model saw it at 504x364 (see test_geometry for the hand computation).
    image = Image.new("RGB", (1000, 750), (255, 255, 255))
    image.paste((255, 0, 0), (555, 115, 667, 231))
    return ToolContext(
        images=[image], model_sizes=[(504, 364)], convention="absolute", min_pixels=3136, max_pixels=200704
    )


def test_crop_cuts_from_the_original_image():
    obs = call_tool(ToolCall("crop", {"bbox": [280, 56, 336, 112]}), _context())
    assert obs.ok, obs.text
    # x: 280*1000/504=555.56 -> 555, 336*1000/504=666.67 -> 667; y: 56*750/364=115.38 -> 115, 112*750/364=230.77 -> 231
    assert obs.metadata["box_original"] == [555, 115, 667, 231]
    crop = obs.images[0]
    assert crop.getpixel((crop.width // 2, crop.height // 2)) == (255, 0, 0)
    assert crop.width % 28 == 0 and crop.height % 28 == 0 and crop.width * crop.height >= 3136


def test_crop_repairs_and_reports():
    obs = call_tool(ToolCall("crop", {"bbox": [336, 112, 280, 56]}), _context())
    assert obs.ok and "swapped" in obs.text
    tiny = call_tool(ToolCall("crop", {"bbox": [100, 100, 101, 101]}), _context())
    assert tiny.ok and "grown" in tiny.text
    x1, y1, x2, y2 = tiny.metadata["box_original"]
    assert x2 - x1 >= 56 and y2 - y1 >= 56  # never smaller than the processor's minimum side


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (ToolCall("teleport", {}), "unknown_tool"),
        (ToolCall("crop", {}), "bad_arguments"),
        (ToolCall("crop", {"bbox": [1, 2, 3, 4], "zoom": 2}), "bad_arguments"),
        (ToolCall("crop", {"bbox": "1,2,3,4"}), "bad_arguments"),
        (ToolCall("crop", {"bbox": [1, "2", 3, 4]}), "bad_arguments"),
        (ToolCall("crop", {"bbox": [1, 2, 3]}), "bad_arguments"),
        (ToolCall("crop", {"bbox": [600, 600, 700, 700]}), "bad_box"),
        (ToolCall("crop", {"bbox": [1, 2, 3, 4], "image_index": 3}), "bad_arguments"),
    ],
)
def test_bad_calls_become_error_observations(call, kind):
    obs = call_tool(call, _context())
    assert obs.error == kind and obs.text and not obs.images


def test_tool_not_offered_is_unknown_and_schemas():
    assert call_tool(ToolCall("crop", {"bbox": [1, 2, 3, 4]}), _context(), offered=[]).error == "unknown_tool"
    assert [s["name"] for s in tool_schemas(["crop"])] == ["crop"]
    with pytest.raises(KeyError, match="unknown tool"):
        tool_schemas(["nope"])
    for name, tool in TOOLS.items():
        assert tool.SCHEMA["name"] == name and tool.SCHEMA["parameters"]["type"] == "object"


def test_every_tool_satisfies_the_tool_protocol_and_is_listed_under_its_name():
    import inspect

    from vagent.toolbox import TOOLS, Tool

    for name, tool in TOOLS.items():
        assert isinstance(tool, Tool), f"{name} lacks NAME, SCHEMA or call"
        assert tool.NAME == name == tool.SCHEMA["name"]
        assert list(inspect.signature(tool.call).parameters) == ["arguments", "context"], name
        assert tool.SCHEMA["parameters"]["type"] == "object", name

"""The ``code`` tool through ``call_tool``: what the model sees for output, images, errors and a missing sandbox."""

from __future__ import annotations

import logging
import uuid

import pytest
from PIL import Image

from vagent.toolbox import ToolContext, call_tool
from vagent.toolbox.code import MAX_IMAGES
from vagent.toolbox.sandbox import Sandbox
from vagent.types import ToolCall

needs_bwrap = pytest.mark.skipif(
    not Sandbox().available(), reason="bubblewrap (bwrap) is missing or does not work here"
)


def _image() -> Image.Image:
    """96x64, white with a red square at (10..29, 20..39), so the code has something to measure."""
    image = Image.new("RGB", (96, 64), "white")
    image.paste((255, 0, 0), (10, 20, 30, 40))
    return image


@pytest.fixture
def context():
    # 2 s: ample for PIL/numpy imports in the sandbox on 2 cores, and the timeout test stays short.
    return ToolContext(images=[_image()], model_sizes=[(112, 56)], sandbox=Sandbox(timeout_s=2.0))


def run_code(code: str, context: ToolContext):
    return call_tool(ToolCall("code", {"code": code}), context)


@needs_bwrap
def test_prints_stdout(context):
    obs = run_code("print(6 * 7)", context)
    assert obs.ok and obs.text == "stdout:\n42" and obs.images == []


@needs_bwrap
def test_reads_the_image_as_pil(context):
    obs = run_code("print(images[0].size, images[0].getpixel((15, 25)), len(images))", context)
    assert obs.ok and obs.text == "stdout:\n(96, 64) (255, 0, 0) 1"


@needs_bwrap
def test_reads_the_image_as_a_file(context):
    code = "import numpy as np\nfrom PIL import Image\na = np.asarray(Image.open('image_0.png'))\nprint(a.shape, (a[..., 1] == 0).sum())"
    obs = run_code(code, context)
    assert obs.ok and obs.text == "stdout:\n(64, 96, 3) 400", obs.text  # the 20x20 red square


@needs_bwrap
def test_images_load_lazily(context):
    obs = run_code("import sys\nprint('PIL' in sys.modules)", context)
    assert obs.text == "stdout:\nFalse"  # a script that never touches an image never pays for PIL


@needs_bwrap
def test_saved_image_comes_back(context):
    obs = run_code("images[0].crop((10, 20, 30, 40)).resize((200, 200)).save('zoom.png')", context)
    assert obs.ok and len(obs.images) == 1 and "zoom.png" in obs.text
    image = obs.images[0]
    assert image.getpixel((image.width // 2, image.height // 2)) == (255, 0, 0)
    assert image.width * image.height <= context.max_pixels and image.width % context.image_factor == 0


@needs_bwrap
def test_show_returns_arrays_and_images(context):
    obs = run_code("import numpy as np\nshow(np.zeros((60, 90, 3), np.uint8))\nshow(images[0])", context)
    assert obs.ok and len(obs.images) == 2 and obs.metadata["images_returned"] == ["shown_0.png", "shown_1.png"]


@needs_bwrap
def test_unchanged_input_images_do_not_come_back(context):
    obs = run_code("images[0].size", context)
    assert obs.ok and obs.images == []


@needs_bwrap
def test_corrupt_output_image_is_a_note(context):
    obs = run_code("open('broken.png', 'wb').write(b'not a png')\nshow(images[0])", context)
    assert obs.ok and len(obs.images) == 1
    assert "broken.png is not a readable image, so it was skipped" in obs.text


@needs_bwrap
def test_output_images_are_capped(context):
    obs = run_code(f"for i in range({MAX_IMAGES + 2}):\n    show(images[0])", context)
    assert obs.ok and len(obs.images) == MAX_IMAGES and "not shown" in obs.text


@needs_bwrap
def test_exception_is_a_code_error_with_its_traceback(context):
    obs = run_code("x = 1\nprint('before')\nx / 0", context)
    assert obs.error == "code_error"
    assert "before" in obs.text and 'File "code.py", line 3' in obs.text and "ZeroDivisionError" in obs.text
    assert "<string>" not in obs.text  # the sandbox's own frames are hidden


@needs_bwrap
def test_syntax_error_is_a_code_error(context):
    obs = run_code("print(", context)
    assert obs.error == "code_error" and "SyntaxError" in obs.text


@needs_bwrap
def test_long_output_is_truncated(context):
    obs = run_code("print('y' * 100_000)", context)
    assert obs.ok and "[output truncated:" in obs.text and len(obs.text) < 10_000


@needs_bwrap
def test_timeout(context):
    obs = run_code("import time\ntime.sleep(60)", context)
    assert obs.error == "timeout" and "2 s" in obs.text


def test_bad_arguments_are_rejected():
    obs = call_tool(ToolCall("code", {"source": "print(1)"}), ToolContext())
    assert obs.error == "bad_arguments"


@pytest.mark.parametrize("bwrap", ["/nonexistent/bwrap", "/bin/false"])
def test_fails_closed_without_a_working_sandbox(tmp_path, bwrap):
    marker = tmp_path / "ran"
    context = ToolContext(sandbox=Sandbox(bwrap=bwrap))
    obs = run_code(f"open({str(marker)!r}, 'w').write('ran')", context)
    assert obs.error == "sandbox_unavailable" and "not run" in obs.text
    assert not marker.exists()


def test_unsandboxed_mode_is_opt_in_and_warns(tmp_path, caplog, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("VAGENT_TEST_SECRET", secret)
    context = ToolContext(images=[_image()], sandbox=Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True))
    with caplog.at_level(logging.WARNING, logger="vagent.toolbox.sandbox"):
        obs = run_code("import os\nprint(images[0].size, os.environ.get('VAGENT_TEST_SECRET'))", context)
    assert obs.ok and obs.text == "stdout:\n(96, 64) None"  # runs, still with a clean environment
    assert obs.metadata["sandboxed"] is False
    assert any("WITHOUT a sandbox" in r.getMessage() for r in caplog.records)


def test_unsandboxed_mode_keeps_the_timeout():
    context = ToolContext(sandbox=Sandbox(timeout_s=1.0, bwrap="/nonexistent/bwrap", allow_unsandboxed=True))
    obs = run_code("while True:\n    pass", context)
    assert obs.error == "timeout" and obs.metadata["duration_s"] < 3


@needs_bwrap
def test_images_are_encoded_once_per_image_and_forgotten_with_it():
    import gc

    from vagent.toolbox import code

    image = Image.new("RGB", (64, 48), (9, 9, 9))
    context = ToolContext(images=[image], model_sizes=[(56, 56)])
    first = call_tool(ToolCall("code", {"code": "print(images[0].size)"}), context)
    assert first.ok and "(64, 48)" in first.text and id(image) in code._ENCODED
    data = code._ENCODED[id(image)][1]
    assert call_tool(ToolCall("code", {"code": "print(1)"}), context).ok
    assert code._ENCODED[id(image)][1] is data  # the second call reused the bytes
    key = id(image)
    del image, context
    gc.collect()
    assert key not in code._ENCODED

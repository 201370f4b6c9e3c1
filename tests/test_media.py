import io
import os

import numpy as np
import pytest
from PIL import Image
from videos import write_video

from vagent.media import MediaError, load_image, probe_video, read_frames, resize_to_budget, smart_resize


def _png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_load_valid_image_from_path_and_bytes(tmp_path):
    image = Image.new("RGB", (40, 30), (10, 20, 30))
    path = tmp_path / "ok.png"
    image.save(path)
    for source in (path, str(path), path.read_bytes()):
        loaded = load_image(source)
        assert loaded.mode == "RGB" and loaded.size == (40, 30)
        assert loaded.getpixel((0, 0)) == (10, 20, 30)


def test_non_image_and_missing_files_give_clear_errors(tmp_path):
    fake = tmp_path / "notes.png"
    fake.write_text("this is a text file with a .png name")
    with pytest.raises(MediaError, match=r"notes\.png is not a readable image"):
        load_image(fake)
    with pytest.raises(MediaError, match="not found"):
        load_image(tmp_path / "missing.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_rejected(tmp_path, fmt):
    rng = np.random.default_rng(0)
    data = _png_bytes(Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)), fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match="corrupt or truncated|not a readable"):
        load_image(path)


def test_decompression_bomb_refused_before_decoding(tmp_path):
    path = tmp_path / "big.png"
    Image.new("L", (300, 200)).save(path)
    with pytest.raises(MediaError, match="60,000 pixels, above the limit of 50,000"):
        load_image(path, max_pixels=50_000)


def test_odd_modes_become_rgb():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red -> white background
    assert load_image(rgba).getpixel((0, 0)) == (255, 255, 255)
    half = Image.new("RGBA", (4, 4), (0, 0, 0, 128))  # half-transparent black over white -> mid grey
    assert load_image(half).getpixel((0, 0))[0] in range(120, 135)
    assert load_image(Image.new("L", (4, 4), 77)).getpixel((0, 0)) == (77, 77, 77)
    assert load_image(Image.new("CMYK", (4, 4), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("RGB", (4, 4), (0, 200, 0)).convert("P")
    assert load_image(palette).getpixel((0, 0))[1] > 150
    deep = Image.new("I;16", (4, 4), 65535)  # 16-bit white must stay white, not overflow
    assert load_image(deep).getpixel((0, 0)) == (255, 255, 255)


def test_exif_rotation_is_applied(tmp_path):
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rot.jpg"
    image.save(path, exif=exif)
    assert load_image(path).size == (20, 40)


def test_resize_to_budget_matches_processor_rule():
    image = Image.new("RGB", (1000, 750))
    out = resize_to_budget(image, min_pixels=3136, max_pixels=200704)
    assert out.size == (504, 364)  # (w, h); hand-computed in test_geometry
    tiny = resize_to_budget(Image.new("RGB", (10, 10)), min_pixels=3136, max_pixels=200704)
    assert tiny.size == (56, 56) and tiny.width * tiny.height >= 3136
    for h, w in [(28, 28), (1, 5000 // 200 + 1), (4000, 3000)]:
        rh, rw = smart_resize(h, w, min_pixels=3136, max_pixels=200704)
        assert rh % 28 == 0 and rw % 28 == 0 and 3136 <= rh * rw <= 200704
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(1, 1000, min_pixels=3136, max_pixels=200704)


def test_video_probe_and_frames_at_timestamps(tmp_path):
    path = write_video(tmp_path / "clip.mp4")
    info = probe_video(path)
    assert (info.num_frames, info.width, info.height) == (24, 64, 48)
    assert info.fps == pytest.approx(8.0) and info.duration == pytest.approx(3.0)
    frames, times = read_frames(path, [0.0, 1.0, 2.99])
    assert times == [0.0, 1.0, 23 / 8]  # frame index = floor(t * fps)
    brightness = [np.asarray(f).mean() for f in frames]
    assert brightness == pytest.approx([0, 80, 230], abs=6)  # lossy codec: a few levels of noise
    with pytest.raises(MediaError, match="outside"):
        read_frames(path, [3.5])


def test_broken_videos_give_clear_errors(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(MediaError, match=r"junk\.mp4 is not a readable video"):
        probe_video(junk)
    with pytest.raises(MediaError, match="not found"):
        read_frames(tmp_path / "none.mp4", [0.0])
    good = write_video(tmp_path / "good.mp4", frames=40)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(good.read_bytes()[:300])
    with pytest.raises(MediaError):
        probe_video(cut)

"""Loading and validating images and videos, and sizing them the way Qwen-VL processors do.

Guards against: missing files, non-image bytes (a text file named ``.png``), truncated files,
decompression bombs (pixel count above a limit, checked from the header before decoding),
odd modes (palette, alpha, CMYK, 16-bit, grayscale are converted to RGB; alpha is composited on
white), EXIF rotation, unreadable or empty videos, and timestamps outside a video.
Does not guard against: adversarial pixels, or the resource use of decoding a huge but valid video
(callers bound frame counts).

Every failure is a ``MediaError`` whose message names the file and what is wrong.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_FACTOR",
    "MediaError",
    "OpenVideo",
    "VideoInfo",
    "load_image",
    "probe_video",
    "read_frames",
    "resize_to_budget",
    "smart_resize",
    "uniform_timestamps",
]

# Qwen-VL vision towers see 14x14 patches merged 2x2, so sides are multiples of 28.
IMAGE_FACTOR = 28
# Refuse to decode images above this many pixels (about 16k x 11k): a 50 KB PNG can expand to gigabytes.
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970


class MediaError(ValueError):
    """An image or video that cannot be used; the message says which file and why."""


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: scale to 8 bits instead of letting PIL clip everything above 255 to white.
        extrema = image.getextrema()
        hi = max(1, extrema[1]) if isinstance(extrema, tuple) else 1
        return image.point(lambda v: v * 255.0 / hi).convert("L").convert("RGB")
    return image.convert("RGB")


def load_image(
    source: str | os.PathLike[str] | bytes | Image.Image, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """Load an image as a fully decoded RGB ``PIL.Image``, or raise ``MediaError`` saying why not.

    Args:
        source: A path, raw encoded bytes, or an already-open image.
        max_pixels: Refuse images with more pixels than this (decompression-bomb guard).
    """
    name = "<bytes>" if isinstance(source, (bytes, bytearray)) else "<image>"
    if isinstance(source, Image.Image):
        image = source
    else:
        if not isinstance(source, (bytes, bytearray)):
            name = str(source)
            path = Path(source)
            if not path.is_file():
                raise MediaError(f"image not found: {name}")
        try:
            opened = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
        except Image.DecompressionBombError as e:
            raise MediaError(f"image {name} is too large to decode safely: {e}") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise MediaError(f"{name} is not a readable image ({type(e).__name__}: {e})") from None
        image = opened
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(f"image {name} has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise MediaError(
            f"image {name} has {width}x{height} = {width * height:,} pixels, above the limit of {max_pixels:,}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()  # decode now so truncation surfaces here, not inside a processor later
        image = ImageOps.exif_transpose(image) or image
        return _to_rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"image {name} is corrupt or truncated ({type(e).__name__}: {e})") from None


def smart_resize(
    height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int = IMAGE_FACTOR
) -> tuple[int, int]:
    """The ``(height, width)`` a Qwen-VL processor resizes an image to (qwen-vl-utils' rule).

    Both sides become multiples of ``factor`` and the pixel count lands in ``[min_pixels, max_pixels]``
    with the aspect ratio kept as closely as possible.

    >>> smart_resize(750, 1000, min_pixels=3136, max_pixels=200704)
    (364, 504)
    """
    # qwen-vl-utils imports torchvision (about 1 s): on first use, not when the toolbox or the CLI is imported.
    from qwen_vl_utils.vision_process import smart_resize as _qwen_smart_resize

    try:
        return _qwen_smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except (ValueError, AssertionError) as e:
        raise MediaError(f"cannot size a {width}x{height} image for the model: {e}") from None


def resize_to_budget(
    image: Image.Image, *, min_pixels: int, max_pixels: int, factor: int = IMAGE_FACTOR
) -> Image.Image:
    """Resize ``image`` exactly as the processor would, so the returned size is the frame the model sees."""
    height, width = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
    if (width, height) == image.size:
        return image
    return image.resize((width, height), Image.Resampling.BICUBIC)


@dataclass(frozen=True)
class VideoInfo:
    """What decord reports about a video file."""

    path: str
    num_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.num_frames / self.fps


def _open_video(path: str | os.PathLike[str]):
    try:
        import decord
    except ImportError:
        raise MediaError("video decoding needs decord: pip install decord") from None
    name = str(path)
    if not Path(path).is_file():
        raise MediaError(f"video not found: {name}")
    try:
        reader = decord.VideoReader(name, ctx=decord.cpu(0), num_threads=1)
    except Exception as e:  # decord raises its own DECORDError / RuntimeError for anything it cannot parse
        raise MediaError(
            f"{name} is not a readable video ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    if len(reader) == 0:
        raise MediaError(f"video {name} has no frames")
    return reader


class OpenVideo:
    """A video opened once: frame count and rate read up front, frames decoded in one batch.

    Lets a caller look at the duration before choosing times without opening the file twice.
    Not thread-safe (one decord reader); open one per call.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._reader = _open_video(path)
        self.path = str(path)
        self.num_frames = len(self._reader)
        self.fps = float(self._reader.get_avg_fps())
        if not math.isfinite(self.fps) or self.fps <= 0:
            raise MediaError(f"video {path} reports an invalid frame rate {self.fps}")

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return self.num_frames / self.fps

    def index_at(self, t: float) -> int:
        """Index of the frame shown at time ``t`` (``floor(t * fps)``; the end time maps to the last frame)."""
        if not math.isfinite(t) or t < 0 or t > self.duration:
            raise MediaError(f"timestamp {t} s is outside video {self.path} (duration {self.duration:.3f} s)")
        return min(self.num_frames - 1, int(t * self.fps))

    def decode(self, indices: Sequence[int]) -> list[Image.Image]:
        """The frames at ``indices`` as RGB images, decoded in one ``get_batch`` (one seek pass)."""
        try:
            batch = self._reader.get_batch(list(indices)).asnumpy()
        except Exception as e:  # a truncated or corrupt stream fails here, after a successful open
            raise MediaError(f"could not decode frames {list(indices)} of {self.path} ({type(e).__name__})") from None
        return [Image.fromarray(frame) for frame in batch]


def probe_video(path: str | os.PathLike[str]) -> VideoInfo:
    """Frame count, fps and size of a video, or ``MediaError``."""
    video = OpenVideo(path)
    width, height = video.decode([0])[0].size
    return VideoInfo(path=str(path), num_frames=video.num_frames, fps=video.fps, width=width, height=height)


def uniform_timestamps(start: float, end: float, num_frames: int) -> list[float]:
    """``num_frames`` times spread evenly over ``[start, end]``, each at the centre of its segment.

    >>> uniform_timestamps(0.0, 4.0, 4)
    [0.5, 1.5, 2.5, 3.5]
    """
    if num_frames <= 0:
        raise ValueError(f"num_frames must be positive, got {num_frames}")
    step = (end - start) / num_frames
    return [start + step * (i + 0.5) for i in range(num_frames)]


def read_frames(path: str | os.PathLike[str], timestamps: Sequence[float]) -> tuple[list[Image.Image], list[float]]:
    """Decode the frames nearest to ``timestamps`` (seconds) with decord.

    Returns:
        The frames as RGB images and the exact time of each decoded frame (``index / fps``), which can
        differ from the request by up to half a frame.

    Raises:
        MediaError: unreadable video, or a timestamp outside ``[0, duration]``.
    """
    video = OpenVideo(path)
    indices = [video.index_at(t) for t in timestamps]
    return video.decode(indices), [i / video.fps for i in indices]

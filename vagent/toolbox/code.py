"""``code``: run model-written Python on the episode's images in a sandbox (see ``vagent.toolbox.sandbox``).

The images are in the code's working directory as ``image_0.png``, ``image_1.png``, ... (full
resolution, in ``ToolContext.images`` order) and, opened on first use so a script that never touches
them never imports PIL, as the list-like ``images``. Images the code saves in its working directory
(or passes to ``show(img)``) come back to the model, resized within its pixel budget like a crop.

Guards against: everything the sandbox does (no network, no host files, timeout, memory, processes,
output size); a missing sandbox (refuses with ``sandbox_unavailable`` rather than run unsandboxed,
unless the context's sandbox opted in); corrupt, huge or too many output images (skipped with a note,
at most ``MAX_IMAGES``); runaway output (cut, and the model is told).
Does not guard against: what the sandbox does not (see its docstring), or code that is valid but
pointless. Images written into subdirectories are not returned.
"""

from __future__ import annotations

import functools
import io
import threading
import weakref
from typing import Any

from PIL import Image

from vagent.media import MediaError, load_image, resize_to_budget
from vagent.toolbox.context import ToolContext
from vagent.toolbox.sandbox import Sandbox, SandboxResult, SandboxUnavailable
from vagent.types import Observation

__all__ = ["MAX_IMAGES", "NAME", "SCHEMA", "call"]

NAME = "code"
SCHEMA = {
    "name": NAME,
    "description": "Run Python 3 code to analyse or edit the images (numpy and PIL are available; no network, "
    "a few seconds of time). The images are files image_0.png, image_1.png, ... in the working directory, "
    "and `images[i]` opens image i as a PIL image. print() what you want to read; to see an image, save it "
    "in the working directory (e.g. img.save('out.png')) or call show(img) with a PIL image or numpy array.",
    "parameters": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The Python program to run."},
        },
        "required": ["code"],
    },
}

MAX_IMAGES = 4  # images returned per call: each costs hundreds of tokens of context
# Decoding limit for returned images (a small PNG can decode to gigabytes); they are resized to max_pixels after.
_MAX_DECODE_PIXELS = 40_000_000
_IMAGE_PATTERNS = ("*.png", "*.jpg", "*.jpeg", "*.webp", "*.bmp", "*.gif")

# Run before the model's code in its namespace: the lazy `images` list and `show`. Paths are absolute so
# they still work after the code changes directory.
_SETUP = '''\
import os as _os

_WORKDIR = _os.getcwd()


class _Images:
    """The episode's images, opened on first use: images[i] is image_i.png as a PIL image."""

    def __init__(self, n):
        self._n, self._cache = n, {}

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = range(self._n)[i]
        if i not in self._cache:
            from PIL import Image
            self._cache[i] = Image.open(_os.path.join(_WORKDIR, f"image_{i}.png"))
            self._cache[i].load()
        return self._cache[i]

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def __repr__(self):
        return f"<{self._n} image(s); images[i] opens image_i.png>"


images = _Images(N_IMAGES)
_shown = [0]


def show(image):
    """Send an image (PIL image or HxW / HxWx3 uint8 array) back to the assistant."""
    if not hasattr(image, "save"):
        from PIL import Image
        image = Image.fromarray(image)
    image.save(_os.path.join(_WORKDIR, f"shown_{_shown[0]}.png"))
    _shown[0] += 1
'''


@functools.cache
def _default_sandbox() -> Sandbox:
    return Sandbox()


# PNG bytes of each image, kept while the image lives: an episode's images are the same objects call after
# call, and encoding a multi-megapixel image costs far more than the sandbox itself. Keyed by id() because
# PIL images are unhashable; the weakref callback drops an entry when its image is freed (id reuse safe).
_ENCODED: dict[int, tuple[weakref.ref, bytes]] = {}
_ENCODED_LOCK = threading.Lock()


def _png_bytes(image: Image.Image) -> bytes:
    key = id(image)
    with _ENCODED_LOCK:
        cached = _ENCODED.get(key)
        if cached is not None and cached[0]() is image:
            return cached[1]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # fast; the files live for one call
    data = buffer.getvalue()

    def forget(_: weakref.ref, key: int = key) -> None:
        with _ENCODED_LOCK:
            _ENCODED.pop(key, None)

    with _ENCODED_LOCK:
        _ENCODED[key] = (weakref.ref(image, forget), data)
    return data


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    """Run ``arguments["code"]`` in ``context.sandbox`` (default: bubblewrap) with the episode's images.

    Errors are observations: ``sandbox_unavailable`` (nothing ran), ``timeout``, ``code_error`` (non-zero exit).
    """
    sandbox = context.sandbox if context.sandbox is not None else _default_sandbox()
    files = {f"image_{i}.png": _png_bytes(image) for i, image in enumerate(context.images)}
    try:
        result = sandbox.run(
            arguments["code"],
            files,
            setup=_SETUP.replace("N_IMAGES", str(len(context.images))),
            collect=_IMAGE_PATTERNS,
        )
    except SandboxUnavailable as e:
        return Observation(
            text=f"The code was not run: no sandbox is available on this machine ({e}).", error="sandbox_unavailable"
        )
    images, notes = _images(result, context)
    text = _describe(result, sandbox.timeout_s, images, notes)
    metadata = {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "duration_s": round(result.duration_s, 3),
        "sandboxed": result.sandboxed,
        "images_returned": [name for name, _ in images],
        # Raw streams, for agent profiles that print them in their own format (vagent.agents).
        "stdout": result.stdout,
        "stderr": result.stderr,
    }
    error = "timeout" if result.timed_out else ("code_error" if result.exit_code != 0 else None)
    return Observation(text=text, images=[image for _, image in images], error=error, metadata=metadata)


def _images(result: SandboxResult, context: ToolContext) -> tuple[list[tuple[str, Image.Image]], list[str]]:
    """Validated, resized output images (at most MAX_IMAGES) and notes about the ones left out."""
    images: list[tuple[str, Image.Image]] = []
    notes = list(result.notes)
    for name, data in result.files.items():
        if len(images) == MAX_IMAGES:
            notes.append(f"{name} and later images not shown (at most {MAX_IMAGES} per call)")
            break
        try:
            image = load_image(data, max_pixels=_MAX_DECODE_PIXELS)
        except MediaError as e:
            # MediaError names the source "<bytes>" and quotes PIL's internals in parentheses; the model needs neither.
            reason = str(e).split(" (")[0].replace("image <bytes>", name).replace("<bytes>", name)
            notes.append(f"{reason}, so it was skipped")
            continue
        out = resize_to_budget(
            image, min_pixels=context.min_pixels, max_pixels=context.max_pixels, factor=context.image_factor
        )
        images.append((name, out))
    return images, notes


def _describe(result: SandboxResult, timeout_s: float, images: list[tuple[str, Image.Image]], notes: list[str]) -> str:
    parts = []
    if result.timed_out:
        parts.append(f"Timeout: the code ran longer than {timeout_s:g} s and was stopped.")
    elif result.exit_code > 128:
        parts.append(
            f"The code was killed by signal {result.exit_code - 128} (it may have hit the memory, CPU or process limit)."
        )
    elif result.exit_code != 0:
        parts.append(f"The code failed with exit code {result.exit_code}.")
    for label, text, dropped in (
        ("stdout", result.stdout, result.stdout_dropped),
        ("stderr", result.stderr, result.stderr_dropped),
    ):
        if text or dropped:
            cut = f"\n[output truncated: {dropped:,} more bytes not shown]" if dropped else ""
            parts.append(f"{label}:\n{text.rstrip()}{cut}")
    if images:
        # in this order; the engine labels them with their indices ("Images 3–4: ...") when it appends them
        parts.append(f"Returned {len(images)} image(s): {', '.join(name for name, _ in images)}.")
    if notes:
        parts.append("Note: " + "; ".join(notes) + ".")
    if not parts:
        parts.append("The code ran and printed nothing (print() what you want to see).")
    return "\n".join(parts)

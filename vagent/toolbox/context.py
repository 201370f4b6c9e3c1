"""What a tool call can see: the episode's media in original resolution, the frame the model saw,
and the services some tools need (a search backend, a code sandbox)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image

from vagent.geometry import Convention

if TYPE_CHECKING:
    from vagent.toolbox.sandbox import Sandbox
    from vagent.toolbox.search import SearchBackend

__all__ = ["ToolContext", "ToolServices"]


@dataclass(frozen=True)
class ToolServices:
    """The long-lived services behind some tools, built once per run and shared by every episode.

    Attributes:
        search: Backend of the ``search`` tool; ``None`` means search is not available.
        sandbox: Runner of the ``code`` tool; ``None`` means the default bubblewrap sandbox.
    """

    search: SearchBackend | None = None
    sandbox: Sandbox | None = None


@dataclass
class ToolContext:
    """Per-episode state handed to every tool call.

    Attributes:
        images: Original, full-resolution images of the episode (prompt images first, then tool outputs,
            in the order the model saw them; ``image_index`` arguments index this list).
        model_sizes: ``(width, height)`` of each image as the model saw it (after smart resize), aligned with ``images``.
        convention: How the policy writes boxes (``"absolute"`` or ``"norm1000"``), from ``Policy.coord_convention``;
            ``"original"``: original-image pixels (agent profiles convert their own conventions to these).
        min_pixels: Smallest image the processor accepts; tools never return smaller images.
        max_pixels: Largest image the model sees; tools resize outputs within it.
        image_factor: Side multiple of model-facing images (patch x merge: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL).
        videos: Paths of the episode's videos (``video_index`` arguments index this list).
        max_frames: Most frames one video-tool call may return (each frame costs image tokens).
        frame_max_pixels: Pixel budget of each returned video frame (smaller than ``max_pixels``: many frames).
        search: Backend of the ``search`` tool; ``None`` means search is not available in this episode.
        sandbox: Runner of the ``code`` tool; ``None`` means the default bubblewrap sandbox.
    """

    images: list[Image.Image] = field(default_factory=list)
    model_sizes: list[tuple[int, int]] = field(default_factory=list)
    convention: Convention = "absolute"
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 256
    image_factor: int = 28
    videos: list[str] = field(default_factory=list)
    max_frames: int = 16
    frame_max_pixels: int = 28 * 28 * 64
    search: SearchBackend | None = None
    sandbox: Sandbox | None = None

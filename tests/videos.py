"""Generated test videos (no downloads): small mp4v clips whose frames tell which frame they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_video(
    path: Path, frames: int = 24, fps: float = 8.0, size: tuple[int, int] = (64, 48), step: int = 10
) -> Path:
    """Write ``frames`` flat grey frames; frame i has brightness min(i * step, 255), so a decoded frame's
    mean brightness says (within codec noise) which frame it is. Returns ``path``."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    for i in range(frames):
        writer.write(np.full((size[1], size[0], 3), min(i * step, 255), dtype=np.uint8))
    writer.release()
    return path

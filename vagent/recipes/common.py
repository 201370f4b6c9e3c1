"""Pieces every recipe builds the same way from its config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vagent.config import ModelConfig, ToolboxConfig

__all__ = ["tiny_checkpoint", "tool_services"]


def tiny_checkpoint(cfg: ModelConfig, out_dir: str | Path, build: bool = True) -> Path:
    """The configured checkpoint dir, or the tiny random one under ``out_dir``, built once (rebuilt when its
    recipe changed). ``build=False`` only names the dir (ranks other than 0 wait for rank 0 to build it)."""
    if cfg.path:
        return Path(cfg.path)
    tiny = cfg.tiny
    out = Path(out_dir) / f"tiny-{tiny.family}-{tiny.size}"
    recipe = {"family": tiny.family, "size": tiny.size, "vocab_size": tiny.vocab_size, "seed": tiny.seed,
              "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}  # fmt: skip
    marker = out / "vagent_tiny.json"
    if build and not (marker.is_file() and json.loads(marker.read_text()) == recipe):
        from vagent.tiny_model import build_tiny_checkpoint

        print(f"building a random tiny {tiny.family} checkpoint ({tiny.size}) in {out} ...", flush=True)
        build_tiny_checkpoint(out, **recipe)
    return out


def tool_services(cfg: ToolboxConfig) -> dict[str, Any]:
    """The ``search`` backend and ``code`` sandbox a rollout needs, as keyword arguments of ``rollout``/``run``."""
    from vagent.toolbox.sandbox import Sandbox
    from vagent.toolbox.search import BM25Backend, HTTPBackend

    search = None
    if cfg.search_corpus:
        search = BM25Backend(cfg.search_corpus)
    elif cfg.search_url:
        search = HTTPBackend(cfg.search_url, cache_dir=cfg.search_cache_dir)
    sandbox = Sandbox(
        timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb, allow_unsandboxed=cfg.allow_unsandboxed_code
    )
    return {"search": search, "sandbox": sandbox}

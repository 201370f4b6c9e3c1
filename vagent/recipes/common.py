"""Pieces every recipe builds the same way from its config."""

from __future__ import annotations

from typing import Any

from vagent.config import ToolboxConfig

__all__ = ["tool_services"]


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

"""Imported first by every vLLM test module (``tests/test_vllm_*.py``): where ``VAGENT_REQUIRE_VLLM`` is set (``make
test`` runs these modules in ``.venv-vllm`` with it), a missing vLLM fails the module instead of skipping it, so CI
cannot pass them by not running them; elsewhere the module is skipped (``conftest.py`` does not even collect it)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("VAGENT_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

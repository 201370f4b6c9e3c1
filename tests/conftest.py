"""Shared fixtures: tiny checkpoints built once per session (no downloads), generated media."""

from __future__ import annotations

import pytest
import torch

from vagent.tiny_model import build_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen25(tmp_path_factory):
    """A random Qwen2.5-VL checkpoint dir (tiny preset)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2_5_vl", family="qwen2_5_vl", size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A random Qwen2-VL checkpoint dir (nano preset: only loading and generation are exercised)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2_vl", family="qwen2_vl", size="nano")


@pytest.fixture(scope="session")
def policy(tiny_qwen25):
    from vagent.model import load_policy

    return load_policy(tiny_qwen25, device="cpu")


@pytest.fixture(scope="session")
def zoom_rows_file(tmp_path_factory, policy):
    """Synthetic zoom rows (gold crop-then-answer trajectories) in the tiny Qwen2.5-VL's frame: ``(n, seed) ->
    path`` of a JSONL, each written once. The production recipes take data only from ``data.train``."""
    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.data import write_rows

    root = tmp_path_factory.mktemp("zoom")
    made = {}

    def make(n: int = 16, seed: int = 0):
        if (n, seed) not in made:
            out = root / f"{n}-{seed}"
            made[n, seed] = write_rows(zoom_rows(out, n, seed=seed, **policy.frame), out / "rows.jsonl")
        return made[n, seed]

    return make

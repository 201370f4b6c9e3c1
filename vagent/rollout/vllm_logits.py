"""The vLLM logits processor that keeps the vision placeholders out of every sample (``VLLMBackend``'s engine).

A module of its own, importing vLLM at the top: vLLM loads it by name (``vagent.rollout.vllm_logits:BanVisionTokens``)
in whichever process samples, this one or, when the engine is sharded over vLLM's own worker processes, each worker.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from vagent.model import vision_token_ids

__all__ = ["BanVisionTokens", "NAME"]

NAME = f"{__name__}:BanVisionTokens"


class BanVisionTokens(LogitsProcessor):
    """Sets the checkpoint's vision placeholder logits (``vagent.model.vision_token_ids`` of the engine's own config)
    to -inf for every row at every step: before the temperature and the nucleus, so the processed log-probs are of
    the distribution without them (what GRPO's trainer scores). One vectorized fill per step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        banned = vision_token_ids(vllm_config.model_config.hf_config)
        self.ids = torch.tensor(banned, dtype=torch.long, device=device)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy choices too

    def update_state(self, batch_update: Any) -> None:
        pass  # the same tokens for every request

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill_(1, self.ids, float("-inf"))

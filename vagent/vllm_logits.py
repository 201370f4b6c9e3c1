"""The vLLM logits processor that keeps the vision placeholders out of every sample (``VLLMBackend``'s engine).

A leaf module of its own, importing vLLM and nothing of vagent: vLLM loads it by name
(``vagent.vllm_logits:BanVisionTokens``) in whichever process samples, this one or, when the engine is sharded over
vLLM's own worker processes, each worker (whose start-up it must not slow with vagent's imports).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

__all__ = ["NAME", "BanVisionTokens"]

NAME = f"{__name__}:BanVisionTokens"


class BanVisionTokens(LogitsProcessor):
    """Sets the checkpoint's vision placeholder logits (the image/video pads and vision start/end of the engine's own
    config: ``Policy.vision_placeholder_ids``, tested equal) to -inf for every row at every step: before the
    temperature and the nucleus, so the processed log-probs are of the distribution without them (what GRPO's
    trainer scores). One vectorized fill per step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        config = vllm_config.model_config.hf_config
        banned = [
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
        ]
        self.ids = torch.tensor(banned, dtype=torch.long, device=device)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy choices too

    def update_state(self, batch_update: Any) -> None:
        pass  # the same tokens for every request

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill_(1, self.ids, float("-inf"))

"""Pure tensor math of training: the masked SFT loss (and, with GRPO, advantages and policy losses)."""

from vagent.algorithms.sft import token_nll_sum, trained_token_count

__all__ = ["token_nll_sum", "trained_token_count"]

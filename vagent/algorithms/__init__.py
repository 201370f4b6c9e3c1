"""Pure tensor math of training: the masked SFT loss, GRPO advantages, the clipped policy loss, KL, entropy."""

from vagent.algorithms.grpo import (
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    policy_loss,
    sampled_logprobs,
)
from vagent.algorithms.lm_head import chunked_token_logprobs
from vagent.algorithms.sft import token_nll_sum, trained_positions, trained_token_count

__all__ = [
    "aggregate",
    "chunked_token_logprobs",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "policy_loss",
    "sampled_logprobs",
    "token_nll_sum",
    "trained_positions",
    "trained_token_count",
]

"""Pure tensor math of training: the masked SFT loss, GRPO advantages, the clipped policy loss, KL, entropy."""

from vagent.algorithms.grpo import (
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    policy_loss,
    token_entropy,
)
from vagent.algorithms.sft import token_nll_sum, trained_token_count

__all__ = [
    "aggregate",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "policy_loss",
    "token_entropy",
    "token_nll_sum",
    "trained_token_count",
]

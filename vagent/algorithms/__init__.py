"""Pure tensor math of training: the masked SFT loss, GRPO advantages, the clipped policy loss, KL, entropy, the DPO
losses."""

from vagent.algorithms.dpo import (
    LOSS_TYPES,
    dpo_loss,
    length_normalized,
    pair_stats,
    self_critic_pairs,
    sequence_logprobs,
)
from vagent.algorithms.grpo import (
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    loss_normalizer,
    policy_loss,
    rollout_correction,
    sampled_logprobs,
)
from vagent.algorithms.lm_head import chunked_token_logprobs
from vagent.algorithms.sft import token_nll_sum, trained_positions, trained_token_count

__all__ = [
    "LOSS_TYPES",
    "aggregate",
    "chunked_token_logprobs",
    "dpo_loss",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "length_normalized",
    "loss_normalizer",
    "pair_stats",
    "policy_loss",
    "rollout_correction",
    "sampled_logprobs",
    "self_critic_pairs",
    "sequence_logprobs",
    "token_nll_sum",
    "trained_positions",
    "trained_token_count",
]

"""GRPO math: group-normalized advantages, the clipped policy loss, KL, entropy. Pure tensor functions.

Shapes: N trajectories = n_groups x group_size, consecutive per group (as ``rollout.run`` returns them);
B x T token tensors where position t holds the log-prob of token t given the tokens before it, and the
mask is 1 on tokens the policy sampled (0 on prompt, tool output, padding).

Loss aggregation over a step that spans micro-batches and ranks: ``policy_loss`` returns per-token terms
and ``aggregate`` divides their sum by a normalizer the caller adds up over the whole mini-batch (all ranks)
from each rank's ``loss_normalizer``: the number of trained tokens (``"token"``: every token weighs the same,
DAPO), the number of sequences with a trained token after a per-sequence token mean (``"sequence"``, GRPO's
original form), or a constant, the sequences times the most tokens an episode may sample (``"dr_grpo"``).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "aggregate",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "loss_normalizer",
    "policy_loss",
    "rollout_correction",
    "sampled_logprobs",
]

Aggregation = Literal["token", "sequence", "dr_grpo"]


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                     negative_scale: float = 1.0, eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """A_i = (r_i - mean(group)) / (std(group) + eps); without ``scale_by_std`` only the mean is removed
    (Dr. GRPO: dividing by the std up-weights groups that are nearly solved or nearly failed). The std is the
    unbiased one (``torch.std``'s default, n - 1 in the denominator), as verl's ``compute_grpo_outcome_advantage``
    and TRL's GRPOTrainer compute it.

    Args:
        rewards: (N,) with N = n_groups * group_size, groups consecutive.
        negative_scale: multiplies the advantages below zero. 1 is GRPO; below 1 the update leans on the
            samples that beat their group; 0 trains on the winners only. Pushing a sampled token down
            spreads its probability over the others: in the quickstart it raised the entropy, and winners
            only lowered it (docs/decisions/negative-scale.md).

    Returns:
        (N,) advantages; a group whose rewards are all equal gets 0 everywhere.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)  # mean 0.25, std sqrt(0.75 / 3) = 0.5
    tensor([ 1.5000, -0.5000, -0.5000, -0.5000])
    >>> group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale_by_std=False)
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, negative_scale=0.5)
    tensor([ 1.5000, -0.2500, -0.2500, -0.2500])
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (n_groups * {group_size},), got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size).float()  # (G, n)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        # unbiased std, as verl and TRL: a group of 2 with rewards {1, 0} gives +-0.707 (the population std, +-1,
        # steps sqrt(n / (n - 1)) further: 7% at n = 8)
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    if negative_scale != 1.0:
        centered = torch.where(centered < 0, centered * negative_scale, centered)
    return centered.view(-1)


def informative_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(n_groups,) bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these:
    a group with one reward value has zero advantage and only dilutes the batch).

    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    tensor([False,  True])
    """
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > eps


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = 3.0,
                max_log_ratio: float = 20.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """PPO-clip per token with asymmetric clipping (DAPO's clip-higher): the ratio is kept in
    ``[1 - clip_low, 1 + clip_high]`` where clipping lowers the objective; with the numerical guards of verl's
    ``compute_policy_loss``.

    Guards (each leaves a token it does not touch exactly as plain PPO-clip, value and gradient):
    the log-ratio is clamped to ``[-max_log_ratio, max_log_ratio]`` before ``exp``, and for A < 0 the loss
    is capped at ``-dual_clip * A`` (dual-clip PPO, Ye et al. 2020, arXiv:1912.09729): per token
    ``min(max(-r A, -clip(r) A), -c A)``. A capped or clamped token gets no gradient.

    Args:
        logprobs: (B, T) log-probs of the current policy (with gradient).
        old_logprobs: (B, T) log-probs of the policy that sampled (no gradient).
        advantages: (B,) one per sequence, broadcast over its tokens.
        mask: (B, T) 1 = sampled token (trained), 0 = prompt, tool output, padding.
        clip_low: the ratio's lower clip is ``1 - clip_low``.
        clip_high: the ratio's upper clip is ``1 + clip_high``.
        dual_clip: c > 1, the cap on a negative-advantage token's loss in units of |A|; None turns it off.
        max_log_ratio: the bound on |log r| before ``exp``; 20 leaves every ratio PPO can act on untouched.

    Returns:
        per_token: (B, T) the loss above on sampled tokens, exactly 0 elsewhere (so masked tokens get no
            gradient), to be reduced with ``aggregate``;
        stats: ``clip_frac`` (share of sampled tokens where the clipped term was chosen), ``dual_clip_frac``
            (sampled tokens whose loss the dual clip capped), ``ratio_max_dev`` (max |ratio - 1|: ~0 on the
            first update of a batch), ``approx_kl`` (k3 of old vs new), as sums/maxima over sampled tokens
            (``clip_frac``/``dual_clip_frac``/``approx_kl`` as sums: divide by token count).

    Raises:
        ValueError: ``dual_clip`` set but not above 1 (a cap at or below |A| would bite at ratio <= 1, inside the
            trust region), or ``max_log_ratio`` not positive.

    >>> lp = torch.zeros(1, 3); adv = torch.tensor([2.0]); m = torch.tensor([[0, 1, 1]])
    >>> loss, stats = policy_loss(lp, lp, adv, m)
    >>> loss.abs().tolist(), float(stats["ratio_max_dev"])  # ratio 1: the loss is -A on sampled tokens
    ([[0.0, 2.0, 2.0]], 0.0)
    >>> stale = torch.tensor([[0.0, 5.0, 100.0]])  # ratios e^5 and e^100 (inf in float32 without the clamp)
    >>> loss, stats = policy_loss(stale, lp, torch.tensor([-1.0]), m)
    >>> loss.tolist(), float(stats["dual_clip_frac"])  # A = -1: each capped at 3 |A|
    ([[0.0, 3.0, 3.0]], 2.0)
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to turn it off), got {dual_clip}")
    if max_log_ratio <= 0:
        raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
    mask = mask.to(logprobs.dtype)
    # one stale token would otherwise make exp() inf and the whole mini-batch's loss NaN; the clamp also turns
    # an inf on a masked position into a finite number that the mask can zero (inf * 0 is NaN)
    log_ratio = torch.clamp(logprobs - old_logprobs, -max_log_ratio, max_log_ratio) * mask  # 0 masked: ratio 1
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    capped = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        # for A < 0 PPO-clip leaves r unbounded above: a token the policy now favours far more than the sampler
        # did pushes with weight r |A|; cap it at c |A|, a constant, so the token stops pushing
        bound = -dual_clip * adv  # (B, 1)
        capped = (adv < 0) & (per_token > bound)  # strict: at the bound the plain gradient is kept
        per_token = torch.where(capped, bound, per_token)
    per_token = per_token * mask
    with torch.no_grad():
        stats = {
            "clip_frac": ((clipped < unclipped).to(mask.dtype) * mask).sum(),
            "dual_clip_frac": (capped.to(mask.dtype) * mask).sum(),
            "ratio_max_dev": ((ratio - 1).abs() * mask).max() if mask.any() else torch.zeros(()),
            "approx_kl": ((torch.exp(-log_ratio) + log_ratio - 1) * mask).sum(),
        }
    return per_token, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, max_value: float = 10.0,
          max_log_ratio: float = 20.0) -> torch.Tensor:  # fmt: skip
    """Per-token k3 estimator of KL(policy || reference): exp(ref - lp) - (ref - lp) - 1 >= 0, 0 where masked
    (verl's ``low_var_kl``, with its guards: ref - lp clamped to ``[-max_log_ratio, max_log_ratio]`` before
    ``exp``, the result to ``[-max_value, max_value]``; a clamped token gets no gradient).

    Args:
        logprobs: (B, T) log-probs of the current policy (with gradient).
        ref_logprobs: (B, T) log-probs of the reference policy (no gradient).
        mask: (B, T) 1 = sampled token.
        max_value: the bound on each token's k3; k3 >= 0, so in effect ``[0, max_value]``.
        max_log_ratio: the bound on |ref - lp| before ``exp``.

    Returns:
        (B, T) per-token k3, 0 where masked.

    >>> kl_k3(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2)).tolist()
    [[0.0, 0.0]]
    >>> kl_k3(torch.tensor([[-1000.0]]), torch.zeros(1, 1), torch.ones(1, 1)).tolist()  # exp(1000): capped
    [[10.0]]
    """
    mask = mask.to(logprobs.dtype)
    # the policy drifting far from the reference on one token (a log-prob near -inf) would make exp() inf and
    # the KL term dominate, or NaN, the whole loss
    diff = torch.clamp(ref_logprobs - logprobs, -max_log_ratio, max_log_ratio) * mask
    return torch.clamp(torch.exp(diff) - diff - 1, -max_value, max_value) * mask


def rollout_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       cap: float = 2.0, max_log_ratio: float = 20.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Token-level truncated importance sampling (TIS) between the engine that sampled and the trainer that scores.

    The rollout engine (vLLM's kernels, bf16, another batching) draws from a distribution a hair off the trainer's
    at the same weights; PPO's ratio is taken against the trainer's old log-probs, so the batch is slightly
    off-policy. Each sampled token's loss is weighted by ``min(pi_old / pi_sampler, cap)`` (Yao et al., "Your
    efficient RL framework secretly brings you off-policy RL training"; verl's ``rollout_is`` at token level, TRL's
    ``vllm_importance_sampling_cap``). The weight carries no gradient.

    Args:
        old_logprobs: (B, T) the trainer's log-probs of the tokens under the weights that sampled them.
        sampler_logprobs: (B, T) the engine's recorded log-probs of the same tokens.
        mask: (B, T) 1 = sampled token.
        cap: the weight's upper bound (verl recommends 2).
        max_log_ratio: the bound on |log ratio| before ``exp``.

    Returns:
        weights: (B, T) detached, ``min(exp(old - sampler), cap)`` on sampled tokens, 1 elsewhere.
        stats: sums over sampled tokens (divide by their count): ``is_ratio`` (the ratio before the cap),
            ``is_clipped`` (tokens whose ratio passed the cap), ``sampler_kl`` (k3 estimate of KL(sampler ||
            trainer) from the sampler's draws), and ``is_ratio_max`` (a maximum).

    >>> old = torch.tensor([[0.0, -1.0, -1.0, -3.0]]); sampler = torch.tensor([[0.0, -1.0, -2.5, -1.0]])
    >>> w, st = rollout_correction(old, sampler, torch.tensor([[0, 1, 1, 1]]), cap=2.0)
    >>> [round(v, 4) for v in w[0].tolist()], int(st["is_clipped"])  # e^1.5 = 4.48 capped at 2; e^-2 kept
    ([1.0, 1.0, 2.0, 0.1353], 1)
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        sampled = mask.bool()
        log_ratio = torch.clamp(old_logprobs.float() - sampler_logprobs.float(), -max_log_ratio, max_log_ratio)
        log_ratio = log_ratio.masked_fill(~sampled, 0.0)  # 1 where nothing was sampled
        ratio = torch.exp(log_ratio)
        weights = ratio.clamp(max=cap)
        as_mask = sampled.float()
        stats = {
            "is_ratio": (ratio * as_mask).sum(),
            "is_ratio_max": ratio[sampled].max() if bool(sampled.any()) else torch.ones(()),
            "is_clipped": ((ratio > cap).float() * as_mask).sum(),
            # k3 of KL(sampler || trainer) with r = pi_old / pi_sampler, x ~ sampler: (r - 1) - log r >= 0
            "sampler_kl": ((ratio - 1 - log_ratio) * as_mask).sum(),
        }
    return weights, stats


def loss_normalizer(trained_tokens: list[int], mode: Aggregation, max_tokens: int = 0) -> float:
    """This rank's share of ``aggregate``'s normalizer for a mini-batch whose trajectories train ``trained_tokens``
    tokens each (0: fully masked, e.g. by over-turn masking); the caller adds the shares over ranks.

    ``"token"``: the trained tokens. ``"sequence"``: the sequences with a trained token; a fully masked one adds no
    loss and stays out of the denominator too (verl's ``agg_loss``), else every kept sequence would be scaled down
    by the step's share of masked ones. ``"dr_grpo"``: a constant, every sequence x ``max_tokens`` (the most tokens
    one may sample), TRL's ``loss_type="dr_grpo"`` (batch x ``max_completion_length``), so that neither a
    sequence's length nor the batch's contents change a token's weight.

    >>> [loss_normalizer([0, 2, 3], mode, max_tokens=8) for mode in ("token", "sequence", "dr_grpo")]
    [5.0, 2.0, 24.0]
    """
    if mode == "token":
        return float(sum(trained_tokens))
    if mode == "sequence":
        return float(sum(n > 0 for n in trained_tokens))
    if mode == "dr_grpo":
        if max_tokens <= 0:
            raise ValueError(f"dr_grpo needs max_tokens > 0, got {max_tokens}")
        return float(len(trained_tokens) * max_tokens)
    raise ValueError(f"aggregation must be 'token', 'sequence' or 'dr_grpo', got {mode!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, normalizer: float) -> torch.Tensor:
    """Reduce (B, T) per-token terms to this micro-batch's share of the mini-batch loss (``normalizer``: the sum of
    every rank's ``loss_normalizer``).

    ``"token"`` and ``"dr_grpo"``: sum over sampled tokens / ``normalizer``.
    ``"sequence"``: sum over sequences of each sequence's token mean / ``normalizer``.

    >>> t = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]]); m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> round(float(aggregate(t, m, "token", 3)), 4), float(aggregate(t, m, "sequence", 2))
    (1.6667, 2.0)
    """
    if mode in ("token", "dr_grpo"):
        return per_token.sum() / normalizer
    if mode == "sequence":
        counts = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # (B,) a fully masked row adds 0
        return (per_token.sum(dim=1) / counts).sum() / normalizer
    raise ValueError(f"aggregation must be 'token', 'sequence' or 'dr_grpo', got {mode!r}")


def sampled_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (with gradient) of the sampled tokens, and the entropy of the distributions they came from.

    Only the sampled positions' logits are upcast to fp32 and normalized, so memory is (sampled tokens, V),
    not (B, T, V).

    Args:
        logits: (B, T, V); position t predicts token t + 1.
        input_ids: (B, T).
        mask: (B, T) 1 = sampled token.

    Returns:
        logprobs: (B, T) float32; log p(x_t | x_<t) at sampled tokens, 0 elsewhere (position 0 is never sampled).
        entropy_sum: () float32, no gradient: the summed entropy of the next-token distributions at the
            sampled positions (divide by the number of sampled tokens for the mean).

    >>> lp, ent = sampled_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 1]]))
    >>> [round(v, 4) for v in lp[0].tolist()], round(float(ent), 4)  # uniform over 4: log(1/4), entropy log 4
    ([0.0, -1.3863, -1.3863], 2.7726)
    """
    selected = mask[:, 1:].bool()  # (B, T-1) 1 = the token at t+1 was sampled
    x = logits[:, :-1][selected].float()  # (N, V)
    log_norm = torch.logsumexp(x, dim=-1)  # (N,)
    picked = x.gather(-1, input_ids[:, 1:][selected].unsqueeze(-1)).squeeze(-1) - log_norm
    shifted = torch.zeros(selected.shape, dtype=torch.float32, device=logits.device).masked_scatter(selected, picked)
    with torch.no_grad():
        lp_all = x - log_norm.unsqueeze(-1)
        entropy_sum = -(lp_all.exp() * lp_all).sum()
    return torch.nn.functional.pad(shifted, (1, 0)), entropy_sum

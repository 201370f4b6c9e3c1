"""The preference losses of DPO: a pair (chosen, rejected) of trajectories for one prompt, each scored by the policy
and by a frozen reference, and a loss that raises the policy's chosen-over-rejected log-ratio against the reference's.

With ``pi_c``, ``pi_r`` the policy's sequence log-probs of the chosen and rejected trajectory and ``ref_c``, ``ref_r``
the reference's, the pair's margin is ``h = (pi_c - ref_c) - (pi_r - ref_r)`` and

* ``sigmoid``: ``-log sigmoid(beta h)`` (Rafailov et al. 2023, eq. 7), with ``label_smoothing`` e the conservative
  DPO of Mitchell 2023: ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)``, for labels flipped at rate e;
* ``sigmoid_norm``: the same on length-normalized log-probs (the token mean, not the sum; Tulu 3's "dpo_norm"): a
  long trajectory does not win or lose by its length alone. The margins are per token, so beta is larger (Tulu 3
  uses 5 where summed DPO uses 0.1);
* ``ipo``: ``(h - 1 / (2 beta))^2`` (Azar et al. 2023, eq. 17) on length-normalized log-probs, as TRL computes it: a
  squared loss that stops pushing once the margin reaches ``1 / (2 beta)``.

The implicit rewards ``beta (pi - ref)`` of each side, their margin and how often the chosen one wins (accuracy) are
what TRL logs as ``rewards/*``; ``pair_stats`` computes them. Only what a trajectory sampled (or a gold assistant turn)
is scored: the sequence log-prob is over the loss mask's tokens, the same mask SFT trains.

``self_critic_pairs`` is Tool-Star's pair rule for DPO on a policy's own rollouts (Dong et al. 2025, arXiv:2505.16410):
in each group of samples of one prompt, the sample the reward ranks highest against the one it ranks lowest.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "LOSS_TYPES",
    "DPOLossType",
    "dpo_loss",
    "length_normalized",
    "pair_stats",
    "self_critic_pairs",
    "sequence_logprobs",
]

DPOLossType = Literal["sigmoid", "sigmoid_norm", "ipo"]
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "sigmoid_norm", "ipo")


def length_normalized(loss_type: str) -> bool:
    """Whether ``loss_type`` compares token-mean log-probs (``sigmoid_norm``, ``ipo``) rather than sums."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; known: {list(LOSS_TYPES)}")
    return loss_type != "sigmoid"


def sequence_logprobs(token_logprobs: torch.Tensor, loss_mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Each sequence's log-prob over its trained tokens: the sum, or with ``average`` the mean per trained token.

    Args:
        token_logprobs: (N, T) log p(x_t | x_<t), position t scoring token t (``masked_token_logprobs``' layout);
            whatever is outside the mask is ignored.
        loss_mask: (N, T) 1 = a trained token (sampled, or gold assistant content), 0 = forced or padding. Position 0
            is never scored (nothing predicts it).
        average: The token mean instead of the sum (a sequence without trained tokens gets 0).

    Returns:
        (N,) float32.

    >>> lp = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    >>> mask = torch.tensor([[1, 1, 0, 1]])  # position 0 never counts; token 2 is forced
    >>> sequence_logprobs(lp, mask).tolist(), sequence_logprobs(lp, mask, average=True).tolist()
    ([-4.0], [-2.0])
    """
    scored = loss_mask[:, 1:].to(token_logprobs.dtype)  # (N, T-1) 1 = token t+1 is scored
    total = (token_logprobs[:, 1:].float() * scored).sum(dim=1)
    if not average:
        return total
    return total / scored.sum(dim=1).clamp(min=1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair DPO loss (see the module docstring for the variants).

    Args:
        policy_chosen, policy_rejected: (B,) the policy's sequence log-probs (``sequence_logprobs``, averaged for the
            length-normalized types), with gradient.
        ref_chosen, ref_rejected: (B,) the frozen reference's, the same way; no gradient flows into them.
        beta: Strength of the tie to the reference (> 0).
        loss_type: ``sigmoid``, ``sigmoid_norm`` or ``ipo``. The caller normalizes the log-probs
            (``length_normalized(loss_type)``); this function only applies the loss to the margin.
        label_smoothing: Assumed rate of flipped preference labels, in [0, 0.5) (sigmoid types only).

    Returns:
        (B,) float32 losses; the step's loss is their mean over every pair of the step.

    A pair the policy already prefers more than the reference does (margin 1 nat, beta 1):

    >>> one, zero = torch.tensor([1.0]), torch.tensor([0.0])
    >>> round(float(dpo_loss(one, zero, zero, zero, beta=1.0)), 4)  # -log sigmoid(1)
    0.3133
    >>> round(float(dpo_loss(one, zero, zero, zero, beta=1.0, loss_type="ipo")), 4)  # (1 - 1/2)^2
    0.25
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    margin = (policy_chosen.float() - ref_chosen.detach().float()) - (
        policy_rejected.float() - ref_rejected.detach().float()
    )  # (B,) h
    if loss_type in ("sigmoid", "sigmoid_norm"):
        return -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    if loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid losses, not to ipo")
        return (margin - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}; known: {list(LOSS_TYPES)}")


def pair_stats(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> dict[str, torch.Tensor]:
    """Per-pair statistics TRL logs, summed over the pairs (divide by their count for the means), no gradient.

    Returns:
        ``rewards/chosen``, ``rewards/rejected``: beta x (policy - reference) log-prob of each side (the implicit
        reward); ``rewards/margin``: their difference; ``rewards/accuracy``: pairs whose chosen reward is the larger;
        ``logratio/chosen``, ``logratio/rejected``: policy - reference log-prob of each side (the rewards / beta);
        ``logps/chosen``, ``logps/rejected``: the policy's log-probs. Each a () float32 sum.

    >>> s = pair_stats(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    >>> {k: float(v) for k, v in s.items() if k.startswith("rewards")}
    {'rewards/chosen': 0.5, 'rewards/rejected': -0.5, 'rewards/margin': 1.0, 'rewards/accuracy': 1.0}
    """
    with torch.no_grad():
        chosen = policy_chosen.float() - ref_chosen.float()  # (B,)
        rejected = policy_rejected.float() - ref_rejected.float()
        return {
            "rewards/chosen": beta * chosen.sum(),
            "rewards/rejected": beta * rejected.sum(),
            "rewards/margin": beta * (chosen - rejected).sum(),
            "rewards/accuracy": (chosen > rejected).float().sum(),
            "logratio/chosen": chosen.sum(),
            "logratio/rejected": rejected.sum(),
            "logps/chosen": policy_chosen.detach().float().sum(),
            "logps/rejected": policy_rejected.detach().float().sum(),
        }


def self_critic_pairs(
    rewards: torch.Tensor,
    group_size: int,
    *,
    margin: float = 0.0,
    can_choose: torch.Tensor | None = None,
    can_reject: torch.Tensor | None = None,
    max_pairs: int = 0,
    eps: float = 1e-6,
) -> list[tuple[int, int]]:
    """Preference pairs from groups of rollouts ranked by their reward: per group, its highest-reward sample (chosen)
    against its lowest (rejected), when their gap exceeds ``margin``.

    Args:
        rewards: (G * S,) total rewards, the S samples of each group consecutive (as ``rollout.run`` returns them).
        group_size: S.
        margin: A pair needs reward(chosen) - reward(rejected) > margin (+ ``eps``, so that a group whose rewards
            differ by float noise alone, which dynamic sampling also treats as all equal, makes none). >= 0.
        can_choose: (G * S,) bool, the samples that may be chosen (None: all). A sample cut by a cap should not be:
            its reward may rank high, but it is an episode that did not finish.
        can_reject: (G * S,) bool, the samples that may be rejected (None: all).
        max_pairs: At most this many pairs, those of the largest reward gaps (an equal gap: the earlier group);
            0 = every pair.
        eps: Float tolerance of the gap test.

    Returns:
        ``(chosen, rejected)`` indices into ``rewards``, in group order. Ties pick the earlier sample, so the rule is
        a pure function of its inputs. A group without an eligible chosen or rejected sample, or whose gap is at most
        the margin, gives none.

    >>> r = torch.tensor([0.2, 1.0, 0.0, 1.0,   0.5, 0.5, 0.5, 0.5,   0.9, 0.3, 0.8, 0.1])
    >>> self_critic_pairs(r, 4)  # group 1's best is sample 1 (the earlier of two); group 2 is all equal
    [(1, 2), (8, 11)]
    >>> self_critic_pairs(r, 4, margin=0.9)  # gaps 1.0 and 0.8
    [(1, 2)]
    >>> self_critic_pairs(r, 4, can_choose=torch.tensor([True] * 8 + [False, True, True, True]))
    [(1, 2), (10, 11)]
    """
    if rewards.ndim != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (n_groups * group_size,) with group_size >= 2, got {tuple(rewards.shape)}, "
                         f"{group_size}")  # fmt: skip
    if margin < 0 or max_pairs < 0:
        raise ValueError(f"need margin >= 0 and max_pairs >= 0, got {margin}, {max_pairs}")
    grouped = rewards.detach().double().view(-1, group_size)  # (G, S)
    choose = torch.ones_like(grouped, dtype=torch.bool) if can_choose is None else can_choose.view(-1, group_size)
    reject = torch.ones_like(grouped, dtype=torch.bool) if can_reject is None else can_reject.view(-1, group_size)
    best = grouped.masked_fill(~choose, float("-inf")).max(dim=1)  # ties: max returns the first index
    worst = grouped.masked_fill(~reject, float("inf")).min(dim=1)
    gaps = best.values - worst.values  # (G,) -inf/nan where a side has no eligible sample
    found = [(float(gaps[g]), g) for g in range(grouped.shape[0]) if gaps[g] > margin + eps]
    if max_pairs:
        found = sorted(sorted(found, key=lambda x: -x[0])[:max_pairs], key=lambda x: x[1])  # stable: earlier group
    return [(g * group_size + int(best.indices[g]), g * group_size + int(worst.indices[g])) for _, g in found]

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
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["LOSS_TYPES", "DPOLossType", "dpo_loss", "length_normalized", "pair_stats", "sequence_logprobs"]

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

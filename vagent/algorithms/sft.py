"""The masked next-token loss of SFT.

The loss of a step is the mean negative log-likelihood over every trained token of the *whole* step
(all micro-batches on all ranks), not a mean of per-batch means: a long conversation weighs as much
as its tokens, whatever batch it landed in, and 2 ranks x 1 micro-batch give the same gradient as
1 rank x 2 micro-batches. So each micro-batch contributes ``token_nll_sum / N`` with ``N`` the step's
trained-token count (``trained_token_count`` summed over micro-batches and ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["token_nll_sum", "trained_positions", "trained_token_count"]


def trained_token_count(loss_mask: torch.Tensor) -> torch.Tensor:
    """Tokens that get a loss: position t is predicted from t-1, so position 0 never does. (B, T) -> ()"""
    return loss_mask[:, 1:].sum()


def trained_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """The positions whose logits the loss reads: t, where token t + 1 is trained. (B, T) -> (B, T) bool; pass
    it to ``policy_logits(..., positions=)`` and the head's logits come only for these."""
    positions = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    positions[:, :-1] = loss_mask[:, 1:].bool()
    return positions


def token_nll_sum(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the trained tokens.

    Args:
        logits: (B, T, V) the model's outputs, position t predicting token t + 1; or (N, V), those of the
            ``trained_positions`` alone, row by row (``policy_logits(..., positions=)``).
        input_ids: (B, T) the tokens.
        loss_mask: (B, T) 1 = train on this token (gold assistant content), 0 = prompt, tool output, padding.

    Returns:
        () float32 sum over trained tokens. Only the trained positions' logits are upcast to fp32, so the
        memory cost is (trained tokens, V), not (B, T, V). Untrained positions get exactly zero gradient.

    Example: uniform logits over V=4 give log(4) per trained token.

    >>> logits = torch.zeros(1, 3, 4)
    >>> round(float(token_nll_sum(logits, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 1]]))), 4)  # 2 log 4
    2.7726
    """
    trained = loss_mask[:, 1:].bool()  # (B, T-1) 1 = the token at t+1 is trained
    predicted = (logits if logits.dim() == 2 else logits[:, :-1][trained]).float()  # (N, V)
    targets = input_ids[:, 1:][trained]  # (N,)
    return F.cross_entropy(predicted, targets, reduction="sum")

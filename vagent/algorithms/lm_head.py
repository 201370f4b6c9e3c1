"""Token log-probs through the language-model head in chunks of positions: never (positions x vocabulary) logits whole.

At Qwen's 151,936-row vocabulary the head's output dwarfs every activation of a long sequence: one GRPO update
over 16 x 1,500 sampled tokens is 24,000 x 151,936 fp32 logits = 14.6 GB, and autograd keeps that (and its
softmax) until backward. ``chunked_token_logprobs`` runs the head on ``chunk_size`` positions at a time; each
chunk is activation-checkpointed, so forward keeps only the (N,) results and the hidden states it already had,
and backward recomputes one chunk's logits at a time. The cost is one more head matmul per chunk (the
recompute), about 1/3 more head FLOPs; the values and gradients are those of the whole computation.

The head is a callable (the model's ``lm_head`` module), not its weight: calling the module keeps the hooks
that DeepSpeed ZeRO-3 (gather the partitioned weight) and other wrappers put on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_token_logprobs", "nucleus_mask"]


def nucleus_mask(probs: torch.Tensor, top_p: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(R, V) probabilities -> (R, V) bool, True outside the nucleus: the smallest set of most likely tokens whose
    mass reaches ``top_p`` (always at least the top token). The sampler and the trainer both cut with it, so the
    ratio is taken between the same truncated distributions.

    Args:
        probs: (R, V) rows summing to 1 (the tempered softmax).
        top_p: Nucleus mass in (0, 1]; 1 keeps everything.
        keep: (R,) token ids never cut (the trainer keeps the sampled token even where its own numerics put it a
            hair outside the nucleus the sampler saw: a -inf log-prob would make the loss NaN).

    >>> nucleus_mask(torch.tensor([[0.5, 0.3, 0.2]]), 0.7).tolist()  # 0.5 < 0.7: the second token joins
    [[False, False, True]]
    """
    if top_p >= 1.0:
        return torch.zeros_like(probs, dtype=torch.bool)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) > top_p  # the mass before a token already reaches top_p
    drop = torch.zeros_like(outside).scatter(-1, order, outside)
    if keep is not None:
        drop[torch.arange(drop.shape[0], device=drop.device), keep] = False
    return drop


def _chunk_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    suppress: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, H) hidden, (C,) targets -> (C,) fp32 log p(target), () fp32 summed entropy (no gradient)."""
    logits = head(hidden).float()  # (C, V): the only place logits exist, one chunk at a time
    if suppress:  # tokens the sampler never draws: out of the distribution before anything else, as it does
        logits = logits.index_fill(-1, torch.tensor(suppress, device=logits.device), float("-inf"))
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:  # the nucleus is a choice of tokens, not a function to differentiate: cut under no_grad
        with torch.no_grad():
            drop = nucleus_mask(torch.softmax(logits, dim=-1), top_p, keep=targets)
        logits = logits.masked_fill(drop, float("-inf"))
    # log_softmax keeps only its output for backward (whose fused kernel writes one more (C, V) buffer), and
    # gather's backward one: three (C, V) fp32 buffers at the peak, not the five of logsumexp and a subtraction
    log_p = torch.log_softmax(logits, dim=-1)  # (C, V)
    del logits
    picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # a row-wise dot product (bmm): no (C, V) product buffer
        cut = top_p < 1.0 or suppress
        finite = log_p.clamp(min=torch.finfo(log_p.dtype).min) if cut else log_p  # 0 * -inf is NaN
        entropy = -torch.einsum("cv,cv->c", log_p.exp(), finite).sum()
    return picked, entropy


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float = 1.0,
    suppress: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / temperature)[target] for each row, the head run on ``chunk_size`` rows at a time;
    with ``top_p`` < 1, of that distribution cut to its nucleus and renormalized (what the sampler drew from).

    Args:
        hidden: (N, H) final hidden states (after the last norm) of the positions to score.
        head: the language-model head, (C, H) -> (C, V) logits (the ``lm_head`` module).
        targets: (N,) int64 token ids the positions predict.
        chunk_size: rows per chunk; peak memory of the head is about 3 x chunk_size x V x 4 bytes (the fp32
            logits, their softmax and its gradient, in backward), not N x V.
        temperature: logits are divided by it before the softmax (1 = the model's own distribution).
        top_p: nucleus mass (1 = off); the target is always kept in its row's nucleus (``nucleus_mask``). The cut
            sorts each chunk's (C, V) probabilities, about 3 more (C, V) buffers at the peak (values, int64 order,
            cumulative sum), again in backward's recompute; tokens outside the nucleus get no gradient. verl and
            TRL train with the temperature alone; vagent's configs keep top_p at 1.
        suppress: token ids taken out of every distribution first (logit -inf), as the samplers take out the vision
            placeholders (``Policy.vision_placeholder_ids``): the distribution scored is the one drawn from.

    Returns:
        logprobs: (N,) float32, with gradient to ``hidden`` and the head's parameters when they require it.
        entropy_sum: () float32, no gradient: the summed entropy of the N (tempered) next-token distributions.

    >>> head = torch.nn.Linear(2, 4, bias=False).requires_grad_(False)
    >>> _ = head.weight.zero_()  # uniform over 4 tokens
    >>> lp, ent = chunked_token_logprobs(torch.ones(3, 2), head, torch.tensor([0, 1, 3]), chunk_size=2)
    >>> [round(v, 4) for v in lp.tolist()], round(float(ent), 4)  # log(1/4) each; entropy 3 log 4
    ([-1.3863, -1.3863, -1.3863], 4.1589)
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"need hidden (N, H) and targets (N,), got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_size <= 0 or temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"need chunk_size > 0, temperature > 0 and top_p in (0, 1], got {chunk_size}, {temperature}, "
                         f"{top_p}")  # fmt: skip
    params = head.parameters() if isinstance(head, torch.nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    pieces, entropy = [], torch.zeros((), dtype=torch.float32, device=hidden.device)
    # an empty selection still runs the head once (on 0 rows), so its parameters stay in the graph for DDP
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if needs_grad:  # keep only the chunk's inputs; backward recomputes its logits
            lp, ent = checkpoint(_chunk_logprobs, head, h, t, temperature, top_p, suppress, use_reentrant=False,
                                 preserve_rng_state=False)  # fmt: skip
        else:
            lp, ent = _chunk_logprobs(head, h, t, temperature, top_p, suppress)
        pieces.append(lp)
        entropy = entropy + ent.detach()
    return torch.cat(pieces), entropy

"""Tool-Star's self-critic DPO step inside GRPO: the policy learns what its reward prefers from preference pairs it
builds out of its own rollouts, with no new generation.

Tool-Star (Dong et al. 2025, arXiv:2505.16410) trains with GRPO on a hierarchical reward and, in its "multi-tool
self-critic RL", alternates it with DPO on pairs of the policy's own samples ranked by that reward. Its repository
(github.com/dongguanting/Tool-Star) runs that DPO offline, as a separate job: pairs sampled from an RL checkpoint are
written out and trained with LLaMA-Factory's DPO (``LLaMA-Factory-main/examples/train_lora/qwen_lora_dpo_2.yaml``:
LoRA, sigmoid loss, beta 0.1, lr 5e-6, its own optimizer), the checkpoint that sampled being the reference; its README
calls the stage optional. Here the step runs inside the GRPO loop, on the step's own groups:

* **Pairs** (``vagent.algorithms.self_critic_pairs``): per group the update trained on, its highest-reward trajectory
  against its lowest, when the gap exceeds the margin. A trajectory cut by a cap is not chosen (an unfinished
  episode is not what to imitate, whatever its partial reward; ``capped_chosen`` lifts that where the caps are the
  task) but may be rejected, unless over-turn masking took its loss mask away (``grpo.mask_truncated``: it then
  trains nothing, DPO included). Groups that dynamic sampling dropped have all-equal rewards and would make no pair
  anyway.
* **The reference** is the weights that sampled: the step's old log-probs of the same tokens (GRPO's ``_Scored.old``),
  so DPO needs no reference model and no extra forward, and pi - ref is how far this step's updates moved each side.
  The caller's ``score`` scores as GRPO does (the sampler's temperature and nucleus), so the two are one quantity.
* **The optimizer** is GRPO's AdamW: one extra step at ``lr_scale`` x the rate of the update's last optimizer step,
  which the schedule does not count. No second set of AdamW moments (twice the trained weights in fp32), and checkpoints and resume are
  unchanged. Tool-Star's separate job starts a fresh optimizer instead; sharing the moments scales the DPO step by
  the gradient statistics of both objectives.
* **Lockstep.** Ranks find different numbers of pairs. Every rank runs as many micro-batches as the rank with the
  most (a rank with fewer runs one of its pairs again at weight 0), so DDP's gradient all-reduce and FSDP's gathers
  meet, and the loss is the mean over every pair of every rank. When no rank finds a pair, nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from vagent.algorithms import dpo_loss, length_normalized, pair_stats, self_critic_pairs, sequence_logprobs
from vagent.data.batching import collate_pairs
from vagent.data.encode import Encoded
from vagent.training.backend import TrainBackend, clip_and_step
from vagent.training.distributed import all_reduce_min, all_reduce_sum

__all__ = ["self_critic_step"]

Batch = dict[str, torch.Tensor]


def self_critic_step(backend: TrainBackend, encoded: Sequence[Encoded], old: Sequence[torch.Tensor],
                     rewards: Sequence[float], capped: Sequence[bool], *, group_size: int, margin: float, beta: float,
                     loss_type: str, lr_scale: float, max_pairs: int, pairs_per_micro: int, pad_id: int,
                     device: torch.device, score: Callable[[Batch], torch.Tensor],
                     capped_chosen: bool = False) -> dict[str, float]:  # fmt: skip
    """Pair this rank's groups, then one DPO optimizer step over every rank's pairs (a collective: every rank calls it).

    Args:
        backend: GRPO's train backend (DDP or FSDP), after the step's update (no gradient held).
        encoded: The step's trajectories as the update trained them (loss mask 1 = sampled; all 0 if masked), group
            after group.
        old: Per trajectory, (T_i,) log-probs of the weights that sampled (0 off the mask): the reference.
        rewards: Per trajectory, its total reward.
        capped: Per trajectory, whether a cap cut it (never chosen unless ``capped_chosen``).
        group_size: Trajectories per group.
        margin, max_pairs: The pair rule's (``self_critic_pairs``; ``max_pairs`` is per rank).
        beta, loss_type: The DPO loss's (``vagent.algorithms.dpo_loss``).
        lr_scale: The step's learning rate over that of the update's last optimizer step.
        pairs_per_micro: Pairs per forward (2x as many rows).
        pad_id: Padding token id.
        device: Where the batches go.
        score: (2B, T) log-probs of a collated batch's masked tokens under ``backend.module``, with gradient.
        capped_chosen: Let a capped trajectory be chosen (when the caps are the task, or nearly every episode hits
            one).

    Returns:
        ``dpo/pairs`` (over all ranks); when there were any, the per-pair means ``dpo/loss``, ``dpo/reward_margin``
        (beta x the log-ratio margin), ``dpo/chosen_logratio``, ``dpo/rejected_logratio`` (policy - sampler, before
        this step), ``dpo/accuracy`` (pairs whose chosen side gained more) and ``dpo/reward_gap`` (the task reward's),
        and the step's ``dpo/grad_norm``.
    """
    n = len(encoded)
    if not len(old) == len(rewards) == len(capped) == n:
        raise ValueError(f"need one old log-prob row, reward and cap flag per trajectory ({n}), got "
                         f"{len(old)}, {len(rewards)}, {len(capped)}")  # fmt: skip
    can_reject = torch.tensor([bool(e.loss_mask.any()) for e in encoded], dtype=torch.bool)  # (N,) has trained tokens
    can_choose = can_reject & ~torch.tensor([c and not capped_chosen for c in capped], dtype=torch.bool)
    pairs = self_critic_pairs(torch.tensor(list(rewards)), group_size, margin=margin, can_choose=can_choose,
                              can_reject=can_reject, max_pairs=max_pairs)  # fmt: skip
    micro = [pairs[i : i + pairs_per_micro] for i in range(0, len(pairs), pairs_per_micro)]
    gap = sum(rewards[c] - rewards[r] for c, r in pairs)
    totals = all_reduce_sum(torch.tensor([float(len(pairs)), gap], dtype=torch.float64, device=device))
    n_pairs = float(totals[0])
    if not n_pairs:
        return {"dpo/pairs": 0.0}
    steps = -int(all_reduce_min(torch.tensor([-float(len(micro))], dtype=torch.float64, device=device)))
    # a rank with fewer micro-batches repeats one of its pairs (or, with none, a trajectory against itself) at weight 0
    filler = micro[-1] if micro else [(int(can_reject.int().argmax()),) * 2]
    average = length_normalized(loss_type)
    sums: dict[str, torch.Tensor] = {}
    for k in range(steps):
        weight = 1.0 if k < len(micro) else 0.0
        chunk = micro[k] if k < len(micro) else filler
        sides = [c for c, _ in chunk] + [r for _, r in chunk]  # the B chosen rows, then the B rejected
        batch = collate_pairs([encoded[i] for i in sides[: len(chunk)]], [encoded[i] for i in sides[len(chunk) :]],
                              pad_id)  # fmt: skip
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        mask = batch["loss_mask"]  # (2B, T) 1 = sampled
        width = mask.shape[1]
        reference = torch.stack([F.pad(old[i].to(device), (0, width - len(old[i]))) for i in sides])  # (2B, T)
        with backend.accumulating(last=k == steps - 1):
            policy = sequence_logprobs(score(batch), mask, average=average)  # (2B,)
            ref = sequence_logprobs(reference, mask, average=average)
            b = len(chunk)
            losses = dpo_loss(policy[:b], policy[b:], ref[:b], ref[b:], beta=beta, loss_type=loss_type)  # (B,)
            backend.backward(losses.sum() * (weight / n_pairs))
        stats = pair_stats(policy[:b], policy[b:], ref[:b], ref[b:], beta=beta)
        stats["loss"] = losses.detach().sum()
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + weight * value
    grad_norm = _extra_step(backend, lr_scale)
    keys = ("loss", "rewards/margin", "logratio/chosen", "logratio/rejected", "rewards/accuracy")
    means = all_reduce_sum(torch.stack([sums[key].double().to(device) for key in keys])) / n_pairs
    names = ("loss", "reward_margin", "chosen_logratio", "rejected_logratio", "accuracy")
    return {"dpo/pairs": n_pairs, **{f"dpo/{name}": float(v) for name, v in zip(names, means, strict=True)},
            "dpo/reward_gap": float(totals[1]) / n_pairs, "dpo/grad_norm": grad_norm}  # fmt: skip


def _extra_step(backend: TrainBackend, lr_scale: float) -> float:
    """One step of the backend's optimizer at ``lr_scale`` x the rates of its last scheduled step (the update's; the
    schedule has moved on to the next step's, which after a run's last step is its floor), outside the schedule: it
    neither advances nor keeps the rates set here. GRPO's backends (DDP, FSDP) own a torch optimizer and a
    ``LambdaLR``; GRPO refuses DeepSpeed. Returns the pre-clip grad norm."""
    optimizer: torch.optim.Optimizer = backend.optimizer  # type: ignore[attr-defined]
    scheduler = backend.scheduler  # type: ignore[attr-defined]
    last = max(scheduler.last_epoch - 1, 0)  # the schedule position of the optimizer step just taken
    rates = [group["lr"] for group in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(last) * lr_scale
    try:
        grad_norm = clip_and_step(backend.model, optimizer, None, backend.max_grad_norm)  # type: ignore[attr-defined]
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
    return grad_norm

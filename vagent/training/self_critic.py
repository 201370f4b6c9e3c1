"""Tool-Star's self-critic DPO inside GRPO: the policy learns what its reward prefers from preference pairs it
builds out of its own rollouts, with no new generation.

Tool-Star (Dong et al. 2025, arXiv:2505.16410) trains with GRPO on a hierarchical reward and, in its "multi-tool
self-critic RL", alternates it with DPO on pairs of the policy's own samples ranked by that reward. Its repository
(github.com/dongguanting/Tool-Star) runs that DPO offline, as a separate job: pairs sampled from an RL checkpoint are
written out and trained with LLaMA-Factory's DPO (``LLaMA-Factory-main/examples/train_lora/qwen_lora_dpo_2.yaml``:
LoRA, sigmoid loss, beta 0.1, lr 5e-6, its own optimizer), the checkpoint that sampled being the reference; its README
calls the stage optional. Here the DPO loss joins the GRPO update, on the step's own groups:

* **Pairs** (``vagent.algorithms.self_critic_pairs``): per group the update trains on, its highest-reward trajectory
  against its lowest, when the gap exceeds the margin. A trajectory cut by a cap is not chosen (an unfinished
  episode is not what to imitate, whatever its partial reward; ``capped_chosen`` lifts that where the caps are the
  task) but may be rejected, unless over-turn masking took its loss mask away (``grpo.mask_truncated``: it then
  trains nothing, DPO included). Groups that dynamic sampling dropped have all-equal rewards and would make no pair
  anyway.
* **The reference** is the weights that sampled: the step's old log-probs of the same tokens (GRPO's ``_Scored.old``),
  so DPO needs no reference model and no extra forward, and pi - ref is how far the update's earlier optimizer steps
  moved each side (0 when it takes one).
  The caller's ``score`` scores as GRPO does (the sampler's temperature and nucleus), so the two are one quantity.
* **A loss term, not an optimizer step.** ``coef`` x the pairs' mean DPO loss joins the gradient of the update's last
  optimizer step: its micro-batches accumulate after the PPO loss's, and GRPO's AdamW steps once on the sum, clipped
  together, as verl adds its entropy and KL losses to the policy loss. The schedule, the optimizer state and the
  checkpoints are those of GRPO alone. A second step of the same AdamW (this module's first version) would go where
  GRPO's momentum points: its first moment is 0.9 m + 0.1 g, so the DPO gradient is a tenth of the step. A fresh
  optimizer, as Tool-Star's separate job has, would cost two fp32 moments per trained weight and new checkpoint state
  (docs/decisions/grpo-self-critic-loss.md).
* **Lockstep.** Ranks find different numbers of pairs. Every rank runs as many micro-batches as the rank with the
  most (a rank with fewer runs one of its pairs again at weight 0), so DDP's gradient all-reduce and FSDP's gathers
  meet, and the loss is the mean over every pair of every rank. When no rank finds a pair, nothing runs and the
  update closes its accumulation with its own last micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from vagent.algorithms import dpo_loss, length_normalized, pair_stats, self_critic_pairs, sequence_logprobs
from vagent.data.batching import collate_pairs
from vagent.data.encode import Encoded
from vagent.training.backend import TrainBackend
from vagent.training.distributed import all_reduce_min, all_reduce_sum

__all__ = ["SelfCritic"]

Batch = dict[str, torch.Tensor]


class SelfCritic:
    """One GRPO step's preference pairs over every rank, and the DPO loss term they add to its update.

    Made (a collective: every rank at the same point) before the update, from the trajectories it trains on; its
    ``backward`` then accumulates ``coef`` x the DPO loss into the gradient of the update's last optimizer step,
    which the caller takes. ``pairs`` is the number over every rank: at 0 there is nothing to add. ``record`` holds
    the ``dpo/*`` metrics (``dpo/pairs`` until ``backward`` adds the rest).

    Args:
        encoded: The step's trajectories as the update trains them (loss mask 1 = sampled; all 0 if masked), group
            after group.
        rewards: Per trajectory, its total reward.
        capped: Per trajectory, whether a cap cut it (never chosen unless ``capped_chosen``).
        group_size: Trajectories per group.
        margin, max_pairs: The pair rule's (``self_critic_pairs``; ``max_pairs`` is per rank).
        capped_chosen: Let a capped trajectory be chosen (when the caps are the task, or nearly every episode hits
            one).
        coef: The DPO loss's weight beside the update's loss.
        beta, loss_type: The DPO loss's (``vagent.algorithms.dpo_loss``).
        pairs_per_micro: Pairs per forward (2x as many rows).
        pad_id: Padding token id.
        device: Where the batches go.
        score: (2B, T) log-probs of a collated batch's masked tokens under the trained module, with gradient.
    """

    def __init__(self, encoded: Sequence[Encoded], rewards: Sequence[float], capped: Sequence[bool], *,
                 group_size: int, margin: float, max_pairs: int, capped_chosen: bool, coef: float, beta: float,
                 loss_type: str, pairs_per_micro: int, pad_id: int, device: torch.device,
                 score: Callable[[Batch], torch.Tensor]) -> None:  # fmt: skip
        n = len(encoded)
        if not len(rewards) == len(capped) == n:
            raise ValueError(f"need one reward and cap flag per trajectory ({n}), got {len(rewards)}, {len(capped)}")
        self.encoded, self.coef, self.beta, self.loss_type = encoded, coef, beta, loss_type
        self.pad_id, self.device, self.score = pad_id, device, score
        can_reject = torch.tensor([bool(e.loss_mask.any()) for e in encoded], dtype=torch.bool)  # (N,) trained tokens
        can_choose = can_reject & ~torch.tensor([c and not capped_chosen for c in capped], dtype=torch.bool)
        pairs = self_critic_pairs(torch.tensor(list(rewards)), group_size, margin=margin, can_choose=can_choose,
                                  can_reject=can_reject, max_pairs=max_pairs)  # fmt: skip
        self.micro = [pairs[i : i + pairs_per_micro] for i in range(0, len(pairs), pairs_per_micro)]
        gap = sum(rewards[c] - rewards[r] for c, r in pairs)
        totals = all_reduce_sum(torch.tensor([float(len(pairs)), gap], dtype=torch.float64, device=device))
        self.pairs, self.gap = float(totals[0]), float(totals[1])
        self.record: dict[str, float] = {"dpo/pairs": self.pairs}
        # micro-batches every rank runs: a rank with fewer repeats one of its pairs (or, with none, a trajectory
        # against itself) at weight 0
        self.steps = -int(all_reduce_min(torch.tensor([-float(len(self.micro))], dtype=torch.float64, device=device)))
        self.filler = self.micro[-1] if self.micro else [(int(can_reject.int().argmax()),) * 2]

    def backward(self, backend: TrainBackend, old: Sequence[torch.Tensor]) -> dict[str, float]:
        """Add ``coef`` x the mean DPO loss over every rank's pairs to ``backend``'s gradients (a collective; only when
        ``pairs``). Its micro-batches close the optimizer step's accumulation (the last one syncs under DDP): the
        caller has run its own micro-batches with ``last=False`` and steps after this.

        Args:
            backend: GRPO's train backend (DDP or FSDP), holding the update's accumulated gradient.
            old: Per trajectory, (T_i,) log-probs of the weights that sampled (0 off the mask): the reference.

        Returns:
            ``record``, now with the per-pair means ``dpo/loss`` (before ``coef``), ``dpo/reward_margin``
            (beta x the log-ratio margin), ``dpo/chosen_logratio``, ``dpo/rejected_logratio`` (policy - sampler, at
            the weights this optimizer step starts from), ``dpo/accuracy`` (pairs whose chosen side gained more) and
            ``dpo/reward_gap`` (the task reward's), and ``time/self_critic`` (its forwards and backwards).
        """
        if not self.pairs:  # the caller's own last micro-batch must then sync the accumulated gradient
            raise RuntimeError("the self-critic found no pair on any rank: there is no DPO loss to add")
        if len(old) != len(self.encoded):
            raise ValueError(f"need one old log-prob row per trajectory ({len(self.encoded)}), got {len(old)}")
        t0 = time.perf_counter()
        average = length_normalized(self.loss_type)
        sums: dict[str, torch.Tensor] = {}
        for k in range(self.steps):
            weight = 1.0 if k < len(self.micro) else 0.0
            chunk = self.micro[k] if k < len(self.micro) else self.filler
            sides = [c for c, _ in chunk] + [r for _, r in chunk]  # the B chosen rows, then the B rejected
            b = len(chunk)
            batch = collate_pairs([self.encoded[i] for i in sides[:b]], [self.encoded[i] for i in sides[b:]],
                                  self.pad_id)  # fmt: skip
            batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
            mask = batch["loss_mask"]  # (2B, T) 1 = sampled
            width = mask.shape[1]
            reference = torch.stack([F.pad(old[i].to(self.device), (0, width - len(old[i]))) for i in sides])
            with backend.accumulating(last=k == self.steps - 1):
                policy = sequence_logprobs(self.score(batch), mask, average=average)  # (2B,)
                ref = sequence_logprobs(reference, mask, average=average)
                losses = dpo_loss(policy[:b], policy[b:], ref[:b], ref[b:], beta=self.beta,
                                  loss_type=self.loss_type)  # (B,)  # fmt: skip
                backend.backward(losses.sum() * (self.coef * weight / self.pairs))
            stats = pair_stats(policy[:b], policy[b:], ref[:b], ref[b:], beta=self.beta)
            stats["loss"] = losses.detach().sum()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + weight * value
        keys = ("loss", "rewards/margin", "logratio/chosen", "logratio/rejected", "rewards/accuracy")
        means = all_reduce_sum(torch.stack([sums[key].double().to(self.device) for key in keys])) / self.pairs
        names = ("loss", "reward_margin", "chosen_logratio", "rejected_logratio", "accuracy")
        self.record.update({f"dpo/{name}": float(v) for name, v in zip(names, means, strict=True)})
        self.record.update({"dpo/reward_gap": self.gap / self.pairs, "time/self_critic": time.perf_counter() - t0})
        return self.record

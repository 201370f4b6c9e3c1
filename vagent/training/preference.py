"""Preference pairs: rows -> encoded (chosen, rejected) micro-batches, and the scoring of a batch of pairs by a policy
against a reference (the DPO loss and its statistics). The DPO recipe trains on it. GRPO's self-critic term
(``vagent.training.self_critic``) takes the same pure loss and ``collate_pairs`` but scores its pairs with GRPO's own
scorer, at the rollout's temperature and nucleus, against the step's old log-probs.

Each side of a pair is the conversation SFT would build for a row whose ``messages`` were that side's turns
(``gold_conversation``: the rollout engine's prompt for the row, then the turns) and is encoded by the one encoder, so
its loss mask is SFT's: tool observations, images and prompt forced (0), the assistant's content trained (1). A
trajectory the rollout engine sampled encodes to its sampled ids and their mask the same way (``encode_messages``).

A batch of B pairs is one forward over 2B rows (``collate_pairs``: the chosen rows, then the rejected ones), as TRL
concatenates them: one pass of the weights, and the shared system prompt runs once. Micro-batches of pairs have global
indices over an endless stream of epochs exactly as ``SFTDataset``'s (``rank_micro_batches`` places them on ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import UnidentifiedImageError

from vagent.agents import get_profile
from vagent.algorithms import dpo_loss, length_normalized, pair_stats, sequence_logprobs, trained_positions
from vagent.data.batching import collate_pairs, epoch_batches
from vagent.data.encode import encode_messages, encoded_length
from vagent.data.rows import Row, RowError
from vagent.model import masked_token_logprobs, policy_logits
from vagent.training.data import gold_conversation
from vagent.types import Message

__all__ = ["PreferenceDataset", "pair_conversations", "pair_logprobs", "preference_loss", "token_logprobs"]


def pair_conversations(row: Row, default_tools: Sequence[str],
                       agent: str = "vagent") -> tuple[list[Message], list[Message]]:  # fmt: skip
    """The chosen and the rejected conversation of a preference row, each built as SFT builds a gold conversation.

    Raises:
        RowError: the row has no ``chosen``/``rejected`` pair, or a side holds a part SFT cannot encode.
    """
    if row.chosen is None or row.rejected is None:
        raise RowError(f"row {row.id!r}: has no preference pair (`chosen` and `rejected`) to train on")
    return gold_conversation(row, default_tools, agent, "chosen"), gold_conversation(row, default_tools, agent,
                                                                                     "rejected")  # fmt: skip


class PreferenceDataset(torch.utils.data.Dataset):
    """Global micro-batch index -> a ``collate_pairs`` batch of ``micro_batch_size`` pairs, with ``pair_index`` (B,):
    each pair's index in ``pairs`` (where precomputed reference log-probs are looked up).

    Pairs are built and measured up front (``encoded_length``, no pixels decoded) and encoded when fetched. A pair
    whose row cannot be built or whose longer side exceeds ``max_length`` is left out and listed in ``skipped``.
    Length grouping uses the pair's two lengths summed (what its rows add to the batch).
    """

    def __init__(self, rows: Sequence[Row], processor: Any, *, min_pixels: int, max_pixels: int, factor: int,
                 default_tools: Sequence[str], max_length: int, micro_batch_size: int, seed: int,
                 group_by_length: bool, group_batches: int, agent: str = "vagent") -> None:  # fmt: skip
        self.processor = processor
        self.forced_spans = get_profile(agent).forced_spans  # as SFTDataset: text the agent's loop forces
        self.budget = {"min_pixels": min_pixels, "max_pixels": max_pixels, "factor": factor}
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self.group_batches = group_batches
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pairs: list[tuple[list[Message], list[Message]]] = []
        self.ids: list[str] = []
        self.lengths: list[int] = []
        self.skipped: list[tuple[str, str]] = []
        for row in rows:
            try:
                pair = pair_conversations(row, default_tools, agent)
                sides = [encoded_length(side, processor, **self.budget) for side in pair]
            except (RowError, OSError, UnidentifiedImageError, ValueError) as e:
                self.skipped.append((row.id, f"{type(e).__name__}: {e}"))
                continue
            if max(sides) > max_length:
                self.skipped.append((row.id, f"{max(sides)} tokens > data.max_length={max_length}"))
                continue
            self.pairs.append(pair)
            self.ids.append(row.id)
            self.lengths.append(sum(sides))
        if not self.pairs:
            reasons = "; ".join(f"{rid}: {why}" for rid, why in self.skipped[:3])
            raise ValueError(f"no usable preference pairs ({len(self.skipped)} skipped: {reasons})")
        self.batches_per_epoch = math.ceil(len(self.pairs) / micro_batch_size)
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def batch(self, g: int) -> list[int]:
        """Pair indices of global micro-batch ``g``."""
        epoch, i = divmod(g, self.batches_per_epoch)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = epoch_batches(self.lengths, self.micro_batch_size, seed=self.seed, epoch=epoch,
                                  group_by_length=self.group_by_length, group_batches=self.group_batches)  # fmt: skip
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1][i]

    def encode(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The pairs ``indices`` as one ``collate_pairs`` batch (2B rows) with their ``pair_index`` (B,)."""
        sides = [[encode_messages(self.pairs[i][side], self.processor, **self.budget, forced_spans=self.forced_spans)
                  for i in indices] for side in (0, 1)]  # fmt: skip
        return {**collate_pairs(sides[0], sides[1], self.pad_id), "pair_index": torch.tensor(list(indices))}

    def __len__(self) -> int:
        return self.batches_per_epoch  # one epoch; indices beyond it continue into the next epochs

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        return self.encode(self.batch(g))


def token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, chunk_size: int = 1024,
                   share_prefix: bool = True) -> torch.Tensor:  # fmt: skip
    """(N, T) float32 log-probs of the batch's trained tokens (``loss_mask`` 1), 0 elsewhere: the language-model head
    in chunks of ``chunk_size`` positions (``masked_token_logprobs``), or with 0 whole, on the trained positions."""
    mask = batch["loss_mask"]
    if chunk_size:
        return masked_token_logprobs(model, batch, mask, chunk_size=chunk_size, share_prefix=share_prefix)[0]
    logits = policy_logits(model, batch, share_prefix=share_prefix, positions=trained_positions(mask))  # (M, V)
    selected = mask[:, 1:].bool()  # (N, T-1) 1 = token t+1 is scored
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["input_ids"][:, 1:][selected].unsqueeze(-1))
    shifted = torch.zeros(selected.shape, dtype=torch.float32, device=logits.device).masked_scatter(
        selected, picked.squeeze(-1)
    )
    return torch.nn.functional.pad(shifted, (1, 0))


def pair_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, average: bool, chunk_size: int = 1024,
                  share_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sequence log-probs of a ``collate_pairs`` batch's chosen and rejected trajectories in one forward.

    Args:
        model: The policy or the reference (possibly wrapped by DDP/FSDP/peft).
        batch: 2B rows, the B chosen then the B rejected.
        average: Token means instead of sums (``length_normalized(loss_type)``).
        chunk_size, share_prefix: As for ``token_logprobs``.

    Returns:
        chosen (B,), rejected (B,) float32, with gradient when the model has it.
    """
    lp = token_logprobs(model, batch, chunk_size=chunk_size, share_prefix=share_prefix)  # (2B, T)
    sequences = sequence_logprobs(lp, batch["loss_mask"], average=average)  # (2B,)
    half = sequences.shape[0] // 2
    return sequences[:half], sequences[half:]


def preference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    reference: tuple[torch.Tensor, torch.Tensor], *, beta: float, loss_type: str,
                    label_smoothing: float = 0.0, chunk_size: int = 1024,
                    share_prefix: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Score a batch of pairs with the policy against the reference's log-probs: the summed DPO loss and the sums of
    its statistics.

    Args:
        model: The policy being trained.
        batch: A ``collate_pairs`` batch (2B rows).
        reference: The reference's (B,) chosen and (B,) rejected sequence log-probs of the same pairs, normalized as
            the loss type asks (``pair_logprobs(reference_model, batch, average=length_normalized(loss_type))``, a
            precomputed table, or the policy with its adapters disabled).
        beta, loss_type, label_smoothing: As for ``vagent.algorithms.dpo_loss``.
        chunk_size, share_prefix: As for ``token_logprobs``.

    Returns:
        loss_sum: () the pairs' summed loss, with gradient; divide by the step's pair count (all micro-batches, all
            ranks) for the step's mean.
        stats: () float32 sums without gradient: ``loss``, ``pairs`` (B) and ``pair_stats``' keys.
    """
    chosen, rejected = pair_logprobs(model, batch, average=length_normalized(loss_type), chunk_size=chunk_size,
                                     share_prefix=share_prefix)  # fmt: skip
    ref_chosen, ref_rejected = (r.to(chosen.device) for r in reference)
    losses = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type,
                      label_smoothing=label_smoothing)  # (B,)  # fmt: skip
    stats = pair_stats(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
    stats["loss"] = losses.detach().sum()
    stats["pairs"] = torch.tensor(float(losses.shape[0]), device=losses.device)
    return losses.sum(), stats

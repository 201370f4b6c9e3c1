"""Batching encoded conversations: collation, length-grouped batch order, padding waste.

Multimodal collation follows the model's contract: ``pixel_values`` concatenates every image's patches
in the order their placeholders appear in the flattened batch (row 0's images, then row 1's, ...)
with one ``image_grid_thw`` row per image. Rows are right-padded; padding has attention 0, loss 0.

The batch order is a pure function of ``(seed, epoch)``, so every rank computes the same order without
talking to the others, and a resumed run continues it exactly from a saved position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vagent.data.encode import Encoded

__all__ = ["collate", "collate_pairs", "epoch_batches", "padding_waste"]


def collate(samples: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad encoded conversations into one batch.

    Returns:
        ``input_ids`` (B, T), ``attention_mask`` (B, T) 1 = real token, ``loss_mask`` (B, T) 1 = trained,
        ``mm_token_type_ids`` (B, T), and with any image ``pixel_values`` (patches, dim) and
        ``image_grid_thw`` (n_images, 3).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    length = max(len(s.input_ids) for s in samples)
    batch = {
        "input_ids": torch.full((len(samples), length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), length, dtype=torch.long),
        "loss_mask": torch.zeros(len(samples), length, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(len(samples), length, dtype=torch.int32),
    }
    for i, sample in enumerate(samples):
        n = len(sample.input_ids)
        batch["input_ids"][i, :n] = sample.input_ids
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = sample.loss_mask
        batch["mm_token_type_ids"][i, :n] = sample.mm_token_type_ids
    with_images = [s for s in samples if s.image_patches]
    if with_images:  # one copy of the batch's patches; the samples' own blocks stay shared
        batch["pixel_values"] = torch.cat([block for s in with_images for block in s.image_patches])
        batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])
    return batch


def collate_pairs(chosen: Sequence[Encoded], rejected: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs as one batch for one forward (TRL's concatenated forward): the B chosen trajectories, then
    the B rejected ones, so row i and row B + i are pair i. The rows share their prompt, and with it the system
    prompt that ``policy_logits(share_prefix=True)`` runs once for the whole batch.

    Returns:
        ``collate``'s keys over 2B rows, images in row order (the chosen rows' first).
    """
    if len(chosen) != len(rejected):
        raise ValueError(f"need as many rejected as chosen trajectories, got {len(chosen)} and {len(rejected)}")
    return collate([*chosen, *rejected], pad_id)


def epoch_batches(
    lengths: Sequence[int], batch_size: int, *, seed: int, epoch: int, group_by_length: bool, group_batches: int = 16
) -> list[list[int]]:
    """The micro-batches of one epoch: every index exactly once, in a random order fixed by ``(seed, epoch)``.

    With ``group_by_length``, the shuffled indices are cut into windows of ``batch_size * group_batches``,
    each window is sorted by length and cut into batches, and the batches are shuffled again: similar
    lengths share a batch (less padding) while the order over the epoch stays random. The last batch may
    be smaller.

    >>> epoch_batches([5, 1, 9, 2], 2, seed=0, epoch=0, group_by_length=True)
    [[3, 1], [2, 0]]
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)).tolist()
    if not group_by_length:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    window = batch_size * group_batches
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i], reverse=True)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


def padding_waste(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of the padded token slots that hold padding, over ``batches``.

    >>> padding_waste([[0, 1]], [3, 1])
    0.3333333333333333
    """
    slots = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    return (slots - real) / slots if slots else 0.0

"""Attention over the slot cache with PyTorch's FlexAttention: each row reads its own slot up to its own length, with
no gather of the batch's keys and no dense ``(B, 1, query, keys)`` mask.

The backend's ``attention="flex"`` stores every layer's keys as one ``(kv_heads, slots x capacity, head_dim)`` tensor
(``SlotCache(flat=True)``: the slots end to end, each starting at a multiple of ``BLOCK``). The layers attend over
that whole storage as a key batch of one, which ``flex_attention`` shares between the query rows, and a ``BlockMask``
made from each row's slot and length (``slot_block_mask``) names the 128-key blocks each row reads: its own slot's,
up to its length. The fused kernel visits only those blocks, so a decode step reads every row's keys once, however
long the batch's longest row is and wherever the rows' slots lie. Compare SDPA over the same storage
(``causal_mask``): the batch's slots gathered up to the longest row (a copy unless the slots are consecutive) and a
dense boolean mask over them, every row paying for the longest.

The mask is the dense one's: query ``j`` of row ``b`` (slot ``s``, ``cached`` tokens already in it) sees positions
``<= cached + j`` of slot ``s`` and nothing else. Blocks that every query of a 128-query tile sees whole are "full"
(the kernel skips the mask there); the block holding a tile's diagonal is "partial" (the kernel evaluates
``mask_mod``). The unit test rebuilds the dense mask from exactly these blocks.

On CUDA ``flex_attention`` runs compiled (``torch.compile``): one function for decode queries (width 1), compiled with
static shapes, and one for prefills, with dynamic ones. Where it runs compiled the backend pads every decode batch
to a power-of-two bucket (``DecodeGraphs``, captured as CUDA graphs unless they are off), so decode compiles once per
bucket and storage size. Uncompiled, ``flex_attention`` materializes the scores over the whole storage: that is what runs on the CPU
(``COMPILE``), as the reference the tests compare with SDPA, not as a fast path. Not measured on a GPU yet: SDPA stays
the default until ``benchmarks/gpu_suite.py --parts rollout`` has run (docs/decisions/decode-attention.md).

flash-attn's ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=..., cache_batch_idx=...)`` would read
this storage by slot index too; it is not wired in (not installed where this was written, and it takes over the
cache write as well).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from vagent.rollout.kv_cache import BLOCK

__all__ = ["COMPILE", "KERNELS", "slot_block_mask", "slot_flex_attention"]

# the backend's ``attention`` option -> the name transformers' AttentionInterface runs it by
KERNELS: dict[str, str] = {"sdpa": "sdpa", "flex": "vagent_slot_flex"}

# where flex_attention runs compiled. Not on the CPU: there it is the tests' reference, and a compile costs tens of
# seconds per shape family on two cores (a test turns it on to check the fused kernel's block lists)
COMPILE: dict[str, bool] = {"cuda": True, "cpu": False}


def slot_block_mask(slot_index: torch.Tensor, cached: torch.Tensor, width: int, capacity: int, slots: int) -> BlockMask:
    """The ``(B, 1, width, slots * capacity)`` block mask of a forward over the flat slot storage.

    Args:
        slot_index: (B,) long, the slot of each row.
        cached: (B,) long, tokens already in each row's slot: its ``width`` new ones are at ``cached + 0 .. width - 1``.
        width: New tokens per row (a decode step: 1).
        capacity: Tokens per slot, a multiple of ``BLOCK``.
        slots: Slots in the storage.

    Query ``j`` of row ``b`` sees the keys at ``slot_index[b] * capacity + p`` for ``p <= cached[b] + j``, as
    ``causal_mask`` does in the slot's own coordinates. Computed on ``slot_index``'s device with tensor operations
    only (no host sync), so a CUDA graph can record it.
    """
    if capacity % BLOCK:
        raise ValueError(f"slot capacity {capacity} is not a multiple of the flex block ({BLOCK})")
    device = slot_index.device
    per_slot, columns = capacity // BLOCK, slots * capacity // BLOCK
    first = torch.arange(0, width, BLOCK, device=device)  # (Q,) the first query of each query tile
    last = (first + BLOCK - 1).clamp(max=width - 1)  # (Q,) its last query
    length = cached.long()[:, None]  # (B, 1)
    full = (length + first + 1) // BLOCK  # (B, Q) blocks every query of the tile sees whole
    seen = (length + last) // BLOCK + 1  # (B, Q) blocks some query of the tile sees
    base = slot_index.long()[:, None, None] * per_slot  # (B, 1, 1) the slot's first block
    column = torch.arange(columns, device=device)  # every block listed: the CPU's compiled kernel asks for all
    full_index = (base + column).clamp(max=columns - 1).expand(-1, first.numel(), -1)  # (B, Q, columns)
    partial_index = (base + full[..., None] + column).clamp(max=columns - 1)  # (B, Q, columns)
    slot_start, limit = slot_index.long() * capacity, cached.long()

    def mask_mod(b, h, q, kv):  # the whole rule: the unfused path evaluates it everywhere, ignoring the block lists
        return (kv >= slot_start[b]) & (kv <= slot_start[b] + limit[b] + q)

    counts, indices = [_heads(t) for t in (seen - full, full)], [_heads(t) for t in (partial_index, full_index)]
    # no q blocks: only a backward reads them
    return BlockMask.from_kv_blocks(counts[0], indices[0], counts[1], indices[1], BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(width, slots * capacity), compute_q_blocks=False)  # fmt: skip


def _heads(t: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B, 1, ...) int32: one mask for every head."""
    return t.to(torch.int32).unsqueeze(1).contiguous()


def slot_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over the flat slot storage.

    Args:
        module: The attention layer (unused).
        query: (B, heads, width, head_dim).
        key, value: (1, kv_heads, slots * capacity, head_dim), the flat storage (``SlotCache(flat=True)``).
        attention_mask: The forward's ``slot_block_mask``.
        scaling: Softmax scale (None: 1 / sqrt(head_dim)).

    Returns:
        ((B, width, heads, head_dim), None): no attention weights.
    """
    if not isinstance(attention_mask, BlockMask):
        raise TypeError("the slot flex attention takes the backend's block mask (HFBackend(attention='flex'))")
    if dropout:
        raise ValueError("the slot flex attention is for generation: no dropout")
    kernel = _kernel(query.device.type, decode=query.shape[2] == 1)
    out = kernel(query, key, value, attention_mask, scaling, query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _decode(query, key, value, block_mask, scale, gqa):
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _prefill(query, key, value, block_mask, scale, gqa):  # its own code object: torch.compile caches per function
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


_compiled: dict[Callable, Callable] = {}


def _kernel(device_type: str, decode: bool) -> Callable:
    function = _decode if decode else _prefill
    if not COMPILE.get(device_type, False):
        return _unfused(function)
    if function not in _compiled:
        # Decode compiles with static shapes: inductor's split-KV decode kernel (one block per key/value head for all
        # of its query heads: the keys are read once) needs a static batch, and the backend pads decode batches to
        # power-of-two buckets for it. One compile per bucket and storage size can pass dynamo's default limit of 8,
        # past which it would run the unfused kernel (the scores over the whole storage).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled[function] = torch.compile(function, dynamic=False if decode else None)
    return _compiled[function]


def _unfused(function: Callable) -> Callable:
    def run(*args):
        with warnings.catch_warnings():  # the unfused path is meant here: flex's advice to compile is not for us
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return function(*args)

    return run


AttentionInterface.register(KERNELS["flex"], slot_flex_attention)

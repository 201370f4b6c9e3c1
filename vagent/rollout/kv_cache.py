"""KV storage where every row owns a preallocated slot: joining and leaving the batch copy nothing.

Per layer, keys and values live in one static tensor ``(slots, kv_heads, capacity, head_dim)``. A row
gets a slot when it starts and keeps it for its whole episode (through its tool calls), its tokens stored
hole-free at ``[0, length)``. A forward writes its new keys in place at each row's own positions
(``index_put_``), so a row joining or leaving the decode batch is bookkeeping, and a turn that resumes after
a tool call prefills only its new tokens into the same slot. Compare the ``DynamicCache`` per batch this
replaces: every join or leave concatenated and copied the whole batch's cache (O(batch x sequence)), and
every decode step copied it again (``torch.cat`` in ``DynamicLayer.update``).

The cache plugs into transformers' attention through the one call the Qwen-VL attention makes,
``cache.update(key_states, value_states, layer_idx)``, which must return the keys and values to attend
over. Here that is the batch's slots up to the longest row: a view when the batch's slots are consecutive
(``rows[a:b]``, no copy), else one gather of those rows. With SDPA the backend passes a matching boolean
``(B, 1, query, keys)`` mask (each row sees its own ``[0, length)`` plus causal new tokens), which
transformers returns as-is to SDPA.

On a GPU the storage is also what CUDA graphs need, fixed addresses: ``decode_graphs.py`` captures the decode
forward at bucketed shapes, planned by ``plan_static`` from its static input buffers.

``flat=True`` lays each layer out as ``(kv_heads, slots, capacity, head_dim)`` instead, with capacities in multiples
of ``BLOCK``, and ``update`` returns the whole storage as one ``(1, kv_heads, slots x capacity, head_dim)`` view: the
layout FlexAttention reads by slot and length through a block mask, with no gather and no dense mask
(``slot_attention.py``, ``HFBackend(attention="flex")``). ``keys``/``values`` are slot-first views either way.
Not done: flash-attn's ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
cache_batch_idx=slots)`` would do the in-place write and the attention over each row's length in one kernel.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "SlotCache", "causal_mask"]

_GROW_TOKENS = 256  # capacity grows in multiples of this (and at least doubles), so growth is rare
BLOCK = 128  # FlexAttention's key block: in the flat layout every slot starts at a multiple of it


class SlotCache:
    """Slot-indexed static KV storage for every layer of a decoder (see the module docstring).

    Args:
        layers: Decoder layers.
        kv_heads: Key/value heads per layer.
        head_dim: Size of one head.
        dtype, device: Of the stored keys and values.
        flat: Store each layer as ``(kv_heads, slots, capacity, head_dim)`` and attend over all of it (FlexAttention
            with a block mask); False: ``(slots, kv_heads, capacity, head_dim)``, the batch's slots gathered (SDPA).

    Attributes:
        keys, values: Per layer, the storage as ``(slots, kv_heads, capacity, head_dim)`` (a view in the flat layout).
    """

    is_compileable = False  # transformers asks (torch.compile); CUDA graphs capture it as it is: decode_graphs.py

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 flat: bool = False) -> None:  # fmt: skip
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device, self.flat = dtype, device, flat
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0
        self.growths = 0
        self.fixed = False
        self._allocate(0, 0)
        # The plan of the next forward (set by ``plan``): which slots, where each row's new tokens go, how far
        # attention reads.
        self._slot_index = torch.zeros(0, dtype=torch.long)
        self._positions = torch.zeros(0, 0, dtype=torch.long)
        self._window: slice | None = None
        self._key_length = 0

    # -- storage ------------------------------------------------------------------------------------

    def token_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one token of one row takes in every layer's keys and values (stored in ``dtype``, default the
        storage's)."""
        size = torch.empty(0, dtype=dtype or self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * size

    def aligned(self, tokens: int) -> int:
        """The capacity that holds ``tokens`` in this layout (flat: the next multiple of ``BLOCK``)."""
        return -(-tokens // BLOCK) * BLOCK if self.flat else tokens

    def fix(self, slots: int, capacity: int, dtype: torch.dtype) -> None:
        """Allocate ``slots`` rows of ``capacity`` tokens once and never grow: a ``reserve`` beyond them is an error
        (the caller admits only rows that fit). Growing by doubling holds the old and the new storage at once
        (at 7B, 17 + 34 GB for 65 rows past 4,608 tokens); a storage sized once from a budget never does."""
        self.keys, self.values, self.dtype = [], [], dtype  # what was stored is dropped
        self._allocate(slots, self.aligned(capacity))
        self.growths += 1
        self.fixed = True

    def clear(self) -> None:
        """Free the storage (its tensors go; the next ``reserve`` allocates anew). Not for fixed storage."""
        if self.fixed:
            raise ValueError("a fixed KV storage is kept; clear() is for storage that grows on demand")
        self.keys, self.values = [], []
        self._allocate(0, 0)
        self.growths += 1  # new addresses from the next reserve on: decode graphs must be captured again

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for ``slots`` rows of ``capacity`` tokens; grows (one copy of what is stored) if needed.

        Raises:
            ValueError: the storage is fixed (``fix``) and this is more than it holds.
        """
        if slots <= self.slots and capacity <= self.capacity:
            return
        if self.fixed:
            raise ValueError(f"the KV storage is fixed at {self.slots} rows x {self.capacity} tokens; asked for "
                             f"{slots} x {capacity}")  # fmt: skip
        new_slots = max(slots, self.slots)
        new_capacity = self.capacity
        if capacity > self.capacity:
            new_capacity = max(capacity, 2 * self.capacity)
            new_capacity = -(-new_capacity // _GROW_TOKENS) * _GROW_TOKENS
        self._allocate(new_slots, new_capacity)
        self.growths += 1

    def _allocate(self, slots: int, capacity: int) -> None:
        """New storage with what is stored copied in, one layer at a time: the old layer is freed as soon as it
        is copied, so the transient is one layer's old storage, not the whole cache twice."""
        for store in (self.keys, self.values):
            for i in range(self.layers if store else 0):
                old, store[i] = store[i], self._zeros(slots, capacity, self.dtype)
                rows, length = min(old.shape[0], slots), min(old.shape[2], capacity)
                store[i][:rows, :, :length] = old[:rows, :, :length]
                del old
            if not store:
                store += [self._zeros(slots, capacity, self.dtype) for _ in range(self.layers)]
        self.slots, self.capacity = slots, capacity

    def _zeros(self, slots: int, capacity: int, dtype: torch.dtype) -> torch.Tensor:
        """One layer's storage as (slots, kv_heads, capacity, head_dim), laid out as ``flat`` says."""
        if self.flat:
            shape = (self.kv_heads, slots, capacity, self.head_dim)
            return torch.zeros(shape, dtype=dtype, device=self.device).transpose(0, 1)
        return torch.zeros(slots, self.kv_heads, capacity, self.head_dim, dtype=dtype, device=self.device)

    def ensure_dtype(self, dtype: torch.dtype) -> None:
        """Store keys/values in ``dtype`` from now on (converts what is stored, once, if it differs)."""
        if dtype != self.dtype:
            self.keys = [self._zeros(self.slots, self.capacity, dtype).copy_(t) for t in self.keys]
            self.values = [self._zeros(self.slots, self.capacity, dtype).copy_(t) for t in self.values]
            self.dtype = dtype
            self.growths += 1

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` tokens of one slot into another (a shared prefix, a twin's prefill): O(row)."""
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[target, :, :length] = layer[source, :, :length]

    # -- one forward --------------------------------------------------------------------------------

    def plan(self, slots: list[int], starts: list[int], width: int, key_length: int) -> None:
        """Set up the next forward: row ``b`` of the batch is slot ``slots[b]``; its ``width`` new tokens are
        written at ``starts[b] + 0 .. width - 1``; attention reads positions ``[0, key_length)`` of each slot."""
        if max(starts) + width > self.capacity or max(slots) >= self.slots:
            raise ValueError("SlotCache.plan: reserve() room for these rows first")
        self._slot_index = torch.tensor(slots, dtype=torch.long, device=self.device)
        starts_t = torch.tensor(starts, dtype=torch.long, device=self.device)
        self._positions = starts_t[:, None] + torch.arange(width, device=self.device)  # (B, width)
        first = slots[0]
        consecutive = slots == list(range(first, first + len(slots)))
        self._window = slice(first, first + len(slots)) if consecutive else None
        self._key_length = key_length

    def plan_static(self, slot_index: torch.Tensor, positions: torch.Tensor, key_length: int) -> None:
        """Plan forwards from tensors the caller owns and refills between them (a CUDA graph's static inputs): row
        ``b`` is slot ``slot_index[b]``, its new tokens go to ``positions[b]`` (B, width); attention reads
        ``[0, key_length)`` of each row's slot, gathered (the slots need not be consecutive)."""
        if key_length > self.capacity:
            raise ValueError("SlotCache.plan_static: reserve() room for key_length first")
        self._slot_index, self._positions, self._window, self._key_length = slot_index, positions, None, key_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a forward's new (B, kv_heads, width, head_dim) keys/values into their slots; return the batch's
        keys/values over ``[0, key_length)``: (B, kv_heads, key_length, head_dim). Flat: the whole storage,
        (1, kv_heads, slots * capacity, head_dim), a view."""
        out = []
        for store, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            # advanced indices around a slice put the indexed dims first: the target is (B, width, heads, dim)
            store[self._slot_index[:, None], :, self._positions] = new.transpose(1, 2).to(store.dtype)
            if self.flat:
                out.append(store.transpose(0, 1).view(1, self.kv_heads, -1, self.head_dim))
            elif self._window is not None:
                out.append(store[self._window, :, : self._key_length])  # a view: no copy
            else:
                out.append(store[:, :, : self._key_length].index_select(0, self._slot_index))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The key length of the planned forward (transformers asks; positions and masks are given explicitly)."""
        return self._key_length


def causal_mask(cached: list[int], widths: list[int], key_length: int) -> torch.Tensor:
    """(B, 1, width, key_length) bool: query j of row b sees its slot's positions ``<= cached[b] + j``."""
    width = max(widths)
    limit = torch.tensor(cached)[:, None] + torch.arange(width)  # (B, width)
    return (torch.arange(key_length) <= limit[:, :, None]).unsqueeze(1)

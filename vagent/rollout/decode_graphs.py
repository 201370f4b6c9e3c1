"""Decode steps replayed from CUDA graphs: the forward of one token per row, captured once per shape bucket.

A decode forward on a GPU is bound by the host, not the GPU: a 3B model's step launches dozens of small
kernels per layer through transformers' Python, and on an H100 the GPU was busy 7 of an eager step's 60 ms
(docs/benchmarks.md, "On a GPU"). A CUDA graph records a forward's kernels once and replays them with one launch.

A graph fixes its shapes and the addresses it reads, so every decode step is padded to a bucket:

* batch: the next power of two >= the generating rows (256 rows: 256), but never past ``max_batch`` (the backend's
  row limit, GRPO's rollout batch: 320 rows of a 320-row rollout are not padded to 512); the padding rows decode
  into a scratch slot (one slot past every live row's) and their logits are dropped;
* keys (SDPA): attention reads each row's slot up to the next power of two >= the step's key length (>= 128; at most
  the storage's capacity when that holds the step), masked to the row's own tokens as in the eager step. With
  ``attention="flex"`` the key length is the storage's capacity, always: the block mask lists only each row's own
  blocks, so a longer bucket costs nothing and one graph per batch bucket serves every context length;
* inputs (token ids, positions, slots, write positions, SDPA's mask) are copied into static buffers before a replay,
  and the cache is planned with those buffers (``SlotCache.plan_static``). Flex's block mask is computed inside the
  graph from the slot and length buffers.

Graphs are keyed by (batch bucket, key bucket) and dropped when the KV storage is reallocated (its addresses
change). All graphs share one memory pool; a capture costs one eager warm-up forward and the capture itself.
When the model's parameters can move between forwards (FSDP, DeepSpeed ZeRO-3 gather them per forward) there are
no graphs. A capture that fails (an operation in the forward that a graph cannot hold) turns graphs off for the
backend, with one warning, and the step runs eagerly.

``capture=False`` runs the same padded, bucketed forward eagerly: the CPU tests check with it that the padding,
the scratch slot and the key buckets give the eager step's tokens exactly.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass

import torch

from vagent.model import attention_implementation, decoder_and_head
from vagent.rollout.kv_cache import SlotCache, causal_mask
from vagent.rollout.slot_attention import KERNELS, slot_block_mask

__all__ = ["DecodeGraphs", "graphs_safe"]

log = logging.getLogger(__name__)

_MIN_KEYS = 128


def graphs_safe(model: torch.nn.Module) -> bool:
    """False when the parameters may be gathered into new memory each forward (FSDP's DTensors, ZeRO-3)."""
    return not any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") for p in model.parameters())


def _bucket(n: int, least: int = 1, most: int | None = None) -> int:
    """The next power of two >= ``n`` (and >= ``least``), capped at ``most`` (never below ``n``)."""
    bucket = max(least, 1 << (n - 1).bit_length())
    return bucket if most is None else min(bucket, max(most, n))


@dataclass
class _Graph:
    """One captured shape: its static inputs, its output and the graph (None when not captured)."""

    ids: torch.Tensor  # (B, 1)
    positions: torch.Tensor  # (3, B, 1)
    slots: torch.Tensor  # (B,)
    writes: torch.Tensor  # (B, 1)
    keys: int  # K, the key length attention reads
    mask: torch.Tensor | None  # (B, 1, 1, K) bool (SDPA); None under flex (its block mask is made in the forward)
    logits: torch.Tensor | None = None  # (B, V) float
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Bucketed decode forwards over a ``SlotCache``, captured as CUDA graphs (see the module docstring).

    Args:
        model: The transformers ``...ForConditionalGeneration`` model, possibly in a peft or DDP wrapper.
        cache: The backend's KV storage.
        cache_argument: The keyword the model's forward takes the cache by.
        capture: Capture CUDA graphs (False: run the bucketed forward eagerly).
        attention: The backend's attention kernel, ``"sdpa"`` or ``"flex"`` (``slot_attention.KERNELS``).
        max_batch: The largest batch bucket (the backend's row limit); None: powers of two without end.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotCache, cache_argument: str, capture: bool = True,
                 attention: str = "sdpa", max_batch: int | None = None) -> None:  # fmt: skip
        self.model, self.cache, self.cache_argument, self.capture = model, cache, cache_argument, capture
        self.attention, self.max_batch = attention, max_batch
        self.decoder, self.head = decoder_and_head(model)  # through peft and DDP wrappers
        self.device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(self.device) if capture else None  # warm-ups and captures run on it
        self.graphs: dict[tuple[int, int, torch.dtype | None], _Graph] = {}
        self._storage = cache.growths  # counts every reallocation: more rows, more tokens, another dtype
        self.failed: str | None = None
        self.captures = 0
        self.capture_s = 0.0

    def decode(self, ids: list[int], positions: list[int], slots: list[int], lengths: list[int], room: int):
        """Logits (rows, V) of one decode step: row b feeds token ``ids[b]`` at RoPE position ``positions[b]``,
        written at ``lengths[b]`` of slot ``slots[b]``. ``room``: the slots the storage holds, one past every live
        row's included (the padding rows' scratch is the last). None when graphs are off."""
        if self.failed is not None:
            return None
        rows, needed = len(ids), max(lengths) + 1
        batch = _bucket(rows, most=self.max_batch)
        if self.attention == "flex":
            self.cache.reserve(room, needed)
            keys = self.cache.capacity  # the block mask reads each row's own blocks only: one bucket for all lengths
        else:
            keys = _bucket(needed, _MIN_KEYS)
            if self.cache.capacity >= needed:
                keys = min(keys, self.cache.capacity)  # the storage's whole length: a bucket that needs no growth
            self.cache.reserve(room, keys)
        if self.cache.growths != self._storage:  # reallocated: the graphs read the old addresses
            self._drop_graphs()
            self._storage = self.cache.growths
        autocast = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        entry = self.graphs.get((batch, keys, autocast))
        fresh = entry is None
        if fresh:
            entry = self.graphs[(batch, keys, autocast)] = self._buffers(batch, keys)
        self._fill(entry, ids, positions, slots, lengths, scratch=self.cache.slots - 1)
        if not self.capture:
            return self._forward(entry, autocast)[:rows]
        if fresh:
            try:
                self._capture(entry, autocast)
            except Exception as error:  # any capture failure: decode eagerly from now on
                reason = f"{type(error).__name__}: {error}"
                if self.attention == "flex":
                    # a compiled flex kernel is compiled for static batch shapes: eager decode at every batch size
                    # of a draining rollout would recompile until dynamo falls back to the unfused kernel (B x H x
                    # all slots' keys of scores). Stay on the buckets, uncaptured.
                    self.capture = False
                    self._drop_graphs()
                    log.warning("CUDA graph capture of the decode step failed; decoding from the batch buckets "
                                "uncaptured (%s)", reason)  # fmt: skip
                    return self._forward(entry, autocast)[:rows]
                self.failed = reason
                self._drop_graphs()
                log.warning("CUDA graph capture of the decode step failed; decoding eagerly (%s)", self.failed)
                return None
        entry.graph.replay()
        # a copy: the output lives in the pool the graphs share, where another graph's replay may write
        return entry.logits[:rows].clone()

    def _drop_graphs(self) -> None:
        """Forget every graph and capture the next ones into a new memory pool. Capturing again into a pool whose
        graphs are gone but which still holds an allocation failed inside PyTorch's allocator on an H100
        (``use_count > 0``)."""
        self.graphs.clear()
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def _buffers(self, batch: int, keys: int) -> _Graph:
        long = dict(dtype=torch.long, device=self.device)
        mask = None  # flex: its block mask is made in the forward
        if self.attention != "flex":
            mask = torch.zeros(batch, 1, 1, keys, dtype=torch.bool, device=self.device)
        return _Graph(ids=torch.zeros(batch, 1, **long), positions=torch.zeros(3, batch, 1, **long),
                      slots=torch.zeros(batch, **long), writes=torch.zeros(batch, 1, **long), keys=keys,
                      mask=mask)  # fmt: skip

    def _fill(self, entry: _Graph, ids, positions, slots, lengths, scratch: int) -> None:
        """Copy one step's inputs into the static buffers; padding rows write at 0 of the scratch slot and see it."""
        batch = entry.ids.shape[0]
        pad = batch - len(ids)
        writes = [*lengths, *[0] * pad]
        entry.ids.copy_(torch.tensor([*ids, *[0] * pad])[:, None], non_blocking=True)
        positions_t = torch.tensor([*positions, *[0] * pad])
        entry.positions.copy_(positions_t.view(1, -1, 1).expand(3, -1, -1), non_blocking=True)
        entry.slots.copy_(torch.tensor([*slots, *[scratch] * pad]), non_blocking=True)
        entry.writes.copy_(torch.tensor(writes)[:, None], non_blocking=True)
        if entry.mask is not None:  # own tokens and the new one
            entry.mask.copy_(causal_mask(writes, [1] * batch, entry.keys), non_blocking=True)

    def _forward(self, entry: _Graph, autocast: torch.dtype | None) -> torch.Tensor:
        """The bucketed decode forward on the static buffers (what a graph records)."""
        self.cache.plan_static(entry.slots, entry.writes, entry.keys)
        mask = entry.mask
        if mask is None:  # recorded with the forward: replays recompute it from the slot and length buffers
            mask = slot_block_mask(entry.slots, entry.writes[:, 0], 1, self.cache.capacity, self.cache.slots)
        # a graph cannot hold autocast's cache of cast weights: cast inside the graph, every replay
        cast = torch.autocast(self.device.type, dtype=autocast, cache_enabled=False) if autocast else nullcontext()
        with cast, attention_implementation(self.model, KERNELS[self.attention]):  # the kernel that reads our mask
            out = self.decoder(input_ids=entry.ids, attention_mask=mask, position_ids=entry.positions,
                               **{self.cache_argument: self.cache}, use_cache=True)  # fmt: skip
            return self.head(out.last_hidden_state[:, 0]).float()

    def _capture(self, entry: _Graph, autocast: torch.dtype | None) -> None:
        """Record the forward on the graphs' own stream, after one eager warm-up there: lazy initializations (the
        cuBLAS workspace of that stream among them) stay outside the graph's memory pool. ``torch.cuda.graph``'s
        context manager is not used: it collects garbage and empties the allocator's cache at every capture, and
        when the capture fails to begin it leaves its stream current."""
        start = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            self._forward(entry, autocast)  # rewrites this step's keys and values: the same ones
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")  # tools run in other threads
            try:
                logits = self._forward(entry, autocast)
            except BaseException:
                with suppress(Exception):  # ending an invalidated capture raises too: the forward's
                    graph.capture_end()  # error is the cause worth logging
                raise
            graph.capture_end()
        current.wait_stream(self.stream)
        entry.graph, entry.logits = graph, logits
        self.captures += 1
        self.capture_s += time.perf_counter() - start

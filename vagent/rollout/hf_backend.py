"""Continuous batched generation on a transformers Qwen-VL model (CPU and GPU): the ``GenerationBackend``.

The engine submits turn requests (a row's whole sequence so far) and calls ``step()``; a step either
prefills the queued turns (joining them to the batch) or decodes one token for every generating row, and
finished turns come back as they finish. Rows join and leave between steps, so a row whose tool is still
running never holds up the rows that are generating.

Why the cache is exact:

* Each row owns a slot of a ``SlotCache`` for its whole episode, its tokens stored hole-free at
  ``[0, length)``. A new turn prefills only the tokens after the cached ones (the last sampled token, the
  forced turn close, the tool observation with its images, the next assistant header) into the same slot.
  Joining and leaving the decode batch copy nothing; attention sees each row's own positions only (mask).
* Positions are multimodal RoPE positions computed over the row's whole sequence (``rope_positions``) and
  passed to every forward: the model's cached ``rope_deltas`` are never used, so interleaving rows (or
  training forwards) cannot pick up stale deltas. A decoded text token's position is the row's largest
  position + 1 on all three axes.
* Samples of one task that start together (a GRPO group) have identical prompts: one of them is prefilled,
  the others get a copy of its slot. Rows that start together and begin with the same text (the system
  prompt with its tool schemas) prefill that prefix once (``common_prefix_length``, the rule training's
  shared-prefix forward uses too), copied into each row's slot.

On CUDA, decode steps replay CUDA graphs captured at bucketed shapes (``decode_graphs.py``): a decode forward
is otherwise bound by the host's kernel launches. Prefills run eagerly (their shapes vary with every turn).

The language model attends with SDPA over the batch's gathered slots and a dense mask (the default), or with
``attention="flex"`` with FlexAttention over the whole storage and a block mask of each row's slot and length
(``slot_attention.py``); both give the same greedy tokens on the CPU in fp32 (tested).

Reference switches for tests and benchmarks (constructor arguments, not engine options):
``reuse_cache=False`` forgets each row's cache at the end of its turn (every turn re-prefills the whole
sequence); ``share_prefix=False`` prefills every row's prefix itself; ``cuda_graphs=False`` decodes eagerly.

Not safe, so not done: sliding-window layers (such models raise at construction).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from vagent.model import (
    Policy,
    attention_implementation,
    cache_argument,
    common_prefix_length,
    decoder_and_head,
    nucleus_mask,
    rope_positions,
)
from vagent.rollout.backend import BackendStats, Sampling, TurnRequest, TurnResult
from vagent.rollout.decode_graphs import DecodeGraphs, graphs_safe
from vagent.rollout.kv_cache import SlotCache, causal_mask
from vagent.rollout.slot_attention import COMPILE, KERNELS, slot_block_mask
from vagent.rollout.stops import StopMatcher

__all__ = ["HFBackend"]


@dataclass(eq=False)
class _Row:
    """What the backend keeps for a row between ``submit`` and ``release``."""

    key: Hashable
    slot: int
    length: int = 0  # tokens of the row's sequence in its slot
    images: int = 0  # images whose placeholders are in the slot
    next_pos: int = 0  # RoPE position of the next token fed
    last: int = 0  # the last sampled token, not yet fed
    sampling: Sampling = field(default_factory=lambda: Sampling(max_new_tokens=0))
    stops: StopMatcher | None = None
    tokens: list[int] = field(default_factory=list)  # this turn's sampled ids
    logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded turn's own stream (Sampling.seed); None: torch's shared one


class HFBackend:
    """Continuous batched sampling over a ``Policy``'s transformers model (see the module docstring).

    Args:
        policy: The loaded policy.
        reuse_cache: Keep each row's KV cache between turns (False: the re-prefill reference).
        share_prefix: Prefill the text that rows starting together share once (False: the per-row reference).
        cuda_graphs: Replay decode steps from CUDA graphs (None: on CUDA, unless the parameters are sharded).
        kv_cache_bytes: Size the KV storage once from this budget (with ``row_tokens``) and never grow it: as many
            slots of ``row_tokens`` as fit, allocated at the first forward in the dtype the layers then make;
            ``max_rows`` tells the engine how many rows it may keep in flight. None: grow on demand.
        row_tokens: The longest row the fixed storage must hold (``max_total_tokens``).
        row_limit: The most rows ever in flight (the engine's batch size): a budget larger than they need
            allocates only what they need, and decode graphs pad no batch past it.
        attention: The language model's attention over the KV storage: ``"sdpa"`` (gathered slots, dense mask) or
            ``"flex"`` (FlexAttention over the whole storage, a block mask per row: ``slot_attention.py``).

    Attributes:
        graphs: The decode graphs, or None (CPU, sharded parameters, ``cuda_graphs=False``; a compiled flex kernel
            keeps the bucketed decode uncaptured, ``graphs.capture`` False, in the last two cases). Graphs replay from
            the addresses of the parameters they were captured with: while a backend lives, update the weights in
            place (``copy_``, an optimizer step), never by assigning new tensors (``.to()``, ``load_state_dict``
            with ``assign=True``).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        reuse_cache: bool = True,
        share_prefix: bool = True,
        cuda_graphs: bool | None = None,
        kv_cache_bytes: int | None = None,
        row_tokens: int | None = None,
        row_limit: int | None = None,
        attention: str = "sdpa",
    ) -> None:
        if attention not in KERNELS:
            raise ValueError(f"attention must be one of {sorted(KERNELS)}, got {attention!r}")
        text_config = policy.model.config.get_text_config()
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or []):
            raise ValueError("sliding-window attention layers are not supported by the HF rollout backend")
        self.policy = policy
        self.reuse_cache = reuse_cache
        self.share_prefix = share_prefix and reuse_cache
        self._vision_ids = policy.vision_placeholder_ids
        self._suppress = torch.tensor(self._vision_ids, dtype=torch.long, device=policy.device)
        # the decoder and head are reached through one unwrap that knows peft (LoRA) and DDP/DeepSpeed wrappers
        self._decoder, self._head = decoder_and_head(policy.model)
        self._cache_argument = cache_argument(self._decoder)
        self._eos = set(policy.eos_token_ids)
        self._pad = policy.tokenizer.pad_token_id or 0
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        self.attention = attention
        self.cache = SlotCache(text_config.num_hidden_layers, text_config.num_key_value_heads, head_dim,
                               policy.dtype, policy.device, flat=attention == "flex")  # fmt: skip
        self._rows: dict[Hashable, _Row] = {}  # every submitted, unreleased row
        self._free: list[int] = []  # slots of released rows
        self._pending: list[TurnRequest] = []
        self._decoding: list[_Row] = []  # the decode batch, in slot order
        self._matchers: dict[tuple[str, ...], StopMatcher] = {}
        self._stats = BackendStats()
        if cuda_graphs is None:
            cuda_graphs = policy.device.type == "cuda" and graphs_safe(policy.model)
        self.graphs = None
        # a compiled flex kernel compiles once per batch shape: decode batches go through the buckets, graphs or not
        if cuda_graphs or (attention == "flex" and COMPILE.get(policy.device.type, False)):
            self.graphs = DecodeGraphs(policy.model, self.cache, self._cache_argument, capture=bool(cuda_graphs),
                                       attention=attention, max_batch=row_limit)  # fmt: skip
        if (kv_cache_bytes is None) != (row_tokens is None):
            raise ValueError("kv_cache_bytes and row_tokens go together")
        # +1: a decode's write; rounded up to the capacity the layout allocates
        self._budget = (kv_cache_bytes, self.cache.aligned(row_tokens + 1)) if kv_cache_bytes is not None else None
        self._row_tokens = row_tokens
        self._row_limit = row_limit

    # -- GenerationBackend --------------------------------------------------------------------------

    def submit(self, request: TurnRequest) -> None:
        """Queue a turn; it starts at the next ``step``."""
        if request.sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.sampling.max_new_tokens}")
        self._pending.append(request)

    def release(self, key: Hashable) -> None:
        """Forget a row (and any turn of it still queued): its slot goes back to the free list, uncleared."""
        self._pending = [r for r in self._pending if r.key != key]
        row = self._rows.pop(key, None)
        if row is not None:
            self._decoding = [r for r in self._decoding if r is not row]
            self._free.append(row.slot)

    @property
    def max_rows(self) -> int | None:
        """Rows the fixed KV storage holds at once (None: it grows on demand). Counted in the dtype the layers make
        now (bf16 under the GRPO recipe's autocast), less the decode graphs' scratch slot."""
        if self._budget is None:
            return None
        if self.cache.fixed:
            return self.cache.slots - (self.graphs is not None)
        budget, tokens = self._budget
        rows = budget // (self.cache.token_bytes(self._compute_dtype()) * tokens) - (self.graphs is not None)
        return min(rows, self._row_limit) if self._row_limit is not None else rows

    def free_storage(self) -> None:
        """Give back KV storage grown on demand, between rollouts (GRPO's update then has the memory); fixed storage
        (``kv_cache_bytes``) is kept. Only when no row is live."""
        if self._rows or self._pending:
            raise ValueError("free_storage: rows are still live")
        if self._budget is None:
            self.cache.clear()
            self._free = []

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._decoding)

    def stats(self) -> BackendStats:
        self._stats.cache_growths = self.cache.growths
        self._stats.stop_decodes = sum(m.decodes for m in self._matchers.values())
        if self.graphs is not None:
            self._stats.graph_captures, self._stats.graph_capture_s = self.graphs.captures, self.graphs.capture_s
        return self._stats

    @torch.no_grad()
    def step(self) -> list[TurnResult]:
        """Prefill queued turns (joining them to the batch), else decode one token for every generating row.

        A prefill step runs only the joining rows' new tokens; the decoding rows wait for that one step
        (running both in one forward would pad every decoding row to the widest new segment:
        docs/decisions/rollout-join-prefill.md).
        """
        # once a step, before any reserve or forward: the storage follows the dtype the layers make now, and a
        # budgeted storage is allocated once, here, in that dtype
        self._match_cache_dtype()
        if self._pending:
            requests, self._pending = self._pending, []
            rows, logits = self._prefill(requests)
        else:
            rows, logits = self._decoding, self._decode()
        return self._sample_and_finish(rows, logits)

    # -- prefill ------------------------------------------------------------------------------------

    def _prefill(self, requests: list[TurnRequest]) -> tuple[list[_Row], torch.Tensor]:
        """Prefill queued turns; returns their rows (joined to the decode batch) and next-token logits (B, V).

        Fresh turns with the same ids and images (the samples of one task) run through the model once; the
        others get a copy of that row's slot and share its logits, each still sampling on its own.
        """
        rows = [self._row_for(r) for r in requests]
        source: list[int] = []  # request i is served by unique[source[i]]
        unique: list[int] = []
        firsts: dict[tuple[int, ...], list[int]] = {}
        for i, (request, row) in enumerate(zip(requests, rows, strict=True)):
            if row.length == 0:
                same_ids = firsts.setdefault(tuple(request.ids), [])
                twin = next((j for j in same_ids if _same_images(requests[unique[j]], request)), None)
                if twin is not None:
                    source.append(twin)
                    continue
                same_ids.append(len(unique))
            source.append(len(unique))
            unique.append(i)
        self._share_prefix([requests[i] for i in unique], [rows[i] for i in unique])
        logits = self._prefill_forward([requests[i] for i in unique], [rows[i] for i in unique])
        for i, (request, row) in enumerate(zip(requests, rows, strict=True)):
            served_by = rows[unique[source[i]]]
            if served_by is not row:
                self.cache.copy_slot(served_by.slot, row.slot, served_by.length)
                row.length, row.images, row.next_pos = served_by.length, served_by.images, served_by.next_pos
            self._start_turn(row, request.sampling)
        self._decoding = sorted(self._decoding + rows, key=lambda r: r.slot)
        index = torch.tensor(source, device=logits.device)
        return rows, logits[index]

    def _row_for(self, request: TurnRequest) -> _Row:
        row = self._rows.get(request.key)
        if row is None:
            self._free.sort(reverse=True)  # lowest free slot first: the decode batch's slots stay consecutive
            slot = self._free.pop() if self._free else len(self._rows)
            row = self._rows[request.key] = _Row(key=request.key, slot=slot)
        if row in self._decoding:
            raise ValueError(f"row {request.key!r} submitted a turn while its previous turn is still generating")
        if not self.reuse_cache:
            row.length = row.images = 0
        if len(request.ids) <= row.length:
            raise ValueError(f"row {request.key!r}: a turn request must extend the row's sequence")
        return row

    def _start_turn(self, row: _Row, sampling: Sampling) -> None:
        row.sampling, row.tokens, row.logprobs = sampling, [], []
        row.generator = None
        if sampling.seed is not None and sampling.temperature > 0:
            row.generator = torch.Generator(device=self.policy.device).manual_seed(sampling.seed)
        if sampling.stop_strings not in self._matchers:
            self._matchers[sampling.stop_strings] = StopMatcher(self.policy.tokenizer, sampling.stop_strings)
        row.stops = self._matchers[sampling.stop_strings]

    def _share_prefix(self, requests: list[TurnRequest], rows: list[_Row]) -> None:
        """Prefill the text the fresh rows all begin with (the system prompt with its tool schemas: most of a
        tool prompt's tokens) once into the first one's slot and copy it into the others' (O(prefix) each), as
        if each had it cached; their prefill then runs only the rest."""
        fresh = [i for i, row in enumerate(rows) if row.length == 0]
        if not self.share_prefix or len(fresh) < 2:
            return
        length = common_prefix_length([requests[i].ids for i in fresh], self._vision_ids)
        if not length:
            return
        first = rows[fresh[0]]
        ids = torch.tensor([requests[fresh[0]].ids[:length]])
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        self.cache.reserve(self._slot_room(), length)
        self.cache.plan([first.slot], [0], length, length)
        self._forward(ids, positions, self._mask([first.slot], [0], length, length), torch.tensor([length - 1]))
        self._stats.prefill_tokens += length
        for i in fresh:
            if rows[i] is not first:
                self.cache.copy_slot(first.slot, rows[i].slot, length)
            rows[i].length = length

    def _prefill_forward(self, requests: list[TurnRequest], rows: list[_Row]) -> torch.Tensor:
        """One forward over the rows' new tokens (right-padded to the widest), written into their slots."""
        cached = [row.length for row in rows]
        new = [r.ids[c:] for r, c in zip(requests, cached, strict=True)]
        width = max(len(n) for n in new)
        input_ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        positions = torch.zeros(3, len(rows), width, dtype=torch.long)
        pixels, grids = [], []
        for i, (request, row, n) in enumerate(zip(requests, rows, new, strict=True)):
            input_ids[i, : len(n)] = torch.tensor(n)
            grid = torch.cat(request.image_grid_thw) if request.image_grid_thw else None
            full = rope_positions(self.policy.model, torch.tensor([request.ids]), image_grid_thw=grid)  # (3, 1, T)
            positions[:, i, : len(n)] = full[:, 0, row.length :]
            pixels += request.pixel_values[row.images :]
            grids += request.image_grid_thw[row.images :]
            row.next_pos = int(full.max()) + 1
        key_length = max(c + width for c in cached)
        # room for the whole turn now, so no decode step of it has to grow the storage
        turn = max(len(r.ids) + r.sampling.max_new_tokens for r in requests)
        self.cache.reserve(self._slot_room(), max(key_length, turn))
        self.cache.plan([row.slot for row in rows], cached, width, key_length)
        vision = {}
        if pixels:
            device = self.policy.device
            vision = {"pixel_values": _stacked_on(pixels, device), "image_grid_thw": torch.cat(grids).to(device)}
        last = torch.tensor([len(n) - 1 for n in new])
        mask = self._mask([row.slot for row in rows], cached, width, key_length)
        logits = self._forward(input_ids, positions, mask, last, **vision)
        self._stats.prefill_tokens += sum(len(n) for n in new)
        for request, row in zip(requests, rows, strict=True):
            row.length, row.images = len(request.ids), len(request.image_grid_thw)
        return logits

    # -- decode -------------------------------------------------------------------------------------

    def _decode(self) -> torch.Tensor:
        """Feed every generating row its last sampled token (written at its own length in its slot)."""
        rows = self._decoding
        lengths = [row.length for row in rows]
        logits = self._graph_decode(rows, lengths) if self.graphs is not None else None
        if logits is None:
            key_length = max(lengths) + 1
            self.cache.reserve(self.cache.slots, key_length)
            self.cache.plan([row.slot for row in rows], lengths, 1, key_length)
            input_ids = torch.tensor([[row.last] for row in rows])
            positions = torch.tensor([row.next_pos for row in rows]).view(1, -1, 1).expand(3, -1, -1)
            sees = self._mask([row.slot for row in rows], lengths, 1, key_length)  # own tokens and the new one
            logits = self._forward(input_ids, positions, sees, torch.zeros(len(rows), dtype=torch.long))
        for row in rows:
            row.length += 1
            row.next_pos += 1
        self._stats.decode_tokens += len(rows)
        self._stats.decode_steps += 1
        return logits

    def _graph_decode(self, rows: list[_Row], lengths: list[int]) -> torch.Tensor | None:
        """The decode forward replayed from a CUDA graph (None when graphs are off or failed to capture)."""
        start = time.perf_counter()
        capturing = self.graphs.capture_s
        if self._budget is not None:  # no batch past the rows the storage holds: 75 rows pad to 75, not to 128
            self.graphs.max_batch = self.max_rows
        logits = self.graphs.decode([r.last for r in rows], [r.next_pos for r in rows], [r.slot for r in rows],
                                    lengths, room=self._slot_room())  # fmt: skip
        if logits is not None:
            self._timed(start + self.graphs.capture_s - capturing)  # a capture is counted in graph_capture_s
        return logits

    # -- shared -------------------------------------------------------------------------------------

    def _mask(self, slots: list[int], cached: list[int], width: int, key_length: int):
        """What a forward attends with (on the device): row ``b`` (slot ``slots[b]``, ``cached[b]`` tokens in it) sees
        its slot up to ``cached[b] + j`` from its new token ``j``. SDPA: (B, 1, width, key_length) bool over the
        gathered slots; flex: the block mask over the whole storage (``slot_block_mask``)."""
        device = self.policy.device
        if self.attention == "flex":
            slot_index, lengths = torch.tensor(slots, device=device), torch.tensor(cached, device=device)
            return slot_block_mask(slot_index, lengths, width, self.cache.capacity, self.cache.slots)
        return causal_mask(cached, [width] * len(cached), key_length).to(device)

    def _forward(self, input_ids, positions, mask, last_index, **vision) -> torch.Tensor:
        """One forward through the slot cache; returns logits at ``last_index`` of each row (B, V). ``mask``: from
        ``_mask``."""
        device = self.policy.device
        start = time.perf_counter()
        with attention_implementation(self.policy.model, KERNELS[self.attention]):  # whatever it was loaded with
            out = self._decoder(
                input_ids=input_ids.to(device),
                attention_mask=mask,  # 4-D (bool or a BlockMask): transformers hands it to the kernel as-is
                position_ids=positions.to(device),
                **{self._cache_argument: self.cache},
                use_cache=True,
                **vision,
            )
            rows = torch.arange(input_ids.shape[0], device=device)
            hidden = out.last_hidden_state[rows, last_index.to(device)]  # (B, H)
            logits = self._head(hidden).float()  # (B, V): only the positions we sample from, never (B, T, V)
        self._timed(start)
        return logits

    def _slot_room(self) -> int:
        """Slots the storage needs: every live row's, and with decode graphs a scratch slot for their padding."""
        return len(self._rows) + len(self._free) + (self.graphs is not None)

    def _check_budget(self) -> None:
        """A budget must hold one row, counted in the dtype the layers make now (checked again when the storage is
        allocated, under the autocast it then runs in)."""
        if self.max_rows < 1:
            budget, tokens = self._budget
            per_row = self.cache.token_bytes(self._compute_dtype()) * tokens * (1 + (self.graphs is not None))
            raise ValueError(f"a KV budget of {budget / 2**30:.2f} GiB holds no row of {self._row_tokens} tokens (one "
                             f"takes {per_row / 2**30:.2f} GiB with its padding slot): raise rollout.kv_cache_gb or "
                             "lower rollout.max_total_tokens")  # fmt: skip

    def _compute_dtype(self) -> torch.dtype:
        device = self.policy.device
        autocast = torch.is_autocast_enabled(device.type)
        return torch.get_autocast_dtype(device.type) if autocast else self.policy.dtype

    def _match_cache_dtype(self) -> None:
        """Keys are stored in the dtype the layers make them in: bf16 under the GRPO recipe's autocast, else the
        model's; a budgeted storage is allocated here, once, in that dtype."""
        if self._budget is not None and not self.cache.fixed:
            self._check_budget()
            self.cache.fix(self.max_rows + (self.graphs is not None), self._budget[1], self._compute_dtype())
        self.cache.ensure_dtype(self._compute_dtype())

    def _timed(self, start: float) -> None:
        """Count a forward that started at ``start`` (on CUDA after it finishes, not when it was launched)."""
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize()
        self._stats.forward_s += time.perf_counter() - start
        self._stats.forward_passes += 1

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """(B, V) raw logits -> each row's token and its log-prob under the distribution it was drawn from.

        A sampled row draws from softmax(logits / T) cut to its nucleus (``top_p``) and renormalized, and records
        that distribution's log-prob: the one GRPO's trainer recomputes (``masked_token_logprobs`` at the same T and
        top_p), so the PPO ratio compares the same distributions. A greedy row records the model's own (T = 1)
        log-prob. Vision placeholders are never drawn: they leave the distribution first (logit -inf), before the
        temperature and the nucleus, as vLLM's banned tokens do and as GRPO's trainer scores (``suppress``).
        """
        temperature = torch.tensor([row.sampling.temperature for row in rows], device=logits.device)
        sampled = temperature > 0
        logits = logits.index_fill(-1, self._suppress, float("-inf"))
        scaled = logits / torch.where(sampled, temperature, 1.0)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
        top_ps = [row.sampling.top_p if row.sampling.temperature > 0 else 1.0 for row in rows]
        if min(top_ps) < 1.0:
            for b, top_p in enumerate(top_ps):  # rows with a nucleus: renormalize over it
                if top_p < 1.0:
                    drop = nucleus_mask(logprobs[b : b + 1].exp(), top_p)[0]
                    logprobs[b] = torch.log_softmax(scaled[b].masked_fill(drop, float("-inf")), dim=-1)
        tokens = logprobs.argmax(dim=-1)
        if bool(sampled.any()):
            tokens = torch.where(sampled, _draw(logprobs.exp(), [row.generator for row in rows]), tokens)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    def _sample_and_finish(self, rows: list[_Row], logits: torch.Tensor) -> list[TurnResult]:
        tokens, logprobs = self._sample(rows, logits)
        results = []
        for row, token, logprob in zip(rows, tokens, logprobs, strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.last = token
            stop = None
            if token in self._eos:
                stop = "eos"
            elif row.stops is not None and row.stops.matches(row.tokens):
                stop = "stop_string"
            elif len(row.tokens) >= row.sampling.max_new_tokens:
                stop = "length"
            if stop:
                results.append(TurnResult(row.key, row.tokens, row.logprobs, stop))
        if results:
            ended = {result.key for result in results}
            self._decoding = [row for row in self._decoding if row.key not in ended]  # leaving copies nothing
        return results


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One token per row of (B, V) probabilities by the inverse CDF: one uniform number per row, then a binary
    search of the row's cumulative sum (float64, so 151,936 summands lose no mass that matters). Same distribution
    as ``torch.multinomial(probs, 1)``, which draws an exponential number for every vocabulary entry: at Qwen's
    vocabulary and 64 rows that took 3x a CPU decode step. A token of probability 0 is never drawn. A row with its own
    generator (a seeded turn) draws its number from it, so its tokens do not depend on which rows share the batch."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device)
    for b, generator in enumerate(generators or []):
        if generator is not None:
            u[b] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generator)
    u = u * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: some cdf entry exceeds it
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _same_images(a: TurnRequest, b: TurnRequest) -> bool:
    return len(a.pixel_values) == len(b.pixel_values) and all(
        x is y or torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True)
    )


def _stacked_on(blocks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(sum of N_i, D) the images' patch blocks (N_i, D) as one tensor on ``device``, each block copied straight into
    its rows there: no concatenation on the host first (on a GPU that was a transient host copy of every image being
    prefilled). A lone block goes as it is (on the CPU, the carried tensor itself)."""
    if len(blocks) == 1:
        return blocks[0].to(device)
    out = torch.empty((sum(len(b) for b in blocks), *blocks[0].shape[1:]), dtype=blocks[0].dtype, device=device)
    start = 0
    for block in blocks:
        out[start : start + len(block)].copy_(block)
        start += len(block)
    return out

"""Batched generation on a transformers model with KV-cache reuse across turns (CPU and GPU).

The engine hands the backend *turn requests* (a row's whole sequence so far) and calls ``step()``;
each step advances every active row by one token, and finished turns come back as they finish. Rows
join and leave the batch between steps, so a row whose tool is still running never holds up the rows
that are generating.

How the cache is kept (why it is exact):

* Each row's KV cache is stored hole-free between turns (only its real tokens, in order). A new turn
  prefills only the tokens after the cached ones (the last sampled token, the forced turn close, the
  tool observation with its images, the next assistant header).
* Rows are batched by left-padding their caches to a common length; new segments are right-padded.
  Padding is masked out of attention (2D mask over cache + new tokens), so a row attends to exactly
  its own tokens. Keys are cached after RoPE, so removing the padding when a row leaves the batch
  (compaction) does not change any stored key.
* Positions are multimodal RoPE positions computed over the row's whole sequence
  (``Policy.rope_positions``) and passed to every forward: the model's cached ``rope_deltas`` are
  never used, so interleaving rows (or training forwards) cannot pick up stale deltas. A decoded text
  token's position is the row's largest position + 1 in all three axes.
* ``reuse_cache=False`` drops each row's cache at the end of its turn, so every turn re-prefills the
  whole sequence: the reference for exactness tests and the baseline of the prefill benchmark.
* Rows that start together and begin with the same text (the system prompt with its tool schemas)
  prefill that prefix once, at batch 1; each row then gets a copy of its cache, as if stored
  (``share_prefix=False`` prefills it per row: the benchmark's baseline).

Not safe, so not done: sliding-window layers (the cache would not be a plain concatenation; such
models raise at construction) and sharing caches between the ``n`` samples of a task beyond the
prefill (their caches are independent copies).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from vagent.model import MIN_SHARED_PREFIX, Policy, cache_argument, output_cache

__all__ = ["HFBackend", "TurnRequest", "TurnResult"]

# Stop strings are checked on the decoded tail of a turn; this many tokens always covers the longest stop.
_TAIL_TOKENS = 24


@dataclass
class TurnRequest:
    """Generate one assistant turn for a row.

    Attributes:
        key: The row's identity; the backend keeps its cache under it until ``release``.
        ids: The row's whole sequence so far, ending with the assistant header of this turn.
        pixel_values: Patches of every image of the row, in order (prompt images, then tool outputs).
        image_grid_thw: (n_images, 3) one row per image.
        max_new_tokens: Budget of this turn.
    """

    key: Hashable
    ids: list[int]
    pixel_values: list[torch.Tensor]
    image_grid_thw: list[torch.Tensor]
    max_new_tokens: int


@dataclass
class TurnResult:
    """A finished turn: sampled ids, their log-probs (temperature 1, unwarped), and why it stopped."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[float]
    stop: str  # "eos" | "stop_string" | "length"


@dataclass
class _Row:
    key: Hashable
    budget: int
    next_pos: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Stored:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, heads, n, dim), hole-free
    length: int  # tokens of the row's sequence that are in the cache
    images: int  # images whose placeholders are in the cache


class HFBackend:
    """Continuous batched sampling over a ``Policy``'s transformers model.

    Args:
        policy: The loaded policy.
        temperature: 0 = greedy.
        top_p: Nucleus mass.
        stop_strings: A turn ends when its text contains one of these (e.g. ``</tool_call>``) or at EOS.
        reuse_cache: Keep each row's KV cache between turns (prefill only new tokens).
        share_prefix: Prefill the text that rows starting together share (the system prompt) once per batch.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_strings: tuple[str, ...] = (),
        reuse_cache: bool = True,
        share_prefix: bool = True,
    ) -> None:
        text_config = policy.model.config.get_text_config()
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or []):
            raise ValueError("sliding-window attention layers are not supported by the HF rollout backend")
        self.policy = policy
        self.temperature, self.top_p = temperature, top_p
        self.stop_strings = stop_strings
        self.reuse_cache = reuse_cache
        self.share_prefix = share_prefix and reuse_cache
        self._suppress = policy.vision_placeholder_ids
        self._cache_argument = cache_argument(policy.model.model)
        self._eos = set(policy.eos_token_ids)
        self._pad = policy.tokenizer.pad_token_id or 0
        self._stored: dict[Hashable, _Stored] = {}
        self._pending: list[TurnRequest] = []
        self._rows: list[_Row] = []  # the decode batch, aligned with the cache's batch dim
        self._cache: DynamicCache | None = None  # the decode batch's cache, per layer (B, heads, L, dim)
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # (B, L) 1 = real token
        self._last = torch.zeros(0, dtype=torch.long)  # (B,) sampled, not yet fed
        # Counters for benchmarks: tokens run through prefill and decode, forward passes and their time.
        self.prefill_tokens = self.decode_tokens = self.forward_passes = 0
        self.forward_s = 0.0

    # -- the engine's interface -------------------------------------------------------------------

    def submit(self, request: TurnRequest) -> None:
        """Queue a turn; it starts at the next ``step``."""
        self._pending.append(request)

    def release(self, key: Hashable) -> None:
        """Forget a row's cache (its episode ended)."""
        self._stored.pop(key, None)

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._rows)

    @torch.no_grad()
    def step(self) -> list[TurnResult]:
        """Prefill queued turns (joining them to the batch), else decode one token for every active row.

        A prefill step runs only the joining rows' new tokens; the decoding rows wait for that one step.
        Measured alternatives were slower (docs/decisions/rollout-join-prefill.md): running both in one forward pads every
        decoding row to the widest new segment, and compacting the batch around each join copies it.
        """
        if self._pending:
            requests, self._pending = self._pending, []
            logits, rows, kv = self._prefill(requests)
        else:
            logits = self._decode()
            rows, kv = [], []
        return self._sample_and_finish(logits, rows, kv)

    # -- internals --------------------------------------------------------------------------------

    def _forward(self, input_ids, attention_mask, position_ids, past: DynamicCache | None, last_index, **vision):
        """One forward; returns logits at ``last_index`` of each row (B, V) and the grown cache."""
        model = self.policy.model
        start = time.perf_counter()
        out = model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{self._cache_argument: past if past is not None else DynamicCache()},
            use_cache=True,
            **vision,
        )
        self.forward_passes += 1
        hidden = out.last_hidden_state[torch.arange(input_ids.shape[0]), last_index]  # (B, H)
        logits = model.lm_head(hidden).float()  # (B, V): only the positions we sample from, never (B, T, V)
        if logits.is_cuda:
            torch.cuda.synchronize()  # so forward_s is the forward's time, not its launch time
        self.forward_s += time.perf_counter() - start
        return logits, output_cache(out)

    def _prefill(self, requests: list[TurnRequest]):
        """Prefill the queued turns; returns their next-token logits (B, V), decode rows and hole-free caches.

        Turns with nothing cached and the same ids and images (the samples of one task: a GRPO group, pass@k)
        run through the model once and share the result; each still samples on its own.
        """
        stored = [self._stored.pop(r.key, None) for r in requests]
        source: list[int] = []  # request i is served by unique[source[i]]
        unique: list[int] = []
        firsts: dict[tuple[int, ...], list[int]] = {}
        for i, (r, s) in enumerate(zip(requests, stored, strict=True)):
            if s is None:
                same_ids = firsts.setdefault(tuple(r.ids), [])
                twin = next((j for j in same_ids if _same_images(requests[unique[j]], r)), None)
                if twin is not None:
                    source.append(twin)
                    continue
                same_ids.append(len(unique))
            source.append(len(unique))
            unique.append(i)
        logits, rows, compact = self._prefill_unique([requests[i] for i in unique], [stored[i] for i in unique])
        for r in requests:
            self._stored[r.key] = _Stored(kv=[], length=len(r.ids), images=len(r.image_grid_thw))  # kv set at leave
        rows = [rows[j] if unique[j] == i else _Row(key=r.key, budget=r.max_new_tokens, next_pos=rows[j].next_pos)
                for i, (r, j) in enumerate(zip(requests, source, strict=True))]  # fmt: skip
        index = torch.tensor(source, device=logits.device)
        return logits[index], rows, [compact[j] for j in source]

    def _prefill_unique(self, requests: list[TurnRequest], stored: list[_Stored | None]):
        device = self.policy.device
        stored = self._shared_prefix(requests, stored)
        cached = [s.length if s else 0 for s in stored]
        new = [r.ids[c:] for r, c in zip(requests, cached, strict=True)]
        lc, lp = max(cached), max(len(n) for n in new)
        batch = len(requests)
        input_ids = torch.full((batch, lp), self._pad, dtype=torch.long)
        positions = torch.zeros(3, batch, lp, dtype=torch.long)
        mask = torch.zeros(batch, lc + lp, dtype=torch.long)
        pixels, grids, rows = [], [], []
        for i, (r, c, n) in enumerate(zip(requests, cached, new, strict=True)):
            input_ids[i, : len(n)] = torch.tensor(n)
            grid = torch.cat(r.image_grid_thw) if r.image_grid_thw else None
            full = self.policy.rope_positions(torch.tensor([r.ids]), grid)  # (3, 1, T) over the whole row
            positions[:, i, : len(n)] = full[:, 0, c:]
            mask[i, lc - c : lc + len(n)] = 1
            done = stored[i].images if stored[i] else 0
            pixels += r.pixel_values[done:]
            grids += r.image_grid_thw[done:]
            rows.append(_Row(key=r.key, budget=r.max_new_tokens, next_pos=int(full.max()) + 1))
        cache = []
        if lc:
            first_stored = next(s for s in stored if s)
            for layer in range(len(first_stored.kv)):
                like = first_stored.kv[layer][0]
                k = like.new_zeros(batch, like.shape[1], lc, like.shape[3])
                v = torch.zeros_like(k)
                for i, s in enumerate(stored):
                    if s:
                        k[i, :, lc - s.length :] = s.kv[layer][0][0]
                        v[i, :, lc - s.length :] = s.kv[layer][1][0]
                cache.append((k, v))
        vision = {}
        if pixels:
            vision = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
        last = torch.tensor([len(n) - 1 for n in new], device=device)
        self.prefill_tokens += sum(len(n) for n in new)
        past = _cache_from(cache) if cache else None
        logits, grown = self._forward(input_ids.to(device), mask.to(device), positions.to(device), past, last, **vision)
        # Compact each row (drop padding) so it joins the decode batch hole-free.
        kv = _tensors(grown)
        compact = []
        for i in range(batch):
            keep = mask[i].nonzero().squeeze(1).to(device)
            compact.append([(k[i : i + 1, :, keep], v[i : i + 1, :, keep]) for k, v in kv])
        return logits, rows, compact

    def _shared_prefix(self, requests: list[TurnRequest], stored: list[_Stored | None]) -> list[_Stored | None]:
        """Give the rows that start fresh the cache of the text they all begin with (the system prompt with its
        tool schemas: most of a tool prompt's tokens), run once at batch 1, as if each had it stored; their
        prefill then runs only the rest. The prefix stops before the first vision token (a text prefix's RoPE
        positions are plain 0..n-1, as in the whole row) and leaves every row at least one token of its own.
        Each row gets its own copy, as from a stored cache. Off with ``share_prefix`` or ``reuse_cache`` False."""
        fresh = [i for i, s in enumerate(stored) if s is None]
        if len(fresh) < 2 or not self.share_prefix:
            return stored
        first = requests[fresh[0]].ids
        length = min(len(requests[i].ids) for i in fresh) - 1
        vision = set(self._suppress)
        length = next((t for t, token in enumerate(first[:length]) if token in vision), length)
        for i in fresh[1:]:
            ids = requests[i].ids
            length = next((t for t in range(length) if ids[t] != first[t]), length)
        if length < MIN_SHARED_PREFIX:
            return stored
        device = self.policy.device
        ids = torch.tensor([first[:length]], device=device)
        positions = torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1)
        mask = torch.ones_like(ids)
        _, cache = self._forward(ids, mask, positions, None, torch.tensor([length - 1], device=device))
        self.prefill_tokens += length
        prefix = _Stored(kv=_tensors(cache), length=length, images=0)
        return [prefix if s is None else s for s in stored]

    def _decode(self) -> torch.Tensor:
        device = self.policy.device
        batch = len(self._rows)
        self.decode_tokens += batch
        self._mask = torch.cat([self._mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        positions = torch.tensor([r.next_pos for r in self._rows]).view(1, batch, 1).expand(3, -1, -1)
        logits, self._cache = self._forward(
            self._last.view(batch, 1).to(device),
            self._mask.to(device),
            positions.to(device),
            self._cache,
            torch.zeros(batch, dtype=torch.long, device=device),
        )
        for r in self._rows:
            r.next_pos += 1
        return logits

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, V) raw logits -> sampled ids (B,) and their unwarped log-probs (B,)."""
        # The recorded log-prob is the model's own (what training recomputes), not the suppressed sampler's.
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        logits[:, self._suppress] = float("-inf")
        if self.temperature <= 0:
            tokens = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / self.temperature, dim=-1)
            if self.top_p < 1.0:
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                # keep the smallest prefix whose mass reaches top_p (always at least the top token)
                drop = sorted_probs.cumsum(-1) - sorted_probs > self.top_p
                sorted_probs[drop] = 0
                probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            tokens = torch.multinomial(probs, 1).squeeze(1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(1)

    def _sample_and_finish(self, logits, joining: list[_Row], joining_kv) -> list[TurnResult]:
        tokens, logprobs = self._sample(logits)
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        rows = joining if joining else self._rows
        if joining:
            self._join(joining, joining_kv, tokens)
        finished: list[int] = []
        results: list[TurnResult] = []
        tokenizer = self.policy.tokenizer
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            stop = None
            if token in self._eos:
                stop = "eos"
            elif self.stop_strings and any(
                s in tokenizer.decode(row.tokens[-_TAIL_TOKENS:]) for s in self.stop_strings
            ):
                stop = "stop_string"
            elif len(row.tokens) >= row.budget:
                stop = "length"
            if stop:
                finished.append(self._rows.index(row))
                results.append(TurnResult(row.key, row.tokens, row.logprobs, stop))
        if not joining:
            self._last = tokens
        if finished:
            self._leave(finished)
        return results

    def _join(self, rows: list[_Row], kv, first_tokens: torch.Tensor) -> None:
        """Add prefilled rows (hole-free caches) to the decode batch, left-padding to a common length."""
        lengths = [kv_row[0][0].shape[2] for kv_row in kv]
        current = self._mask.shape[1]
        length = max([current, *lengths])
        merged = []
        current_kv = _tensors(self._cache) if self._rows else []
        for layer in range(len(kv[0])):
            parts_k, parts_v = [], []
            if self._rows:
                k, v = current_kv[layer]
                pad = length - current
                parts_k.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                parts_v.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            for kv_row, n in zip(kv, lengths, strict=True):
                k, v = kv_row[layer]
                parts_k.append(torch.nn.functional.pad(k, (0, 0, length - n, 0)))
                parts_v.append(torch.nn.functional.pad(v, (0, 0, length - n, 0)))
            merged.append((torch.cat(parts_k), torch.cat(parts_v)))
        masks = [torch.nn.functional.pad(self._mask, (length - current, 0))] if self._rows else []
        masks += [torch.nn.functional.pad(torch.ones(1, n, dtype=torch.long), (length - n, 0)) for n in lengths]
        self._cache, self._mask = _cache_from(merged), torch.cat(masks)
        self._last = torch.cat([self._last, first_tokens])
        self._rows += rows

    def _leave(self, indices: list[int]) -> None:
        """Take finished rows out of the batch, storing each one's cache hole-free for its next turn."""
        kv = _tensors(self._cache)
        for i in indices:
            row = self._rows[i]
            entry = self._stored.get(row.key)
            if entry is not None and self.reuse_cache:
                keep = self._mask[i].nonzero().squeeze(1).to(kv[0][0].device)
                entry.kv = [(k[i : i + 1, :, keep], v[i : i + 1, :, keep]) for k, v in kv]
                entry.length += len(row.tokens) - 1  # the last sampled token was never fed
            else:
                self._stored.pop(row.key, None)
        leaving = set(indices)
        stay = [i for i in range(len(self._rows)) if i not in leaving]
        index = torch.tensor(stay, dtype=torch.long)
        self._rows = [self._rows[i] for i in stay]
        self._last = self._last[index]
        self._mask = self._mask[index]
        if not self._rows:
            self._mask, self._cache = torch.zeros(0, 0, dtype=torch.long), None
            return
        # Drop columns that are padding for every remaining row (the longest row may just have left).
        first = int(self._mask.any(0).nonzero()[0])
        self._mask = self._mask[:, first:]
        rows = index.to(kv[0][0].device)
        self._cache = _cache_from([(k[rows, :, first:], v[rows, :, first:]) for k, v in kv])


def _same_images(a: TurnRequest, b: TurnRequest) -> bool:
    return len(a.pixel_values) == len(b.pixel_values) and all(
        x is y or torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True)
    )


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding these tensors as they are (``DynamicCache(ddp_cache_data=...)`` would copy them)."""
    cache = DynamicCache()
    for k, v in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache

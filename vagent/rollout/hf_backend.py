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

Not safe, so not done: sliding-window layers (the cache would not be a plain concatenation; such
models raise at construction) and sharing prefixes between the ``n`` samples of a task (their caches
are independent copies).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from vagent.model import Policy

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
    """

    def __init__(
        self,
        policy: Policy,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_strings: tuple[str, ...] = (),
        reuse_cache: bool = True,
    ) -> None:
        text_config = policy.model.config.get_text_config()
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or []):
            raise ValueError("sliding-window attention layers are not supported by the HF rollout backend")
        self.policy = policy
        self.temperature, self.top_p = temperature, top_p
        self.stop_strings = stop_strings
        self.reuse_cache = reuse_cache
        config = policy.model.config
        # A random or confused policy must not emit vision placeholders: the next forward would then hold
        # more image tokens than images and fail.
        self._suppress = [config.image_token_id, config.video_token_id, config.vision_start_token_id]
        self._suppress.append(config.vision_end_token_id)
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
        """One forward for every active row: queued turns prefill their new tokens while the decoding rows
        take their next token in the same forward (a mixed step), else a plain decode step."""
        logits = self._prefill() if self._pending else self._decode()
        return self._sample_and_finish(logits)

    # -- internals --------------------------------------------------------------------------------

    def _forward(self, input_ids, attention_mask, position_ids, past: DynamicCache | None, last_index, **vision):
        """One forward; returns logits at ``last_index`` of each row (B, V) and the grown cache."""
        model = self.policy.model
        start = time.perf_counter()
        out = model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past if past is not None else DynamicCache(),
            use_cache=True,
            **vision,
        )
        self.forward_passes += 1
        hidden = out.last_hidden_state[torch.arange(input_ids.shape[0]), last_index]  # (B, H)
        logits = model.lm_head(hidden).float()  # (B, V): only the positions we sample from, never (B, T, V)
        if logits.is_cuda:
            torch.cuda.synchronize()  # so forward_s is the forward's time, not its launch time
        self.forward_s += time.perf_counter() - start
        return logits, out.past_key_values

    def _prefill(self) -> torch.Tensor:
        """A mixed step: queued turns join the batch and prefill their new tokens while every decoding row
        feeds its next token, all in one forward. The decode batch's cache is not copied row by row: the
        joining rows' caches are left-padded to its length and concatenated; the new-token window is as
        wide as the longest new segment, so shorter rows get masked holes (see ``_leave`` for compaction)."""
        requests, self._pending = self._pending, []
        device = self.policy.device
        entries = []  # per joining row: (row, hole-free cache or None, new tokens, their positions (3, n), images)
        for r in requests:
            stored = self._stored.pop(r.key, None)
            cached = stored.length if stored else 0
            grid = torch.cat(r.image_grid_thw) if r.image_grid_thw else None
            full = self.policy.rope_positions(torch.tensor([r.ids]), grid)  # (3, 1, T) over the whole row
            done = stored.images if stored else 0
            row = _Row(key=r.key, budget=r.max_new_tokens, next_pos=int(full.max()) + 1)
            new = r.ids[cached:]
            entries.append((row, stored.kv if stored else None, new, full[:, 0, cached:],
                            r.pixel_values[done:], r.image_grid_thw[done:]))  # fmt: skip
            self.prefill_tokens += len(new)
            # kv and length are set when the row leaves the batch (see _leave)
            self._stored[r.key] = _Stored(kv=[], length=len(r.ids), images=len(r.image_grid_thw))
        decoding = len(self._rows)
        self.decode_tokens += decoding
        old_len = self._mask.shape[1] if decoding else 0
        joined_len = [e[1][0][0].shape[2] if e[1] else 0 for e in entries]
        lc = max([old_len, *joined_len])
        width = max([len(e[2]) for e in entries] + ([1] if decoding else []))
        batch = decoding + len(entries)
        input_ids = torch.full((batch, width), self._pad, dtype=torch.long)
        positions = torch.zeros(3, batch, width, dtype=torch.long)
        new_mask = torch.zeros(batch, width, dtype=torch.long)
        for i, row in enumerate(self._rows):
            input_ids[i, 0], positions[:, i, 0], new_mask[i, 0] = self._last[i], row.next_pos, 1
            row.next_pos += 1
        pixels, grids = [], []
        for j, (_, _, new, pos, pix, grd) in enumerate(entries):
            input_ids[decoding + j, : len(new)] = torch.tensor(new)
            positions[:, decoding + j, : len(new)] = pos
            new_mask[decoding + j, : len(new)] = 1
            pixels += pix
            grids += grd
        past_mask = torch.zeros(len(entries), lc, dtype=torch.long)
        for j, n in enumerate(joined_len):
            past_mask[j, lc - n :] = 1
        if decoding:
            past_mask = torch.cat([torch.nn.functional.pad(self._mask, (lc - old_len, 0)), past_mask])
        past = None
        if lc:
            like = _tensors(self._cache) if decoding else next(e[1] for e in entries if e[1])
            layers = []
            for layer, (k0, _) in enumerate(like):
                parts_k, parts_v = [], []
                if decoding:
                    k, v = _tensors(self._cache)[layer]
                    parts_k.append(torch.nn.functional.pad(k, (0, 0, lc - old_len, 0)) if lc > old_len else k)
                    parts_v.append(torch.nn.functional.pad(v, (0, 0, lc - old_len, 0)) if lc > old_len else v)
                k_new = k0.new_zeros(len(entries), k0.shape[1], lc, k0.shape[3])
                v_new = torch.zeros_like(k_new)
                for j, (_, kv, *_) in enumerate(entries):
                    if kv:
                        k_new[j, :, lc - joined_len[j] :] = kv[layer][0][0]
                        v_new[j, :, lc - joined_len[j] :] = kv[layer][1][0]
                layers.append((torch.cat([*parts_k, k_new]), torch.cat([*parts_v, v_new])))
            past = _cache_from(layers)
        vision = {}
        if pixels:
            vision = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
        last = torch.tensor([0] * decoding + [len(e[2]) - 1 for e in entries], device=device)
        mask = torch.cat([past_mask, new_mask], dim=1)
        logits, self._cache = self._forward(
            input_ids.to(device), mask.to(device), positions.to(device), past, last, **vision
        )
        self._mask = mask
        self._rows = self._rows + [e[0] for e in entries]
        return logits

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

    def _sample_and_finish(self, logits: torch.Tensor) -> list[TurnResult]:
        tokens, logprobs = self._sample(logits)
        self._last = tokens.cpu()
        finished: list[int] = []
        results: list[TurnResult] = []
        tokenizer = self.policy.tokenizer
        for i, (row, token, logprob) in enumerate(zip(self._rows, self._last.tolist(), logprobs.tolist(), strict=True)):
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
                finished.append(i)
                results.append(TurnResult(row.key, row.tokens, row.logprobs, stop))
        if finished:
            self._leave(finished)
        return results

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
        stay = [i for i in range(len(self._rows)) if i not in set(indices)]
        self._rows = [self._rows[i] for i in stay]
        if not self._rows:
            self._mask, self._cache = torch.zeros(0, 0, dtype=torch.long), None
            self._last = torch.zeros(0, dtype=torch.long)
            return
        index = torch.tensor(stay, dtype=torch.long)
        self._last, mask = self._last[index], self._mask[index]
        rows = index.to(kv[0][0].device)
        if mask.float().mean() < 0.5:
            # Mostly padding and holes (mixed steps leave holes in short rows): compact every row, left-pad again.
            lengths = mask.sum(1)
            length = int(lengths.max())
            layers = []
            for k, v in kv:
                k_out = k.new_zeros(len(stay), k.shape[1], length, k.shape[3])
                v_out = torch.zeros_like(k_out)
                for j, i in enumerate(stay):
                    keep = mask[j].nonzero().squeeze(1).to(k.device)
                    k_out[j, :, length - len(keep) :] = k[i, :, keep]
                    v_out[j, :, length - len(keep) :] = v[i, :, keep]
                layers.append((k_out, v_out))
            self._mask = (torch.arange(length)[None, :] >= (length - lengths)[:, None]).long()
            self._cache = _cache_from(layers)
            return
        # Drop columns that are padding for every remaining row (the longest row may just have left).
        first = int(mask.any(0).nonzero()[0])
        self._mask = mask[:, first:]
        self._cache = _cache_from([(k[rows, :, first:], v[rows, :, first:]) for k, v in kv])


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

"""The contract between the rollout engine and a generation backend.

The engine owns episodes (turns, tools, limits); a backend owns the model and its KV cache. The engine
submits one *turn request* per assistant turn (the row's whole token sequence so far, its images, and how
to sample), calls ``step()`` while the backend has work, and gets each turn back as it finishes; when an
episode ends it releases the row. Any object with these methods is a backend (``HFBackend`` is the one
implementation today), so a second backend needs no engine change.

``TurnBarrier`` wraps a backend into the turn-synchronous baseline the benchmarks compare against.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from PIL import Image

__all__ = ["BackendStats", "GenerationBackend", "Sampling", "TurnBarrier", "TurnRequest", "TurnResult"]


@dataclass(frozen=True)
class Sampling:
    """How to sample one turn.

    Attributes:
        max_new_tokens: Budget of the turn.
        temperature: 0 = greedy.
        top_p: Nucleus mass (1 = off).
        stop_strings: The turn ends when its text contains one of these (or at EOS).
        seed: The turn's own sampling seed: each backend draws the turn from a generator of its own seeded with it
            (vLLM's per-request generator, the HF backend's ``torch.Generator`` per row), so the turn's tokens do not
            depend on what else is batched. None = the backend's shared stream.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class TurnRequest:
    """Generate one assistant turn for a row.

    Attributes:
        key: The row's identity; the backend may keep state (its KV cache) under it until ``release``.
        ids: The row's whole sequence so far, ending with the assistant header of this turn.
        pixel_values: Patches of every image of the row, in order (prompt images, then tool outputs); None for each
            where the backend does not need them (``needs_pixels``).
        image_grid_thw: One (1, 3) grid row per image.
        sampling: How to sample the turn.
        images: The model-sized images those patches were made from, in the same order (None where unknown): what a
            backend with its own processor (vLLM) sends, which must give back exactly these patches.
    """

    key: Hashable
    ids: list[int]
    pixel_values: list[torch.Tensor | None]
    image_grid_thw: list[torch.Tensor]
    sampling: Sampling
    images: list[Image.Image | None] = field(default_factory=list)


@dataclass
class TurnResult:
    """A finished turn: sampled ids, their log-probs under the distribution each was drawn from (softmax at the
    turn's temperature, cut to its nucleus; the model's own at T = 1 for a greedy turn), and why it stopped."""

    key: Hashable
    token_ids: list[int]
    logprobs: list[float]
    stop: str  # "eos" | "stop_string" | "length"


@dataclass
class BackendStats:
    """Counters since the backend was made (benchmarks and tests read them).

    Attributes:
        prefill_tokens: Tokens run through prefill forwards (new tokens only, shared prefixes once).
        decode_tokens: Tokens run through decode forwards (one per active row per step).
        forward_passes: Model forwards.
        forward_s: Wall time inside model forwards (synchronized on CUDA).
        decode_steps: Decode forwards (a subset of ``forward_passes``).
        stop_decodes: Tail decodes the stop-string fallback needed (``StopMatcher``).
        cache_growths: Times the KV storage was reallocated to hold more rows or tokens.
        graph_captures: CUDA graphs of the decode step captured (one per shape bucket and storage).
        graph_capture_s: Wall time of those captures (their warm-up forwards included).
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_passes: int = 0
    forward_s: float = 0.0
    decode_steps: int = 0
    stop_decodes: int = 0
    cache_growths: int = 0
    graph_captures: int = 0
    graph_capture_s: float = 0.0


@runtime_checkable
class GenerationBackend(Protocol):
    """What the engine needs from a generation backend. A backend whose class sets ``needs_pixels = False`` (vLLM:
    its own processor makes the patches from ``TurnRequest.images``) gets requests whose ``pixel_values`` are None
    unless a trainer takes the patches; without the attribute, the engine makes them."""

    def submit(self, request: TurnRequest) -> None:
        """Queue a turn; it starts at a later ``step``."""
        ...

    def step(self) -> list[TurnResult]:
        """Advance the queued and running turns; return the turns that finished (possibly none)."""
        ...

    def release(self, key: Hashable) -> None:
        """Forget a row (its episode ended): free whatever the backend keeps for it."""
        ...

    @property
    def busy(self) -> bool:
        """Whether ``step`` has work to do now."""
        ...

    def stats(self) -> BackendStats:
        """Counters since the backend was made."""
        ...


class TurnBarrier:
    """The turn-synchronous baseline (benchmarks only): a wrapper that holds every submitted turn until no row
    is generating and every row whose turn ended has either submitted its next turn (its tools returned) or
    been released. So rows move turn by turn in lock step, as in a rollout without tool/generation overlap.

    Args:
        backend: The backend that generates.
    """

    def __init__(self, backend: GenerationBackend) -> None:
        self.backend = backend
        self._held: list[TurnRequest] = []
        self._open: set[Hashable] = set()  # rows whose turn ended and that have not come back yet

    def submit(self, request: TurnRequest) -> None:
        self._open.discard(request.key)
        self._held.append(request)

    def step(self) -> list[TurnResult]:
        if self._held and self._ready():
            for request in self._held:
                self.backend.submit(request)
            self._held = []
        results = self.backend.step() if self.backend.busy else []
        self._open.update(result.key for result in results)
        return results

    def release(self, key: Hashable) -> None:
        self._open.discard(key)
        self.backend.release(key)

    @property
    def busy(self) -> bool:
        return self.backend.busy or bool(self._held and self._ready())

    def stats(self) -> BackendStats:
        return self.backend.stats()

    def _ready(self) -> bool:
        return not self.backend.busy and not self._open

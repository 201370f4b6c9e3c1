"""The server's one door into the rollout engine: batched turn generation and the server-side tool loop.

Everything the server needs from ``vagent.rollout`` goes through this module, so a change of the engine's
backend API (the ``GenerationBackend`` protocol: submit / step / release / stats) touches only this file.

``BatchedGenerator`` keeps one shared backend for every unseeded request: each row carries its own sampling
settings (temperature, top-p, stop strings), so all of them generate together in one batch (rows join and leave
between steps: continuous batching). A request with a ``seed`` gets a lane of its own whose RNG state is swapped
in around each of its steps, so it samples the same tokens whatever else the server is doing. With a vLLM engine
(``vagent serve --backend vllm``) every request shares its one batch: a seeded request's turns carry their own seed,
which vLLM draws from with a generator of the request's own (the same draws whatever else is batched; the logits
themselves can still differ in their last bits with the batch, as in vLLM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from vagent.model import Policy
from vagent.rollout import GenerationBackend, HFBackend, RolloutLimits, Task, TurnRequest, TurnResult, run
from vagent.rollout import Sampling as TurnSampling
from vagent.types import Trajectory

__all__ = ["BatchedGenerator", "Finished", "Sampling", "run_agent"]


@dataclass(frozen=True)
class Sampling:
    """How a request samples; only ``seed`` decides which lane (batch) it joins.

    Attributes:
        temperature: 0 = greedy.
        top_p: Nucleus mass.
        stop: Stop strings (a turn also ends at EOS).
        seed: A seeded request's own lane: ``(seed, request id)``; None shares the lane with every unseeded request.
    """

    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    seed: tuple[int, str] | None = None


@dataclass
class Finished:
    """A finished sample: its sampled ids (stop included), their log-probs (the model's, temperature 1) and why it
    stopped (``eos`` | ``stop_string`` | ``length``)."""

    key: Hashable
    token_ids: list[int]
    stop: str
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Lane:
    backend: GenerationBackend
    keys: set[Hashable] = field(default_factory=set)
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (cpu, cuda) generator states of a seeded lane


class BatchedGenerator:
    """Continuous batched generation of single assistant turns, for many requests at once. Not thread-safe:
    one thread (the server's scheduler) calls it.

    Args:
        policy: The loaded policy.
    """

    def __init__(self, policy: Policy, engine: GenerationBackend | None = None) -> None:
        self.policy = policy
        self.engine = engine  # a vLLM engine: one lane for every request (seeds go with the requests)
        self.lanes: dict[tuple[int, str] | None, _Lane] = {}  # by Sampling.seed; None: the shared lane

    @property
    def busy(self) -> bool:
        return any(lane.keys for lane in self.lanes.values())

    def submit(self, key: Hashable, sampling: Sampling, encoded: dict[str, torch.Tensor], max_new_tokens: int,
               images: list | None = None) -> None:  # fmt: skip
        """Queue one sample of a prompt encoded by ``vagent.data.encode`` (``input_ids`` ending with the assistant
        header, ``pixel_values`` and ``image_grid_thw`` when it has images, made from the model-sized ``images``)."""
        lane_key = None if self.engine is not None else sampling.seed
        lane = self.lanes.get(lane_key)
        if lane is None:
            rng = self._seeded_state(sampling.seed[0]) if lane_key else None
            lane = self.lanes[lane_key] = _Lane(self.engine or HFBackend(self.policy), rng=rng)
        ids = encoded["input_ids"].tolist()
        pixels, grids = [], []
        if "pixel_values" in encoded:
            grids = list(encoded["image_grid_thw"].split(1))
            pixels = list(encoded["pixel_values"].split([int(g.prod()) for g in grids]))
        # sample i draws with seed + i (as vLLM's own n > 1 does), kept non-negative: vLLM reads -1 as no seed
        seed = (sampling.seed[0] + key[1]) & (2**63 - 1) if self.engine is not None and sampling.seed else None
        turn = TurnSampling(max_new_tokens, sampling.temperature, sampling.top_p, sampling.stop, seed=seed)
        lane.backend.submit(TurnRequest(key, ids, pixels, grids, sampling=turn, images=list(images or [])))
        lane.keys.add(key)

    def step(self) -> list[Finished]:
        """One forward per busy lane. Returns the samples that finished; their caches are released."""
        finished: list[Finished] = []
        for seed, lane in list(self.lanes.items()):
            if not lane.keys:
                continue
            results = self._step(lane)
            for result in results:
                lane.backend.release(result.key)
                lane.keys.discard(result.key)
                finished.append(Finished(result.key, list(result.token_ids), result.stop, list(result.logprobs)))
            if not lane.keys and seed is not None:
                del self.lanes[seed]  # a seeded lane serves one request
        return finished

    def partial(self) -> dict[Hashable, list[int]]:
        """Tokens sampled so far by every row that is mid-turn (for streaming)."""
        if self.engine is not None:
            return {key: tokens for key, tokens in self.engine.partial().items() if tokens}
        # The backend keeps its decode batch private; reading it here keeps that knowledge in this adapter.
        return {
            row.key: row.tokens for lane in self.lanes.values() for row in lane.backend._rows.values() if row.tokens
        }

    def reset(self) -> None:
        """Drop every lane and its rows (after a failed step: the batch state is not trusted any more)."""
        for lane in self.lanes.values():
            if lane.backend is self.engine:  # the engine outlives the lane: its rows go
                self.cancel(list(lane.keys))
        self.lanes.clear()

    def cancel(self, keys: list[Hashable]) -> None:
        """Forget these samples wherever they are (a request that failed alone); never raises."""
        for lane in self.lanes.values():
            for key in keys:
                if key in lane.keys or lane.backend is self.engine:
                    lane.keys.discard(key)
                    try:
                        lane.backend.release(key)
                    except Exception:  # the server goes on: a row it cannot release is the backend's to drop
                        pass
        for seed in [seed for seed, lane in self.lanes.items() if seed is not None and not lane.keys]:
            del self.lanes[seed]  # a seeded lane serves one request

    def _step(self, lane: _Lane) -> list[TurnResult]:
        if lane.rng is None:
            return lane.backend.step()
        cuda = self.policy.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.policy.device] if cuda else [], device_type="cuda"):
            torch.set_rng_state(lane.rng[0])
            if cuda:
                torch.cuda.set_rng_state(lane.rng[1], self.policy.device)
            results = lane.backend.step()
            lane.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.policy.device) if cuda else None)
        return results

    def _seeded_state(self, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = self.policy.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.policy.device] if cuda else [], device_type="cuda"):
            torch.manual_seed(seed)
            return torch.get_rng_state(), torch.cuda.get_rng_state(self.policy.device) if cuda else None


def run_agent(
    policy: Policy,
    tasks: list[Task],
    limits: RolloutLimits,
    *,
    seed: int | None = None,
    batch_size: int = 16,
    agent: str = "vagent",
    tool_workers: int = 8,
    engine: GenerationBackend | None = None,
) -> list[Trajectory]:
    """Run the engine's tool loop on ``tasks`` (one sample each) as one batch under the ``agent`` profile, its calls
    on ``tool_workers`` threads; ``seed`` fixes the sampling (a vLLM ``engine``: each turn request's own seed)."""
    if engine is not None:
        limits = dataclasses.replace(limits, sampling_seed=seed)
        # the engine seeds a turn by its task's id: here each choice's index, not the request's id (new each time),
        # so the same seeded request samples the same, and its n choices are n different draws
        numbered = tasks if seed is None else [dataclasses.replace(t, id=f"choice-{i}") for i, t in enumerate(tasks)]
        out = run(policy, numbered, 1, limits, batch_size=batch_size, agent=agent, tool_workers=tool_workers,
                  backend=engine)  # fmt: skip
        for trajectory, task in zip(out, tasks, strict=True):
            trajectory.task_id = task.id
        return out
    if seed is None:
        return run(policy, tasks, 1, limits, batch_size=batch_size, agent=agent, tool_workers=tool_workers)
    cuda = policy.device.type == "cuda"
    with torch.random.fork_rng(devices=[policy.device] if cuda else [], device_type="cuda"):
        torch.manual_seed(seed)
        return run(policy, tasks, 1, limits, batch_size=batch_size, agent=agent, tool_workers=tool_workers)

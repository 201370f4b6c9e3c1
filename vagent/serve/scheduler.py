"""The server's model thread: gathers pending requests into batched generation.

HTTP handlers (asyncio) hand jobs to ``Scheduler.submit``; one background thread owns the model. Each loop it
takes every job that arrived, adds their samples to the running batch (``BatchedGenerator``: continuous
batching, so a request that arrives mid-generation joins at the next step instead of waiting for the batch to
drain), runs one step, and reports partial tokens (streaming) and finished samples back through each job's
``sink``. Agent jobs (the tool loop) that arrived together run as one batched ``rollout.run``; the plain lanes
wait meanwhile. A step that raises fails the jobs in flight with a 500 and the loop goes on with a fresh batch.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vagent.model import Policy
from vagent.rollout import GenerationBackend, RolloutLimits, Task
from vagent.serve.backend import BatchedGenerator, Sampling, run_agent

__all__ = ["Job", "Scheduler"]

log = logging.getLogger(__name__)

Event = tuple[str, Any, Any]  # ("tokens", index, ids) | ("finished", index, Finished) | ("trajectories", list, None)
# | ("error", message, None)


@dataclass
class Job:
    """One request's work.

    Attributes:
        id: The request id.
        n: Samples.
        sampling: The lane its samples generate in.
        sink: Receives the job's events; must be thread-safe (the app wraps ``loop.call_soon_threadsafe``).
        encoded: A chat job's prompt (``vagent.data.encode`` output ending with the assistant header).
        images: The model-sized images its patches were made from (what a vLLM engine is sent).
        max_tokens: A chat job's per-sample budget.
        stream: Report partial tokens.
        tasks: An agent job's episodes (one per sample) and ``limits``: run with the tool loop.
        seed: An agent job's sampling seed.
        cancelled: Set by the app when the client went away: events are dropped.
    """

    id: str
    n: int
    sampling: Sampling
    sink: Callable[[Event], None]
    encoded: dict[str, torch.Tensor] | None = None
    images: list = field(default_factory=list)
    max_tokens: int = 0
    stream: bool = False
    tasks: list[Task] = field(default_factory=list)
    limits: RolloutLimits | None = None
    seed: int | None = None
    cancelled: bool = False
    sent: dict[int, int] = field(default_factory=dict)  # tokens already streamed per sample

    def emit(self, event: Event) -> None:
        if self.cancelled:
            return
        try:
            self.sink(event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled = True


class Scheduler:
    """Owns the model thread (see the module docstring).

    Args:
        policy: The loaded policy.
        agent_batch_size: Episodes the tool loop runs at once.
        engine: What generates (a vLLM engine, ``--backend vllm``); None: vagent's HF backend.
    """

    def __init__(self, policy: Policy, agent_batch_size: int = 16, agent_profile: str = "vagent",
                 tool_workers: int = 8, engine: GenerationBackend | None = None) -> None:  # fmt: skip
        self.policy, self.agent_profile, self.tool_workers = policy, agent_profile, tool_workers
        self.engine = engine
        self.generator = BatchedGenerator(policy, engine)
        self.agent_batch_size = agent_batch_size
        self._inbox: deque[Job] = deque()
        self._running: dict[str, Job] = {}  # chat jobs with samples in the batch
        self._cond = threading.Condition()
        self._stopped = False
        self.steps = 0  # generation steps run (one forward per busy lane each)
        self._thread = threading.Thread(target=self._loop, name="vagent-serve-model", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._inbox.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self.generator.busy and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                new, self._inbox = list(self._inbox), deque()
            try:
                self._admit(new)
            except Exception as e:  # nothing may end this thread: every later request would wait forever
                self._fail(e, "admitting requests failed", also=new)
                continue
            if self.generator.busy:
                self._step()

    def _admit(self, new: list[Job]) -> None:
        agents = [job for job in new if job.encoded is None]
        for job in new:
            if job.encoded is not None:
                try:
                    for i in range(job.n):
                        self.generator.submit((job.id, i), job.sampling, job.encoded, job.max_tokens, job.images)
                except Exception as e:  # a request the backend refuses (vLLM: too many images ...) fails alone
                    log.warning("request %s refused by the backend: %s", job.id, e)
                    self.generator.cancel([(job.id, i) for i in range(job.n)])
                    job.emit(("error", f"the request could not be scheduled: {type(e).__name__}: {e}", None))
                    continue
                self._running[job.id] = job
        if agents:
            self._run_agents(agents)

    def _fail(self, error: Exception, what: str, also: list[Job] = ()) -> None:
        """Fail every job in the batch (and ``also``) with a 500 and start over with an empty batch."""
        log.exception(what)
        for job in {id(j): j for j in [*self._running.values(), *also]}.values():
            job.emit(("error", f"{what}: {type(error).__name__}: {error}", None))
        self._running.clear()
        self.generator.reset()

    def _step(self) -> None:
        try:
            finished = self.generator.step()
            self.steps += 1
        except Exception as e:  # a failed forward (e.g. out of memory) must not take the server down
            self._fail(e, "generation failed")
            return
        for key, tokens in self.generator.partial().items():
            job = self._running[key[0]]
            if job.stream and len(tokens) > job.sent.get(key[1], 0):
                job.sent[key[1]] = len(tokens)
                job.emit(("tokens", key[1], list(tokens)))
        for result in finished:
            job = self._running[result.key[0]]
            job.emit(("finished", result.key[1], result))
            job.n -= 1
            if job.n == 0:
                del self._running[job.id]

    def _run_agents(self, jobs: list[Job]) -> None:
        """Agent jobs that share sampling settings and limits run as one batch (``run`` takes one ``RolloutLimits``:
        each request keeps its own ``max_turns``, token and image budgets); a seeded job runs alone (reproducible)."""
        groups: dict[tuple, list[Job]] = defaultdict(list)
        for job in jobs:
            # a seeded job's Sampling is its own; RolloutLimits is unhashable (mutable), its repr names every field
            groups[(job.sampling, repr(job.limits))].append(job)
        for group in groups.values():
            seed = group[0].seed
            tasks = [task for job in group for task in job.tasks]
            try:
                trajectories = run_agent(self.policy, tasks, group[0].limits, seed=seed, batch_size=self.agent_batch_size,
                                         agent=self.agent_profile, tool_workers=self.tool_workers,
                                         engine=self.engine)  # fmt: skip
            except Exception as e:
                log.exception("agent rollout failed")
                for job in group:
                    job.emit(("error", f"the agent rollout failed: {type(e).__name__}: {e}", None))
                continue
            start = 0
            for job in group:
                job.emit(("trajectories", trajectories[start : start + len(job.tasks)], None))
                start += len(job.tasks)

"""The tool calls of a turn: run at once in a pool of threads, handed back in call order with their images' indices.

Each call of a turn is its own job: the profile's ``act`` on a one-action copy of the parsed turn, on a copy of the
row's images from before the turn, then the model view of its images and the encoding of the turn that carries its
result back, all in a worker thread. ``ToolCalls.collect`` hands a turn's results back in call order, whichever call
finished first.

Guards against:

* a slow call holding up the other calls of its turn (they run at once) or other rows (the engine keeps generating
  while a row's calls run);
* a call that never returns: it is abandoned ``timeout_s`` after a worker started it, and the model gets a ``timeout``
  observation. Its thread is left to finish on its own (Python cannot stop a thread) and a new thread takes its place
  in the pool, so stuck calls never shrink the pool nor block the engine; the threads are daemons, so neither do they
  block the interpreter's exit;
* time spent queued being taken for a timeout: each call's clock starts when a worker starts it. A queued call waits
  for a worker however long that takes (the engine counts it as ``tool_queue_s``); it is never cut, and it cannot wait
  forever, since every running call returns or is abandoned within ``timeout_s``;
* two image-returning calls of a turn being told the same index: a tool never numbers its output; the worker sets
  ``Observation.first_image`` to where its images land if no earlier call of the turn returns any, and ``collect``,
  which knows what every earlier call returned, corrects it (the turn is then rendered and tokenized again, text
  only: its images' patches stay). The profile's ``observation_message`` decides whether the index is shown (vagent's
  protocol: ``"Image 3: ..."``; the published agents render their own wording, as their code does);
* a tool or its encoding raising: a ``tool_exception`` observation.

Does not guard against: what an abandoned thread holds (memory, a file, a process) until its call returns on its own,
nor many stuck calls each leaving a thread behind (tools with their own limits, like the ``code`` sandbox, which kills
its process tree, never get that far); a tool that changes the images it was given in place (each call gets a copy of
the list of images, not of the images).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from vagent.agents import AgentProfile, get_profile
from vagent.chat import ParsedTurn
from vagent.data.encode import attach_patches, encode_message, grid_patches, image_patches, message_ids
from vagent.toolbox import ToolContext
from vagent.types import ImagePatches, Message, Observation

__all__ = ["Call", "CallOutcome", "Segment", "ToolCalls", "ToolPool", "TurnCalls", "act", "segment"]


def act(parsed: ParsedTurn, context: ToolContext, offered: list[str], agent: str | AgentProfile = "vagent"
        ) -> list[Observation]:  # fmt: skip
    """One observation per action of a turn, in order, as the agent profile runs them, every one on the images of
    ``context`` (as the engine runs a turn's calls; the observations are not placed: no ``first_image``). Never raises.

    Under vagent's protocol, well-formed calls run through ``call_tool`` (which checks the name and the
    arguments); blocks that could not be parsed come back as error observations with the parse error's kind.
    """
    return get_profile(agent).act(parsed, context, offered)


@dataclass
class Segment:
    """A forced piece of a row: ids (mask 0) and the patches of the images whose placeholders it holds."""

    ids: list[int]
    patches: list[ImagePatches] = field(default_factory=list)


def segment(encoded: dict[str, torch.Tensor], images: Sequence[Image.Image] = ()) -> Segment:
    """The ``Segment`` of an ``encode_segment`` result, its patches carrying the model-sized ``images`` it was
    encoded with (what a backend with its own processor is sent)."""
    return Segment(encoded["input_ids"].tolist(), image_patches(encoded, images))


@dataclass
class CallOutcome:
    """One call's result: the observation, the turn that carries it back, encoded."""

    observation: Observation
    message: Message
    segment: Segment
    model_sizes: list[tuple[int, int]]  # of the observation's images as the model sees them


@dataclass(eq=False)
class Call:
    """One job in a ``ToolPool``: its result comes in ``future``; ``started`` is set by the worker that runs it."""

    fn: Callable[..., Any]
    args: tuple
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # None while it waits for a worker
    abandoned: bool = False


class ToolPool:
    """``workers`` daemon threads running jobs first come first served, where an abandoned job gives up its thread's
    place: a new thread takes it (``concurrent.futures.ThreadPoolExecutor`` cannot replace a thread that is stuck)."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a tool pool needs at least one worker, got {workers}")
        self._jobs: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0  # threads that take jobs (not counting abandoned ones still running their call)
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Call:
        if self._closed:
            raise RuntimeError("the tool pool is shut down")
        call = Call(fn, args)
        self._jobs.put(call)
        return call

    def abandon(self, call: Call) -> bool:
        """Give up on a running ``call``: its thread finishes it on its own and then ends, and a new thread takes its
        place. False (nothing done) when the call has finished meanwhile: its result stands."""
        with self._lock:
            if call.future.done():
                return False
            call.abandoned = True
            self._live -= 1
            if not self._closed:
                self._spawn()
            return True

    def shutdown(self) -> None:
        """Cancel the jobs still queued and let every thread end once it is idle; waits for none of them."""
        with self._lock:
            self._closed = True
            live = self._live
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in range(live):
            self._jobs.put(None)

    def _spawn(self) -> None:
        self._live += 1
        threading.Thread(target=self._work, name="vagent-tool", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._jobs.get()
            if call is None:
                return
            if not call.future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            call.started = time.monotonic()
            try:
                result = call.fn(*call.args)
            except BaseException as e:  # the caller gets it from the future, as from any executor
                call.future.set_exception(e)
            else:
                call.future.set_result(result)
            with self._lock:
                if call.abandoned:  # a new thread took this one's place when the call was abandoned
                    return


@dataclass
class TurnCalls:
    """The calls of one row's turn, in call order."""

    calls: list[Call]
    first_image: int  # the episode's index of the first image the turn's calls return
    ended: float = field(default_factory=time.monotonic)  # when the turn ended and its calls were submitted

    def queued_s(self) -> float:
        """Seconds its calls waited for a worker, all together."""
        now = time.monotonic()
        return sum((now if c.started is None else c.started) - c.submitted for c in self.calls)


class ToolCalls:
    """Runs the tool calls of every row's turns in one ``ToolPool``; see the module docstring.

    Args:
        profile: The agent profile (``act`` runs a call, ``observation_message`` renders its result).
        processor: The policy's processor (encodes the result's turn).
        model_view: An image as the policy sees it (``Policy.model_view``).
        workers: Threads running calls, shared by all rows.
        timeout_s: A call still running this long after a worker started it is abandoned (a ``timeout`` observation).
        keep_patches: Attach each output image's patches to its part of the turn that shows it (``ContentPart.patches``).
    """

    def __init__(self, profile: AgentProfile, processor: Any, model_view: Callable[[Image.Image], Image.Image],
                 workers: int, timeout_s: float, keep_patches: bool = False, pixels: bool = True) -> None:  # fmt: skip
        self.profile, self.processor, self.model_view, self.timeout_s = profile, processor, model_view, timeout_s
        self.keep_patches = keep_patches
        self.pixels = pixels  # False: observations' images get grids, not patches (``grid_patches``)
        self.pool = ToolPool(workers)

    def submit(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> TurnCalls:
        """Start every call of ``parsed``, each on its own: none waits for another, so a pool smaller than a turn's
        calls cannot deadlock, and calls queue first come first served whatever row they belong to. Every call sees
        the images from before the turn (a copy: an abandoned call can never change the row after it moved on)."""
        before = dataclasses.replace(context, images=list(context.images), model_sizes=list(context.model_sizes))
        calls = [self.pool.submit(self._run, dataclasses.replace(parsed, actions=[action]), before, list(offered))
                 for action in parsed.actions]  # fmt: skip
        return TurnCalls(calls, first_image=len(before.images))

    def ready(self, turn: TurnCalls) -> bool:
        """Every call of ``turn`` returned or was abandoned (a queued call is neither: the turn waits for it). A call
        running past its time is abandoned here and now, so its thread's place goes to the next queued call, which
        may be one of this turn's own."""
        now = time.monotonic()
        for call in turn.calls:
            if not call.future.done() and call.started is not None and now - call.started >= self.timeout_s:
                self.pool.abandon(call)  # False if it returned meanwhile: its result stands
        return all(c.future.done() or c.abandoned for c in turn.calls)

    def wait(self, turns: Sequence[TurnCalls]) -> None:
        """Sleep until a call of ``turns`` returns or the first running one runs past its time."""
        pending = [c for turn in turns for c in turn.calls if not (c.future.done() or c.abandoned)]
        if pending:
            now = time.monotonic()
            # a call that starts while this sleeps runs out no sooner than timeout_s from now
            deadline = min((c.started + self.timeout_s for c in pending if c.started is not None),
                           default=now + self.timeout_s)  # fmt: skip
            wait([c.future for c in pending], timeout=max(0.0, deadline - now), return_when=FIRST_COMPLETED)

    def collect(self, turn: TurnCalls) -> list[CallOutcome]:
        """The results of a ``ready`` turn in call order: an abandoned call gets a ``timeout`` observation (whether or
        not it has returned since), one that raised a ``tool_exception`` one; each output is labelled with the index
        its first image gets when the results are appended in this order."""
        if not self.ready(turn):
            raise RuntimeError("collect() needs a ready turn: every call returned or abandoned")
        outcomes, first = [], turn.first_image
        for call in turn.calls:
            outcome = self._placed(self._result(call), first)
            first += len(outcome.observation.images)
            outcomes.append(outcome)
        return outcomes

    def shutdown(self) -> None:
        """Cancel the queued calls; abandoned and running ones finish on their own (never waited for)."""
        self.pool.shutdown()

    # -- in a worker thread -------------------------------------------------------------------------

    def _run(self, turn: ParsedTurn, context: ToolContext, offered: list[str]) -> CallOutcome:
        """Run one call (``turn`` holds only it) and encode the turn that carries its result back."""
        [observation] = self.profile.act(turn, context, offered)
        if observation.images:  # where its images land unless an earlier call of the turn returns some (collect)
            observation = dataclasses.replace(observation, first_image=len(context.images))
        return self._outcome(observation, [self.model_view(img) for img in observation.images])

    # -- on the engine's thread ---------------------------------------------------------------------

    def _result(self, call: Call) -> CallOutcome:
        if call.abandoned:
            text = f"the tool call did not finish within {self.timeout_s:g} s."
            return self._outcome(Observation(text=text, error="timeout"), [])
        if call.future.exception() is not None:  # the call or its encoding raised
            return self._outcome(Observation(text=f"the tool call {call.future.exception()}.", error="tool_exception"),
                                 [])  # fmt: skip
        return call.future.result()

    def _placed(self, outcome: CallOutcome, first_image: int) -> CallOutcome:
        """``outcome`` with its images labelled from ``first_image``: rendered and tokenized again if the worker's
        guess was wrong (only the text: the patches stay)."""
        observation = outcome.observation
        if not observation.images or observation.first_image == first_image:
            return outcome
        observation = dataclasses.replace(observation, first_image=first_image)
        return self._outcome(observation, patches=outcome.segment.patches, sizes=outcome.model_sizes)

    def _outcome(self, observation: Observation, shown: Sequence[Image.Image] = (),
                 patches: list[ImagePatches] | None = None, sizes: list[tuple[int, int]] | None = None
                 ) -> CallOutcome:  # fmt: skip
        """The turn that carries ``observation`` back, encoded with its model-sized images ``shown`` (or their
        ``patches``, made already)."""
        message = self.profile.observation_message(observation)
        if self.profile.inline:  # text inside the open assistant turn, tokenized as the agent's loop does
            encoded = Segment(self.processor.tokenizer.encode(message.plain_text))
        elif patches is not None or not self.pixels:
            patches = patches if patches is not None else grid_patches(self.processor, shown)
            encoded = Segment(message_ids(self.processor, message, patches).tolist(), patches)
        else:
            encoded = segment(encode_message(self.processor, message, shown), shown)
        if self.keep_patches and encoded.patches:  # made from this message's images: they go on its parts
            attach_patches([message], encoded.patches)
        return CallOutcome(observation, message, encoded, sizes if sizes is not None else [img.size for img in shown])

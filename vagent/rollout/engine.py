"""The multi-turn rollout: a per-row state machine over a batch of rows.

    start ──► generating ──► (turn ends) ──► calling tools ──► observation appended ──► generating ...
                                  └──► answered | no_action | max_turns | max_tokens | max_images | failed

Token-in, token-out: each row is kept as the exact token ids the model saw and sampled. Sampled tokens
get loss mask 1 and their log-probs; everything the engine forces (prompt, the ``<|im_end|>`` that
closes a turn cut at a stop string, tool turns with their images, scripted turns) gets 0. Decoded text
is only ever *read* (to parse calls); it is never tokenized back into the row. Every segment is made by
``vagent.data.encode`` (the one encoder), so ``encode_messages(trajectory.messages)`` gives back exactly
``trajectory.token_ids``.

Each row is in exactly one ``RowState`` and the driver loop dispatches on it: GENERATING (its turn request
is with the backend), TOOLS (its calls run concurrently in a thread pool, each with the encoding of its output;
the results come back in call order) or DONE.
Rows generate together in a ``GenerationBackend``'s batch (``HFBackend`` by default: continuous batching,
a KV slot per row kept across turns); a row running tools leaves the batch and rejoins when its
observations are ready, so the other rows keep generating. A call that does not return within
``tool_timeout_s`` is abandoned: the row gets a ``timeout`` error observation for it and goes on (the stuck thread
is left to finish on its own; tools with their own limits, like the ``code`` sandbox, never get that far).

The agent protocol (how model text becomes tool calls, how observations are rendered, the prompt, the stop
strings, call budgets, pre-filled and inline text) is the row's ``vagent.agents`` profile's, read at one call
site each: ``profile.parse``, ``profile.act``, ``profile.observation_message``, ``prompt_messages`` and
``profile.stop_strings``.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from PIL import Image

from vagent.agents import AgentProfile, get_profile
from vagent.chat import ParsedTurn, ParseError
from vagent.data.encode import encode_message, encode_prompt, image_patches, template_suffix
from vagent.data.rows import Row
from vagent.media import load_image
from vagent.model import Policy
from vagent.rollout.backend import GenerationBackend, Sampling, TurnRequest, TurnResult
from vagent.rollout.hf_backend import HFBackend
from vagent.toolbox import ToolContext, ToolServices
from vagent.types import ContentPart, Frame, ImagePatches, Message, Observation, ToolCall, ToolResult, Trajectory

__all__ = [
    "STOP_STRINGS",
    "RolloutLimits",
    "RowState",
    "Task",
    "act",
    "first_view_frames",
    "prompt_messages",
    "rollout",
    "run",
]

STOP_STRINGS = get_profile("vagent").stop_strings  # vagent's own protocol; each profile has its own


@dataclass
class Task:
    """One episode to run.

    Attributes:
        id: The canonical row's id.
        question: The user's question.
        images: Prompt images (paths or PIL images), full resolution.
        videos: Video paths the video tools can read.
        tools: Names of the tools offered.
        scripted_turns: Assistant turns forced before the policy samples (loss mask 0), e.g. to
            show a tool round-trip with an untrained model, or to replay a gold prefix. A ``None``
            entry lets the policy sample that turn; while scripted turns remain, a sampled turn with
            neither a call nor an answer does not end the episode (forced-turn ablations, benchmarks).
    """

    id: str
    question: str
    images: list[str | Image.Image] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=lambda: ["crop"])
    scripted_turns: list[str | None] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: Row, default_tools: Sequence[str]) -> Task:
        """The episode of a canonical row: the question with its choices listed as "A. ...", its media, and
        the row's own tool list when it has one (an empty list means no tools), else ``default_tools``."""
        question = row.question
        if row.choices:
            question += "\n" + "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(row.choices))
        tools = row.tools if row.tools is not None else default_tools
        return cls(id=row.id, question=question, images=list(row.images), videos=list(row.videos), tools=list(tools))


@dataclass
class RolloutLimits:
    """Per-episode limits and sampling settings.

    Attributes:
        max_tool_calls: Tool calls allowed across the episode, every call of a turn counted (None = no cap beyond
            the agent profile's own ``limits.max_calls``; the smaller of the two applies). A turn whose calls would
            pass it ends the episode before they run (stop reason ``max_calls``).
        frame_budget: ``(lo, hi)``: frames of each video the prompt shows, drawn per task (``first_view_frames``) so
            that the first view does not already show everything. None = the profile's own view.
        seed: Seeds the per-task draws (``frame_budget``); tokens are sampled from torch's generator, not from it.
    """

    max_turns: int = 4
    max_new_tokens: int = 96
    max_total_tokens: int = 4096
    max_images: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_tool_calls: int | None = None
    frame_budget: tuple[int, int] | None = None
    seed: int = 0


def first_view_frames(task_id: str, budget: tuple[int, int] | Sequence[int], seed: int = 0) -> int:
    """How many frames of each video the first view of task ``task_id`` shows: drawn uniformly from ``budget``
    (``[lo, hi]``, both included) by a generator seeded with the task and ``seed``, so every sample of a task (a
    GRPO group) shares its prompt, a rerun draws the same, and different tasks draw differently.

    >>> first_view_frames("q1", (4, 4))
    4
    """
    lo, hi = budget
    return random.Random(f"{seed}/{task_id}").randint(lo, hi)  # a str seed is hashed by sha512: stable across runs


def act(parsed: ParsedTurn, context: ToolContext, offered: list[str], agent: str | AgentProfile = "vagent"
        ) -> list[Observation]:  # fmt: skip
    """One observation per action of a turn, in order, as the agent profile runs them. Never raises.

    Under vagent's protocol, well-formed calls run through ``call_tool`` (which checks the name and the
    arguments); blocks that could not be parsed come back as error observations with the parse error's kind.
    """
    return get_profile(agent).act(parsed, context, offered)


class RowState(enum.Enum):
    """Where a row is in its episode; the driver loop's one dispatch."""

    GENERATING = "generating"  # a turn request is with the backend
    TOOLS = "tools"  # its tool calls run in the pool; it rejoins the batch when they return (or time out)
    DONE = "done"  # stopped (``stop`` says why); collected as a Trajectory


@dataclass
class _Segment:
    """A forced piece of a row: ids (mask 0) and the patches of the images whose placeholders it holds."""

    ids: list[int]
    patches: list[ImagePatches] = field(default_factory=list)


@dataclass
class _CallOutcome:
    """One call's result, made in a worker thread: the observation, the turn that carries it back, encoded."""

    observation: Observation
    message: Message
    segment: _Segment
    model_sizes: list[tuple[int, int]]  # of the observation's images as the model sees them


@dataclass
class _Row:
    key: int
    task: Task
    context: ToolContext
    messages: list[Message]
    scripted: list[str | None]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = sampled, 0 = forced
    logprobs: list[float] = field(default_factory=list)
    patches: list[ImagePatches] = field(default_factory=list)  # one per image, in order: made once, held by reference
    metrics: Counter[str] = field(default_factory=Counter)
    state: RowState = RowState.GENERATING
    turns: int = 0
    futures: list[Future] = field(default_factory=list)  # one per call of the turn, in call order
    deadline: float = 0.0
    pending_actions: list[ToolCall | ParseError] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)  # Trajectory.tool_results
    frames: list[Frame] = field(default_factory=list)  # Trajectory.frames
    tool_started: float = 0.0
    prefill: list[int] = field(default_factory=list)  # ids the profile forced at the start of the open turn
    open_turn: Message | None = None  # an inline profile's assistant turn, continued after each tool result
    answer: str | None = None
    stop: str | None = None

    def force(self, segment: _Segment) -> None:
        self.ids += segment.ids
        self.mask += [0] * len(segment.ids)
        self.logprobs += [0.0] * len(segment.ids)
        self.patches += segment.patches


class _Engine:
    """Runs rows to completion; see the module docstring."""

    def __init__(self, policy, limits, backend, services, batch_size, tool_workers, tool_timeout_s, on_turn,
                 progress, agent="vagent", keep_patches=False):  # fmt: skip
        self.policy, self.limits, self.backend = policy, limits, backend
        self.keep_patches = keep_patches
        self.profile = get_profile(agent)
        self.services = services
        self.batch_size, self.tool_timeout_s = batch_size, tool_timeout_s
        # a backend whose KV storage is sized once holds so many rows; the others wait for a slot (never an OOM)
        held = getattr(backend, "max_rows", None)
        self.in_flight = min(batch_size, max(held, 1)) if held is not None else batch_size  # 0: its step says why
        self.on_turn, self.progress = on_turn, progress
        self.sampling = dict(temperature=limits.temperature, top_p=limits.top_p, stop_strings=self.profile.stop_strings)
        # one call budget: the rollout's and the agent's own (Pixel-Reasoner: 4), whichever is smaller
        budgets = [b for b in (limits.max_tool_calls, self.profile.limits.max_calls) if b is not None]
        self.max_calls = min(budgets) if budgets else None
        self.pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="vagent-tool")
        tokenizer = policy.tokenizer
        self.header = tokenizer.encode(template_suffix(policy.processor, [], add_generation_prompt=True))
        self.im_end, self.newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n")
        self.rows: dict[int, _Row] = {}
        self.last_prompt: tuple | None = None  # (task, originals, shown, messages, segment) of the last task started

    # -- driver -------------------------------------------------------------------------------------

    def run(self, jobs: list[tuple[int, Task]]) -> dict[int, Trajectory]:
        queue, done = deque(jobs), {}
        try:
            while queue or self.rows:
                while queue and len(self.rows) < self.in_flight:
                    key, task = queue.popleft()
                    self._start(key, task)
                if self.backend.busy:
                    for result in self.backend.step():
                        self._on_turn_end(self.rows[result.key], result)
                else:  # nothing to generate: sleep until a tool returns or times out
                    self._wait_for_tools()
                for key, row in list(self.rows.items()):
                    if row.state is RowState.TOOLS and (all(f.done() for f in row.futures)
                                                        or time.monotonic() >= row.deadline):  # fmt: skip
                        self._on_tools_done(row)  # GENERATING or DONE next
                    if row.state is RowState.DONE:
                        done[key] = self._finish(self.rows.pop(key))
                    # GENERATING: the backend holds the row until its turn ends
        finally:
            for key in self.rows:  # only after an error: the backend must not keep these rows' slots
                self.backend.release(key)
            # Abandoned (timed-out) tool threads must not block the caller: do not wait for them.
            self.pool.shutdown(wait=False, cancel_futures=True)
        return done

    def _wait_for_tools(self) -> None:
        waiting = [r for r in self.rows.values() if r.state is RowState.TOOLS]
        if waiting:
            timeout = max(0.0, min(r.deadline for r in waiting) - time.monotonic())
            running = [f for r in waiting for f in r.futures if not f.done()]  # a done one would return at once
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    # -- row life cycle -----------------------------------------------------------------------------

    def _prompt(self, task: Task) -> tuple[list[Image.Image], list[Image.Image], list[Message], _Segment]:
        """A task's images (original and model-sized), prompt messages and encoded prompt: made once per task
        and shared by its samples (a GRPO group), whose identical prompts the backend then prefills once."""
        made = self.last_prompt  # a task's samples start one after another: one slot is enough, and memory stays flat
        if made is None or made[0] is not task:
            budget, frames = self.limits.frame_budget, None
            if budget is not None and task.videos:  # drawn per task: every sample of a group sees the same view
                frames = first_view_frames(task.id, budget, self.limits.seed)
            messages = prompt_messages(task, [load_image(img) for img in task.images], self.profile, frames=frames)
            # The profile may add images of its own (LongVT and Pixel-Reasoner show a video as frames).
            originals = [part.image for m in messages for part in m.content if part.type == "image"]
            shown = [self.policy.model_view(img) for img in originals]
            segment = _segment(encode_prompt(self.policy.processor, messages, shown))
            made = self.last_prompt = (task, originals, shown, messages, segment)
        return made[1], made[2], list(made[3]), made[4]

    def _start(self, key: int, task: Task) -> None:
        policy = self.policy
        min_pixels, max_pixels = policy.pixel_budget
        originals, shown, messages, segment = self._prompt(task)
        context = ToolContext(
            images=list(originals),
            model_sizes=[img.size for img in shown],
            convention=policy.coord_convention,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_factor=policy.image_factor,
            videos=list(task.videos),
            search=self.services.search,
            sandbox=self.services.sandbox,
        )
        row = _Row(key=key, task=task, context=context, messages=messages, scripted=list(task.scripted_turns))
        row.frames = [Frame(o.size, v.size, policy.coord_convention) for o, v in zip(originals, shown, strict=True)]
        row.force(segment)
        self.rows[key] = row
        self._next_turn(row)

    def _next_turn(self, row: _Row) -> None:
        """Open the next assistant turn, or stop the row at a limit."""
        limits = self.limits
        if row.turns >= limits.max_turns:
            self._stop(row, "max_turns")
            return
        # Text the agent's loop writes at the start of the turn (DeepEyesV2's "<think>"): forced, part of the turn.
        forced = row.scripted and row.scripted[0] is not None  # a scripted turn writes its own opening
        prefill = [] if forced else self.policy.tokenizer.encode(self.profile.prefill(row.turns + 1))
        # an inline profile's turn goes on after its tool result: no header, no opening of its own
        opening = list(self.header) + prefill if row.open_turn is None else []
        # what the turn may sample: the episode's cap less the opening and the "<|im_end|>\n" that closes the turn
        room = limits.max_total_tokens - len(row.ids) - len(opening) - 1 - len(self.newline)
        scripted = [*self.policy.tokenizer.encode(row.scripted[0]), self.im_end] if forced else None
        budget = min(limits.max_new_tokens, room)
        if budget <= 0 or (scripted is not None and len(scripted) > room + 1):  # (a script brings its own <|im_end|>)
            self._stop(row, "max_tokens")
            return
        row.turns += 1
        row.metrics["turns"] += 1
        row.prefill = prefill if row.open_turn is None else []
        row.force(_Segment(opening))
        if scripted is not None:
            row.metrics["scripted_turns"] += 1
            row.scripted.pop(0)
            self._on_turn_end(row, TurnResult(row.key, scripted, [0.0] * len(scripted), "eos"), sampled=False)
            return
        if row.scripted:
            row.scripted.pop(0)  # a None hole: this turn is sampled
        row.state = RowState.GENERATING
        sampling = Sampling(max_new_tokens=budget, **self.sampling)
        pixels, grids = [p.pixel_values for p in row.patches], [p.grid_thw for p in row.patches]
        self.backend.submit(TurnRequest(row.key, list(row.ids), pixels, grids, sampling))

    def _on_turn_end(self, row: _Row, result: TurnResult, sampled: bool = True) -> None:
        ids = list(result.token_ids)
        flag = 1 if sampled else 0
        prefill, row.prefill = row.prefill, []  # already in row.ids (forced with the header)
        text = self.policy.tokenizer.decode(prefill + ids, skip_special_tokens=True)
        parsed = self.profile.parse(text)
        for error in parsed.errors:
            row.metrics[f"parse_error/{error.kind}"] += 1
        over_budget = self.max_calls is not None and row.metrics["tool_calls"] + len(parsed.actions) > self.max_calls
        # An inline profile (Tool-Star) keeps the turn open across a call: its result continues the same turn.
        # A sampled turn that ended at EOS ended the turn, whatever it wrote.
        inline = (self.profile.inline and parsed.answer is None and bool(parsed.actions) and not over_budget
                  and (not sampled or result.stop == "stop_string"))  # fmt: skip
        if inline and ids and ids[-1] == self.im_end:
            ids = ids[:-1]  # a scripted inline segment: the engine closes nothing yet
        # Close the turn the way the chat template renders it: "...<|im_end|>\n".
        closing = (
            [] if inline else list(self.newline) if ids and ids[-1] == self.im_end else [self.im_end, *self.newline]
        )
        row.ids += ids + closing
        row.mask += [flag] * len(ids) + [0] * len(closing)
        row.logprobs += (result.logprobs[: len(ids)] if sampled else [0.0] * len(ids)) + [0.0] * len(closing)
        if sampled:
            row.metrics["sampled_tokens"] += len(ids)
        turn = Message(
            "assistant",
            [ContentPart("text", text)],
            tool_calls=parsed.tool_calls,
            token_ids=prefill + ids + closing,
            sampled=[0] * len(prefill) + [flag] * len(ids) + [0] * len(closing),
        )
        if row.open_turn is not None:  # the rest of an inline turn: one assistant message for the whole turn
            turn = _joined(row.open_turn, turn)
            row.open_turn = None
        if inline:
            row.open_turn = turn  # emitted when the turn closes
        else:
            self._emit(row, turn)
        if parsed.answer is not None:
            row.answer = parsed.answer
            self._stop(row, "answered")
        elif not parsed.actions and row.scripted:
            self._next_turn(row)  # the script goes on
        elif not parsed.actions:
            self._stop(row, "max_tokens" if result.stop == "length" else "no_action")
        elif over_budget:
            self._stop(row, "max_calls")  # none of the turn's calls runs: the budget is the episode's, not the turn's
        else:
            row.state = RowState.TOOLS
            row.pending_actions = list(parsed.actions)
            row.tool_started = time.monotonic()
            row.deadline = row.tool_started + self.tool_timeout_s
            # The turn's calls run at once, each its own job in the pool: none waits for another, so a bounded pool
            # cannot deadlock, and calls queue first come first served whatever row they belong to. All of them see
            # the images from before the turn (a copy: an abandoned call can never change the row after it moved on).
            before = dataclasses.replace(row.context, images=list(row.context.images),
                                         model_sizes=list(row.context.model_sizes))  # fmt: skip
            row.futures = [self.pool.submit(self._call_tool, dataclasses.replace(parsed, actions=[action]), before,
                                            row.task.tools) for action in parsed.actions]  # fmt: skip

    def _stop(self, row: _Row, reason: str) -> None:
        row.state, row.stop = RowState.DONE, reason

    def _call_tool(self, turn: ParsedTurn, context: ToolContext, offered: list[str]) -> _CallOutcome:
        """Worker thread: run one call (``turn`` holds only it) and encode the turn that carries its result back."""
        [observation] = self.profile.act(turn, context, offered)
        shown = [self.policy.model_view(img) for img in observation.images]
        return self._outcome(observation, shown)

    def _outcome(self, observation: Observation, shown: list[Image.Image]) -> _CallOutcome:
        message = self.profile.observation_message(observation)
        if self.profile.inline:  # text inside the open assistant turn, tokenized as the agent's loop does
            segment = _Segment(self.policy.tokenizer.encode(message.plain_text))
        else:
            segment = _segment(encode_message(self.policy.processor, message, shown))
        return _CallOutcome(observation, message, segment, [img.size for img in shown])

    def _on_tools_done(self, row: _Row) -> None:
        """The turn's calls returned or its deadline passed: append their results in call order, up to the caps."""
        outcomes = []
        for future in row.futures:
            done = future.done()  # read once: a call may finish while this runs
            if done and future.exception() is None:
                outcomes.append(future.result())
                continue
            # timed out (or the call or its encoding raised): the model hears about it and the episode goes on
            if done:
                observation = Observation(text=f"the tool call {future.exception()}.", error="tool_exception")
            else:
                future.cancel()  # still queued: it never starts (a running one is left to finish on its own)
                observation = Observation(text=f"the tool call did not finish within {self.tool_timeout_s:g} s.",
                                          error="timeout")  # fmt: skip
            outcomes.append(self._outcome(observation, []))
        row.futures = []
        row.metrics["tool_wait_s"] += time.monotonic() - row.tool_started  # in the calling-tools state
        kept, images = [], len(row.context.images)
        for outcome in outcomes:  # the image cap counts in call order, whichever call finished first
            images += len(outcome.observation.images)
            if images > self.limits.max_images:
                break
            kept.append(outcome)
        out_of_images = len(kept) < len(outcomes)
        for action, outcome in zip(row.pending_actions, kept, strict=False):
            row.metrics["tool_calls"] += 1
            if outcome.observation.error:
                row.metrics[f"tool_error/{outcome.observation.error}"] += 1
            row.tool_results.append(self._tool_result(action, outcome.observation))
        closing = 1 + len(self.newline) if row.open_turn is not None else 0  # what _finish adds to close the turn
        if len(row.ids) + sum(len(o.segment.ids) for o in kept) + closing > self.limits.max_total_tokens:
            # the observation would carry the episode past its cap: stop before it, never with part of an image's
            # placeholders (the calls ran and are counted; the policy just does not see their output)
            self._stop(row, "max_tokens")
            return
        row.context = dataclasses.replace(
            row.context,
            images=row.context.images + [img for o in kept for img in o.observation.images],
            model_sizes=row.context.model_sizes + [size for o in kept for size in o.model_sizes],
        )
        for outcome in kept:
            row.force(outcome.segment)
            if row.open_turn is not None:  # an inline result: forced text inside the open assistant turn
                ids = outcome.segment.ids
                result = Message("assistant", outcome.message.content, token_ids=ids, sampled=[0] * len(ids))
                row.open_turn = _joined(row.open_turn, result)
            else:
                self._emit(row, outcome.message, outcome.observation)
        if out_of_images:
            row.metrics["tool_calls"] += 1
            self._stop(row, "max_images")
        elif len(row.ids) >= self.limits.max_total_tokens:
            self._stop(row, "max_tokens")
        else:
            self._next_turn(row)

    def _tool_result(self, action: ToolCall | ParseError, observation: Observation) -> ToolResult:
        """What rewards and metrics read of one call: named by the vagent tool it ran under every profile."""
        if not isinstance(action, ToolCall):
            return ToolResult(None, None, observation.error, observation.metadata)
        native = None if self.profile.name == "vagent" else action.name
        return ToolResult(self.profile.tool_for(action) if native else action.name, action.arguments,
                          observation.error, observation.metadata, native=native)  # fmt: skip

    def _emit(self, row: _Row, message: Message, observation: Observation | None = None) -> None:
        row.messages.append(message)
        if self.on_turn:
            self.on_turn(message, observation)

    def _finish(self, row: _Row) -> Trajectory:
        self.backend.release(row.key)
        if row.open_turn is not None:  # an inline turn cut by a limit: close it the way the template would
            closing = [self.im_end, *self.newline]
            row.force(_Segment(closing))
            self._emit(
                row, _joined(row.open_turn, Message("assistant", [], token_ids=closing, sampled=[0] * len(closing)))
            )
            row.open_turn = None
        trajectory = Trajectory(
            task_id=row.task.id,
            messages=row.messages,
            token_ids=row.ids,
            loss_mask=row.mask,
            logprobs=row.logprobs,
            answer=row.answer,
            stop_reason=row.stop,
            metrics=dict(row.metrics),
            tool_results=row.tool_results,
            frames=row.frames,
            patches=row.patches if self.keep_patches else [],
        )
        if self.progress:
            self.progress(trajectory)
        return trajectory


def prompt_messages(task: Task, images: list[Image.Image | str] | None = None, agent: str | AgentProfile = "vagent",
                    frames: int | None = None) -> list[Message]:  # fmt: skip
    """The system and user messages an episode of ``task`` starts from, as the agent profile writes them (vagent:
    the system prompt with the schemas of the offered tools, then the prompt images, the videos' names and
    lengths, and the question). SFT builds its prompts here too, so the cold start trains on exactly the prompt
    the engine shows.

    Args:
        task: The episode.
        images: The prompt images (default: ``task.images`` as given: paths or PIL images).
        agent: The agent profile (``vagent.agents.PROFILES``) or its name.
        frames: Frames of each video the prompt shows (``RolloutLimits.frame_budget``'s draw); None = the profile's
            own view of a video.
    """
    images = list(task.images if images is None else images)
    return get_profile(agent).prompt(task.question, images, task.videos, task.tools, frames=frames)


def _joined(first: Message, then: Message) -> Message:
    """One assistant message from two consecutive pieces of the same turn (an inline profile's turn)."""
    return Message(
        "assistant",
        [ContentPart("text", first.plain_text + then.plain_text)],
        tool_calls=first.tool_calls + then.tool_calls,
        token_ids=(first.token_ids or []) + (then.token_ids or []),
        sampled=(first.sampled or []) + (then.sampled or []),
    )


def _segment(encoded: dict[str, torch.Tensor]) -> _Segment:
    return _Segment(encoded["input_ids"].tolist(), image_patches(encoded))


def run(
    policy: Policy,
    tasks: list[Task],
    n_samples: int = 1,
    limits: RolloutLimits | None = None,
    services: ToolServices | None = None,
    batch_size: int = 8,
    progress: Callable[[Trajectory], None] | None = None,
    *,
    backend: GenerationBackend | None = None,
    tool_workers: int = 8,
    tool_timeout_s: float = 60.0,
    on_turn: Callable[[Message, Observation | None], None] | None = None,
    agent: str | AgentProfile = "vagent",
    keep_patches: bool = False,
) -> list[Trajectory]:
    """Run ``n_samples`` episodes per task, ``batch_size`` rows at a time.

    Args:
        policy: The loaded policy.
        tasks: Episodes to run.
        n_samples: Samples per task (a GRPO group).
        limits: Turn/token/image limits and sampling settings.
        services: The ``search`` backend and ``code`` sandbox (default: no search, the default sandbox).
        batch_size: Rows in flight at once (generating or waiting for tools).
        progress: Called with each trajectory as it finishes.
        backend: What generates (default: a new ``HFBackend`` over ``policy``). Pass one to keep its KV storage
            across calls, to read its ``stats()``, or to run a reference configuration (tests, benchmarks).
        tool_workers: Threads running tool calls, shared by all rows; the calls of one turn run concurrently.
        tool_timeout_s: A call of a turn that has not returned this long after the turn ended is abandoned with a
            ``timeout`` observation (a call still queued then never runs).
        on_turn: Called with every new assistant/tool message (streaming displays), and for a tool message the
            ``Observation`` it renders (its ``metadata`` has e.g. a crop's box in original pixels), else None.
        agent: The agent profile (``vagent.agents.PROFILES``) or its name: prompt, call syntax, tool mapping,
            observation rendering and answer extraction of a published agent (default: vagent's own).
        keep_patches: Hand each trajectory its images' patches (``Trajectory.patches``, the tensors the engine made
            once and prefilled from) for a trainer to encode without the processor; off, they go with the row.

    Returns:
        Trajectories grouped by task, in task order (``n_samples`` consecutive ones per task).
    """
    limits = limits or RolloutLimits()
    backend = backend if backend is not None else HFBackend(policy)
    jobs = [(i * n_samples + s, task) for i, task in enumerate(tasks) for s in range(n_samples)]
    engine = _Engine(policy, limits, backend, services or ToolServices(), batch_size, tool_workers, tool_timeout_s,
                     on_turn, progress, agent, keep_patches)  # fmt: skip
    done = engine.run(jobs)
    return [done[key] for key, _ in jobs]


def rollout(
    policy: Policy,
    task: Task,
    limits: RolloutLimits,
    on_turn: Callable[[Message, Observation | None], None] | None = None,
    services: ToolServices | None = None,
    agent: str | AgentProfile = "vagent",
) -> Trajectory:
    """Run one episode of ``task``. Tool failures become observations; nothing raises for model output.
    ``on_turn`` is called with each new message and, for tool messages, its observation (see ``run``)."""
    return run(policy, [task], 1, limits, services, batch_size=1, on_turn=on_turn, agent=agent)[0]

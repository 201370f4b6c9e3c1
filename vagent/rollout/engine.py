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
is with the backend), TOOLS (its calls run concurrently in a thread pool, ``vagent.rollout.calls``, each with the
encoding of its output; the results come back in call order, each output labelled with its images' indices) or DONE.
Rows generate together in a ``GenerationBackend``'s batch (``HFBackend`` by default: continuous batching,
a KV slot per row kept across turns); a row running tools leaves the batch and rejoins when its
observations are ready, so the other rows keep generating. A call still running ``tool_timeout_s`` after a worker
started it is abandoned: the row gets a ``timeout`` error observation for it and goes on (see ``calls`` for what that
guards against and what not). The turn's results are appended in call order up to the caps: an output whose images
would pass ``max_images`` ends the episode before it, as one whose tokens would pass ``max_total_tokens`` does
before the turn's results; every call of the turn ran and is counted either way.

The agent protocol (how model text becomes tool calls, how observations are rendered, the prompt, the stop
strings, call budgets, pre-filled and inline text) is the row's ``vagent.agents`` profile's, read at one call
site each: ``profile.parse``, ``profile.act`` and ``profile.observation_message`` (in ``calls``),
``prompt_messages`` (in ``episode``, with ``Task`` and ``RolloutLimits``) and ``profile.stop_strings``.
"""

from __future__ import annotations

import dataclasses
import enum
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image

from vagent.agents import AgentProfile, get_profile
from vagent.chat import ParseError
from vagent.data.encode import attach_patches, encode_prompt, grid_patches, prompt_ids, template_suffix
from vagent.media import load_image
from vagent.model import Policy
from vagent.rollout.backend import GenerationBackend, Sampling, TurnRequest, TurnResult
from vagent.rollout.calls import Segment, ToolCalls, TurnCalls, segment
from vagent.rollout.episode import RolloutLimits, Task, first_view_frames, prompt_messages
from vagent.rollout.hf_backend import HFBackend
from vagent.toolbox import ToolContext, ToolServices
from vagent.types import ContentPart, Frame, ImagePatches, Message, Observation, ToolCall, ToolResult, Trajectory

__all__ = ["STOP_STRINGS", "RowState", "rollout", "run"]

STOP_STRINGS = get_profile("vagent").stop_strings  # vagent's own protocol; each profile has its own


class RowState(enum.Enum):
    """Where a row is in its episode; the driver loop's one dispatch."""

    GENERATING = "generating"  # a turn request is with the backend
    TOOLS = "tools"  # its tool calls run in the pool; it rejoins the batch when they return (or time out)
    DONE = "done"  # stopped (``stop`` says why); collected as a Trajectory


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
    # (the backend's: each turn request passes them; a kept episode's parts carry their own, ContentPart.patches)
    metrics: Counter[str] = field(default_factory=Counter)
    state: RowState = RowState.GENERATING
    turns: int = 0
    calls: TurnCalls | None = None  # the open turn's calls while the row is in TOOLS
    pending_actions: list[ToolCall | ParseError] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)  # Trajectory.tool_results
    frames: list[Frame] = field(default_factory=list)  # Trajectory.frames
    prefill: list[int] = field(default_factory=list)  # ids the profile forced at the start of the open turn
    open_turn: Message | None = None  # an inline profile's assistant turn, continued after each tool result
    answer: str | None = None
    stop: str | None = None

    def force(self, forced: Segment) -> None:
        self.ids += forced.ids
        self.mask += [0] * len(forced.ids)
        self.logprobs += [0.0] * len(forced.ids)
        self.patches += forced.patches


class _Engine:
    """Runs rows to completion; see the module docstring."""

    def __init__(self, policy, limits, backend, services, batch_size, tool_workers, tool_timeout_s, on_turn,
                 progress, agent="vagent", keep_patches=False, n_samples=1):  # fmt: skip
        self.policy, self.limits, self.backend = policy, limits, backend
        self.n_samples = n_samples  # a job's key is task index * n_samples + sample
        self.keep_patches = keep_patches
        self.profile = get_profile(agent)
        self.services = services
        self.batch_size = batch_size
        # a backend whose KV storage is sized once holds so many rows; the others wait for a slot (never an OOM)
        held = getattr(backend, "max_rows", None)
        self.in_flight = min(batch_size, max(held, 1)) if held is not None else batch_size  # 0: its step says why
        self.on_turn, self.progress = on_turn, progress
        self.sampling = dict(temperature=limits.temperature, top_p=limits.top_p, stop_strings=self.profile.stop_strings)
        # one call budget: the rollout's and the agent's own (Pixel-Reasoner: 4), whichever is smaller
        budgets = [b for b in (limits.max_tool_calls, self.profile.limits.max_calls) if b is not None]
        self.max_calls = min(budgets) if budgets else None
        # patches are made where the backend runs the vision tower on them (HF) or a trainer takes them (GRPO)
        self.pixels = keep_patches or getattr(backend, "needs_pixels", True)
        self.tools = ToolCalls(self.profile, policy.processor, policy.model_view, tool_workers, tool_timeout_s,
                               keep_patches=keep_patches, pixels=self.pixels)  # fmt: skip
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
                    if row.state is RowState.TOOLS and self.tools.ready(row.calls):
                        self._on_tools_done(row)  # GENERATING or DONE next
                    if row.state is RowState.DONE:
                        done[key] = self._finish(self.rows.pop(key))
                    # GENERATING: the backend holds the row until its turn ends
        finally:
            for key in self.rows:  # only after an error: the backend must not keep these rows' slots
                self.backend.release(key)
            self.tools.shutdown()  # abandoned (timed-out) tool threads must not block the caller: never waited for
        return done

    def _wait_for_tools(self) -> None:
        self.tools.wait([r.calls for r in self.rows.values() if r.state is RowState.TOOLS])

    # -- row life cycle -----------------------------------------------------------------------------

    def _prompt(self, task: Task) -> tuple[list[Image.Image], list[Image.Image], list[Message], Segment]:
        """A task's images (original and model-sized), prompt messages and encoded prompt: made once per task
        and shared by its samples (a GRPO group), whose identical prompts the backend then prefills once."""
        made = self.last_prompt  # a task's samples start one after another: one slot is enough, and memory stays flat
        if made is None or made[0] is not task:
            frames = self._first_view_frames(task)
            messages = prompt_messages(task, [load_image(img) for img in task.images], self.profile, frames=frames)
            # The profile may add images of its own (LongVT and Pixel-Reasoner show a video as frames).
            originals = [part.image for m in messages for part in m.content if part.type == "image"]
            showed_frames = len(originals) > len(task.images)  # profiles without a frame view ignore the budget
            if frames is not None and showed_frames and len(originals) >= self.limits.max_images:
                raise ValueError(
                    f"task {task.id!r}: its {len(task.images)} image(s) and a first view of {frames} frame(s) per "
                    f"video ({len(task.videos)} video(s), rollout.frame_budget) fill max_images ({self.limits.max_images})"
                    " before any tool image: raise max_images, or give this row fewer images or videos"
                )
            shown = [self.policy.model_view(img) for img in originals]
            if self.pixels:
                encoded = segment(encode_prompt(self.policy.processor, messages, shown), shown)
            else:
                patches = grid_patches(self.policy.processor, shown)
                encoded = Segment(prompt_ids(self.policy.processor, messages, patches).tolist(), patches)
            if self.keep_patches:  # on the parts they were made from: the group's samples share these messages
                attach_patches(messages, encoded.patches)
            made = self.last_prompt = (task, originals, shown, messages, encoded)
        return made[1], made[2], list(made[3]), made[4]

    def _first_view_frames(self, task: Task) -> int | None:
        """Frames of each video the task's prompt shows under the frame budget (None: no budget, or no video): the
        draw, clamped so that the prompt, ``images + videos x frames`` as vagent's profile shows them, leaves room
        under ``max_images`` for at least one tool image; at least one frame (``_prompt`` refuses a task whose
        prompt then fills the cap)."""
        budget = self.limits.frame_budget
        if budget is None or not task.videos:
            return None
        room = (self.limits.max_images - 1 - len(task.images)) // len(task.videos)
        return max(1, min(first_view_frames(task.id, budget, self.limits.seed), room))  # per task: a group shares it

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
        row.force(Segment(opening))
        if scripted is not None:
            row.metrics["scripted_turns"] += 1
            row.scripted.pop(0)
            self._on_turn_end(row, TurnResult(row.key, scripted, [0.0] * len(scripted), "eos"), sampled=False)
            return
        if row.scripted:
            row.scripted.pop(0)  # a None hole: this turn is sampled
        row.state = RowState.GENERATING
        # by task and sample, not by the key's place in this call: a rerun in other chunks draws the same tokens
        where = f"{row.task.id}/{row.key % self.n_samples}/{row.turns}"
        seed = None if limits.sampling_seed is None else zlib.crc32(f"{limits.sampling_seed}/{where}".encode())
        sampling = Sampling(max_new_tokens=budget, **self.sampling, seed=seed)
        pixels, grids = [p.pixel_values for p in row.patches], [p.grid_thw for p in row.patches]
        self.backend.submit(
            TurnRequest(row.key, list(row.ids), pixels, grids, sampling, [p.image for p in row.patches])
        )

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
            row.metrics["malformed_answer"] = int(bool(parsed.errors))  # the answer's own turn broke the grammar
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
            row.calls = self.tools.submit(parsed, row.context, row.task.tools)  # at once, each its own job

    def _stop(self, row: _Row, reason: str) -> None:
        row.state, row.stop = RowState.DONE, reason

    def _on_tools_done(self, row: _Row) -> None:
        """The turn's calls returned or ran out of time: append their results in call order, up to the caps."""
        calls, row.calls = row.calls, None
        outcomes = self.tools.collect(calls)
        row.metrics["tool_wait_s"] += time.monotonic() - calls.ended  # in the calling-tools state
        row.metrics["tool_queue_s"] += calls.queued_s()  # of which its calls waited for a worker (summed over calls)
        for action, outcome in zip(row.pending_actions, outcomes, strict=True):  # every call ran: each is counted
            row.metrics["tool_calls"] += 1
            if outcome.observation.error:
                row.metrics[f"tool_error/{outcome.observation.error}"] += 1
            row.tool_results.append(self._tool_result(action, outcome.observation))
        kept, images = [], len(row.context.images)
        for outcome in outcomes:  # the image cap counts in call order, whichever call finished first
            images += len(outcome.observation.images)
            if outcome.observation.images and images > self.limits.max_images:  # only returned images trip it
                break
            kept.append(outcome)
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
        if len(kept) < len(outcomes):
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
            row.force(Segment(closing))
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
            sample=row.key % self.n_samples,
        )
        if self.progress:
            self.progress(trajectory)
        return trajectory


def _joined(first: Message, then: Message) -> Message:
    """One assistant message from two consecutive pieces of the same turn (an inline profile's turn)."""
    return Message(
        "assistant",
        [ContentPart("text", first.plain_text + then.plain_text)],
        tool_calls=first.tool_calls + then.tool_calls,
        token_ids=(first.token_ids or []) + (then.token_ids or []),
        sampled=(first.sampled or []) + (then.sampled or []),
    )


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
        tool_workers: Threads running tool calls, shared by all rows (``rollout.tool_workers``); the calls of one
            turn run concurrently, and calls beyond it wait for a thread (the ``tool_queue_s`` metric).
        tool_timeout_s: A call still running this long after a worker started it is abandoned with a ``timeout``
            observation (its thread finishes on its own; a new one takes its place). Time queued does not count.
        on_turn: Called with every new assistant/tool message (streaming displays), and for a tool message the
            ``Observation`` it renders (its ``metadata`` has e.g. a crop's box in original pixels), else None.
        agent: The agent profile (``vagent.agents.PROFILES``) or its name: prompt, call syntax, tool mapping,
            observation rendering and answer extraction of a published agent (default: vagent's own).
        keep_patches: Hand each trajectory its images' patches, each on the image part it was made from
            (``ContentPart.patches``; ``Trajectory.patches`` lists them): the tensors the engine made once and
            prefilled from, for a trainer to encode without the processor. Off, they go with the row.

    Returns:
        Trajectories grouped by task, in task order (``n_samples`` consecutive ones per task).

    Raises:
        ValueError: Under ``limits.frame_budget``, a task whose prompt images and one frame per video already fill
            ``max_images`` (named in the message): no tool image could ever be shown.
    """
    limits = limits or RolloutLimits()
    backend = backend if backend is not None else HFBackend(policy)
    jobs = [(i * n_samples + s, task) for i, task in enumerate(tasks) for s in range(n_samples)]
    engine = _Engine(policy, limits, backend, services or ToolServices(), batch_size, tool_workers, tool_timeout_s,
                     on_turn, progress, agent, keep_patches, n_samples)  # fmt: skip
    done = engine.run(jobs)
    settle = getattr(backend, "settle", None)  # vLLM in a TP group: step with the group's other ranks until theirs end
    if settle is not None:
        settle()
    return [done[key] for key, _ in jobs]


def rollout(
    policy: Policy,
    task: Task,
    limits: RolloutLimits,
    on_turn: Callable[[Message, Observation | None], None] | None = None,
    services: ToolServices | None = None,
    agent: str | AgentProfile = "vagent",
    backend: GenerationBackend | None = None,
) -> Trajectory:
    """Run one episode of ``task``. Tool failures become observations; nothing raises for model output.
    ``on_turn`` is called with each new message and, for tool messages, its observation; ``backend`` is what
    generates (default: a new ``HFBackend``; see ``run``)."""
    return run(policy, [task], 1, limits, services, batch_size=1, on_turn=on_turn, agent=agent, backend=backend)[0]

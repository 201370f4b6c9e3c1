"""Episodes of a model behind an OpenAI-compatible endpoint (``vllm serve``, ``vagent serve``, hosted APIs), with
vagent running the agent profile's tools on this side: ``endpoint_episodes`` is ``vagent.eval.runner.evaluate``'s
``episodes`` hook.

Each episode is the engine's state machine over chat completions instead of token ids: the profile's prompt
(``prompt_messages``, the frame budget drawn as the engine draws it) goes out as chat messages (text parts, images as
PNG data URLs of the model's view), the reply is read by ``profile.parse``, its calls run by ``profile.act`` (one action
per job in the engine's ``ToolPool``, every call on the images from before the turn, abandoned after
``tool_timeout_s``), their observations rendered by ``profile.observation_message`` go back as the next message, until
an answer or a limit. Stop reasons, metrics (``turns``, ``tool_calls``, ``tool_error/*``, ``parse_error/*``) and
``ToolResult``s are the engine's; ``token_ids`` stay empty (the server keeps its tokens).

Guards against: a server that leaves the matched stop string out of the reply (OpenAI does; the profile's parser
needs it: it is put back, from vLLM's ``stop_reason`` or the tag left open); transient failures (connection errors,
timeouts, 429 and 5xx retried with backoff, ``Retry-After`` obeyed: ``JudgeClient``); a request that still fails: the
episode ends with stop reason ``failed`` and ``metrics[ENDPOINT_ERROR]`` says why (the runner records it; never
raised); the runner counting samples by arrival: a task's samples reach ``progress`` in sample order, always from
the calling thread.

Does not cover: scripted turns (a ``ValueError``); ``video`` content parts (no profile sends one: videos reach the
model as frames, from the prompt's first view or the video tools, as images); the token caps exactly (no tokenizer
here: ``max_total_tokens`` is read off the server's ``usage`` after each reply, so a turn may run past it by the
observation before it, and is then ended with ``max_tokens``; without ``usage`` it is not enforced); hosted APIs that
refuse images in ``tool`` messages or a tool message without a ``tool_call_id`` (pass ``tool_role="user"``);
pre-filled and inline turns (DeepEyesV2, Tool-Star) need a server that continues an assistant message
(``continue_final_message``: vLLM, ``vagent serve``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vagent.agents import AgentProfile, get_profile
from vagent.judge.client import TRUNCATED, JudgeClient, JudgeReply
from vagent.judge.verdicts import chat_messages
from vagent.media import load_image, resize_to_budget
from vagent.rollout.calls import Call, ToolPool
from vagent.rollout.episode import RolloutLimits, Task, first_view_frames, prompt_messages
from vagent.toolbox import ToolContext, ToolServices
from vagent.types import ContentPart, Frame, Message, Observation, ToolCall, ToolResult, Trajectory

__all__ = ["ENDPOINT_ERROR", "EndpointEpisodes", "endpoint_episodes"]

ENDPOINT_ERROR = "endpoint_error"  # Trajectory.metrics key of an episode whose request failed (stop reason "failed")
QWEN25_PIXELS = (56 * 56, 28 * 28 * 16384)  # Qwen2.5-VL's processor defaults (min_pixels, max_pixels)


def endpoint_episodes(endpoint: str | JudgeClient, *, model: str | None = None, limits: RolloutLimits,
                      agent: str | AgentProfile = "vagent", services: ToolServices | None = None,
                      concurrency: int = 8, episodes_in_flight: int | None = None, retries: int = 3,
                      backoff_s: float = 1.0, api_key: str | None = None, seed: int | None = 0, timeout_s: float = 300.0,
                      tool_workers: int = 8, tool_timeout_s: float = 60.0, convention: str = "absolute",
                      pixel_budget: tuple[int, int] = QWEN25_PIXELS, image_factor: int = 28,
                      tool_role: str | None = None) -> EndpointEpisodes:  # fmt: skip
    """The ``episodes`` hook of ``evaluate``: ``(tasks, n_samples, progress)`` runs ``n_samples`` episodes per task
    against the endpoint and calls ``progress(trajectory)`` as each finishes (a task's samples in sample order).

    Args:
        endpoint: The API root (``http://host:8000/v1``), or a ``JudgeClient`` to use as it is (then ``model``,
            ``api_key``, ``retries``, ``backoff_s`` and ``timeout_s`` are its own).
        model: The model id to send (required with a URL).
        limits: ``max_turns``, ``max_images``, ``max_tool_calls``, ``frame_budget`` as the engine reads them;
            ``temperature``, ``top_p`` and ``max_new_tokens`` (``max_tokens``) go with every request;
            ``max_total_tokens`` is read off the server's ``usage``.
        agent: The agent profile the model speaks (``vagent.agents.PROFILES``).
        services: The ``search`` backend and ``code`` sandbox of the tools.
        concurrency: Requests in flight at once (all episodes together).
        episodes_in_flight: Episodes run at once (threads; default ``2 x concurrency``: some run tools meanwhile).
        retries, backoff_s, api_key, timeout_s: The client's (``JudgeClient``); ``timeout_s`` per attempt.
        seed: Each request's ``seed`` is made of it, the task, the sample and the turn, so a rerun asks the same
            (a server that honours seeds repeats itself); None sends none.
        tool_workers, tool_timeout_s: The tool threads and the time a call may run (``vagent.rollout.run``'s).
        convention, pixel_budget, image_factor: How the served model sees images (``Policy.frame``): how it writes
            boxes (``"absolute"``: pixels of its view; ``"norm1000"``), its processor's ``(min_pixels, max_pixels)``
            and side multiple (defaults: Qwen2.5-VL's). Images are sent as that view, which the server keeps as is.
        tool_role: Send tool turns as this role (``"user"`` for APIs that refuse images in ``tool`` messages);
            None: the profile's own (vagent: ``tool``; DeepEyes: ``user``).
    """
    if isinstance(endpoint, str):
        if not model:
            raise ValueError("endpoint_episodes needs model= with an endpoint URL")
        endpoint = JudgeClient(endpoint, model, api_key=api_key, concurrency=concurrency, timeout_s=timeout_s,
                               retries=retries, backoff_s=backoff_s)  # fmt: skip
    if concurrency < 1 or tool_workers < 1:
        raise ValueError("concurrency >= 1 and tool_workers >= 1 are required")
    frame = _Frame(convention, *pixel_budget, image_factor)
    return EndpointEpisodes(endpoint, limits, get_profile(agent), services or ToolServices(), concurrency,
                            episodes_in_flight or 2 * concurrency, seed, tool_workers, tool_timeout_s, frame,
                            tool_role)  # fmt: skip


@dataclass(frozen=True)
class _Frame:
    """How the served model sees images (``Policy.frame``)."""

    convention: str
    min_pixels: int
    max_pixels: int
    factor: int

    def view(self, image: Image.Image) -> Image.Image:
        return resize_to_budget(image, min_pixels=self.min_pixels, max_pixels=self.max_pixels, factor=self.factor)


@dataclass
class _Episode:
    """One episode's state (the engine's ``_Row`` without tokens)."""

    task: Task
    sample: int
    pool: ToolPool  # runs its tool calls
    context: ToolContext
    messages: list[Message]  # as people read them (Trajectory.messages)
    wire: list[dict[str, Any]]  # the same, as chat messages: each image encoded once per episode
    frames: list[Frame]
    metrics: Counter[str] = field(default_factory=Counter)
    tool_results: list[ToolResult] = field(default_factory=list)
    turns: int = 0
    total_tokens: int | None = None  # prompt + completion of the last reply, when the server reports usage
    open_turn: Message | None = None  # an inline profile's assistant turn, continued after each tool result
    answer: str | None = None
    stop: str | None = None
    error: str | None = None


class EndpointEpisodes:
    """The callable ``endpoint_episodes`` returns; see there. ``close()`` ends the client's idle pool."""

    def __init__(self, client: JudgeClient, limits: RolloutLimits, profile: AgentProfile, services: ToolServices,
                 concurrency: int, workers: int, seed: int | None, tool_workers: int, tool_timeout_s: float,
                 frame: _Frame, tool_role: str | None) -> None:  # fmt: skip
        self.client, self.limits, self.profile, self.services = client, limits, profile, services
        self.requests = threading.BoundedSemaphore(concurrency)  # in-flight requests, all episodes together
        self.workers, self.seed, self.frame, self.tool_role = workers, seed, frame, tool_role
        self.tool_workers, self.tool_timeout_s = tool_workers, tool_timeout_s
        budgets = [b for b in (limits.max_tool_calls, profile.limits.max_calls) if b is not None]
        self.max_calls = min(budgets) if budgets else None  # the rollout's and the agent's own, as the engine

    def __call__(self, tasks: list[Task], n_samples: int,
                 progress: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """Run ``n_samples`` episodes per task; returns them grouped by task, in task order (``rollout.run``'s)."""
        if scripted := [t.id for t in tasks if t.scripted_turns]:
            raise ValueError(f"endpoint episodes run no scripted turns (tasks {scripted[:3]})")
        jobs = [(i, s) for i in range(len(tasks)) for s in range(n_samples)]
        done: dict[tuple[int, int], Trajectory] = {}
        released = [0] * len(tasks)  # the runner numbers a task's samples by arrival: hand them over in order
        pool = ToolPool(self.tool_workers)  # the call's own: abandoned tool threads end with it, never waited for
        executor = ThreadPoolExecutor(self.workers, thread_name_prefix="vagent-endpoint")
        try:
            futures = {executor.submit(self._episode, tasks[i], s, pool): (i, s) for i, s in jobs}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    i, s = futures[future]
                    done[(i, s)] = future.result()  # a bug or a bad task raises here; failed requests do not
                    while released[i] < n_samples and (i, released[i]) in done:
                        if progress is not None:
                            progress(done[(i, released[i])])
                        released[i] += 1
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
            pool.shutdown()
        return [done[job] for job in jobs]

    def close(self) -> None:
        self.client.close()

    # -- one episode (in a worker thread) -----------------------------------------------------------

    def _episode(self, task: Task, sample: int, pool: ToolPool) -> Trajectory:
        episode = self._start(task, sample, pool)
        while episode.stop is None:
            self._turn(episode)
        if episode.open_turn is not None:  # an inline turn cut by a limit: it ends here
            self._emit(episode, episode.open_turn)
            episode.open_turn = None
        metrics = dict(episode.metrics)
        if episode.error is not None:
            metrics[ENDPOINT_ERROR] = episode.error
        return Trajectory(task.id, episode.messages, answer=episode.answer, stop_reason=episode.stop,
                          metrics=metrics, tool_results=episode.tool_results, frames=episode.frames,
                          sample=sample)  # fmt: skip

    def _start(self, task: Task, sample: int, pool: ToolPool) -> _Episode:
        """The prompt as the engine makes it (``_Engine._prompt``), its images as the served model sees them."""
        limits, frame = self.limits, self.frame
        frames = None
        if limits.frame_budget is not None and task.videos:
            room = (limits.max_images - 1 - len(task.images)) // len(task.videos)
            frames = max(1, min(first_view_frames(task.id, limits.frame_budget, limits.seed), room))
        messages = prompt_messages(task, [load_image(img) for img in task.images], self.profile, frames=frames)
        originals = [part.image for m in messages for part in m.content if part.type == "image"]
        if frames is not None and len(originals) > len(task.images) and len(originals) >= limits.max_images:
            raise ValueError(f"task {task.id!r}: its images and a first view of {frames} frame(s) per video fill "
                             f"max_images ({limits.max_images}) before any tool image")  # fmt: skip
        shown = [frame.view(img) for img in originals]
        context = ToolContext(images=list(originals), model_sizes=[img.size for img in shown],
                              convention=frame.convention, min_pixels=frame.min_pixels, max_pixels=frame.max_pixels,
                              image_factor=frame.factor, videos=list(task.videos), search=self.services.search,
                              sandbox=self.services.sandbox)  # fmt: skip
        frames_seen = [Frame(o.size, v.size, frame.convention) for o, v in zip(originals, shown, strict=True)]
        episode = _Episode(task, sample, pool, context, [], [], frames_seen)
        for message in messages:
            self._emit(episode, message)
        return episode

    def _turn(self, episode: _Episode) -> None:
        """One assistant turn (the engine's ``_next_turn`` and ``_on_turn_end``), then its tools."""
        limits = self.limits
        room = limits.max_total_tokens - (episode.total_tokens or 0)
        if episode.turns >= limits.max_turns or room <= 0:
            episode.stop = "max_turns" if episode.turns >= limits.max_turns else "max_tokens"
            return
        episode.turns += 1
        episode.metrics["turns"] += 1
        # text the agent's loop writes at the start of the turn (DeepEyesV2's "<think>"), or the open inline turn
        prefill = self.profile.prefill(episode.turns) if episode.open_turn is None else ""
        head = episode.open_turn.plain_text if episode.open_turn is not None else prefill
        reply = self._request(episode, head, min(limits.max_new_tokens, room))
        if reply.error is not None and reply.error != TRUNCATED:  # a cut reply is a turn cut at max_tokens
            episode.stop, episode.error = "failed", reply.error
            return
        if reply.usage and isinstance(reply.usage.get("prompt_tokens"), int):
            episode.total_tokens = reply.usage["prompt_tokens"] + int(reply.usage.get("completion_tokens") or 0)
            episode.metrics["sampled_tokens"] += int(reply.usage.get("completion_tokens") or 0)
        text = _with_stop(reply, self.profile.stop_strings)
        if episode.total_tokens is not None and episode.total_tokens > limits.max_total_tokens:
            # the engine would have cut this turn at the cap (its text then unread): so is it here
            self._emit(episode, self._joined(episode, Message.text("assistant", prefill + text)))
            episode.stop = "max_tokens"
            return
        self._on_reply(episode, prefill + text, reply.finish_reason, stopped=_ends_with_stop(reply, text, self.profile))

    def _on_reply(self, episode: _Episode, text: str, finish: str | None, stopped: bool) -> None:
        parsed = self.profile.parse(text)
        for error in parsed.errors:
            episode.metrics[f"parse_error/{error.kind}"] += 1
        over_budget = (
            self.max_calls is not None and episode.metrics["tool_calls"] + len(parsed.actions) > self.max_calls
        )
        # an inline profile (Tool-Star) keeps the turn open across a call, if the turn ended at its stop string
        inline = self.profile.inline and parsed.answer is None and bool(parsed.actions) and not over_budget and stopped
        turn = self._joined(episode, Message("assistant", [ContentPart("text", text)], tool_calls=parsed.tool_calls))
        if inline:
            episode.open_turn = turn
        else:
            self._emit(episode, turn)
        if parsed.answer is not None:
            episode.answer, episode.stop = parsed.answer, "answered"
            episode.metrics["malformed_answer"] = int(bool(parsed.errors))  # as the engine records it
        elif not parsed.actions:
            episode.stop = "max_tokens" if finish == "length" else "no_action"
        elif over_budget:
            episode.stop = "max_calls"  # none of the turn's calls runs: the budget is the episode's
        else:
            self._tools(episode, self._run_calls(episode.pool, parsed, episode.context, episode.task.tools))

    def _tools(self, episode: _Episode, observations: list[tuple[ToolCall | Any, Observation]]) -> None:
        """Append the turn's results in call order up to ``max_images`` (the engine's ``_on_tools_done``)."""
        kept, images = [], len(episode.context.images)
        for action, observation in observations:  # every call ran: each is counted
            episode.metrics["tool_calls"] += 1
            if observation.error:
                episode.metrics[f"tool_error/{observation.error}"] += 1
            episode.tool_results.append(self._tool_result(action, observation))
        for _, observation in observations:
            images += len(observation.images)
            if observation.images and images > self.limits.max_images:
                break
            kept.append(observation)
        new = [img for o in kept for img in o.images]
        episode.context = dataclasses.replace(episode.context, images=episode.context.images + new,
                                              model_sizes=episode.context.model_sizes
                                              + [self.frame.view(img).size for img in new])  # fmt: skip
        for observation in kept:
            message = self.profile.observation_message(observation)
            if episode.open_turn is not None:  # an inline result: text inside the open assistant turn
                episode.open_turn = self._joined(episode, Message("assistant", message.content))
            else:
                self._emit(episode, message)
        if len(kept) < len(observations):
            episode.stop = "max_images"

    def _run_calls(self, pool: ToolPool, parsed: Any, context: ToolContext, offered: Sequence[str]
                   ) -> list[tuple[Any, Observation]]:  # fmt: skip
        """The turn's calls at once in the tool pool, each on the images from before the turn, placed in call order
        (``vagent.rollout.calls``); a call past ``tool_timeout_s`` gets a ``timeout`` observation."""
        before = dataclasses.replace(context, images=list(context.images), model_sizes=list(context.model_sizes))
        calls = [pool.submit(self.profile.act, dataclasses.replace(parsed, actions=[action]), before, list(offered))
                 for action in parsed.actions]  # fmt: skip
        out, first = [], len(before.images)
        for action, call in zip(parsed.actions, calls, strict=True):
            observation = self._outcome(pool, call)
            if observation.images:
                observation = dataclasses.replace(observation, first_image=first)
                first += len(observation.images)
            out.append((action, observation))
        return out

    def _outcome(self, pool: ToolPool, call: Call) -> Observation:
        while not call.future.done():
            started = call.started
            remaining = 0.1 if started is None else started + self.tool_timeout_s - time.monotonic()
            if remaining <= 0 and pool.abandon(call):
                return Observation(text=f"the tool call did not finish within {self.tool_timeout_s:g} s.",
                                   error="timeout")  # fmt: skip
            wait([call.future], timeout=max(remaining, 0.01))
        if call.future.exception() is not None:
            return Observation(text=f"the tool call {call.future.exception()}.", error="tool_exception")
        [observation] = call.future.result()
        return observation

    # -- requests and messages ----------------------------------------------------------------------

    def _request(self, episode: _Episode, head: str, max_tokens: int) -> JudgeReply:
        """The turn's chat completion; ``head`` (pre-filled text or the open inline turn) is continued."""
        messages = list(episode.wire)
        extra = None
        if head:  # vLLM's and vagent serve's extension: go on writing the last assistant message
            messages.append({"role": "assistant", "content": head})
            extra = {"continue_final_message": True, "add_generation_prompt": False}
        seed = None if self.seed is None else zlib.crc32(f"{self.seed}/{episode.task.id}/{episode.sample}/"
                                                         f"{episode.turns}".encode())  # fmt: skip
        with self.requests:
            reply = self.client.complete(messages, temperature=self.limits.temperature, top_p=self.limits.top_p,
                                         max_tokens=max_tokens, seed=seed, stop=self.profile.stop_strings or None,
                                         extra=extra, cache=False)  # fmt: skip
        episode.metrics["endpoint_retries"] += max(0, reply.attempts - 1)
        return reply

    def _emit(self, episode: _Episode, message: Message) -> None:
        episode.messages.append(message)
        [wire] = chat_messages([_shown(message, self.frame)])
        if wire["role"] == "tool" and self.tool_role is not None:
            wire["role"] = self.tool_role
        episode.wire.append(wire)

    def _joined(self, episode: _Episode, then: Message) -> Message:
        """``then``, after the open inline turn if there is one (one assistant message for the whole turn)."""
        first = episode.open_turn
        if first is None:
            return then
        episode.open_turn = None
        return Message("assistant", [ContentPart("text", first.plain_text + then.plain_text)],
                       tool_calls=first.tool_calls + then.tool_calls)  # fmt: skip

    def _tool_result(self, action: Any, observation: Observation) -> ToolResult:
        """What rewards read of one call, named by the vagent tool it ran (the engine's ``_tool_result``)."""
        if not isinstance(action, ToolCall):
            return ToolResult(None, None, observation.error, observation.metadata)
        native = None if self.profile.name == "vagent" else action.name
        return ToolResult(self.profile.tool_for(action) if native else action.name, action.arguments,
                          observation.error, observation.metadata, native=native)  # fmt: skip


def _shown(message: Message, frame: _Frame) -> Message:
    """``message`` with its images as the served model sees them (what is sent: smaller, and kept as is there)."""
    parts = [dataclasses.replace(p, image=frame.view(load_image(p.image if p.image is not None else p.path)), path=None)
             if p.type == "image" else p for p in message.content]  # fmt: skip
    return Message(message.role, parts)


def _with_stop(reply: JudgeReply, stops: Sequence[str]) -> str:
    """The reply's text with the stop string it ended at, which OpenAI-compatible servers leave out: vLLM names it
    (``stop_reason``); otherwise it is the closing tag of the tag left open last (``<tool_call>`` ... →
    ``</tool_call>``), and none when every tag is closed (the turn ended at EOS).

    >>> _with_stop(JudgeReply('<tool_call>{"name": "crop"}', finish_reason="stop"), ("</tool_call>", "</answer>"))
    '<tool_call>{"name": "crop"}</tool_call>'
    """
    text = reply.text
    if not stops or reply.finish_reason != "stop" or any(text.endswith(s) for s in stops):
        return text
    if "stop_reason" in reply.choice:  # vLLM: the stop string matched, or None / a token id (EOS)
        named = reply.choice["stop_reason"]
        return text + named if isinstance(named, str) and named in stops else text
    opened = [(text.rfind("<" + s[2:]), s) for s in stops if s.startswith("</")]
    opened = [(at, s) for at, s in opened if at >= 0 and at > text.rfind(s)]
    return text + max(opened)[1] if opened else text


def _ends_with_stop(reply: JudgeReply, text: str, profile: AgentProfile) -> bool:
    """Whether the turn ended at one of the profile's stop strings (not at EOS or ``max_tokens``)."""
    return reply.finish_reason == "stop" and any(text.rstrip().endswith(s) for s in profile.stop_strings)

"""The multi-turn rollout: generate -> parse -> call tools -> append observation -> ... -> done.

Token-in, token-out: the episode is kept as the exact token ids the model saw and sampled. Sampled
tokens get loss mask 1 and their log-probs; everything the engine forces (prompt, the ``<|im_end|>``
that closes a turn cut at a stop string, tool turns with their images, scripted turns) gets 0.
Decoded text is only ever *read* (to parse calls); it is never tokenized back into the episode.

Tool turns are tokenized as separate segments. That is exact because every segment boundary sits
next to a special token (``<|im_end|>``, ``<|im_start|>``), where the BPE never merges across.

This first version runs one episode at a time and re-runs the whole prefix every turn (no KV cache
reuse, no batching across rows, tools run inline). The batched engine with concurrent tools and
cache reuse replaces ``run`` behind the same signature.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from vagent.chat import ParsedTurn, ParseError, observation_content, observation_text, parse_turn, system_prompt
from vagent.media import load_image
from vagent.model import Policy, mm_token_type_ids
from vagent.toolbox import ToolContext, call_tool, tool_schemas
from vagent.types import ContentPart, Message, Observation, Trajectory

if TYPE_CHECKING:
    from vagent.toolbox.sandbox import Sandbox
    from vagent.toolbox.search import SearchBackend

__all__ = ["RolloutLimits", "Task", "act", "rollout", "run"]

STOP_STRINGS = ["</tool_call>", "</answer>"]


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
            show a tool round-trip with an untrained model, or to replay a gold prefix.
    """

    id: str
    question: str
    images: list[str | Image.Image] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=lambda: ["crop"])
    scripted_turns: list[str] = field(default_factory=list)


@dataclass
class RolloutLimits:
    max_turns: int = 4
    max_new_tokens: int = 96
    max_total_tokens: int = 4096
    max_images: int = 8
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class _Episode:
    """Growing token state of one episode."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = sampled, 0 = forced
    logprobs: list[float] = field(default_factory=list)
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # one (patches, dim) block per image, in order
    grids: list[torch.Tensor] = field(default_factory=list)  # one (1, 3) row per image

    def force(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_media(self, encoded: Any) -> None:
        if "pixel_values" in encoded:
            self.pixel_values.append(encoded["pixel_values"])
            self.grids.append(encoded["image_grid_thw"])


def _template_suffix(processor: Any, messages: list[dict[str, Any]]) -> str:
    """Text the chat template adds for ``messages`` after a conversation, ending with the assistant header."""
    anchor = [{"role": "system", "content": "x"}]
    before = processor.apply_chat_template(anchor, tokenize=False)
    after = processor.apply_chat_template(anchor + messages, add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the checkpoint's chat template does not render turns incrementally")
    return after[len(before) :]


def act(parsed: ParsedTurn, context: ToolContext, offered: list[str]) -> list[Observation]:
    """One observation per ``<tool_call>`` block of a turn, in order. Never raises.

    Well-formed calls run through ``call_tool`` (which checks the name and the arguments); blocks
    that could not be parsed come back as error observations with the parse error's kind.
    """
    observations = []
    for action in parsed.actions:
        if isinstance(action, ParseError):
            observations.append(Observation(text=action.message + ".", error=action.kind))
        else:
            observations.append(call_tool(action, context, offered=offered))
    return observations


def rollout(
    policy: Policy,
    task: Task,
    limits: RolloutLimits,
    on_turn: Callable[[Message], None] | None = None,
    search: SearchBackend | None = None,
    sandbox: Sandbox | None = None,
) -> Trajectory:
    """Run one episode of ``task`` with ``policy``. Tool failures become observations; nothing raises
    for model output. ``on_turn`` is called with each new message (for streaming displays);
    ``search`` and ``sandbox`` serve the ``search`` and ``code`` tools."""
    processor, tokenizer = policy.processor, policy.tokenizer
    min_pixels, max_pixels = policy.pixel_budget
    originals = [load_image(img) for img in task.images]
    shown = [policy.model_view(img) for img in originals]
    context = ToolContext(
        images=list(originals),
        model_sizes=[img.size for img in shown],
        convention=policy.coord_convention,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_factor=policy.image_factor,
        videos=list(task.videos),
        search=search,
        sandbox=sandbox,
    )
    system = system_prompt(tool_schemas(task.tools))
    user_content = [{"type": "image"} for _ in shown] + [{"type": "text", "text": task.question}]
    prompt = processor.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user_content}],
        add_generation_prompt=True,
        tokenize=False,
    )
    episode = _Episode()
    encoded = processor(text=[prompt], images=shown or None, return_tensors="pt")
    episode.force(encoded["input_ids"][0].tolist())
    episode.add_media(encoded)
    messages = [
        Message.text("system", system),
        Message("user", [ContentPart("image", image=img) for img in originals] + [ContentPart("text", task.question)]),
    ]
    metrics: Counter[str] = Counter()
    im_end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n")
    scripted = list(task.scripted_turns)
    stop, answer = "max_turns", None
    for _ in range(limits.max_turns):
        budget = min(limits.max_new_tokens, limits.max_total_tokens - len(episode.ids))
        if budget <= 0:
            stop = "max_tokens"
            break
        metrics["turns"] += 1
        if scripted:
            text = scripted.pop(0)
            episode.force([*tokenizer.encode(text), im_end, *newline])
            metrics["scripted_turns"] += 1
            cut = False
        else:
            generation = policy.generate(
                _model_inputs(episode, policy),
                max_new_tokens=budget,
                temperature=limits.temperature,
                top_p=limits.top_p,
                stop_strings=STOP_STRINGS,
            )[0]
            episode.ids += generation.token_ids
            episode.mask += [1] * len(generation.token_ids)
            episode.logprobs += generation.logprobs
            metrics["sampled_tokens"] += len(generation.token_ids)
            # Close the turn the way the chat template renders it: "...<|im_end|>\n".
            closing = newline if generation.stop == "eos" else [im_end, *newline]
            episode.force(closing)
            text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            cut = generation.stop == "length"
        parsed = parse_turn(text)
        for error in parsed.errors:
            metrics[f"parse_error/{error.kind}"] += 1
        assistant = Message("assistant", [ContentPart("text", text)], tool_calls=parsed.tool_calls)
        messages.append(assistant)
        if on_turn:
            on_turn(assistant)
        if parsed.answer is not None:
            stop, answer = "answered", parsed.answer
            break
        if not parsed.actions:
            stop = "max_tokens" if cut else "no_action"  # cut by a token budget vs. ended its turn with neither
            break
        if not _run_tools(parsed, task, context, episode, messages, metrics, limits, policy, on_turn):
            stop = "max_images"
            break
        if len(episode.ids) >= limits.max_total_tokens:
            stop = "max_tokens"
            break
    return Trajectory(
        task_id=task.id,
        messages=messages,
        token_ids=episode.ids,
        loss_mask=episode.mask,
        logprobs=episode.logprobs,
        answer=answer,
        stop_reason=stop,
        metrics=dict(metrics),
    )


def _run_tools(
    parsed: ParsedTurn,
    task: Task,
    context: ToolContext,
    episode: _Episode,
    messages: list[Message],
    metrics: Counter[str],
    limits: RolloutLimits,
    policy: Policy,
    on_turn: Callable[[Message], None] | None,
) -> bool:
    """Run the turn's calls and append one tool turn per call. False when the image budget is exhausted."""
    for observation in act(parsed, context, task.tools):
        metrics["tool_calls"] += 1
        if observation.error:
            metrics[f"tool_error/{observation.error}"] += 1
        if len(context.images) + len(observation.images) > limits.max_images:
            return False
        shown = [policy.model_view(img) for img in observation.images]
        context.images += observation.images
        context.model_sizes += [img.size for img in shown]
        segment = _template_suffix(policy.processor, [{"role": "tool", "content": observation_content(observation)}])
        encoded = policy.processor(text=[segment], images=shown or None, return_tensors="pt")
        episode.force(encoded["input_ids"][0].tolist())
        episode.add_media(encoded)
        stamps = observation.timestamps or []
        content = [
            ContentPart("image", image=img, timestamps=[stamps[i]] if i < len(stamps) else None)
            for i, img in enumerate(observation.images)
        ]
        tool_message = Message("tool", [*content, ContentPart("text", observation_text(observation))])
        messages.append(tool_message)
        if on_turn:
            on_turn(tool_message)
    return True


def _model_inputs(episode: _Episode, policy: Policy) -> dict[str, torch.Tensor]:
    config = policy.model.config
    input_ids = torch.tensor([episode.ids], dtype=torch.long)  # (1, T)
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if episode.pixel_values:
        inputs["pixel_values"] = torch.cat(episode.pixel_values)  # prompt images, then each tool image, in order
        inputs["image_grid_thw"] = torch.cat(episode.grids)  # (n_images, 3)
        inputs["mm_token_type_ids"] = mm_token_type_ids(input_ids, config.image_token_id, config.video_token_id)
    return {k: v.to(policy.device) for k, v in inputs.items()}


def run(
    policy: Policy,
    tasks: list[Task],
    n_samples: int = 1,
    limits: RolloutLimits | None = None,
    search: SearchBackend | None = None,
    sandbox: Sandbox | None = None,
) -> list[Trajectory]:
    """Run ``n_samples`` episodes per task; trajectories come back grouped by task, in task order."""
    limits = limits or RolloutLimits()
    return [rollout(policy, task, limits, search=search, sandbox=sandbox) for task in tasks for _ in range(n_samples)]

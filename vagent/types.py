"""The data types every stage shares: messages, tool calls, observations and trajectories.

A trajectory is both what people read (``messages``: text, tool calls, the images tools returned)
and what the trainers consume (``token_ids`` with a ``loss_mask`` saying which tokens the policy
sampled). Both views are kept side by side so nothing is ever re-tokenized from decoded text.

Images live in memory as ``PIL.Image`` objects while a rollout runs; ``to_dict`` writes them out
as files through a caller-supplied ``save_image`` function so a JSONL line stays small. In a trajectory GRPO trains
on, each image part also carries its image's patches as the policy saw them (``ContentPart.patches``, an
``ImagePatches`` the engine made once, when it showed the image), so the trainer never runs the processor on them
again; they are not serialized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image

if TYPE_CHECKING:
    import torch

__all__ = [
    "ContentPart",
    "Frame",
    "ImagePatches",
    "Message",
    "Observation",
    "Role",
    "StopReason",
    "ToolCall",
    "ToolResult",
    "Trajectory",
]

Role = Literal["system", "user", "assistant", "tool"]

# Why a trajectory ended; recorded per row so eval and training can report the mix.
# max_tokens covers both budgets: a turn cut at max_new_tokens without a call or answer, and the episode total;
# max_calls: a turn's calls would pass the episode's tool-call budget (the rollout's and the agent profile's).
StopReason = Literal["answered", "no_action", "max_turns", "max_tokens", "max_images", "max_calls", "failed"]


@dataclass
class ContentPart:
    """One piece of a message: text, an image or a video.

    Attributes:
        type: ``"text"``, ``"image"`` or ``"video"``.
        text: The text for a text part.
        image: Decoded pixels for an image part (inputs after loading, tool outputs).
        path: Where the image or video lives on disk, if anywhere.
        timestamps: For frames sampled from a video, the time in seconds of each frame.
        patches: For an image part of an episode the rollout ran with ``keep_patches``: this image's patches, as
            the engine made them from this very part when it showed it (``vagent.data.encode.attach_patches``); the
            encoder then uses them instead of running the processor. Held by reference (a group's samples share
            their prompt's parts), never serialized, ignored by equality; None once released.
    """

    type: Literal["text", "image", "video"]
    text: str | None = None
    image: Image.Image | None = None
    path: str | None = None
    timestamps: list[float] | None = None
    patches: ImagePatches | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.type not in ("text", "image", "video"):
            raise ValueError(f"ContentPart.type must be 'text', 'image' or 'video', got {self.type!r}")
        if self.type == "text" and self.text is None:
            raise ValueError("a text ContentPart needs text")
        if self.type == "image" and self.image is None and self.path is None:
            raise ValueError("an image ContentPart needs an image or a path")
        if self.type == "video" and self.path is None:
            raise ValueError("a video ContentPart needs a path")
        if self.patches is not None and self.type != "image":
            raise ValueError(f"only an image ContentPart carries patches, not a {self.type!r} one")


@dataclass
class ToolCall:
    """A parsed tool call: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    ``raw`` keeps the exact text the model wrote so viewers and error messages can quote it.
    """

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass
class Observation:
    """What a tool returns to the model.

    Attributes:
        text: Human/model-readable result, or the error message when ``error`` is set.
        images: Images the tool produced (crops, frames, plots), in order.
        error: Error kind (e.g. ``"bad_arguments"``, ``"timeout"``) when the call failed; None on success.
        timestamps: For video frames, the time in seconds of each returned image.
        metadata: Structured extras for metrics and rewards (e.g. the crop box in original pixels).
        first_image: The episode's index of the first of ``images`` (the next follow in order), set by whoever
            appends them to the episode (the rollout engine, in call order), never by the tool: only the caller knows
            where they land when several calls of a turn run at once. vagent's protocol labels the output with it
            (``"Image 3: ..."``); None = not placed (no label).
    """

    text: str
    images: list[Image.Image] = field(default_factory=list)
    error: str | None = None
    timestamps: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    first_image: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ToolResult:
    """One tool call of an episode as rewards, metrics and viewers read it (the images stay in ``messages``).

    Attributes:
        name: The vagent tool called; None for a call that could not be parsed (or a native call with no
            vagent equivalent: see ``native``).
        arguments: Its arguments as the tool received them; None for an unparsed call.
        error: The Observation's error kind, None on success.
        metadata: The Observation's metadata, e.g. a crop's ``box_original`` and ``image_index``, a video tool's
            ``span``: grounding rewards read what the policy looked at from here.
        native: Under a published agent's profile, the agent's own name for the call (``image_zoom_in_tool``);
            ``name`` is then the vagent tool it ran (``crop``), so rewards read every profile alike.
    """

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    native: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Frame:
    """How the policy saw one prompt image, so a box it answers with maps back to original pixels
    (``geometry.model_to_original``) without reopening the image.

    Attributes:
        original_size: ``(width, height)`` of the image on disk.
        model_size: ``(width, height)`` after the processor's resize.
        convention: How the policy writes boxes: ``"absolute"`` (pixels of the model's view) or ``"norm1000"``.
    """

    original_size: tuple[int, int]
    model_size: tuple[int, int]
    convention: str


@dataclass(frozen=True, eq=False)  # compared by identity: the same image is the same object
class ImagePatches:
    """One image as the vision tower takes it: its rows of the processor's ``pixel_values`` and its grid.

    Made once per image by the rollout engine and held by reference: a prompt image's patches are the same tensor in
    every sample of its group, and a tool output's are the same tensor in every turn after it. An episode hands them
    to the trainer on the image parts they were made from (``ContentPart.patches``).

    Attributes:
        pixel_values: (grid_t * grid_h * grid_w, channels * temporal_patch * patch**2) fp32 patches; None where the
            engine made none (``vagent.data.encode.grid_patches``: a backend that needs only the image, no trainer).
        grid_thw: (1, 3) the image's ``image_grid_thw`` row.
        image: The model-sized image the patches were made from, where the engine made them: a backend that runs
            its own processor (vLLM) is sent this image, which its processor turns into these same patches.
    """

    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor
    image: Image.Image | None = None


@dataclass
class Message:
    """One chat turn.

    Attributes:
        role: Who speaks.
        content: Text and image parts, in order.
        tool_calls: Filled for assistant turns that called tools.
        token_ids: For assistant turns the engine produced: the exact ids of the turn after the
            ``<|im_start|>assistant\n`` header, as sampled (or forced, for scripted turns), ending with
            the ``<|im_end|>`` and newline that close it. The encoder uses them instead of re-tokenizing
            ``content``, so training sees exactly what was sampled.
        sampled: Aligned with ``token_ids``: 1 = sampled by the policy, 0 = forced by the engine.
        trained: For gold assistant turns (no ``token_ids``): False shows the turn as context without training
            on it (a row's ``"train": false``).
    """

    role: Role
    content: list[ContentPart]
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] | None = None
    sampled: list[int] | None = None
    trained: bool = True

    @classmethod
    def text(cls, role: Role, text: str) -> Message:
        return cls(role=role, content=[ContentPart(type="text", text=text)])

    @property
    def plain_text(self) -> str:
        """The text parts joined, images left out."""
        return "".join(part.text or "" for part in self.content if part.type == "text")

    @property
    def images(self) -> list[Image.Image | str]:
        return [part.image if part.image is not None else part.path for part in self.content if part.type == "image"]


@dataclass
class Trajectory:
    """One sampled episode for one task.

    Attributes:
        task_id: The canonical row's ``id``.
        messages: The conversation as people read it (system, user, assistant, tool, ...).
        token_ids: Every token of the episode, prompt included. (T,)
        loss_mask: Aligned with ``token_ids``; 1 = sampled by the policy, 0 = forced (prompt, tool output). (T,)
        logprobs: Aligned with ``token_ids``; the sampler's log-prob for sampled tokens, 0.0 elsewhere. (T,)
        answer: Text inside the final ``<answer>`` tag, or None.
        stop_reason: Why the episode ended.
        metrics: Counters (turns, tool calls, tool errors by kind, ...).
        tool_results: One ``ToolResult`` per tool call, in order.
        frames: Per prompt image, the ``Frame`` the policy saw.
        reward: Filled in by the trainer or eval, never by the rollout.
        sample: Which of the task's samples this is (0 .. n_samples - 1): its sampling seeds are drawn from it, so a
            run asking for fewer samples makes the first ones. None where the maker does not number them.
    """

    task_id: str
    messages: list[Message]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    answer: str | None = None
    stop_reason: StopReason = "failed"
    metrics: dict[str, Any] = field(default_factory=dict)
    tool_results: list[ToolResult] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    reward: float | None = None
    sample: int | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or (self.logprobs and len(self.logprobs) != n):
            raise ValueError(
                f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs ({len(self.logprobs)}) must align"
            )

    @property
    def images(self) -> list[Image.Image | str]:
        """Every image in conversation order: the prompt's, then each tool output's."""
        return [img for message in self.messages for img in message.images]

    @property
    def last_reply(self) -> str:
        """The text of the last assistant turn: what a judge's verdict is read from, and what a judge is shown of an
        answer without ``<answer>``. ``answer`` (or "") for a trajectory without an assistant turn (one built from
        an answer alone)."""
        return next((m.plain_text for m in reversed(self.messages) if m.role == "assistant"), self.answer or "")

    @property
    def patches(self) -> list[ImagePatches]:
        """The patches its image parts carry, in conversation order: every image's when the rollout kept them
        (``run(..., keep_patches=True)``: GRPO), none otherwise or once released."""
        return [p.patches for m in self.messages for p in m.content if p.patches is not None]

    def release_patches(self) -> None:
        """Let go of its images' patches (the parts keep their pixels). A group's samples share their prompt's parts,
        so this releases the prompt image's patches for the whole group."""
        for message in self.messages:
            for part in message.content:
                part.patches = None

    def to_dict(self, save_image: Callable[[Image.Image], str] | None = None) -> dict[str, Any]:
        """A JSON-ready dict. In-memory images are written with ``save_image`` (returns a path) or dropped."""

        def part_dict(part: ContentPart) -> dict[str, Any]:
            out: dict[str, Any] = {"type": part.type}
            if part.text is not None:
                out["text"] = part.text
            path = part.path
            if part.image is not None and path is None and save_image is not None:
                path = save_image(part.image)
            if path is not None:
                out["path"] = path
            if part.timestamps is not None:
                out["timestamps"] = part.timestamps
            return out

        return {
            "task_id": self.task_id,
            "messages": [
                {
                    "role": m.role,
                    "content": [part_dict(p) for p in m.content],
                    "tool_calls": [{"name": c.name, "arguments": c.arguments, "raw": c.raw} for c in m.tool_calls],
                    **({"token_ids": m.token_ids, "sampled": m.sampled} if m.token_ids is not None else {}),
                }
                for m in self.messages
            ],
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "answer": self.answer,
            "stop_reason": self.stop_reason,
            "metrics": self.metrics,
            "tool_results": [dataclasses.asdict(r) for r in self.tool_results],
            "frames": [dataclasses.asdict(f) for f in self.frames],  # sizes as JSON lists
            "reward": self.reward,
            **({"sample": self.sample} if self.sample is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Inverse of ``to_dict``; images come back as paths (loaded lazily by whoever needs pixels)."""
        messages = [
            Message(
                role=m["role"],
                content=[
                    ContentPart(type=p["type"], text=p.get("text"), path=p.get("path"), timestamps=p.get("timestamps"))
                    for p in m["content"]
                ],
                tool_calls=[ToolCall(c["name"], c["arguments"], c.get("raw", "")) for c in m.get("tool_calls", [])],
                token_ids=m.get("token_ids"),
                sampled=m.get("sampled"),
            )
            for m in data["messages"]
        ]
        return cls(
            task_id=data["task_id"],
            messages=messages,
            token_ids=list(data.get("token_ids", [])),
            loss_mask=list(data.get("loss_mask", [])),
            logprobs=list(data.get("logprobs", [])),
            answer=data.get("answer"),
            stop_reason=data.get("stop_reason", "failed"),
            metrics=dict(data.get("metrics", {})),
            tool_results=[ToolResult(**r) for r in data.get("tool_results", [])],
            frames=[
                Frame(tuple(f["original_size"]), tuple(f["model_size"]), f["convention"])
                for f in data.get("frames", [])
            ],
            reward=data.get("reward"),
            sample=data.get("sample"),
        )

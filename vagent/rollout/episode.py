"""What an episode is before it runs: the task, its limits, and the prompt it starts from.

``Task`` is one episode (a canonical row's question, media and tools, plus any scripted turns); ``RolloutLimits`` its
limits and sampling settings; ``prompt_messages`` the system and user messages it starts from, as the agent profile
writes them (SFT builds its prompts here too); ``first_view_frames`` the frame budget's draw for a task.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image

from vagent.agents import AgentProfile, get_profile
from vagent.data.rows import Row
from vagent.types import Message

__all__ = ["RolloutLimits", "Task", "first_view_frames", "prompt_messages"]


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
            that the first view does not already show everything, then clamped so that the prompt (its images and
            every video's frames) leaves room under ``max_images`` for a tool image. None = the profile's own view.
        seed: Seeds the per-task draws (``frame_budget``); tokens are sampled from torch's generator, not from it.
        sampling_seed: Fixes each sampled turn: every turn request carries a seed made of it, the task's id, the
            sample's index and the turn (``vagent serve``'s seeded requests, ``vagent eval``'s reproducible samples),
            drawn from a generator of its own by either backend. None: the backend's shared stream (GRPO must not
            set it: every step would draw the same noise).
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
    sampling_seed: int | None = None

    @classmethod
    def fields(cls) -> frozenset[str]:
        """The names of the limits: a config section's keys that are limits, not choices of engine."""
        return frozenset(f.name for f in dataclasses.fields(cls))


def first_view_frames(task_id: str, budget: tuple[int, int] | Sequence[int], seed: int = 0) -> int:
    """How many frames of each video the first view of task ``task_id`` shows: drawn uniformly from ``budget``
    (``[lo, hi]``, both included) by a generator seeded with the task and ``seed``, so every sample of a task (a
    GRPO group) shares its prompt, a rerun draws the same, and different tasks draw differently.

    >>> first_view_frames("q1", (4, 4))
    4
    """
    lo, hi = budget
    return random.Random(f"{seed}/{task_id}").randint(lo, hi)  # a str seed is hashed by sha512: stable across runs


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

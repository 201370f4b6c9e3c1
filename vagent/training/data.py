"""SFT data: canonical rows with a gold ``messages`` trajectory -> encoded, length-grouped micro-batches.

The conversation of a row is its gold turns after the prompt the rollout engine would show for that row
(``vagent.rollout.prompt_messages``: the system prompt with the offered tools' schemas, the prompt images,
the videos' lengths, the question with its choices). So the cold start trains on exactly the prompt the
policy later sees in GRPO and eval. A row whose ``messages`` carry their own system/user turns is taken
verbatim instead (converted third-party data).

Micro-batches have global indices ``g = 0, 1, 2, ...`` over an endless stream of epochs (each epoch a
fresh ``(seed, epoch)`` order), so the data position is one integer, every rank computes the same order,
and optimizer step ``s`` consumes micro-batches ``[s*W*A, (s+1)*W*A)``: rank ``r`` takes ``s*W*A + r + k*W``
for ``k < A``. The set a step trains on depends only on ``W*A``, which is why 2 ranks x 1 micro-batch
and 1 rank x 2 micro-batches compute the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from PIL import UnidentifiedImageError

from vagent.agents import get_profile
from vagent.algorithms import trained_positions
from vagent.data.batching import collate, epoch_batches
from vagent.data.encode import encode_messages, encoded_length
from vagent.data.rows import Row, RowError
from vagent.model import Policy, policy_logits
from vagent.rollout.engine import Task, prompt_messages
from vagent.rollout.episode import first_view_frames
from vagent.types import Message

__all__ = ["SFTDataset", "gold_conversation", "gold_reproduced", "rank_micro_batches"]


def gold_conversation(row: Row, default_tools: Sequence[str], agent: str = "vagent", key: str = "messages",
                      frame_budget: Sequence[int] | None = None, seed: int = 0) -> list[Message]:  # fmt: skip
    """The full conversation SFT trains on for ``row`` (see the module docstring); ``agent`` names the
    profile whose prompt precedes the gold turns (``vagent.agents.PROFILES``). ``key`` names the row's field that
    holds the gold turns: ``messages``, or a preference pair's ``chosen`` or ``rejected`` (built the same way).
    ``frame_budget``: the prompt shows each video's first view as the rollout does under ``rollout.frame_budget``
    with ``seed`` (the same draw per row: ``first_view_frames``), so a video cold start trains on the prompt the
    policy will be rolled out from; None: the profile's own view.

    Raises:
        RowError: the row has no such turns, or they hold a part SFT cannot encode.
    """
    turns = list(getattr(row, key) or [])
    if not turns:
        raise RowError(f"row {row.id!r}: has no gold `{key}` to train on")
    for i, message in enumerate(turns):
        for j, part in enumerate(message.content):
            if part.type == "video":  # the engine shows videos only as frames returned by the video tools
                raise RowError(
                    f"row {row.id!r}: {key}[{i}].content[{j}] is a video part; gold trajectories show videos as the "
                    "frames a sample_frames/crop_clip tool turn returned (image parts), as the rollout engine does"
                )
    if any(m.role in ("system", "user") for m in turns):
        if turns[0].role not in ("system", "user"):
            raise RowError(f"row {row.id!r}: {key} with their own prompt must start with a system or user turn")
        return turns
    frames = first_view_frames(row.id, frame_budget, seed) if frame_budget and row.videos else None
    return prompt_messages(Task.from_row(row, default_tools), agent=agent, frames=frames) + turns


class SFTDataset(torch.utils.data.Dataset):
    """Global micro-batch index -> collated micro-batch (see the module docstring).

    Conversations are built and measured up front (``encoded_length``: text tokens plus each image's
    visual tokens from its header, no pixels decoded), and encoded only when their batch is fetched.
    Rows that cannot be built (unreadable image, bad parts) or exceed ``max_length`` are left out and
    listed in ``skipped`` with the reason.
    """

    def __init__(self, rows: Sequence[Row], processor: Any, *, min_pixels: int, max_pixels: int, factor: int,
                 default_tools: Sequence[str], max_length: int, micro_batch_size: int, seed: int,
                 group_by_length: bool, group_batches: int, agent: str = "vagent",
                 frame_budget: Sequence[int] | None = None) -> None:  # fmt: skip
        self.processor = processor
        # Text the agent's loop forces into assistant turns (pre-filled or inline results) is not trained on.
        self.forced_spans = get_profile(agent).forced_spans
        self.budget = {"min_pixels": min_pixels, "max_pixels": max_pixels, "factor": factor}
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.group_by_length = group_by_length
        self.group_batches = group_batches
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.conversations: list[list[Message]] = []
        self.ids: list[str] = []
        self.lengths: list[int] = []
        self.skipped: list[tuple[str, str]] = []
        for row in rows:
            try:
                conversation = gold_conversation(row, default_tools, agent, frame_budget=frame_budget, seed=seed)
                length = encoded_length(conversation, processor, **self.budget)
            except (RowError, OSError, UnidentifiedImageError, ValueError) as e:
                self.skipped.append((row.id, f"{type(e).__name__}: {e}"))
                continue
            if length > max_length:
                self.skipped.append((row.id, f"{length} tokens > data.max_length={max_length}"))
                continue
            self.conversations.append(conversation)
            self.ids.append(row.id)
            self.lengths.append(length)
        if not self.conversations:
            reasons = "; ".join(f"{rid}: {why}" for rid, why in self.skipped[:3])
            raise ValueError(f"no usable SFT rows ({len(self.skipped)} skipped: {reasons})")
        self.batches_per_epoch = math.ceil(len(self.conversations) / micro_batch_size)
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def batch(self, g: int) -> list[int]:
        """Conversation indices of global micro-batch ``g``."""
        epoch, i = divmod(g, self.batches_per_epoch)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = epoch_batches(self.lengths, self.micro_batch_size, seed=self.seed, epoch=epoch,
                                  group_by_length=self.group_by_length, group_batches=self.group_batches)  # fmt: skip
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1][i]

    def __len__(self) -> int:
        return self.batches_per_epoch  # one epoch; indices beyond it continue into the next epochs

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        encoded = [encode_messages(self.conversations[i], self.processor, **self.budget, forced_spans=self.forced_spans)
                   for i in self.batch(g)]  # fmt: skip
        return collate(encoded, self.pad_id)


@torch.no_grad()
def gold_reproduced(policy: Policy, rows: Sequence[Row], default_tools: Sequence[str] = (), *, agent: str = "vagent",
                    micro_batch_size: int = 8) -> dict[str, bool]:  # fmt: skip
    """Whether each row's gold turns are the model's greedy choice, teacher-forced: every token SFT trains on (the
    assistant's) is the model's most likely one after the gold before it. One forward a micro-batch instead of a
    rollout. Where every gold assistant turn is trained and each tool turn is what its tool returns (a program's
    printed output), a row that passes is what a greedy episode writes; the check is stricter in one place, as it
    also asks for the end-of-turn token the engine appends itself after a stop string. TRL logs the token-level mean
    of this (``mean_token_accuracy``); here a row counts only if every token is right. Returns row id -> reproduced;
    a row SFT cannot build, or with no trained token, is False."""
    min_pixels, max_pixels = policy.pixel_budget
    data = SFTDataset(rows, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=policy.image_factor, default_tools=default_tools, max_length=1 << 30,
                      micro_batch_size=micro_batch_size, seed=0, group_by_length=True, group_batches=1, agent=agent)  # fmt: skip
    reproduced = {row.id: False for row in rows}
    was_training = policy.model.training
    policy.model.eval()
    try:
        for g in range(len(data)):
            batch = {k: v.to(policy.device) for k, v in data[g].items()}
            positions = trained_positions(batch["loss_mask"])
            logits = policy_logits(policy.model, batch, positions=positions)  # position t predicts token t + 1
            right = logits.argmax(-1) == batch["input_ids"][:, 1:][positions[:, :-1]]
            rows_of = positions.nonzero()[:, 0]  # each trained token's row in the micro-batch
            for i, conversation in enumerate(data.batch(g)):
                mine = rows_of == i
                reproduced[data.ids[conversation]] = bool(mine.any() and right[mine].all())
    finally:
        policy.model.train(was_training)
    return reproduced


def rank_micro_batches(start_step: int, total_steps: int, rank: int, world_size: int, grad_accum: int) -> Iterator[int]:
    """Global micro-batch indices rank ``rank`` trains on, steps ``start_step`` .. ``total_steps - 1``, in order.

    >>> list(rank_micro_batches(1, 3, rank=1, world_size=2, grad_accum=2))
    [5, 7, 9, 11]
    """
    per_step = world_size * grad_accum
    for step in range(start_step, total_steps):
        for k in range(grad_accum):
            yield step * per_step + rank + k * world_size

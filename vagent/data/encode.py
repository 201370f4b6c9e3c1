"""The one encoder: a conversation (``Message`` list or ``Trajectory``) -> model tensors + loss mask.

SFT, GRPO, eval and the rollout engine all go through ``encode_segment``/``encode_messages``, so the
ids the policy sampled are exactly the ids it is trained on:

* The conversation is rendered with the checkpoint's chat template one message at a time (the text
  the template adds for message *i* given messages *< i*). Segments are tokenized separately, which
  is exact because every boundary sits next to a special token (``<|im_end|>``, ``<|im_start|>``)
  that the BPE never merges across.
* An assistant message that carries ``token_ids`` (the engine's exact sampled ids) is used as is,
  never re-tokenized from its text; its ``sampled`` flags become the loss mask (GRPO trains only
  what was sampled). A gold assistant message without ids (SFT) is tokenized and trained on its
  content and closing ``<|im_end|>`` (unless ``trained`` is False: context only); the header and the
  newline after ``<|im_end|>`` are masked. The agent profile's ``forced_spans`` (text its loop writes into
  an assistant turn: DeepEyesV2's pre-filled ``<think>``, Tool-Star's inline ``<result>``) are masked too.
* System, user and tool messages are masked (0). Their images are resized exactly as the policy saw
  them (``resize_to_budget`` with the policy's pixel budget and patch grid) and run through the
  processor, so ``pixel_values`` holds every image's patches in conversation order (prompt images,
  then each tool output) with one ``image_grid_thw`` row each.

Multimodal RoPE positions are not computed here: they need the model's vision config
(``Policy.rope_positions`` computes them over the whole sequence from these outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vagent.media import load_image, resize_to_budget, smart_resize
from vagent.types import Message

__all__ = [
    "Encoded",
    "encode_message",
    "encode_messages",
    "encode_prompt",
    "encode_segment",
    "encoded_length",
    "template_dicts",
    "template_suffix",
]

_ANCHOR = [{"role": "system", "content": "x"}]


@dataclass
class Encoded:
    """Model inputs of one conversation.

    Attributes:
        input_ids: (T,) token ids.
        loss_mask: (T,) 1 = train on this token (sampled, or gold assistant content), 0 = forced.
        pixel_values: (patches, dim) every image's patches in order, or None without images.
        image_grid_thw: (n_images, 3) one row per image, or None.
        mm_token_type_ids: (T,) 1 at image placeholders, 2 at video placeholders, 0 elsewhere.
        logprobs: (T,) the sampler's log-probs where the engine recorded them, 0 elsewhere.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor
    logprobs: torch.Tensor


def template_dicts(message: Message) -> dict[str, Any]:
    """A ``Message`` as the chat template wants it: text parts verbatim, an ``{"type": "image"}`` per image."""
    content = [
        {"type": "image"} if part.type == "image" else {"type": "text", "text": part.text or ""}
        for part in message.content
    ]
    return {"role": message.role, "content": content}


def template_suffix(processor: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Text the chat template adds for ``messages`` after any conversation (anchored on a system turn)."""
    before = processor.apply_chat_template(_ANCHOR, tokenize=False)
    after = processor.apply_chat_template(
        _ANCHOR + messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    if not after.startswith(before):
        raise ValueError("the checkpoint's chat template does not render turns incrementally")
    return after[len(before) :]


def encode_segment(processor: Any, text: str, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
    """Tokenize one rendered segment with its (already model-sized) images. Returns ``input_ids`` (n,)
    and, with images, ``pixel_values`` and ``image_grid_thw``."""
    batch = processor(text=[text], images=list(images) or None, return_tensors="pt")
    out = {"input_ids": batch["input_ids"][0]}
    if images:
        out["pixel_values"] = batch["pixel_values"]
        out["image_grid_thw"] = batch["image_grid_thw"]
    return out


def encode_prompt(
    processor: Any, messages: Sequence[Message], images: Sequence[Image.Image]
) -> dict[str, torch.Tensor]:
    """The conversation's opening (system/user messages before the first assistant turn) rendered as a fresh
    chat and tokenized with its (model-sized) images, as ``encode_segment`` returns it."""
    text = processor.apply_chat_template([template_dicts(m) for m in messages], tokenize=False)
    return encode_segment(processor, text, images)


def encode_message(processor: Any, message: Message, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
    """A system/user/tool message appended to a conversation: its template text tokenized with its
    (model-sized) images, as ``encode_segment`` returns it."""
    text = template_suffix(processor, [template_dicts(message)], add_generation_prompt=False)
    return encode_segment(processor, text, images)


def _model_images(message: Message, min_pixels: int, max_pixels: int, factor: int) -> list[Image.Image]:
    images = []
    for part in message.content:
        if part.type == "image":
            source = part.image if part.image is not None else part.path
            image = load_image(source)
            images.append(resize_to_budget(image, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor))
    return images


def encode_messages(
    messages: Sequence[Message],
    processor: Any,
    *,
    min_pixels: int,
    max_pixels: int,
    factor: int = 28,
    logprobs: Sequence[float] | None = None,
    forced_spans: Callable[[str, int], list[tuple[int, int]]] | None = None,
) -> Encoded:
    """Encode a conversation (see the module docstring).

    Args:
        messages: The conversation, starting with its system/user prompt.
        processor: The checkpoint's processor (chat template, tokenizer, image processor).
        min_pixels, max_pixels, factor: The policy's pixel budget and patch grid (``Policy.pixel_budget``,
            ``Policy.image_factor``); images are resized with them exactly as the policy saw them.
        logprobs: Optional per-token log-probs of the whole sequence (a Trajectory's), carried through.
        forced_spans: The agent profile's ``forced_spans(text, turn)``: character spans of a gold assistant
            turn's text (``turn`` 1-based) that the agent's loop forces; their tokens get loss mask 0.

    Returns:
        An ``Encoded``; for an engine trajectory ``input_ids`` equals ``Trajectory.token_ids``.
    """
    tokenizer = processor.tokenizer
    header_text = template_suffix(processor, [], add_generation_prompt=True)  # "<|im_start|>assistant\n"
    header = tokenizer.encode(header_text)
    ids: list[torch.Tensor] = []
    mask: list[torch.Tensor] = []
    pixels, grids = [], []

    def add(segment: dict[str, torch.Tensor], trained: torch.Tensor | None = None) -> None:
        ids.append(segment["input_ids"])
        mask.append(trained if trained is not None else torch.zeros_like(segment["input_ids"]))
        if "pixel_values" in segment:
            pixels.append(segment["pixel_values"])
            grids.append(segment["image_grid_thw"])

    # The prompt (everything before the first assistant turn) is rendered as a whole, like a fresh chat.
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    prompt_images = [img for m in messages[:first] for img in _model_images(m, min_pixels, max_pixels, factor)]
    add(encode_prompt(processor, messages[:first], prompt_images))
    turn_number = 0
    for message in messages[first:]:
        turn_number += message.role == "assistant"
        if message.role != "assistant":
            add(encode_message(processor, message, _model_images(message, min_pixels, max_pixels, factor)))
            continue
        add({"input_ids": torch.tensor(header)})
        if message.token_ids is not None:
            turn = torch.tensor(message.token_ids, dtype=torch.long)
            sampled = message.sampled if message.sampled is not None else [1] * len(message.token_ids)
            add({"input_ids": turn}, torch.tensor(sampled, dtype=torch.long))
        else:
            spans = forced_spans(message.plain_text, turn_number) if forced_spans and message.trained else []
            turn, trained = _gold_turn(processor, message, header_text, spans)
            add({"input_ids": turn}, trained)
    input_ids = torch.cat(ids).long()
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_token = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    types = (input_ids == image_token).int() + 2 * (input_ids == video_token).int()
    lp = torch.tensor(list(logprobs), dtype=torch.float32) if logprobs else torch.zeros(len(input_ids))
    if len(lp) != len(input_ids):
        raise ValueError(f"logprobs ({len(lp)}) do not align with the encoded ids ({len(input_ids)})")
    return Encoded(
        input_ids=input_ids,
        loss_mask=torch.cat(mask).long(),
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        mm_token_type_ids=types,
        logprobs=lp,
    )


def _gold_turn(processor: Any, message: Message, header_text: str,
               spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A gold assistant turn's ids as the template renders them after the header, and their loss mask: 1 on the
    content and its ``<|im_end|>`` (0 for an untrained turn and inside the forced ``spans``), 0 on the newline the
    template adds after it."""
    tokenizer = processor.tokenizer
    body = template_suffix(processor, [template_dicts(message)], add_generation_prompt=False)
    if not body.startswith(header_text):
        raise ValueError("the chat template renders assistant turns with a different header")
    content = body[len(header_text) :]
    turn = torch.tensor(tokenizer.encode(content), dtype=torch.long)
    trained = torch.full_like(turn, int(message.trained))
    if spans:
        trained *= _outside(tokenizer, content, spans, len(turn))
    newline = tokenizer.encode("\n")
    if turn[-len(newline) :].tolist() == newline:
        trained[-len(newline) :] = 0
    return turn, trained


def _outside(tokenizer: Any, text: str, spans: list[tuple[int, int]], n: int) -> torch.Tensor:
    """(n,) 1 for tokens of ``text`` that overlap none of ``spans`` (character ranges), 0 for the others."""
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    if len(offsets) != n:
        raise ValueError("the tokenizer's offsets do not align with its ids; cannot mask forced spans")
    keep = [int(not any(a < e and s < b for s, e in spans)) for a, b in offsets]
    return torch.tensor(keep, dtype=torch.long)


def _image_size(part: Any) -> tuple[int, int]:
    if part.image is not None:
        return part.image.size
    with Image.open(part.path) as image:  # reads the header only
        return image.size


def encoded_length(
    messages: Sequence[Message], processor: Any, *, min_pixels: int, max_pixels: int, factor: int = 28
) -> int:
    """``len(encode_messages(messages, ...).input_ids)`` for a gold conversation, without decoding any pixels.

    The conversation is rendered whole and tokenized once (segment boundaries sit next to special tokens,
    so this matches the segment-wise encoding); each image then adds its visual tokens (one per
    ``factor``x``factor`` block of its model-sized frame) minus the placeholder already counted. Used to
    group conversations by length before any of them is encoded.
    """
    text = processor.apply_chat_template([template_dicts(m) for m in messages], tokenize=False)
    n = len(processor.tokenizer.encode(text))
    for message in messages:
        for part in message.content:
            if part.type == "image":
                width, height = _image_size(part)
                h, w = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
                n += (h // factor) * (w // factor) - 1
    return n

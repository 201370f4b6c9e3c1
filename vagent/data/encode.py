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
  then each tool output) with one ``image_grid_thw`` row each. An image part that carries its patches
  (``ContentPart.patches``: the engine attached them to the part it made them from, ``attach_patches``)
  is not processed again: where every image of a segment carries them they are used as they are, by
  reference, and only the text is tokenized, each image's placeholder expanded to its grid's tokens as
  the processor expands it. The patches travel on their own image's part, so no list kept beside the
  conversation can pair an image with another image's pixels (two images of one size would have the
  same ids whichever pixels they carried).

Multimodal RoPE positions are not computed here: they need the model's vision config
(``Policy.rope_positions`` computes them over the whole sequence from these outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vagent.data.pieces import token_ids
from vagent.media import load_image, resize_to_budget, smart_resize
from vagent.types import ContentPart, ImagePatches, Message

__all__ = [
    "Encoded",
    "attach_patches",
    "encode_message",
    "encode_messages",
    "encode_prompt",
    "encode_segment",
    "encoded_length",
    "image_patches",
    "message_ids",
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
        image_patches: One (patches_i, dim) block per image, in order; blocks are shared, never copied (a group's
            prompt image is one tensor in all its samples' encodings). ``collate`` concatenates a batch's.
        image_grid_thw: (n_images, 3) one row per image, or None.
        mm_token_type_ids: (T,) 1 at image placeholders, 2 at video placeholders, 0 elsewhere.
        logprobs: (T,) the sampler's log-probs where the engine recorded them, 0 elsewhere.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    image_patches: list[torch.Tensor]
    image_grid_thw: torch.Tensor | None
    mm_token_type_ids: torch.Tensor
    logprobs: torch.Tensor

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """(patches, dim) every image's patches in order (a new tensor), or None without images."""
        return torch.cat(self.image_patches) if self.image_patches else None


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
    return encode_segment(processor, _prompt_text(processor, messages), images)


def encode_message(processor: Any, message: Message, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
    """A system/user/tool message appended to a conversation: its template text tokenized with its
    (model-sized) images, as ``encode_segment`` returns it."""
    return encode_segment(processor, _message_text(processor, message), images)


def message_ids(processor: Any, message: Message, patches: Sequence[ImagePatches]) -> torch.Tensor:
    """(n,) the ids ``encode_message`` gives ``message`` whose images have these ``patches`` (one per image, in
    order), without running the processor on any pixels: only the text is tokenized."""
    return _ids_with_patches(processor, _message_text(processor, message), patches)


def prompt_ids(processor: Any, messages: Sequence[Message], patches: Sequence[ImagePatches]) -> torch.Tensor:
    """(n,) the ids ``encode_prompt`` gives ``messages`` whose images have these ``patches`` (one per image, in
    order), without running the processor on any pixels: only the text is tokenized."""
    return _ids_with_patches(processor, _prompt_text(processor, messages), patches)


def grid_patches(processor: Any, images: Sequence[Image.Image]) -> list[ImagePatches]:
    """Each model-sized image's ``ImagePatches`` without pixels (``pixel_values`` None): the grid its size gives, as
    the processor's ``image_grid_thw`` would, and the image. For a backend that runs its own processor on the images
    (vLLM) where no trainer takes the patches: the processor's pixel work is then done once, not twice."""
    patch = processor.image_processor.patch_size
    return [ImagePatches(None, torch.tensor([[1, image.height // patch, image.width // patch]]), image)
            for image in images]  # fmt: skip


def image_patches(encoded: dict[str, torch.Tensor], images: Sequence[Image.Image] = ()) -> list[ImagePatches]:
    """The per-image ``ImagePatches`` of an ``encode_segment`` result: views into its ``pixel_values``, no copy; each
    with its model-sized image when ``images`` (those the segment was encoded with, in order) are given."""
    if "pixel_values" not in encoded:
        return []
    grids = list(encoded["image_grid_thw"].split(1))
    blocks = encoded["pixel_values"].split([int(g.prod()) for g in grids])
    shown = list(images) or [None] * len(grids)
    return [ImagePatches(block, grid, image) for block, grid, image in zip(blocks, grids, shown, strict=True)]


def attach_patches(messages: Sequence[Message], patches: Sequence[ImagePatches]) -> None:
    """Hand each image part of ``messages`` its own patches: ``patches`` are what the processor made of exactly these
    messages' images, in order (``image_patches`` of ``encode_prompt``/``encode_message`` on them), so the pairing is
    the processor's own. The encoder then uses them (``ContentPart.patches``).

    Raises:
        ValueError: not one patch block per image part.
    """
    parts = [part for m in messages for part in m.content if part.type == "image"]
    if len(parts) != len(patches):
        raise ValueError(f"{len(patches)} image patches for messages of {len(parts)} image(s)")
    for part, patch in zip(parts, patches, strict=True):
        part.patches = patch


def _prompt_text(processor: Any, messages: Sequence[Message]) -> str:
    return processor.apply_chat_template([template_dicts(m) for m in messages], tokenize=False)


def _message_text(processor: Any, message: Message) -> str:
    return template_suffix(processor, [template_dicts(message)], add_generation_prompt=False)


def _ids_with_patches(processor: Any, text: str, patches: Sequence[ImagePatches]) -> torch.Tensor:
    """(n,) the ids ``encode_segment`` gives ``text`` with images of these patches, without their pixels: the text
    tokenized with its one placeholder per image, each placeholder then repeated once per merged patch of its grid
    (``grid.prod() / merge_size**2``, the processor's own expansion; a run of the placeholder, an added token,
    tokenizes to one id per placeholder, so expanding ids or text gives the same ids)."""
    token = processor.image_token
    if text.count(token) != len(patches):
        raise ValueError(f"the segment has {text.count(token)} image placeholder(s) but {len(patches)} image patches")
    ids = torch.tensor(token_ids(processor.tokenizer, text), dtype=torch.long)
    if not patches:
        return ids
    merge = processor.image_processor.merge_size**2
    pads = ids == processor.tokenizer.convert_tokens_to_ids(token)
    if int(pads.sum()) != len(patches):
        raise ValueError(f"the segment tokenizes to {int(pads.sum())} image placeholder(s) for {len(patches)} images")
    repeats = torch.ones_like(ids)
    repeats[pads] = torch.tensor([int(patch.grid_thw.prod()) // merge for patch in patches])
    return ids.repeat_interleave(repeats)


def _check_grids(parts: Sequence[ContentPart], processor: Any, min_pixels: int, max_pixels: int, factor: int) -> None:
    """Each part's patches must have the grid its image's size gives under the pixel budget: patches made under
    another budget (or another processor) are refused rather than trained on."""
    patch = processor.image_processor.patch_size
    for part in parts:
        width, height = _image_size(part)
        h, w = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
        grid = part.patches.grid_thw.flatten().tolist()
        if grid != [1, h // patch, w // patch]:
            raise ValueError(f"an image's patches have grid {grid}, but the image ({width}x{height}) is seen at "
                             f"{w}x{h}: grid [1, {h // patch}, {w // patch}]")  # fmt: skip


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
        An ``Encoded``; for an engine trajectory ``input_ids`` equals ``Trajectory.token_ids``. Images whose parts
        carry their patches (``ContentPart.patches``) are taken by reference wherever every image of their segment
        carries them; the other segments' images are run through the processor.

    Raises:
        ValueError: carried patches do not have the grid their image's size gives under the pixel budget.
    """
    tokenizer = processor.tokenizer
    header_text = template_suffix(processor, [], add_generation_prompt=True)  # "<|im_start|>assistant\n"
    header = tokenizer.encode(header_text)
    budget = (min_pixels, max_pixels, factor)
    ids: list[torch.Tensor] = []
    mask: list[torch.Tensor] = []

    def add(segment: torch.Tensor, trained: torch.Tensor | None = None) -> None:
        ids.append(segment)
        mask.append(trained if trained is not None else torch.zeros_like(segment))

    # The prompt (everything before the first assistant turn) is rendered as a whole, like a fresh chat.
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    segment, images = _forced(processor, _prompt_text(processor, messages[:first]), messages[:first], *budget)
    add(segment)
    turn_number = 0
    for message in messages[first:]:
        turn_number += message.role == "assistant"
        if message.role != "assistant":
            segment, shown = _forced(processor, _message_text(processor, message), [message], *budget)
            add(segment)
            images += shown
            continue
        add(torch.tensor(header))
        if message.token_ids is not None:
            turn = torch.tensor(message.token_ids, dtype=torch.long)
            sampled = message.sampled if message.sampled is not None else [1] * len(message.token_ids)
            add(turn, torch.tensor(sampled, dtype=torch.long))
        else:
            spans = forced_spans(message.plain_text, turn_number) if forced_spans and message.trained else []
            add(*_gold_turn(processor, message, header_text, spans))
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
        image_patches=[image.pixel_values for image in images],
        image_grid_thw=torch.cat([image.grid_thw for image in images]) if images else None,
        mm_token_type_ids=types,
        logprobs=lp,
    )


def _forced(processor: Any, text: str, source: Sequence[Message], min_pixels: int, max_pixels: int,
            factor: int) -> tuple[torch.Tensor, list[ImagePatches]]:  # fmt: skip
    """A masked segment's ids and its images' patches: those its image parts carry when every one does, else (none
    does: a trajectory read back from disk, or sent to this rank without its patches) the processor's on the images
    resized as the policy saw them. Some but not all is a bug upstream, never re-encoded quietly."""
    parts = [part for m in source for part in m.content if part.type == "image"]
    carried = sum(part.patches is not None for part in parts)
    if 0 < carried < len(parts):
        raise ValueError(f"{carried} of a segment's {len(parts)} image parts carry patches: either all or none do "
                         "(the engine attaches them per segment)")  # fmt: skip
    if parts and carried == len(parts):
        _check_grids(parts, processor, min_pixels, max_pixels, factor)
        shown = [part.patches for part in parts]
        return _ids_with_patches(processor, text, shown), shown
    resized = [img for m in source for img in _model_images(m, min_pixels, max_pixels, factor)]
    segment = encode_segment(processor, text, resized)
    return segment["input_ids"], image_patches(segment)


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

"""The one encoder on gold (SFT) conversations: only assistant content is trained."""

import dataclasses

import pytest
import torch
from PIL import Image

from vagent.data import encode_messages, template_dicts
from vagent.data.encode import attach_patches, encode_message, encode_prompt, image_patches
from vagent.types import ContentPart, Message

CALL = '<think>too small</think><tool_call>{"name": "crop", "arguments": {"bbox": [1, 2, 60, 70]}}</tool_call>'


def test_gold_conversation_trains_assistant_content_only(policy):
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    crop = Image.new("RGB", (112, 112), (200, 10, 30))
    messages = _crop_conversation([ContentPart("image", image=image), ContentPart("text", "What is it?")], crop)
    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
    tokenizer = policy.tokenizer
    trained = tokenizer.decode(enc.input_ids[enc.loss_mask.bool()].tolist())
    # exactly the two assistant turns, each with its <|im_end|>; no header, no newline, no prompt or tool text
    assert trained == CALL + "<|im_end|>" + "<answer>a square</answer><|im_end|>"
    # the whole sequence is what the chat template renders for the conversation
    conversation = [template_dicts(m) for m in messages]
    text = policy.processor.apply_chat_template(conversation, tokenize=False)
    shown = [policy.model_view(image), policy.model_view(crop)]
    expected = policy.processor(text=[text], images=shown, return_tensors="pt")["input_ids"][0]
    assert enc.input_ids.tolist() == expected.tolist()
    assert len(enc.image_grid_thw) == 2
    assert int(enc.mm_token_type_ids.sum()) == int((enc.input_ids == policy.model.config.image_token_id).sum())


def test_an_assistant_turn_marked_untrained_is_context_only(policy):
    """A gold turn with ``trained=False`` (a row's ``"train": false``) is in the sequence, unchanged, but gets no
    loss: SFT can teach the answer after a tool call without teaching the call again."""
    crop = Image.new("RGB", (112, 112), (200, 10, 30))

    def conversation(trained):
        return [
            Message.text("system", "You answer."),
            Message.text("user", "What is it?"),
            Message("assistant", [ContentPart("text", CALL)], trained=trained),
            Message("tool", [ContentPart("image", image=crop), ContentPart("text", "Image 1: cropped region.")]),
            Message.text("assistant", "<answer>a square</answer>"),
        ]

    min_pixels, max_pixels = policy.pixel_budget
    full, context = (encode_messages(conversation(t), policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
                     for t in (True, False))  # fmt: skip
    assert context.input_ids.tolist() == full.input_ids.tolist()
    trained = policy.tokenizer.decode(context.input_ids[context.loss_mask.bool()].tolist())
    assert trained == "<answer>a square</answer><|im_end|>"


def _crop_conversation(question: list[ContentPart], crop: Image.Image, label: int = 1,
                       answer: str = "a square") -> list[Message]:  # fmt: skip
    """System, the user's ``question``, a crop call, its ``crop`` output (labelled "Image ``label``"), the answer."""
    return [
        Message.text("system", "You answer."),
        Message("user", question),
        Message.text("assistant", CALL),
        Message("tool", [ContentPart("image", image=crop), ContentPart("text", f"Image {label}: cropped region.")]),
        Message.text("assistant", f"<answer>{answer}</answer>"),
    ]


def _without_patches(messages):
    """The same conversation with no part carrying patches: the encoder then runs the processor on every image."""
    return [dataclasses.replace(m, content=[dataclasses.replace(p, patches=None) for p in m.content]) for m in messages]


def test_patches_carried_by_their_parts_encode_like_the_processor_and_a_wrong_grid_is_an_error(policy):
    """Each image part carries the patches made from it (``attach_patches`` on the segment that showed it): the
    encoder takes them by reference and gives the processor's ids and pixels; patches of another image size are
    refused rather than trained on, and a segment whose images carry none is run through the processor."""
    image, crop = Image.new("RGB", (300, 200), (10, 200, 30)), Image.new("RGB", (112, 112), (200, 10, 30))
    messages = _crop_conversation([ContentPart("image", image=image), ContentPart("text", "What is it?")], crop)
    budget = dict(zip(("min_pixels", "max_pixels"), policy.pixel_budget, strict=True))
    made = image_patches(encode_prompt(policy.processor, messages[:2], [policy.model_view(image)]))
    attach_patches(messages[:2], made)
    made += image_patches(encode_message(policy.processor, messages[3], [policy.model_view(crop)]))
    attach_patches(messages[3:4], made[1:])
    carried = encode_messages(messages, policy.processor, **budget)
    again = encode_messages(_without_patches(messages), policy.processor, **budget)
    assert carried.input_ids.tolist() == again.input_ids.tolist()
    assert carried.loss_mask.tolist() == again.loss_mask.tolist()
    assert torch.equal(carried.pixel_values, again.pixel_values) and torch.equal(carried.image_grid_thw,
                                                                                 again.image_grid_thw)  # fmt: skip
    assert [a is p.pixel_values for a, p in zip(carried.image_patches, made, strict=True)] == [True, True]
    assert not any(a is p.pixel_values for a, p in zip(again.image_patches, made, strict=True))
    assert Message("user", [ContentPart("image", image=image, patches=made[0])]) == Message(
        "user", [ContentPart("image", image=image)]
    )  # equality ignores patches
    with pytest.raises(ValueError, match="1 image patches for messages of 2"):
        attach_patches(messages, made[:1])
    with pytest.raises(ValueError, match="only an image ContentPart carries patches"):
        ContentPart("text", "x", patches=made[0])
    messages[1].content[0].patches = made[1]  # the crop's 112x112 patches on the 300x200 prompt image
    with pytest.raises(ValueError, match="grid"):
        encode_messages(messages, policy.processor, **budget)
    messages[1].content[0].patches = None  # the prompt's segment runs the processor, the tool turn's stays carried
    mixed = encode_messages(messages, policy.processor, **budget)
    assert torch.equal(mixed.pixel_values, again.pixel_values)
    assert mixed.image_patches[0] is not made[0].pixel_values and mixed.image_patches[1] is made[1].pixel_values


def test_images_of_one_size_each_encode_from_their_own_parts_patches(policy):
    """Images of the same size give the same ids whichever patches stand for them, so only their pixels can tell a
    mis-pairing: two prompt images and a tool output, all 112x112 and of different colours, each part carrying its
    own, encode to the processor's pixel_values run on the images again."""
    colours = [(200, 10, 30), (10, 200, 30), (10, 30, 200)]
    red, green, blue = (Image.new("RGB", (112, 112), c) for c in colours)
    question = [ContentPart("image", image=red), ContentPart("image", image=green), ContentPart("text", "Which?")]
    messages = _crop_conversation(question, blue, label=2, answer="the first")
    budget = dict(zip(("min_pixels", "max_pixels"), policy.pixel_budget, strict=True))
    attach_patches(messages[:2], image_patches(encode_prompt(policy.processor, messages[:2], [red, green])))
    attach_patches(messages[3:4], image_patches(encode_message(policy.processor, messages[3], [blue])))
    carried = encode_messages(messages, policy.processor, **budget)
    again = encode_messages(_without_patches(messages), policy.processor, **budget)
    grids = carried.image_grid_thw.tolist()
    assert grids[0] == grids[1] == grids[2]  # a grid check alone could not tell these images apart
    blocks = again.image_patches
    assert not any(torch.equal(blocks[i], blocks[j]) for i, j in ((0, 1), (0, 2), (1, 2)))  # their pixels can
    assert carried.input_ids.tolist() == again.input_ids.tolist()
    assert all(torch.equal(a, b) for a, b in zip(carried.image_patches, again.image_patches, strict=True))
    messages[1].content[1].patches = None  # one of the prompt segment's two images without its patches: a bug upstream
    with pytest.raises(ValueError, match="1 of a segment's 2 image parts carry patches"):
        encode_messages(messages, policy.processor, **budget)

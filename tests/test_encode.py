"""The one encoder on gold (SFT) conversations: only assistant content is trained."""

import pytest
import torch
from PIL import Image

from vagent.data import encode_messages, template_dicts
from vagent.data.encode import encode_message, encode_prompt, image_patches
from vagent.types import ContentPart, Message

CALL = '<think>too small</think><tool_call>{"name": "crop", "arguments": {"bbox": [1, 2, 60, 70]}}</tool_call>'


def test_gold_conversation_trains_assistant_content_only(policy):
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    crop = Image.new("RGB", (112, 112), (200, 10, 30))
    messages = [
        Message.text("system", "You answer."),
        Message("user", [ContentPart("image", image=image), ContentPart("text", "What is it?")]),
        Message.text("assistant", CALL),
        Message("tool", [ContentPart("image", image=crop), ContentPart("text", "Image 1: cropped region.")]),
        Message.text("assistant", "<answer>a square</answer>"),
    ]
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


def test_patches_made_once_encode_like_the_processor_and_a_mismatch_is_an_error(policy):
    """``patches`` (what the engine made when it showed each image) give the processor's ids and pixels, by reference;
    too few patches, or patches of another image size, are refused rather than trained on."""
    image, crop = Image.new("RGB", (300, 200), (10, 200, 30)), Image.new("RGB", (112, 112), (200, 10, 30))
    messages = [
        Message.text("system", "You answer."),
        Message("user", [ContentPart("image", image=image), ContentPart("text", "What is it?")]),
        Message.text("assistant", CALL),
        Message("tool", [ContentPart("image", image=crop), ContentPart("text", "Image 1: cropped region.")]),
        Message.text("assistant", "<answer>a square</answer>"),
    ]
    budget = dict(zip(("min_pixels", "max_pixels"), policy.pixel_budget, strict=True))
    made = image_patches(encode_prompt(policy.processor, messages[:2], [policy.model_view(image)]))
    made += image_patches(encode_message(policy.processor, messages[3], [policy.model_view(crop)]))
    carried = encode_messages(messages, policy.processor, patches=made, **budget)
    again = encode_messages(messages, policy.processor, **budget)
    assert carried.input_ids.tolist() == again.input_ids.tolist()
    assert carried.loss_mask.tolist() == again.loss_mask.tolist()
    assert torch.equal(carried.pixel_values, again.pixel_values) and torch.equal(carried.image_grid_thw,
                                                                                 again.image_grid_thw)  # fmt: skip
    assert [a is p.pixel_values for a, p in zip(carried.image_patches, made, strict=True)] == [True, True]
    with pytest.raises(ValueError, match="1 image patches for a conversation of 2"):
        encode_messages(messages, policy.processor, patches=made[:1], **budget)
    with pytest.raises(ValueError, match="grid"):
        encode_messages(messages, policy.processor, patches=made[::-1], **budget)

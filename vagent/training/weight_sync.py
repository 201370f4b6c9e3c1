"""The trained weights as a rollout engine takes them: whole tensors under their HF names, one at a time.

A colocated engine (vLLM) keeps its own copy of the weights, so after every optimizer step the trainer streams the
new ones into it. ``generation_weights`` walks the trained model in parameter order (layer by layer) and yields
``(name, tensor)``:

* FSDP2: each parameter's ``full_tensor()``, an all-gather, so every rank must walk the whole stream at the same
  point (each rank's engine takes its copy); one whole parameter exists at a time besides the shards.
* LoRA (peft): each adapted linear layer's merged weight, ``W + scale * B @ A`` (under FSDP2 from the gathered
  factors), under the base layer's name; the adapters themselves are not sent (verl and TRL merge, push, and keep training the adapters). The trained model
  is not modified: nothing is merged in place.
* A tied LM head is one parameter (the input embedding): the engine ties its head to it, as the checkpoint says.
* DDP and plain models: the parameters themselves, by reference.

Names are those of the transformers model (``model.language_model.layers.0...``); vLLM maps them to its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["generation_weights"]


@torch.no_grad()
def generation_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, whole tensor)`` of every weight of the trained ``model`` (DDP-, FSDP2- or peft-wrapped), in parameter
    order (see the module docstring), in ``dtype`` (the engine's; None: as trained). Under FSDP2 a collective: every
    rank consumes the whole iterator; each shard is cast before the all-gather (bf16 halves its traffic).

    >>> layer = torch.nn.Linear(2, 2)
    >>> [name for name, _ in generation_weights(layer)]
    ['weight', 'bias']
    """
    while not hasattr(model, "config") and hasattr(model, "module"):  # DDP / DeepSpeed wrappers
        model = model.module
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        yield from _merged(model.get_base_model(), dtype)
        return
    for name, param in model.named_parameters():
        yield name, _whole(param, dtype)


def _merged(base: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with each LoRA layer's active adapters merged in, under the base layer's names."""
    from peft.tuners.lora import LoraLayer

    lora_layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for name, param in base.named_parameters():
        if ".lora_" in name:  # the adapters' own factors: merged into their base layer's weight below
            continue
        if ".base_layer." in name:
            owner, _, leaf = name.rpartition(".base_layer.")
            layer = lora_layers[owner]
            tensor = _whole(param, None)
            if leaf == "weight" and not layer.disable_adapters:
                # merged in fp32 (a bf16 base and fp32 adapters: one rounding, not two), back in the base's dtype
                merged = tensor.float()
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        a = _whole(layer.lora_A[adapter].weight, torch.float32)  # (r, in)
                        b = _whole(layer.lora_B[adapter].weight, torch.float32)  # (out, r)
                        merged = merged + layer.scaling[adapter] * (b @ a)
                tensor = merged.to(tensor.dtype)
            yield f"{owner}.{leaf}", tensor.to(dtype) if dtype is not None else tensor
            continue
        yield name, _whole(param, dtype)


def _whole(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = param.detach()
    if dtype is not None:
        tensor = tensor.to(dtype)  # a shard stays a shard: the cast happens before the gather
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

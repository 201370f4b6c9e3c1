"""Fold a LoRA adapter into its base checkpoint on the CPU, one weight at a time: the merged HF model dir.

A LoRA checkpoint holds the adapter (peft format, ``PeftModel.from_pretrained(base, adapter_dir)`` loads it) and
the trainer state, never a merged copy of the model: merging a device copy at every save doubled the model on the
GPU. ``merge_lora`` builds the plain HF model dir from the adapter and the base checkpoint's files instead:

* every base safetensors file is copied byte for byte, then each LoRA target's weight is overwritten in place
  with ``W + scale * B @ A`` (computed in fp32, written back in W's own dtype, so the merged dir keeps the source
  checkpoint's dtype and layout: the same files, keys, shapes and index). The host holds one weight and its fp32
  merge at a time, never the model;
* the base dir's other files (config, generation config, processor, tokenizer, chat template) are copied as they are;
* the result is written into a temp dir and renamed into place, so ``out`` is either complete or absent.

Names: a base checkpoint in Qwen's released layout (``model.layers.N...``) and one in transformers 5's
(``model.language_model.layers.N...``) are matched to peft's module names by dropping the leading ``model.`` and
``language_model.`` parts. Not covered (refused with a message): DoRA, per-module rank or alpha patterns,
trained biases (``bias != "none"``), ``modules_to_save``, ``fan_in_fan_out`` layers, non-safetensors checkpoints.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from vagent.training.publish import safetensors_header

__all__ = ["ADAPTER_DIR", "MergeError", "adapter_base", "merge_lora"]

ADAPTER_DIR = "adapter"  # where a LoRA checkpoint keeps its adapter (beside trainer_state.json)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


class MergeError(RuntimeError):
    """The adapter cannot be merged into the base as asked; the message says why."""


def adapter_base(adapter_dir: Path) -> Path:
    """The base checkpoint dir an adapter was trained on (``base_model_name_or_path`` of its adapter_config.json).

    Raises:
        MergeError: the adapter dir has no adapter_config.json or names no base.
    """
    config = _adapter_config(adapter_dir)
    base = config.get("base_model_name_or_path")
    if not base:
        raise MergeError(f"{adapter_dir}/adapter_config.json names no base model: pass the base dir")
    return Path(base)


def merge_lora(adapter_dir: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """Write the base checkpoint with the LoRA adapter of ``adapter_dir`` merged in, as a plain HF model dir ``out``.

    Args:
        adapter_dir: A peft LoRA adapter dir (``adapter_config.json`` + ``adapter_model.safetensors``), or a
            checkpoint dir holding one under ``adapter/``.
        out: The merged model dir to write (replaced if it exists).
        base: The base checkpoint dir; None = the one the adapter names (``adapter_base``).

    Returns:
        ``out``.

    Raises:
        MergeError: an unsupported adapter, a base without safetensors weights, or an adapter target the base lacks.
    """
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / ADAPTER_DIR).is_dir():
        adapter_dir = adapter_dir / ADAPTER_DIR
    base = Path(base) if base is not None else adapter_base(adapter_dir)
    deltas = _adapter_deltas(adapter_dir)  # base-checkpoint-free names -> (A, B, scale); small: the adapters only
    files = _weight_files(base)
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in base.iterdir():  # config, processor, tokenizer, index... and the weights, copied whole first
        if path.is_file():
            shutil.copyfile(path, tmp / path.name)
    merged = set()
    for name in files:
        merged |= _merge_file(base / name, tmp / name, deltas)
    missing = sorted(set(deltas) - merged)
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MergeError(f"{len(missing)} adapter targets have no weight in {base} (first: {missing[0]}): "
                         "is it the base the adapter was trained on?")  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _adapter_config(adapter_dir: Path) -> dict:
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise MergeError(f"{adapter_dir} holds no LoRA adapter (no adapter_config.json)")
    return json.loads(path.read_text())


def _adapter_deltas(adapter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module name without leading model./language_model.: (A (r, in), B (out, r), scale)}`` of every target."""
    from safetensors.torch import load_file

    config = _adapter_config(adapter_dir)
    for key in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise MergeError(f"{adapter_dir}: adapters with {key}={config[key]!r} are not merged by vagent (peft's "
                             "merge_and_unload on a loaded model does it)")  # fmt: skip
    if config.get("bias", "none") != "none" or config.get("peft_type", "LORA") != "LORA":
        raise MergeError(f"{adapter_dir}: only LoRA adapters without trained biases are merged")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    deltas = {}
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        deltas[_canonical(module.removeprefix("base_model.model."))] = (a, weights[f"{module}.lora_B.weight"], scale)
    if not deltas:
        raise MergeError(f"{adapter_dir}/adapter_model.safetensors holds no lora_A/lora_B weights")
    return deltas


def _canonical(name: str) -> str:
    """A module name without its leading ``model.``/``language_model.`` parts, the same in every checkpoint layout.

    >>> _canonical("model.language_model.layers.0.self_attn.q_proj"), _canonical("model.layers.0.self_attn.q_proj")
    ('layers.0.self_attn.q_proj', 'layers.0.self_attn.q_proj')
    """
    parts = name.split(".")
    while parts and parts[0] in ("model", "language_model"):
        parts = parts[1:]
    return ".".join(parts)


def _weight_files(base: Path) -> list[str]:
    """The base checkpoint's safetensors files (one, or the shards its index lists)."""
    if (base / _WEIGHTS[1]).is_file():
        return sorted(set(json.loads((base / _WEIGHTS[1]).read_text())["weight_map"].values()))
    if (base / _WEIGHTS[0]).is_file():
        return [_WEIGHTS[0]]
    raise MergeError(f"{base} has no {_WEIGHTS[0]} or {_WEIGHTS[1]}: the merge reads safetensors checkpoints only")


def _merge_file(source: Path, copy: Path, deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> set[str]:
    """Overwrite, in ``copy`` (a byte copy of the safetensors file ``source``), each LoRA target's weight with its
    merged value, one weight at a time, read from ``source`` (the header, and so every offset, stays as it is).
    Returns the canonical names merged."""
    from safetensors import safe_open

    header, data_start = safetensors_header(source)
    targets = {}
    for key in header:
        canonical = _canonical(key.removesuffix(".weight"))
        if key.endswith(".weight") and canonical in deltas:
            if canonical in targets.values():
                raise MergeError(f"{source}: two weights match the adapter target {canonical}")
            targets[key] = canonical
    if not targets:
        return set()
    with safe_open(str(source), framework="pt") as reader, open(copy, "r+b") as writer:
        for key, canonical in targets.items():
            weight = reader.get_tensor(key)  # (out, in)
            a, b, scale = deltas[canonical]
            if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise MergeError(
                    f"{key}: adapter {tuple(b.shape)} x {tuple(a.shape)} does not fit {tuple(weight.shape)}"
                )
            merged = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype).contiguous()
            start, end = header[key]["data_offsets"]
            raw = merged.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert len(raw) == end - start, key  # same shape and dtype: the same bytes
            writer.seek(data_start + start)
            writer.write(raw)
            del weight, merged, raw
    return set(targets.values())

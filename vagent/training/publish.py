"""The model a run publishes: the dtype of a model dir's weights, and a model dir re-written in another dtype.

One rule for what a run publishes (``out_dir/model``), whatever trained it (DDP, FSDP2, DeepSpeed ZeRO-2/3, LoRA): the
weights are written in the dtype of the checkpoint the run started from, read from its weight files' headers (a bf16
release comes back bf16, an fp32 checkpoint fp32). The checkpoints themselves keep fp32 master weights, so a resume
continues exactly; ``write_model_as`` turns one into the other.

The dtype is read from the safetensors headers rather than ``config.json``: released configs name it at the top
(``torch_dtype``, ``dtype``) or only inside ``text_config`` (Qwen3-VL's), and a config written by ``save_pretrained``
names the module's dtype, which under DeepSpeed's bf16 mode is not the weights'. ``config.json`` is the fallback for a
dir without safetensors files.

``write_model_as`` holds one tensor and its cast at a time (transformers 5 writes a 7B model as a single file of tens of
GB): each file is re-written by hand in the safetensors layout (an 8-byte little-endian header length, a JSON header
of dtype, shape and byte offsets per tensor, then the raw bytes), which is the whole format.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

__all__ = ["safetensors_header", "set_config_dtype", "weights_dtype", "write_model_as"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def safetensors_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header (per tensor: dtype, shape, byte offsets from the data's start; and
    ``__metadata__``) and the byte at which its data starts; nothing else is read."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def weights_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The floating-point dtype of every weight of an HF model dir (its safetensors headers; nothing is loaded), or
    config.json's (top level, then ``text_config``) when the dir has no safetensors file. None: the weights mix
    floating dtypes, or nothing names one.

    >>> weights_dtype("/nonexistent") is None
    True
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        codes = {entry["dtype"] for file in files for key, entry in safetensors_header(file)[0].items()
                 if key != "__metadata__"}  # fmt: skip
        floating = {_DTYPES[c] for c in codes if c in _DTYPES}
        return floating.pop() if len(floating) == 1 else None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for section in (config, config.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def set_config_dtype(model_dir: Path, dtype: torch.dtype) -> None:
    """Make ``model_dir/config.json`` name ``dtype`` (top level and the sub-configs that name one)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    config.pop("torch_dtype", None)
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), dict) and ("dtype" in config[sub] or "torch_dtype" in config[sub]):
            config[sub].pop("torch_dtype", None)
            config[sub]["dtype"] = name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)


def write_model_as(source: Path, out: Path, dtype: torch.dtype) -> None:
    """Copy the HF model dir ``source`` to ``out`` (which must not exist) with every floating-point weight in
    ``dtype`` and config.json saying so: the same files, keys, order and metadata; one tensor in memory at a time."""
    from safetensors import safe_open

    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    sizes: dict[str, int] = {}
    for file in sorted(source.glob("*.safetensors")):
        header, _ = safetensors_header(file)
        new, offset = {}, 0
        for key, entry in header.items():
            if key == "__metadata__":
                new[key] = entry
                continue
            code = _CODES[dtype] if entry["dtype"] in _DTYPES else entry["dtype"]
            numel = 1
            for n in entry["shape"]:
                numel *= n
            nbytes = numel * (torch.finfo(_DTYPES[code]).bits // 8 if code in _DTYPES else _itemsize(entry))
            new[key] = {"dtype": code, "shape": entry["shape"], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        sizes[file.name] = offset
        text = json.dumps(new, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with safe_open(str(file), framework="pt") as reader, open(out / file.name, "wb") as writer:
            writer.write(struct.pack("<Q", len(text)) + text)
            for key in new:
                if key == "__metadata__":
                    continue
                tensor = reader.get_tensor(key)
                if header[key]["dtype"] in _DTYPES:
                    tensor = tensor.to(dtype)
                writer.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                del tensor
    set_config_dtype(out, dtype)
    index = out / "model.safetensors.index.json"
    if index.is_file():  # its total size counts bytes, which the dtype changed
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        index.write_text(json.dumps(data, indent=2) + "\n")


_ITEMSIZES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
               "F8_E5M2": 1}  # fmt: skip


def _itemsize(entry: dict) -> int:
    """Bytes per element of a safetensors dtype this module does not cast (integers, booleans, fp8)."""
    if entry["dtype"] not in _ITEMSIZES:
        raise ValueError(f"unknown safetensors dtype {entry['dtype']!r}")
    return _ITEMSIZES[entry["dtype"]]

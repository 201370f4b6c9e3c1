"""The published model's dtype: read from the weight files, and a model dir re-written in another dtype."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from vagent.training.publish import weights_dtype, write_model_as


def test_the_dtype_is_the_weights_not_the_configs(tiny_qwen25, tmp_path):
    """The headers decide (a config written under DeepSpeed's bf16 mode names the module's dtype, not the weights'); a
    dir whose weights mix floating dtypes has none; without safetensors files config.json decides, inside
    ``text_config`` too (Qwen3-VL-8B-Instruct's config.json names its dtype only there)."""
    assert weights_dtype(tiny_qwen25) == torch.float32
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    save_file({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16), "i": torch.zeros(2, dtype=torch.int64)},
              str(mixed / "model.safetensors"))  # fmt: skip
    assert weights_dtype(mixed) is None
    (mixed / "model.safetensors").unlink()
    assert weights_dtype(mixed) == torch.bfloat16
    (mixed / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}, "vision_config": {}}))
    assert weights_dtype(mixed) == torch.bfloat16


@pytest.mark.parametrize("shard", [None, "200KB"], ids=["one file", "sharded"])
def test_a_model_dir_rewritten_in_bf16_loads_with_transformers_and_holds_the_rounded_weights(tiny_qwen25, tmp_path,
                                                                                             shard):  # fmt: skip
    source = tiny_qwen25
    if shard:  # several files and an index, whose total size must follow the dtype
        source = tmp_path / "sharded"
        AutoModelForImageTextToText.from_pretrained(tiny_qwen25).save_pretrained(source, max_shard_size=shard)
        assert len(list(source.glob("*.safetensors"))) > 1
    out = tmp_path / "bf16"
    write_model_as(source, out, torch.bfloat16)
    assert weights_dtype(out) == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    before = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    after = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k].to(torch.bfloat16)) for k in before)
    if shard:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in after.values())
        assert index["weight_map"] == json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    model = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    back = tmp_path / "fp32"
    write_model_as(out, back, torch.float32)  # bf16 -> fp32 is exact
    again = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert all(v.dtype == torch.float32 and torch.equal(v, after[k].float()) for k, v in again.items())

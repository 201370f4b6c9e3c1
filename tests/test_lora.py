"""LoRA as it is run past 7B: saves that hold the adapter (no second copy of the model), a merged model built on the
CPU from the adapter and the base, a bf16 frozen base with fp32 adapters, and no dropout where GRPO and DPO compare
log-probs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_sft import _losses, _run
from test_sft import _overrides as sft_overrides
from test_sft import rows_file as rows_file  # the fixture, shared

from vagent.cli import main as cli_main
from vagent.config import DPOConfig, GRPOConfig, ModelConfig, SFTConfig, TrainConfig, load_config
from vagent.model import load_policy
from vagent.recipes.common import load_trainable, prepare_model
from vagent.training import checkpoint as ckpt
from vagent.training.distributed import DistEnv
from vagent.training.memory import SHAPES, Setup, plan

ROOT = Path(__file__).resolve().parent.parent
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
LORA = ["train.lora.enabled=true", "train.lora.r=4"]


def _train_cfg(*overrides: str) -> TrainConfig:
    return load_config(SFTConfig, None, ["model.path=x", "data.train=x", *overrides]).train


def _lora_policy(checkpoint: Path, *overrides: str, no_dropout: bool = False):
    """The tiny checkpoint wrapped with LoRA as the recipes load it, its adapters moved off zero (as training does),
    so that the adapters change what the model computes."""
    train = _train_cfg(*LORA, *overrides)
    policy, model, _ = load_trainable(ModelConfig(path=str(checkpoint), device="cpu"), train, Path("unused"), CPU,
                                      None, seed=0, no_dropout=no_dropout)  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # lora_B starts at zero: B @ A = 0 until it trains
    return policy, model


def _ids(policy) -> torch.Tensor:
    """(1, T) a text prompt's ids: the adapters sit on the language model, which every token runs through."""
    return policy.tokenizer("Crop the red box and answer: how many cats are there?", return_tensors="pt").input_ids


# -- 1. saves that fit: the adapter alone, and a merged model built on the CPU ----------------------------------------

# Run in a fresh process so the high-water mark of this pytest process (other tests' models) does not mask the save's.
# The model is sized so that a copy of it (135 MB in fp32) stands far above the allocator's noise (a few MB).
_SAVE_PEAK = textwrap.dedent("""
    import ctypes, gc, json, re, sys
    from pathlib import Path
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from vagent.recipes.common import build_backend, save_checkpoint
    from vagent.config import OptimConfig, TrainConfig, LoraConfig
    from vagent.training.adapters import apply_lora
    from vagent.training.distributed import DistEnv

    config = AutoConfig.from_pretrained(sys.argv[1])
    text = config.text_config
    # head_dim stays the tiny checkpoint's 16 (its multimodal RoPE sections), the GQA ratio 2
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 512, 2048, 8
    text.num_attention_heads, text.num_key_value_heads = 32, 16
    text.layer_types = [text.layer_types[0]] * text.num_hidden_layers
    config.vision_config.out_hidden_size = 512
    model = AutoModelForImageTextToText.from_config(config)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    backend = build_backend(TrainConfig(lora=LoraConfig(enabled=True)), OptimConfig(), model, env, total_steps=10,
                            micro_batch_size=1, grad_accum=1, bf16=False, find_unused=False)

    def status(field):
        return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status("VmRSS")
    try:  # "5" resets the high-water mark to the current resident set (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        method, floor = "VmHWM reset before the save", before
    except OSError:  # the mark's growth: a lower bound of the save's extra memory
        method, floor = "VmHWM growth", status("VmHWM")
    save_checkpoint(backend, None, Path(sys.argv[2]), 1, {}, env, keep_last=1)
    print(json.dumps({"base_bytes": base_bytes, "extra_bytes": status("VmHWM") - floor, "method": method}))
""")


def test_a_lora_checkpoint_save_allocates_no_second_copy_of_the_base(tmp_path, tiny_qwen25):
    """The process's peak resident memory during ``save_checkpoint`` of a LoRA model stays within a small fraction of
    the base's bytes: no copy of the model is made (the save used to merge a deep copy, 1x the base more)."""
    run = subprocess.run([sys.executable, "-c", _SAVE_PEAK, str(tiny_qwen25), str(tmp_path / "checkpoints")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    print(measured)
    assert measured["base_bytes"] > 100e6  # large enough that a copy could not hide in the noise
    # today's save adds at most a few MB (the adapters, AdamW's state of them, safetensors' buffers)
    assert measured["extra_bytes"] < 0.15 * measured["base_bytes"], measured
    step = tmp_path / "checkpoints" / "step-00000001"
    assert (step / "adapter" / "adapter_model.safetensors").is_file() and not (step / "model").exists()


def test_the_saved_adapter_and_the_merged_model_give_the_trained_models_logits(tmp_path, tiny_qwen25):
    """The adapter a checkpoint holds loads with ``PeftModel.from_pretrained`` onto the base, and ``vagent merge-lora``
    writes a plain HF dir that transformers loads: both give the trained model's logits; every weight that is not a
    LoRA target is the base's, bit for bit, in the base's files, dtypes and layout."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    policy, model = _lora_policy(tiny_qwen25)
    ids = _ids(policy)
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    step = tmp_path / "step-00000002"
    ckpt.save_model(model, policy.processor, step / "model")
    assert not (step / "model").exists()  # the checkpoint holds the adapter alone

    base = load_policy(tiny_qwen25, device="cpu", dtype="float32").model
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, step / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, trained, atol=1e-5, rtol=0)

    assert cli_main(["merge-lora", str(step), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, atol=1e-5, rtol=0)
    load_policy(tmp_path / "merged", device="cpu")  # with its processor: what load_policy needs is there

    before, after = load_file(tiny_qwen25 / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert before.keys() == after.keys() and all(before[k].dtype == after[k].dtype for k in before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("proj.weight") and "visual" not in k for k in changed), sorted(changed)


@pytest.mark.slow
def test_a_killed_lora_run_resumes_from_its_adapter_checkpoint_to_the_same_losses(tmp_path, tiny_qwen25, rows_file):
    """A LoRA checkpoint (adapter + trainer state, no model) resumes exactly: killed after step 5, the run resumes
    from step 4 to the uninterrupted run's losses bit for bit on CPU, LoRA's dropout (SFT's 0.05) included."""
    args = [*LORA, "train.save_every=2"]
    whole = _run(sft_overrides(tmp_path / "whole", tiny_qwen25, rows_file, *args))
    assert whole.returncode == 0, whole.stderr[-2000:]
    run = sft_overrides(tmp_path / "run", tiny_qwen25, rows_file, *args)
    assert _run(run, ("step", 5)).returncode == -9
    assert not (tmp_path / "run" / "checkpoints" / "step-00000004" / "model").exists()
    resumed = _run(run)
    assert resumed.returncode == 0 and "at step 4" in resumed.stdout, resumed.stderr[-2000:]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "whole")
    load_policy(tmp_path / "run" / "model", device="cpu")  # merged once, at the end


def test_merge_lora_refuses_a_base_that_lacks_the_adapters_targets(tmp_path, tiny_qwen25, tiny_qwen2):
    policy, model = _lora_policy(tiny_qwen25)
    ckpt.save_model(model, policy.processor, tmp_path / "step" / "model")
    assert cli_main(["merge-lora", str(tmp_path / "step"), "--out", str(tmp_path / "m"), "--base",
                     str(tiny_qwen2)]) == 2  # fmt: skip
    assert not (tmp_path / "m").exists()


# -- 2. a bf16 frozen base with fp32 adapters -------------------------------------------------------------------------


def test_under_bf16_the_base_is_bf16_and_the_adapters_train_in_fp32(tiny_qwen25):
    """``train.precision=bf16`` with LoRA loads the frozen base in bf16 (no fp32 copy to re-cast at every forward) and
    keeps every trainable parameter in fp32 (AdamW's small steps would round away in bf16); a step trains."""
    train = _train_cfg(*LORA, "train.precision=bf16")
    policy, model, _ = load_trainable(ModelConfig(path=str(tiny_qwen25), device="cpu"), train, Path("unused"), CPU,
                                      None, seed=0)  # fmt: skip
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen.values())
    assert policy.dtype == torch.bfloat16  # what the generation path (HF backend, vLLM's weights) reads
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = _ids(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in trainable.items() if "lora_A" in n)


def test_under_fsdp_the_bf16_base_and_fp32_adapters_are_sharded_and_a_bf16_step_trains_the_adapters(tiny_qwen25):
    """``train.sharding=fsdp`` with LoRA under bf16 (torchtune's layout): the model is built on the meta device and
    wrapped before sharding; every base weight is a bf16 shard loaded from the checkpoint, every adapter an fp32 shard
    (``lora_B`` zero, ``lora_A`` as the unsharded path starts it); a step under FSDP's bf16 policy moves the adapters."""
    from torch.distributed.tensor import DTensor

    from vagent.recipes.common import build_backend
    from vagent.training.adapters import lora_init
    from vagent.training.distributed import shutdown

    cfg = load_config(SFTConfig, None, ["model.path=x", "data.train=x", *LORA, "train.precision=bf16",
                                        "train.sharding=fsdp"])  # fmt: skip
    try:
        policy, model, _ = load_trainable(ModelConfig(path=str(tiny_qwen25), device="cpu"), cfg.train,
                                          Path("unused"), CPU, None, seed=3)  # fmt: skip
        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
        assert all(p.dtype == torch.bfloat16 for n, p in params.items() if n not in trainable)
        start = load_policy(tiny_qwen25, device="cpu", dtype="bfloat16").model.state_dict()
        name = next(n for n in params if n.endswith("q_proj.base_layer.weight"))
        assert torch.equal(params[name].full_tensor(), start[name.removeprefix("base_model.model.").replace(
            ".base_layer.", ".")])  # fmt: skip
        lora_a = next(n for n in trainable if "lora_A" in n)
        assert torch.equal(trainable[lora_a].full_tensor(), lora_init(lora_a, tuple(trainable[lora_a].shape), 3))
        backend = build_backend(cfg.train, cfg.optim, model, CPU, total_steps=2, micro_batch_size=1, grad_accum=1,
                                bf16=True, find_unused=False)  # fmt: skip
        before = {n: p.full_tensor().clone() for n, p in trainable.items()}
        ids = _ids(policy)
        backend.backward(backend.module(input_ids=ids, labels=ids).loss)
        backend.step()
        assert all(not torch.equal(before[n], p.full_tensor()) for n, p in trainable.items() if "lora_B" in n)
    finally:
        shutdown()


def test_the_memory_plan_counts_a_bf16_base_under_lora():
    """``vagent memory``: under bf16 LoRA's base is 2 bytes a parameter, its adapters 4 (+ 2 for autocast's copy)."""
    shape = SHAPES["qwen2.5-vl-7b"]
    lora = plan(shape, Setup(stage="sft", lora_rank=64, bf16=True))
    weights = dict((name, value) for name, value, _ in lora.lines)["parameters"]
    full = plan(shape, Setup(stage="sft", lora_rank=64, bf16=False))
    fp32 = dict((name, value) for name, value, _ in full.lines)["parameters"]
    base = shape.params()
    adapters = fp32 / 4 - base
    assert weights == pytest.approx(2 * base + 6 * adapters)
    assert lora.peak < full.peak


# -- 3. no dropout where log-probs are compared ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_attention_dropout(tmp_path_factory, tiny_qwen25):
    """The tiny checkpoint with attention dropout 0.1 in its language model (Qwen's own checkpoints say 0.0)."""
    out = tmp_path_factory.mktemp("ckpt") / "dropout"
    shutil.copytree(tiny_qwen25, out)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("text_config", {})["attention_dropout"] = 0.1
    config["attention_dropout"] = 0.1
    (out / "config.json").write_text(json.dumps(config))
    return out


def _two_train_mode_passes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    with torch.no_grad():
        return tuple(torch.log_softmax(model(input_ids=ids).logits, -1) for _ in range(2))


def test_grpo_and_dpo_score_the_same_tokens_alike_in_train_mode(with_attention_dropout):
    """As GRPO and DPO load the policy (the default LoRA config, attention dropout in the checkpoint), two train-mode
    passes give the same log-probs; as SFT loads it, dropout stays as configured (LoRA's 0.05 by default)."""
    policy, model = _lora_policy(with_attention_dropout, no_dropout=True)
    first, second = _two_train_mode_passes(model, _ids(policy))
    assert torch.equal(first, second)
    assert not any(m.p for m in model.modules() if isinstance(m, torch.nn.Dropout))

    policy, model = _lora_policy(with_attention_dropout)  # SFT: dropout as asked
    first, second = _two_train_mode_passes(model, _ids(policy))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_the_rl_recipes_load_without_dropout(stage, monkeypatch, tmp_path):
    """GRPO and DPO ask ``load_trainable`` for a dropout-free model (the call is the recipe's; the model is stubbed)."""
    from vagent.recipes import dpo, grpo

    recipe = {"grpo": grpo, "dpo": dpo}[stage]
    seen = {}

    def stub(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(recipe, "load_trainable", stub)
    config = {"grpo": "qwen2_5_vl_tiny_cpu.yaml", "dpo": "qwen2_5_vl_tiny_cpu.yaml"}[stage]
    cls = {"grpo": GRPOConfig, "dpo": DPOConfig}[stage]
    cfg = load_config(cls, ROOT / "configs" / stage / config, ["model.path=x", "data.train=x", f"out_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="stop here"):
        recipe.train(cfg)
    assert seen.get("no_dropout") is True


@pytest.mark.parametrize("cls", [GRPOConfig, DPOConfig])
def test_a_grpo_or_dpo_config_that_asks_for_dropout_is_refused_naming_the_key(cls):
    args = ["model.path=x", "data.train=x", *LORA]
    load_config(cls, None, args)  # unset: no dropout
    load_config(cls, None, [*args, "train.lora.dropout=0"])
    with pytest.raises(ValueError, match=r"train\.lora\.dropout=0\.05: ") as error:
        load_config(cls, None, [*args, "train.lora.dropout=0.05"])
    assert "\n" not in str(error.value)
    load_config(SFTConfig, None, [*args, "train.lora.dropout=0.05"])  # SFT keeps what it asks


def test_sft_keeps_loras_dropout_by_default(tiny_qwen25):
    policy = load_policy(tiny_qwen25, device="cpu")
    model = prepare_model(_train_cfg(*LORA), policy, None, CPU, 0)
    assert {m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n} == {0.05}


@pytest.mark.gpu
def test_on_cuda_a_lora_save_allocates_no_device_memory(tmp_path, tiny_qwen25):
    """The GPU side of the save test above: ``torch.cuda.max_memory_allocated`` over the save of a LoRA model on CUDA
    stays within a small fraction of the base's bytes (the merged deep copy used to add all of them)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vagent.training.adapters import apply_lora

    config = AutoConfig.from_pretrained(tiny_qwen25)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 1024, 4096, 8  # head_dim 16 as the tiny one
    text.num_attention_heads, text.num_key_value_heads = 64, 32
    text.layer_types = [text.layer_types[0]] * text.num_hidden_layers
    config.vision_config.out_hidden_size = 1024
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ckpt.save_model(model, None, tmp_path / "step" / "model")
    extra = torch.cuda.max_memory_allocated() - before
    assert base_bytes > 400e6 and extra < 0.05 * base_bytes, (extra, base_bytes)
    assert (tmp_path / "step" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_lora_target_that_is_not_a_linear_layer_is_refused_naming_it(tiny_qwen25):
    """peft would adapt an embedding too (``lora_embedding_A/B``), which the FSDP loader, the CPU merge and the weight
    sync do not handle: refused at wrap time, with the layer type named."""
    from vagent.training.adapters import apply_lora

    model = load_policy(tiny_qwen25, device="cpu").model
    with pytest.raises(ValueError, match=r"\['Embedding'\] layers: vagent's LoRA adapts linear layers only"):
        apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "embed_tokens"])


def test_under_fsdp_a_tied_head_stays_tied_with_lora_and_the_generation_copy_gets_the_merged_weights(like_3b):
    """Qwen2.5-VL-3B's layout (a head tied to the input embedding) with LoRA under FSDP2: the head is still the
    embedding after loading into shards, and the generation copy gets it tied and each adapted layer merged (at the
    start, B = 0: the base's own weights)."""
    from vagent.training.distributed import shutdown
    from vagent.training.fsdp import InferenceCopy

    cfg = load_config(SFTConfig, None, ["model.path=x", "data.train=x", *LORA, "train.sharding=fsdp"])
    try:
        _, model, _ = load_trainable(ModelConfig(path=str(like_3b), device="cpu"), cfg.train, Path("unused"), CPU,
                                     None, seed=0)  # fmt: skip
        base = model.get_base_model()
        assert base.lm_head.weight is base.model.language_model.embed_tokens.weight
        copy = InferenceCopy(model, torch.float32).refresh(model)
        assert copy.lm_head.weight.data_ptr() == copy.model.language_model.embed_tokens.weight.data_ptr()
        start = load_policy(like_3b, device="cpu", dtype="float32").model.state_dict()
        assert all(torch.equal(value, start[name]) for name, value in copy.state_dict().items())
    finally:
        shutdown()

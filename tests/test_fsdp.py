"""train.sharding=fsdp: config errors, FSDP2 on CPU/gloo in one process (bf16 mixed precision, text-only batches,
the inference copy), and 2-rank runs launched with torchrun (the same losses as one unsharded rank, a SIGKILLed run
resuming to the same losses, a consolidated model/ that transformers loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_pipelines.synthetic.zoom import zoom_rows
from vagent.algorithms import token_nll_sum, trained_token_count
from vagent.config import ConfigError, GRPOConfig, SFTConfig, load_config
from vagent.data import write_rows
from vagent.data.batching import collate
from vagent.data.encode import encode_messages
from vagent.model import load_policy, policy_logits
from vagent.training.data import gold_conversation
from vagent.training.distributed import DistEnv, shutdown
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SFT_CONFIG = ROOT / "configs" / "sft" / "qwen2_5_vl_tiny_cpu.yaml"
GRPO_CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
SIZE = (448, 336)  # small images keep a step ~0.1 s; the tile stays 28 px (as in test_sft)


# -- bad configurations: one line, before any model loads ----------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "config", "overrides", "message"),
    [
        (SFTConfig, SFT_CONFIG, ["train.sharding=fsdp", "train.deepspeed=configs/deepspeed/zero2.json"], "pick one"),
        (GRPOConfig, GRPO_CONFIG, ["train.deepspeed=configs/deepspeed/zero3.json"], "train.sharding=fsdp"),
        (SFTConfig, SFT_CONFIG, ["train.sharding=zero"], "ddp"),
    ],
    ids=["fsdp+deepspeed", "grpo+deepspeed", "unknown"],
)
def test_an_unsupported_sharding_is_one_clear_error(cls, config, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(cls, config, overrides)
    assert "\n" not in str(info.value)


# -- one process: FSDP2 over a gloo group of one ---------------------------------------------------------------


@pytest.fixture()
def sharded(tiny_qwen25):
    """A fresh tiny policy sharded with the bf16 mixed-precision policy, and a text+image batch and a text-only
    batch; the process group of one is destroyed afterwards."""
    from vagent.training.fsdp import InferenceCopy, shard_model

    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    reference = {k: v.clone() for k, v in policy.model.state_dict().items()}
    copy = InferenceCopy(policy.model, torch.float32)
    shard_model(policy.model, env, bf16=True)
    yield policy, env, copy, reference
    shutdown()


def _batch(policy, tmp_path, images: bool) -> dict[str, torch.Tensor]:
    min_pixels, max_pixels = policy.pixel_budget
    budget = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    rows = zoom_rows(tmp_path, 2, seed=0, size=SIZE, clutter=5, **budget)
    encoded = []
    for row in rows:
        messages = gold_conversation(row, ["crop"])
        if not images:  # the same turns, text only
            for m in messages:
                m.content = [p for p in m.content if p.type == "text"]
        encoded.append(encode_messages(messages, policy.processor, **budget))
    return collate(encoded, policy.tokenizer.pad_token_id or 0)


def test_bf16_mixed_precision_trains_on_cpu_gloo_and_text_only_batches_still_run_the_vision_tower(sharded, tmp_path):
    """gloo on CPU runs FSDP2 with param_dtype=bf16 / reduce_dtype=fp32 (torch 2.14). A text-only batch runs the
    vision tower on the dummy image, so its blocks gather and get (zero) gradients like on a rank with images."""
    from torch.distributed.tensor import DTensor

    from vagent.training.backend import build_optimizer
    from vagent.training.fsdp import FSDPBackend

    policy, env, _, _ = sharded
    model = policy.model
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    backend = FSDPBackend(model, env, optimizer=optimizer, scheduler=scheduler, max_grad_norm=1.0)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())  # fp32 shards
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for images in (True, False):
        batch = _batch(policy, tmp_path, images)
        logits = policy_logits(backend.module, batch)
        assert logits.dtype == torch.bfloat16  # computed in bf16
        loss = token_nll_sum(logits, batch["input_ids"], batch["loss_mask"]) / batch["loss_mask"].sum()
        backend.backward(loss)
        vision = [p for n, p in model.named_parameters() if ".visual.blocks." in n]
        assert vision and all(p.grad is not None for p in vision), f"images={images}"
        if not images:
            assert all(float(p.grad.full_tensor().abs().max()) == 0.0 for p in vision)
        norm = backend.step()
        assert torch.isfinite(torch.tensor(norm)) and norm > 0
        assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())  # fp32 AdamW state
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    assert len(changed) > 0.5 * len(before)


@pytest.mark.parametrize("rank", [0, 1])
def test_sft_eval_runs_as_many_forwards_on_every_rank(monkeypatch, rank):
    """3 val micro-batches over 2 ranks: both ranks run 2 forwards (FSDP gathers weights in lockstep, so a rank that
    skipped one would hang the other); rank 1's second is a repeat that counts nothing."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from vagent.recipes import sft

    forwards = []

    def nll_sum(module, batch, train):
        forwards.append(int(batch["loss_mask"].sum()))
        return torch.tensor(float(batch["loss_mask"].sum()))

    monkeypatch.setattr(sft, "_nll_sum", nll_sum)
    batches = [{"loss_mask": torch.ones(1, k)} for k in (3, 5, 7)]
    val_set = type("Val", (), {"batches_per_epoch": 3, "__getitem__": lambda self, i: batches[i]})()
    backend = SimpleNamespace(module=torch.nn.Linear(1, 1), accumulating=lambda last: nullcontext())
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    loss = sft._eval_loss(backend, val_set, env, train=None)
    assert forwards == ([3, 7] if rank == 0 else [5, 7])
    counted = [batches[0], batches[2]] if rank == 0 else [batches[1]]  # rank 1's repeat of batch 2 is not counted
    nll, tokens = (sum(float(b["loss_mask"].sum()) for b in counted),
                   sum(int(trained_token_count(b["loss_mask"])) for b in counted))  # fmt: skip
    assert loss == pytest.approx(nll / tokens)  # one process: no all-reduce


def test_the_inference_copy_holds_the_whole_current_weights(sharded):
    policy, _, copy, reference = sharded
    with torch.no_grad():
        for p in policy.model.parameters():  # move the shards off the loaded weights
            p.add_(0.5)
    model = copy.refresh(policy.model)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    for name, value in model.state_dict().items():
        expected = reference[name] + 0.5 if name in dict(model.named_parameters()) else reference[name]
        assert torch.equal(value, expected), name


def _with_released_key_names(checkpoint: Path, out: Path) -> Path:
    """A copy of ``checkpoint`` whose weights carry the names the released Qwen2.5-VL checkpoints use (``model.layers.*``,
    ``visual.*``; transformers 5 renames them to ``model.language_model.*`` and ``model.visual.*`` on load)."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    renamed = {re.sub(r"^model\.visual\.", "visual.", re.sub(r"^model\.language_model\.", "model.", k)): v
               for k, v in weights.items()}  # fmt: skip
    assert "visual.merger.mlp.0.weight" in renamed and "model.layers.0.mlp.up_proj.weight" in renamed
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", ["tiny_qwen25", "like_3b", "released_key_names"])
def test_loading_into_shards_from_the_meta_device_gives_load_policys_model_exactly(request, name, tmp_path):
    """load_sharded (built on the meta device, rank 0's checkpoint broadcast into the shards) against load_policy: the
    same full state dict, the same buffers (the RoPE inverse frequencies no checkpoint holds, rebuilt after to_empty),
    the tie of like_3b's head, the same logits on an image batch, bit for bit, also from a checkpoint with the released
    models' key names; and the inference copy built from the sharded model (its HF class under FSDP's) holds the same
    weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    from vagent.training.fsdp import InferenceCopy, load_sharded

    if name == "released_key_names":
        path = _with_released_key_names(request.getfixturevalue("tiny_qwen25"), tmp_path / "released")
    else:
        path = request.getfixturevalue(name)
    plain = load_policy(path, device="cpu", dtype="float32")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        policy = load_sharded(path, env, bf16=False)
        model = policy.model
        assert isinstance(model, FSDPModule) and not model.training
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        expected = plain.model.state_dict()
        assert full.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(full[key], value), key
        buffers = dict(model.named_buffers())
        assert buffers.keys() == dict(plain.model.named_buffers()).keys() and any("inv_freq" in k for k in buffers)
        for key, value in plain.model.named_buffers():
            assert torch.equal(buffers[key], value), key
        tied = plain.model.config.tie_word_embeddings
        assert tied == (name == "like_3b")
        assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tied
        assert model.generation_config.to_dict() == plain.model.generation_config.to_dict()
        batch = _batch(plain, tmp_path, images=True)
        with torch.no_grad():  # one forward each (a sharded model never runs a shared prefix apart)
            logits = [policy_logits(m, batch, share_prefix=False) for m in (model, plain.model)]
        assert torch.equal(*logits)
        copy = InferenceCopy(model, torch.float32).refresh(model)
        for key, value in plain.model.state_dict().items():
            assert torch.equal(copy.state_dict()[key], value), key
    finally:
        shutdown()


def test_the_meta_model_is_frozen_and_checkpointed_as_configured_before_it_is_sharded(tiny_qwen25, tmp_path):
    """The 3B/7B configs freeze the vision tower and checkpoint activations: load_trainable hands that preparation to
    load_sharded, which runs it on the meta model; a step then trains the merger and never the frozen tower."""
    from vagent.config import TrainConfig
    from vagent.recipes.common import freeze_and_checkpoint
    from vagent.training.fsdp import load_sharded

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cfg = TrainConfig(freeze_vision=True, gradient_checkpointing=True, sharding="fsdp")
    try:
        model = load_sharded(tiny_qwen25, env, bf16=False, prepare=lambda m: freeze_and_checkpoint(cfg, m, env)).model
        replays = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.23; the old name warns
        assert replays if replays is not None else model.is_gradient_checkpointing
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen and all(".visual." in f".{n}" and ".merger." not in n for n in frozen)
        model.train()
        plain = load_policy(tiny_qwen25, device="cpu", dtype="float32")
        batch = _batch(plain, tmp_path, images=True)
        loss = token_nll_sum(policy_logits(model, batch), batch["input_ids"], batch["loss_mask"])
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(grads[n] is None for n in frozen)
        assert all(grads[n] is not None for n in grads if ".merger." in n)
    finally:
        shutdown()


def test_a_non_persistent_buffer_that_nothing_rebuilds_is_an_error(tiny_qwen25, monkeypatch):
    """to_empty leaves the RoPE inverse frequencies uninitialized; if the model's init did not recompute them, every
    forward would rotate by garbage: load_sharded refuses instead."""
    from transformers import PreTrainedModel

    from vagent.training.fsdp import load_sharded

    monkeypatch.setattr(PreTrainedModel, "_init_weights", lambda self, module: None)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        with pytest.raises(RuntimeError, match="inv_freq"):
            load_sharded(tiny_qwen25, env, bf16=False)
    finally:
        shutdown()


# -- two ranks under torchrun --------------------------------------------------------------------------------

# The recipes run in child processes. Fault injection lives here, not in the library: "checkpoint N" SIGKILLs
# every rank after all files of checkpoint N are in its temp dir, before it is committed. For GRPO, "even" adds
# the toy reward of test_grpo (the share of even sampled ids: it spreads within every group of a random model)
# and rolls out each prompt under its own seed, so a prompt's samples do not depend on which rank or which
# batch it lands in (then one rank and two ranks roll out the same samples).
CHILD = """
import os, signal, sys, zlib
import torch
from vagent.training import checkpoint
stage, fault, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
if fault == "checkpoint":
    commit = checkpoint.commit_checkpoint
    def killing_commit(root, tmp, step, *args, **kwargs):
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(root, tmp, step, *args, **kwargs)
    checkpoint.commit_checkpoint = killing_commit
if stage == "grpo":
    import vagent.rewards as rewards
    from vagent.recipes import grpo
    def even_tokens(trajectories, rows):
        out = []
        for t in trajectories:
            ids = [i for m in t.messages if m.role == "assistant" for i, s in zip(m.token_ids, m.sampled) if s]
            out.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
        return out
    rewards.REWARDS["even_tokens"] = even_tokens
    rollout = grpo.run
    def seeded(policy, tasks, n_samples, limits, **kwargs):
        out = []
        for task in tasks:
            torch.manual_seed(zlib.crc32(task.id.encode()))
            out += rollout(policy, [task], n_samples, limits, **kwargs)
        return out
    grpo.run = seeded
    grpo.main(sys.argv[4:])
else:
    from vagent.recipes import sft
    sft.main(sys.argv[4:])
"""


def _launch(tmp_path: Path, stage: str, ranks: int, args: list[str], fault: tuple[str, int] = ("none", 0)):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), str(script), stage, fault[0], str(fault[1]), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)


def _records(out_dir: Path) -> list[dict]:
    return read_metrics(out_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def sft_rows(tmp_path_factory, policy):
    out = tmp_path_factory.mktemp("fsdp-data")
    min_pixels, max_pixels = policy.pixel_budget
    budget = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    write_rows(zoom_rows(out, 8, seed=0, size=SIZE, clutter=20, **budget), out / "train.jsonl")
    # 5 val rows = 3 micro-batches: rank 1 has one forward less and repeats one to stay in lockstep
    write_rows(zoom_rows(out, 5, seed=1, size=SIZE, clutter=20, **budget), out / "val.jsonl")
    return out / "train.jsonl"


def _sft_args(out_dir, model, rows, *extra):
    return ["--config", str(SFT_CONFIG), f"out_dir={out_dir}", f"model.path={model}", f"data.train={rows}",
            f"data.val={rows.with_name('val.jsonl')}", "data.micro_batch_size=2", "optim.lr=2e-3",
            "train.max_steps=6", "train.save_every=2", "train.eval_every=0", "train.tensorboard=false", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tiny_qwen25, sft_rows):
    """One unsharded rank with 2 micro-batches a step, and 2 FSDP ranks with 1 each: the same global batches."""
    one, two = tmp_path_factory.mktemp("sft-one"), tmp_path_factory.mktemp("sft-fsdp")
    result = _launch(one, "sft", 1, _sft_args(one, tiny_qwen25, sft_rows, "optim.grad_accum=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _launch(two, "sft", 2, _sft_args(two, tiny_qwen25, sft_rows, "optim.grad_accum=1", "train.sharding=fsdp"))
    assert result.returncode == 0, result.stderr[-3000:]
    return one, two


def _curve(out_dir: Path, key: str) -> list[float]:
    return [r[key] for r in _records(out_dir) if key in r]


@pytest.mark.slow
def test_two_fsdp_ranks_give_the_sft_losses_of_one_rank(sft_runs):
    one, two = sft_runs
    assert len(_curve(one, "loss")) == 6
    for key in ("loss", "grad_norm", "eval_loss"):  # eval: 3 val micro-batches over 2 ranks
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-5, abs=1e-6), key
    # the optimizer went to torch.distributed.checkpoint shards, the schedule beside them
    checkpoint = two / "checkpoints" / "step-00000006"
    assert (checkpoint / "optimizer" / ".metadata").is_file() and (checkpoint / "scheduler.pt").is_file()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_the_consolidated_model_loads_with_transformers_and_gives_the_trained_logits(sft_runs, tiny_qwen25, tmp_path):
    """model/ of the FSDP run is a plain HF dir; its logits are those of the same training run unsharded."""
    from transformers import AutoModelForImageTextToText

    one, two = sft_runs
    sharded = AutoModelForImageTextToText.from_pretrained(two / "model", dtype=torch.float32).eval()
    plain = AutoModelForImageTextToText.from_pretrained(one / "model", dtype=torch.float32).eval()
    start = AutoModelForImageTextToText.from_pretrained(tiny_qwen25, dtype=torch.float32).eval()
    batch = _batch(load_policy(two / "model", device="cpu"), tmp_path, images=True)
    with torch.no_grad():
        logits = [policy_logits(m, batch) for m in (sharded, plain, start)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    assert not torch.allclose(logits[0], logits[2], atol=1e-2)  # it trained


@pytest.mark.slow
def test_a_sigkilled_fsdp_run_resumes_to_the_same_losses(sft_runs, tiny_qwen25, sft_rows, tmp_path):
    _, two = sft_runs
    args = _sft_args(tmp_path, tiny_qwen25, sft_rows, "optim.grad_accum=1", "train.sharding=fsdp")
    killed = _launch(tmp_path, "sft", 2, args, fault=("checkpoint", 4))
    assert killed.returncode != 0
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / ".tmp-step-00000004" / "optimizer").is_dir()  # the shards were written, not committed
    assert not (checkpoints / "step-00000004").exists()
    resumed = _launch(tmp_path, "sft", 2, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert _curve(tmp_path, "loss") == _curve(two, "loss")  # bit for bit on CPU
    assert not list(checkpoints.glob(".tmp-*"))


LORA = ("train.lora.enabled=true", "train.lora.dropout=0")  # no dropout: its masks differ between 1 and 2 ranks


@pytest.fixture(scope="module")
def lora_sft_runs(tmp_path_factory, tiny_qwen25, sft_rows):
    """LoRA: one unsharded rank (DDP's path) with 2 micro-batches a step, and 2 FSDP ranks with 1 each."""
    one, two = tmp_path_factory.mktemp("lora-one"), tmp_path_factory.mktemp("lora-fsdp")
    result = _launch(one, "sft", 1, _sft_args(one, tiny_qwen25, sft_rows, "optim.grad_accum=2", "optim.lr=2e-2", *LORA))
    assert result.returncode == 0, result.stderr[-3000:]
    args = _sft_args(two, tiny_qwen25, sft_rows, "optim.grad_accum=1", "optim.lr=2e-2", "train.sharding=fsdp", *LORA)
    result = _launch(two, "sft", 2, args)
    assert result.returncode == 0, result.stderr[-3000:]
    return one, two


@pytest.mark.slow
def test_lora_under_fsdp_trains_as_one_unsharded_rank_and_saves_the_adapter_alone(lora_sft_runs, tiny_qwen25,
                                                                                 tmp_path):  # fmt: skip
    """The adapters start from the same values sharded or not (lora_init), so the losses agree; a checkpoint holds the
    gathered adapter (peft's format) and no model; the final model/ is the merge, and both give the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    one, two = lora_sft_runs
    for key in ("loss", "grad_norm"):
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-5, abs=1e-6), key
    checkpoint = two / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["adapter", "optimizer", "rng", "scheduler.pt",
                                                           "trainer_state.json"]  # fmt: skip
    load = AutoModelForImageTextToText.from_pretrained
    merged = [load(out / "model", dtype=torch.float32).eval() for out in (one, two)]
    adapted = PeftModel.from_pretrained(load(tiny_qwen25, dtype=torch.float32), checkpoint / "adapter").eval()
    start = load(tiny_qwen25, dtype=torch.float32).eval()
    batch = _batch(load_policy(two / "model", device="cpu"), tmp_path, images=True)
    with torch.no_grad():
        logits = [policy_logits(m, batch) for m in (*merged, adapted, start)]
    assert torch.allclose(logits[1], logits[0], atol=1e-4) and torch.allclose(logits[2], logits[1], atol=1e-4)
    assert not torch.allclose(logits[1], logits[3], atol=1e-3)  # it trained


@pytest.mark.slow
def test_a_sigkilled_lora_fsdp_run_resumes_from_its_adapter_to_the_same_losses(lora_sft_runs, tiny_qwen25, sft_rows,
                                                                              tmp_path):  # fmt: skip
    _, two = lora_sft_runs
    args = _sft_args(tmp_path, tiny_qwen25, sft_rows, "optim.grad_accum=1", "optim.lr=2e-2", "train.sharding=fsdp",
                     *LORA)  # fmt: skip
    killed = _launch(tmp_path, "sft", 2, args, fault=("checkpoint", 4))
    assert killed.returncode != 0 and not (tmp_path / "checkpoints" / "step-00000004").exists()
    resumed = _launch(tmp_path, "sft", 2, args)
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stderr[-3000:]
    assert _curve(tmp_path, "loss") == _curve(two, "loss")  # bit for bit on CPU


@pytest.mark.slow
def test_lora_grpo_under_fsdp_samples_from_the_merged_weights_and_matches_one_rank(tiny_qwen25, zoom_rows_file,
                                                                                  tmp_path):  # fmt: skip
    """The inference copy gets each adapted layer's merged weight from the gathered factors; the KL reference is the
    policy with its adapters off. Rewards, losses and KL agree with one unsharded rank, the sampler's log-probs with
    the trained model's."""
    rows = zoom_rows_file(16, 1000)
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("grpo.kl_coef=0.05", "train.lora.enabled=true")
    result = _launch(tmp_path, "grpo", 1, _grpo_args(one, tiny_qwen25, rows, 4, *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _launch(tmp_path, "grpo", 2, _grpo_args(two, tiny_qwen25, rows, 2, "train.sharding=fsdp", *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    assert _curve(one, "kl")[-1] > 1e-4  # the adapters moved the policy off its reference
    for key in (*GRPO_KEYS, "kl"):
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-4, abs=1e-6), key
    assert max(_curve(two, "sampler_logprob_gap")) < 1e-5
    assert (two / "checkpoints" / "step-00000003" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [(), LORA], ids=["full", "lora"])
def test_a_sigkilled_qwen3_vl_fsdp_run_resumes_to_the_same_losses(like_qwen3_8b, tmp_path, lora):
    """configs/sft/qwen3_vl_8b_fsdp.yaml's structure (Qwen3-VL in miniature: DeepStack, its 32-pixel grid and 0-1000
    boxes, Qwen's vocabulary) under FSDP on 2 ranks, full fine-tuning and LoRA: killed at a checkpoint, resumed to
    the uninterrupted run's losses bit for bit."""
    frame = load_policy(like_qwen3_8b, device="cpu").frame
    data = tmp_path / "data"
    write_rows(zoom_rows(data, 8, seed=0, size=SIZE, clutter=20, **frame), data / "train.jsonl")
    write_rows(zoom_rows(data, 2, seed=1, size=SIZE, clutter=20, **frame), data / "val.jsonl")
    args = lambda out: _sft_args(out, like_qwen3_8b, data / "train.jsonl", "optim.grad_accum=1",  # noqa: E731
                                 "train.sharding=fsdp", *lora)  # fmt: skip
    full, resumed = _kill_and_resume(tmp_path, "sft", args, at=4, resumes_at=2)
    assert len(_curve(full, "loss")) == 6 and _curve(resumed, "loss") == _curve(full, "loss")


def _kill_and_resume(tmp_path: Path, stage: str, args, at: int, resumes_at: int) -> tuple[Path, Path]:
    """Run ``stage`` on 2 ranks whole (``tmp_path/full``), then killed as checkpoint ``at`` is written and resumed
    from checkpoint ``resumes_at`` (``tmp_path/killed``); ``args(out_dir)`` is the command line. Returns the two out
    dirs."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    result = _launch(tmp_path, stage, 2, args(full))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _launch(tmp_path, stage, 2, args(killed), fault=("checkpoint", at))
    assert result.returncode != 0 and not (killed / "checkpoints" / f"step-{at:08d}").exists()
    result = _launch(tmp_path, stage, 2, args(killed))
    assert result.returncode == 0 and f"at step {resumes_at}" in result.stdout, result.stderr[-3000:]
    return full, killed


def _grpo_args(out_dir, model, rows, prompts_per_step, *extra):
    return ["--config", str(GRPO_CONFIG), f"out_dir={out_dir}", f"model.path={model}", "train.max_steps=3",
            "train.save_every=1", "train.tensorboard=false", f"data.train={rows}", "rollout.max_turns=1",
            "rollout.max_new_tokens=6", "grpo.group_size=4", f"grpo.prompts_per_step={prompts_per_step}",
            "grpo.micro_batch_size=2", "grpo.inner_updates=2", "grpo.dynamic_sampling=false", "optim.lr=3e-2",
            "rewards.weights={even_tokens: 1.0}", "rewards.options={}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, tiny_qwen25, zoom_rows_file):
    """One rank rolls out 4 prompts a step, two FSDP ranks 2 each: the same prompts and (seeded per prompt) the same
    samples."""
    one, two = tmp_path_factory.mktemp("grpo-one"), tmp_path_factory.mktemp("grpo-fsdp")
    result = _launch(one, "grpo", 1, _grpo_args(one, tiny_qwen25, zoom_rows_file(16, 1000), 4))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _launch(two, "grpo", 2, _grpo_args(two, tiny_qwen25, zoom_rows_file(16, 1000), 2, "train.sharding=fsdp"))
    assert result.returncode == 0, result.stderr[-3000:]
    return one, two


GRPO_KEYS = ("reward", "response_len", "loss", "grad_norm", "entropy", "approx_kl", "sampler_logprob_gap")


@pytest.mark.slow
def test_two_fsdp_ranks_give_the_grpo_losses_of_one_rank(grpo_runs):
    """The rewards, the losses and the later steps' samples (drawn from the updated weights) agree."""
    one, two = grpo_runs
    for key in GRPO_KEYS:
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-4, abs=1e-6), key
    assert len(_curve(one, "loss")) == 3 and _curve(one, "reward")[0] != _curve(one, "reward")[-1]
    assert max(_curve(two, "sampler_logprob_gap")) < 1e-5  # the gathered copy samples with the trained weights


@pytest.mark.slow
def test_the_kl_reference_loaded_into_shards_gives_the_kl_of_one_rank(tiny_qwen25, zoom_rows_file, tmp_path):
    """grpo.kl_coef > 0 under FSDP: the frozen reference is built on the meta device and loaded into shards like the
    policy (load_sharded); its KL and the losses it enters are those of one unsharded rank."""
    rows = zoom_rows_file(16, 1000)
    one, two = tmp_path / "one", tmp_path / "two"
    result = _launch(tmp_path, "grpo", 1, _grpo_args(one, tiny_qwen25, rows, 4, "grpo.kl_coef=0.05"))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _launch(
        tmp_path, "grpo", 2, _grpo_args(two, tiny_qwen25, rows, 2, "train.sharding=fsdp", "grpo.kl_coef=0.05")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(_curve(one, "kl")) > 0.01  # the policy moved away from the reference
    for key in ("kl", "loss", "grad_norm", "reward"):
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_a_sigkilled_fsdp_grpo_run_resumes_to_the_same_rewards_and_losses(
    grpo_runs, tiny_qwen25, zoom_rows_file, tmp_path
):
    _, two = grpo_runs
    args = _grpo_args(tmp_path, tiny_qwen25, zoom_rows_file(16, 1000), 2, "train.sharding=fsdp")
    killed = _launch(tmp_path, "grpo", 2, args, fault=("checkpoint", 2))
    assert killed.returncode != 0 and not (tmp_path / "checkpoints" / "step-00000002").exists()
    resumed = _launch(tmp_path, "grpo", 2, args)
    assert resumed.returncode == 0 and "at step 1" in resumed.stdout, resumed.stderr[-3000:]
    for key in GRPO_KEYS:
        assert _curve(tmp_path, key) == _curve(two, key), key  # bit for bit on CPU


@pytest.mark.slow
def test_a_sigkilled_lora_fsdp_grpo_run_resumes_from_its_adapter_to_the_same_rewards_and_losses(
    tiny_qwen25, zoom_rows_file, tmp_path
):
    """configs/grpo/qwen2_5_vl_7b_lora_fsdp.yaml's structure: the adapter checkpoint and the sharded optimizer are all a
    resume has; the resumed run samples from the same merged weights and trains to the same numbers."""
    rows = zoom_rows_file(16, 1000)
    args = lambda out: _grpo_args(out, tiny_qwen25, rows, 2, "train.sharding=fsdp", "train.lora.enabled=true")  # noqa: E731
    full, resumed = _kill_and_resume(tmp_path, "grpo", args, at=2, resumes_at=1)
    for key in GRPO_KEYS:
        assert _curve(resumed, key) == _curve(full, key), key  # bit for bit on CPU


@pytest.mark.slow
def test_sharded_optimizer_state_resumes_on_another_world_size(sft_runs, tiny_qwen25, sft_rows, tmp_path):
    """torch.distributed.checkpoint reshards: the 2-rank run's step-4 checkpoint resumed on 1 FSDP rank (2 micro-batches
    a step: the same global batch) continues with the 2-rank run's losses."""
    _, two = sft_runs
    checkpoint = two / "checkpoints" / "step-00000004"
    args = _sft_args(tmp_path, tiny_qwen25, sft_rows, "optim.grad_accum=2", "train.sharding=fsdp",
                     f"train.resume={checkpoint}", "train.allow_changes=true")  # fmt: skip
    result = _launch(tmp_path, "sft", 1, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 4" in result.stdout and "no RNG state" not in result.stdout  # rank 0's RNG is there
    assert _curve(tmp_path, "loss") == pytest.approx(_curve(two, "loss")[4:], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_tied_input_and_output_embeddings_stay_tied_and_train_as_unsharded(tiny_qwen25, sft_rows, tmp_path):
    """Qwen2.5-VL-3B ties its LM head to the input embedding: one parameter shared by the root unit."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    def tied(model) -> bool:
        return model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()

    ckpt = tmp_path / "tied"
    shutil.copytree(tiny_qwen25, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config.setdefault("text_config", {})["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    weights = load_file(ckpt / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert tied(AutoModelForImageTextToText.from_pretrained(ckpt))
    runs = {}
    for ranks, extra in ((1, ["optim.grad_accum=2"]), (2, ["optim.grad_accum=1", "train.sharding=fsdp"])):
        out = tmp_path / f"run{ranks}"
        args = _sft_args(out, ckpt, sft_rows, "train.max_steps=2", "train.save_every=0", *extra)
        result = _launch(tmp_path, "sft", ranks, args)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[ranks] = out
    assert _curve(runs[2], "loss") == pytest.approx(_curve(runs[1], "loss"), rel=1e-5, abs=1e-6)
    sharded, plain = (AutoModelForImageTextToText.from_pretrained(runs[r] / "model") for r in (2, 1))
    assert tied(sharded)
    # measured: one of 57 tensors differs, by 2.5e-6 (the reduction order of the gradient sums, through AdamW)
    for (name, a), b in zip(sharded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name


def test_the_inference_copy_of_a_tied_model_generates_with_the_trained_head(like_3b):
    """Qwen2.5-VL-3B ties its head: the sharded model lists the pair once, and the copy must tie it again (before,
    the copy's head kept the uninitialized memory of to_empty and rollouts were noise)."""
    from vagent.training.fsdp import InferenceCopy, shard_model

    policy = load_policy(like_3b, device="cpu", dtype="float32")
    assert policy.model.config.tie_word_embeddings
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    embedding = policy.model.model.language_model.embed_tokens.weight.detach().clone()
    copy = InferenceCopy(policy.model, torch.float32)
    shard_model(policy.model, env, bf16=False)
    try:
        model = copy.refresh(policy.model)
        assert torch.equal(model.lm_head.weight, embedding)
        assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    finally:
        shutdown()


@pytest.mark.slow
def test_two_nodes_of_one_rank_train_grpo_as_one_node_of_two(grpo_runs, tiny_qwen25, zoom_rows_file, tmp_path):
    """The multi-node launch (docs/guide/scaling.md, tools/slurm_train.sbatch): one torchrun per 'node', joined by
    the c10d rendezvous on the loopback address, trains GRPO under FSDP to the losses of one node with two ranks."""
    import socket

    _, two = grpo_runs
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "nodes"
    args = _grpo_args(out, tiny_qwen25, zoom_rows_file(16, 1000), 2, "train.sharding=fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "vagent-test"]  # fmt: skip
    command = [str(script), "grpo", "none", "0", *args]
    nodes = [subprocess.Popen([*launcher, "--node-rank", str(rank), *command], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for rank in (0, 1)]  # fmt: skip
    outputs = [node.communicate(timeout=400) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    for key in GRPO_KEYS:
        assert _curve(out, key) == pytest.approx(_curve(two, key), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("checkpoint", ["tiny_qwen25", "like_qwen3_8b"])
def test_a_text_only_forward_gives_every_trained_vision_parameter_a_gradient(request, checkpoint):
    """touch_vision_every_forward feeds the tower's merged output (transformers 5 returns it as the pooler output; the
    last hidden state skips the merger) and Qwen3-VL's DeepStack features: every vision parameter that trains under
    freeze_vision (the merger; Qwen3-VL's DeepStack mergers too) must get a gradient from a micro-batch without images.
    Else DDP's second step raises "Expected to have finished reduction", and FSDP2 reduce-scatters fewer gradients on
    that rank than on one with images (gloo: "Received data size doesn't match"; NCCL: a hang)."""
    from vagent.model import is_vision_tower
    from vagent.training.adapters import freeze_vision, touch_vision_every_forward

    policy = load_policy(request.getfixturevalue(checkpoint), device="cpu")
    freeze_vision(policy.model)
    assert touch_vision_every_forward(policy.model, always=False)
    ids = torch.tensor([policy.tokenizer.encode("a question without any image")])
    policy_logits(policy.model.train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}).sum().backward()
    trained = {n: p.grad for n, p in policy.model.named_parameters() if ".visual." in n and not is_vision_tower(n)}
    assert trained and all(g is not None for g in trained.values()), [n for n, g in trained.items() if g is None]
    if checkpoint == "like_qwen3_8b":
        assert any("deepstack_merger_list" in n for n in trained)

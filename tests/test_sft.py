"""SFT on a tiny checkpoint: learning, masking, distributed equivalence, exact resume after SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BOTH_VOCABS_QWEN_SLOW

from data_pipelines.synthetic.zoom import zoom_rows
from vagent.algorithms import token_nll_sum
from vagent.config import ConfigError, SFTConfig, load_config
from vagent.data import load_rows, write_rows
from vagent.data.batching import collate
from vagent.data.encode import encode_messages, encoded_length
from vagent.model import load_policy, policy_logits
from vagent.recipes import sft
from vagent.training.checkpoint import ResumeError
from vagent.training.data import SFTDataset, gold_conversation
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "sft" / "qwen2_5_vl_tiny_cpu.yaml"  # the subprocess runs use the shipped tiny config
# Small images keep each step ~0.1 s on CPU; the tile stays 28 px so the crop call is a real one.
SIZE = (448, 336)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory, policy):
    out = tmp_path_factory.mktemp("sft-data")
    min_pixels, max_pixels = policy.pixel_budget
    budget = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    write_rows(zoom_rows(out, 12, seed=0, size=SIZE, clutter=20, **budget), out / "train.jsonl")
    write_rows(zoom_rows(out, 4, seed=1, size=SIZE, clutter=20, **budget), out / "val.jsonl")
    return out / "train.jsonl"


def _overrides(out_dir, model, rows_file, *extra):
    return [f"out_dir={out_dir}", f"model.path={model}", "model.device=cpu", f"data.train={rows_file}",
            f"data.val={rows_file.with_name('val.jsonl')}", "data.micro_batch_size=2", "optim.lr=2e-3",
            "optim.grad_accum=2", "train.max_steps=6", "train.tensorboard=false", *extra]  # fmt: skip


def _losses(out_dir):
    return [r["loss"] for r in read_metrics(Path(out_dir) / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("checkpoint", BOTH_VOCABS_QWEN_SLOW, indirect=True)
def test_loss_decreases_and_parameters_change(tmp_path, checkpoint, rows_file):
    before = {k: v.clone() for k, v in load_policy(checkpoint, device="cpu").model.state_dict().items()}
    model_dir = sft.train(load_config(SFTConfig, None, _overrides(tmp_path, checkpoint, rows_file)))
    losses = _losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    after = load_policy(model_dir, device="cpu").model.state_dict()  # the final dir loads with load_policy
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > 0.9 * len(before), f"only {len(changed)}/{len(before)} tensors changed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert {"lr", "grad_norm", "padding_waste", "tokens_per_s"} <= set(records[0])
    assert any("eval_loss" in r for r in records)


def test_only_assistant_tokens_get_gradient(policy, rows_file):
    row = next(r for r in load_rows(rows_file) if len(r.messages) == 3)  # crop, tool turn, answer
    conversation = gold_conversation(row, ["crop"])
    assert [m.role for m in conversation] == ["system", "user", "assistant", "tool", "assistant"]
    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(conversation, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
    # mask: exactly the two assistant turns' content (+ <|im_end|>) is trained
    trained = policy.tokenizer.decode(enc.input_ids[enc.loss_mask.bool()].tolist())
    assert trained == "".join(m.plain_text + "<|im_end|>" for m in conversation if m.role == "assistant")
    assert len(enc.image_grid_thw) == 2  # the prompt image and the crop
    # gradient: the logits that predict prompt, tool-observation (image tokens too) and header tokens get 0
    batch = collate([enc], policy.tokenizer.pad_token_id)
    model = policy.model
    model.zero_grad()
    logits = policy_logits(model, batch)
    logits.retain_grad()
    token_nll_sum(logits, batch["input_ids"], batch["loss_mask"]).backward()
    grad_norm = logits.grad[0, :-1].abs().sum(-1)  # (T-1,) position t predicts token t+1
    target_trained = batch["loss_mask"][0, 1:].bool()
    assert torch.all(grad_norm[~target_trained] == 0)
    assert torch.all(grad_norm[target_trained] > 0)
    image_token = model.config.image_token_id
    assert (batch["input_ids"][0, 1:][~target_trained] == image_token).sum() > 0  # image tokens are among the masked
    model.zero_grad()


def test_encoded_length_is_exact_and_batches_hold_every_image(policy, rows_file):
    rows = load_rows(rows_file)
    min_pixels, max_pixels = policy.pixel_budget
    budget = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    for row in rows[:4]:
        conversation = gold_conversation(row, ["crop"])
        assert encoded_length(conversation, policy.processor, **budget) == len(
            encode_messages(conversation, policy.processor, **budget).input_ids
        )
    data = SFTDataset(rows, policy.processor, default_tools=["crop"], max_length=4096, micro_batch_size=3, seed=0,
                      group_by_length=True, group_batches=4, **budget)  # fmt: skip
    batch = data[0]
    n_images = int(batch["image_grid_thw"].shape[0])
    conversations = [data.conversations[i] for i in data.batch(0)]
    assert n_images == sum(1 for c in conversations for m in c for p in m.content if p.type == "image")
    assert int(batch["pixel_values"].shape[0]) == int(batch["image_grid_thw"].prod(-1).sum())
    # the placeholders match the patches (4 patches merge into one token)
    assert int((batch["input_ids"] == policy.model.config.image_token_id).sum()) * 4 == batch["pixel_values"].shape[0]
    # every epoch covers every conversation once
    seen = sorted(i for g in range(data.batches_per_epoch) for i in data.batch(g))
    assert seen == list(range(len(rows)))


def test_a_long_row_is_skipped_with_its_reason(policy, rows_file):
    min_pixels, max_pixels = policy.pixel_budget
    kwargs = dict(default_tools=["crop"], micro_batch_size=2, seed=0, group_by_length=False, group_batches=1,
                  min_pixels=min_pixels, max_pixels=max_pixels, factor=28)  # fmt: skip
    lengths = sorted(SFTDataset(load_rows(rows_file), policy.processor, max_length=10**6, **kwargs).lengths)
    limit = lengths[len(lengths) // 2]  # half the rows are longer
    data = SFTDataset(load_rows(rows_file), policy.processor, max_length=limit, **kwargs)
    assert data.skipped and all(f"data.max_length={limit}" in why for _, why in data.skipped)
    assert len(data.conversations) + len(data.skipped) == 12 and max(data.lengths) <= limit
    with pytest.raises(ValueError, match="no usable SFT rows"):
        SFTDataset(load_rows(rows_file), policy.processor, max_length=10, **kwargs)


def test_changed_config_or_data_is_reported_on_resume(tmp_path, tiny_qwen25, rows_file):
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "train.max_steps=2")
    sft.train(load_config(SFTConfig, None, args))
    with pytest.raises(ResumeError, match=r"config\.optim\.lr"):
        sft.train(load_config(SFTConfig, None, [*args, "optim.lr=1e-4", "train.max_steps=3"]))
    changed_rows = rows_file.with_name("train-changed.jsonl")  # next to the images it names
    changed_rows.write_text(rows_file.read_text().replace('"source": "synthetic/zoom"', '"source": "other"'))
    args2 = [a if not a.startswith("data.train=") else f"data.train={changed_rows}" for a in args]
    with pytest.raises(ResumeError, match="train_data"):
        sft.train(load_config(SFTConfig, None, args2))
    # allowed explicitly: it resumes and warns
    sft.train(load_config(SFTConfig, None, [*args2, "train.allow_changes=true", "train.max_steps=3"]))
    assert len(_losses(tmp_path)) == 3


def test_without_the_final_save_a_run_leaves_its_metrics_and_no_checkpoint(tmp_path, tiny_qwen25, rows_file):
    """``train.save_final=false`` (a benchmark's run): the steps and their metrics, no checkpoint, no ``model/``."""
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "train.max_steps=2", "train.save_final=false", "data.val=null")
    assert sft.train(load_config(SFTConfig, None, args)) is None
    assert len(_losses(tmp_path)) == 2
    assert not (tmp_path / "model").exists() and not list((tmp_path / "checkpoints").glob("step-*"))


def test_lora_trains_only_adapters_and_saves_a_merged_model(tmp_path, tiny_qwen25, rows_file):
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "train.max_steps=2", "train.lora.enabled=true",
                      "train.lora.r=4", "train.freeze_vision=true", "train.gradient_checkpointing=true")  # fmt: skip
    model_dir = sft.train(load_config(SFTConfig, None, args))
    base = load_policy(tiny_qwen25, device="cpu").model.state_dict()
    merged = load_policy(model_dir, device="cpu").model.state_dict()  # plain HF weights, no peft needed
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all("visual" not in k and k.endswith("proj.weight") for k in changed), sorted(changed)[:5]
    assert (tmp_path / "checkpoints" / "step-00000002" / "adapter" / "adapter_model.safetensors").is_file()


def test_deepspeed_without_the_package_says_how_to_get_it(tmp_path, tiny_qwen25, rows_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # the test environment has it: import it as if it had not
    args = _overrides(tmp_path, tiny_qwen25, rows_file, f"train.deepspeed={ROOT}/configs/deepspeed/zero2.json")
    with pytest.raises(ImportError, match=r"vagent\[gpu\]"):
        sft.train(load_config(SFTConfig, None, args))


# -- multi-process: torchrun and SIGKILL -------------------------------------------------------------------

# Runs the SFT recipe in a child process that SIGKILLs itself at a chosen point (fault injection lives in
# the test, not in the library): "step N" right after step N's metrics are written, "checkpoint N" after
# every file of checkpoint N is in its temp dir but before it is committed.
FAULT = """
import os, signal, sys
from vagent.training import checkpoint, metrics
mode, at = sys.argv[1], int(sys.argv[2])
if mode == "step":
    log = metrics.MetricsLogger.log
    def killing_log(self, step, values):
        log(self, step, values)
        if step == at and "loss" in values:
            os.kill(os.getpid(), signal.SIGKILL)
    metrics.MetricsLogger.log = killing_log
elif mode == "checkpoint":
    commit = checkpoint.commit_checkpoint
    def killing_commit(root, tmp, step, *args, **kwargs):
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(root, tmp, step, *args, **kwargs)
    checkpoint.commit_checkpoint = killing_commit
from vagent.recipes import sft
sft.main(sys.argv[3:])
"""


def _torchrun(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tools" / "train.py"), "--config", str(CONFIG), *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def _run(args, fault=("none", 0)):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", FAULT, fault[0], str(fault[1]), "--config", str(CONFIG), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_qwen25, rows_file):
    out = tmp_path_factory.mktemp("sft-full")
    result = _run(_overrides(out, tiny_qwen25, rows_file, "train.save_every=2"))
    assert result.returncode == 0, result.stderr[-2000:]
    return _losses(out)


def test_two_ranks_give_the_loss_curve_of_one_rank_with_twice_the_accumulation(tmp_path, tiny_qwen25, rows_file,
                                                                                 uninterrupted):  # fmt: skip
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "optim.grad_accum=1", "train.save_every=2")
    result = _torchrun(args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(tmp_path) == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


def test_the_shared_prefix_changes_no_loss(tmp_path, tiny_qwen25, rows_file, uninterrupted):
    """The run above shares its rows' system prompt (the crop schema) in one forward; row by row gives its losses."""
    result = _run(_overrides(tmp_path, tiny_qwen25, rows_file, "train.save_every=2", "train.share_prefix=false"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert _losses(tmp_path) == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_zero_on_two_cpu_ranks_gives_the_same_loss_curve(tmp_path, tiny_qwen25, rows_file, uninterrupted,
                                                                    stage):  # fmt: skip
    """DeepSpeed runs on CPU over gloo (the test environment installs it, as the `gpu` extra does)."""
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "optim.grad_accum=1", "train.save_every=2",
                      f"train.deepspeed={ROOT}/configs/deepspeed/{stage}.json")  # fmt: skip
    result = _torchrun(args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(tmp_path) == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)
    load_policy(tmp_path / "model", device="cpu")  # ZeRO-3 shards were gathered into a loadable HF dir


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "lora"), [("zero2", False), ("zero3", False), ("zero2", True)],
                         ids=["zero2", "zero3", "zero2-lora"])  # fmt: skip
def test_under_bf16_a_zero_checkpoint_holds_deepspeeds_fp32_masters(tmp_path, tiny_qwen25, rows_file, stage, lora):
    """DeepSpeed computes with a bf16 copy of the module (the adapters too) and keeps fp32 masters in its optimizer:
    the checkpoint's model/ (or adapter/) holds the masters, trained values that bf16 cannot represent, as DDP's and
    FSDP's do; the published model/ is in the dtype of the checkpoint the run started from (here fp32)."""
    from safetensors.torch import load_file

    from vagent.training.publish import weights_dtype

    extra = ["train.lora.enabled=true", "train.lora.dropout=0"] if lora else []
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "optim.grad_accum=1", "train.precision=bf16",
                      "train.max_steps=2", "train.save_every=2", f"train.deepspeed={ROOT}/configs/deepspeed/{stage}.json",
                      *extra)  # fmt: skip
    result = _torchrun(args)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    if lora:
        saved = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
        trained = [k for k in saved if ".lora_B." in k]  # zero at the start: every value is the update's
    else:
        saved = load_file(str(checkpoint / "model" / "model.safetensors"))
        start = load_file(str(tiny_qwen25 / "model.safetensors"))
        trained = [k for k in saved if not torch.equal(saved[k], start[k])]
        assert weights_dtype(checkpoint / "model") == torch.float32
        published = load_file(str(tmp_path / "model" / "model.safetensors"))
        assert all(torch.equal(published[k], saved[k]) for k in saved)  # an fp32 source: published as the masters
    assert trained and all(saved[k].dtype == torch.float32 for k in saved)
    assert any(not torch.equal(saved[k].bfloat16().float(), saved[k]) for k in trained)  # not the bf16 module's
    assert weights_dtype(tmp_path / "model") == torch.float32


# 15 s each: the kill mid-training runs by default, the kill mid-checkpoint with the slow tests
@pytest.mark.parametrize(
    "fault",
    [("step", 5), pytest.param(("checkpoint", 4), marks=pytest.mark.slow)],
    ids=["mid-training", "mid-checkpoint"],
)
def test_a_killed_run_resumes_to_the_same_losses(tmp_path, tiny_qwen25, rows_file, uninterrupted, fault):
    args = _overrides(tmp_path, tiny_qwen25, rows_file, "train.save_every=2")
    killed = _run(args, fault)
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoints = tmp_path / "checkpoints"
    if fault[0] == "checkpoint":  # the half-written checkpoint is there, but only as a temp dir
        assert (checkpoints / ".tmp-step-00000004").is_dir() and not (checkpoints / "step-00000004").exists()
        assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    resumed = _run(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected_from = 4 if fault[0] == "step" else 2
    assert f"at step {expected_from}" in resumed.stdout
    assert _losses(tmp_path) == uninterrupted  # bit for bit, on CPU
    assert not list(checkpoints.glob(".tmp-*"))
    state = json.loads((checkpoints / "step-00000006" / "trainer_state.json").read_text())
    assert state["step"] == 6


def test_a_video_row_trains_on_the_frames_its_tool_turn_returned(tmp_path, policy):
    """Videos reach the model as the frames a video tool returned (as in the rollout engine), so a video
    SFT row is a multi-image conversation: the frames batch like any tool images, each after its time."""
    from data_pipelines.gold import tool_turn
    from tests.videos import write_video
    from vagent.data import Row
    from vagent.toolbox import ToolContext

    video = write_video(tmp_path / "clip.mp4", frames=24, fps=8.0, size=(96, 64))
    min_pixels, max_pixels = policy.pixel_budget
    context = ToolContext(videos=[str(video)], min_pixels=min_pixels, max_pixels=max_pixels)
    call, tool = tool_turn("sample_frames", {"start": 0.5, "end": 2.5, "num_frames": 3}, context, tmp_path / "frame")
    assert sum(part["type"] == "image" for part in tool["content"]) == 3
    row = Row.from_dict({
        "id": "v0", "question": "When does it get bright?", "answer": [1.0, 2.0], "answer_type": "span",
        "videos": [str(video)], "tools": ["sample_frames"],
        "messages": [
            {"role": "assistant", "content": call},
            tool,
            {"role": "assistant", "content": "<answer>[1.0, 2.0]</answer>"},
        ],
    })  # fmt: skip
    conversation = gold_conversation(row, ["crop"])
    assert "Video 0: 3.0 s long." in conversation[1].plain_text  # the engine's prompt, with the row's tools
    assert '"sample_frames"' in conversation[0].plain_text and '"crop"' not in conversation[0].plain_text
    data = SFTDataset([row, row], policy.processor, default_tools=["crop"], max_length=10**5, micro_batch_size=2,
                      seed=0, group_by_length=True, group_batches=1, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=28)  # fmt: skip
    batch = data[0]
    assert batch["image_grid_thw"].shape[0] == 6  # 3 frames per conversation, in order
    text = policy.tokenizer.decode(batch["input_ids"][0])
    import re

    assert len(re.findall(r"t=\d+\.\d\ds<\|vision_start\|>", text)) == 3  # each frame right after its time
    trained = policy.tokenizer.decode(batch["input_ids"][0][batch["loss_mask"][0].bool()])
    assert "sample_frames" in trained and "t=" not in trained


def test_the_vision_tower_can_train_at_its_own_learning_rate(policy):
    from vagent.training.backend import build_optimizer, warmup_cosine

    model = policy.model
    plain = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    assert {g["lr"] for g in plain.param_groups} == {1e-3}
    assert plain.defaults["fused"]  # torch's fused kernel on CPU; DeepSpeed asks for the plain one
    unfused = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, fused=False)
    assert not unfused.defaults["fused"]
    scaled = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, vision_lr_scale=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    by_lr = {}
    for group in scaled.param_groups:
        by_lr.setdefault(group["lr"], []).extend(names[id(p)] for p in group["params"])
        assert group["weight_decay"] == (0.1 if group["params"][0].ndim >= 2 else 0.0)
    slow = by_lr[min(by_lr)]
    assert min(by_lr) == pytest.approx(1e-4) and max(by_lr) == 1e-3 and scaled.param_groups[0]["lr"] == 1e-3
    assert slow and all(".visual." in f".{n}" and ".merger." not in n for n in slow)
    assert any(".merger." in n for n in by_lr[1e-3])  # the projector keeps the language model's rate
    assert sum(len(g["params"]) for g in scaled.param_groups) == sum(1 for p in model.parameters() if p.requires_grad)
    scheduler = warmup_cosine(scaled, warmup_steps=0, total_steps=10, min_ratio=0.0)
    scaled.step()
    scheduler.step()  # the schedule scales every group from its own base
    lrs = [g["lr"] for g in scaled.param_groups]
    assert max(lrs) / min(lrs) == pytest.approx(10.0)
    with pytest.raises(ConfigError, match="vision_lr_scale"):
        load_config(SFTConfig, None, ["optim.vision_lr_scale=0"])


def test_gold_reproduced_is_whether_every_trained_token_is_the_argmax(policy, rows_file, monkeypatch):
    """``gold_reproduced`` gives a row True when every token SFT trains on is the model's argmax after the gold before
    it. The random model reproduces no row, and a row SFT cannot build is False. A model whose argmax is the gold's
    next token everywhere but at one row's last trained token reproduces every other row, the rows spread over
    micro-batches as SFT batches them."""
    import dataclasses

    from vagent.training import data as sft_data

    rows = load_rows(rows_file)
    broken = dataclasses.replace(rows[0], id="broken", images=["/nonexistent.png"])
    assert sft_data.gold_reproduced(policy, [*rows, broken], ["crop"], micro_batch_size=3) == {
        r.id: False for r in [*rows, broken]
    }
    min_pixels, max_pixels = policy.pixel_budget
    one = SFTDataset([rows[5]], policy.processor, max_length=10**6, default_tools=["crop"], micro_batch_size=1, seed=0,
                     group_by_length=False, group_batches=1, min_pixels=min_pixels, max_pixels=max_pixels, factor=28)  # fmt: skip
    spoiled = one[0]["input_ids"][0]

    def argmax_is_the_gold(model, batch, positions):
        """(B, T, V) logits built from the loss mask alone, not from ``positions``: position t's argmax is token t + 1
        where that token is trained, another token elsewhere; then the rows of ``positions``, as the real one."""
        ids, trained = batch["input_ids"], batch["loss_mask"].bool()
        vocab = int(ids.max()) + 2
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token t + 1 (the last position: itself)
        wanted = torch.where(torch.cat([trained[:, 1:], trained[:, -1:] & False], dim=1), nxt, (nxt + 1) % vocab)
        for i, row in enumerate(ids):
            if len(row) >= len(spoiled) and torch.equal(row[: len(spoiled)], spoiled):
                last = int(trained[i].nonzero().max()) - 1  # predicts the row's last trained token
                wanted[i, last] = (wanted[i, last] + 1) % vocab
        return torch.nn.functional.one_hot(wanted, num_classes=vocab).float()[positions]

    monkeypatch.setattr(sft_data, "policy_logits", argmax_is_the_gold)
    assert sft_data.gold_reproduced(policy, rows, ["crop"], micro_batch_size=3) == {
        r.id: r.id != rows[5].id for r in rows
    }
    # a row with no trained token shows nothing reproduced
    untrained = dataclasses.replace(rows[1], id="untrained", messages=[
        dataclasses.replace(m, trained=False) if m.role == "assistant" else m for m in rows[1].messages
    ])  # fmt: skip
    assert sft_data.gold_reproduced(policy, [untrained, rows[2]], ["crop"]) == {"untrained": False, rows[2].id: True}

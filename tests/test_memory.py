"""The memory plan: parameter counts against real models, the shipped 3B/7B configs fit 80 GiB at 8 ranks, errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from vagent.config import TrainConfig
from vagent.training.memory import SHAPES, GiB, Setup, image_bytes, plan, shape_from_config_json

ROOT = Path(__file__).resolve().parent.parent
CONFIG_TINY_GRPO = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
PRODUCTION = sorted(
    [
        *ROOT.glob("configs/sft/qwen2_5_vl_*b_fsdp.yaml"),
        *ROOT.glob("configs/sft/qwen2_5_vl_*b_lora.yaml"),
        *ROOT.glob("configs/grpo/qwen2_5_vl_*b*.yaml"),
    ]
)


def _memory(*args, check=True, capsys=None):
    """``vagent memory ARGS``: in this process through the recipe (fast), or with ``capsys=None`` as a subprocess."""
    if capsys is not None:
        from vagent.recipes.memory import main

        code = main([str(a) for a in args])
        out = capsys.readouterr()
        done = subprocess.CompletedProcess(args, code, out.out, out.err)
    else:
        done = subprocess.run([sys.executable, "-m", "vagent.cli", "memory", *map(str, args)], capture_output=True,
                              text=True, cwd=ROOT)  # fmt: skip
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _peak(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("peak per rank: ") and last.endswith(" GiB"), last
    return float(last.split()[3])


def test_the_shape_counts_every_parameter_of_a_real_checkpoint(tiny_qwen25, tiny_qwen25_qwen_vocab):
    from transformers import AutoModelForImageTextToText

    for path in (tiny_qwen25, tiny_qwen25_qwen_vocab):
        model = AutoModelForImageTextToText.from_pretrained(path)
        shape = shape_from_config_json(path)
        assert shape.params() == sum(p.numel() for p in model.parameters())
        assert shape.vision_params() == sum(p.numel() for p in model.model.visual.parameters())


def test_the_released_shapes_have_their_published_sizes():
    assert SHAPES["qwen2.5-vl-7b"].params() == pytest.approx(8.29e9, rel=0.002)  # "8.29B params" on the model card
    assert SHAPES["qwen2.5-vl-3b"].params() == pytest.approx(3.75e9, rel=0.002)


@pytest.mark.parametrize("config", PRODUCTION, ids=lambda p: p.name)
def test_every_shipped_3b_and_7b_config_fits_80_gib_per_rank_on_8_gpus(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    size = "7b" if "7b" in config.name else "3b"
    done = _memory("--config", config, "--world-size", 8, "--shape", f"qwen2.5-vl-{size}", "--gpu-memory", 80,
                   capsys=capsys)  # fmt: skip
    assert 0 < _peak(done.stdout) <= 80
    sharding = "ddp" if "_lora" in config.name else "fsdp"  # FSDP2 shards full fine-tuning; LoRA runs under DDP
    assert f"{sharding} over 8 rank(s)" in done.stdout and "LM head" in done.stdout
    assert config.read_text().startswith("# Launch: torchrun")


def test_the_7b_grpo_and_sft_plans_at_8_ranks(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    grpo = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b")
    sft = _memory(
        "--config", "configs/sft/qwen2_5_vl_7b_fsdp.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b", capsys=capsys
    )  # the GRPO one through the `vagent` command itself, this one in process
    assert _peak(grpo.stdout) <= 80 and _peak(sft.stdout) <= 80
    assert "rollout KV cache (kept across steps)" in grpo.stdout and "rollout.kv_cache_gb=12" in grpo.stdout
    assert "rollout whole-weights copy (resident)" in grpo.stdout
    assert "rollout" not in sft.stdout


def test_a_plan_that_does_not_fit_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    # today's GRPO: every rank holds fp32 weights, gradients and AdamW of 8.3B parameters (about 130 GB)
    done = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                   "--sharding", "ddp", "--gpu-memory", 80, check=False, capsys=capsys)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "does not fit" in done.stderr and "> --gpu-memory 80" in done.stderr
    assert _peak(done.stdout) > 120


def test_a_config_whose_checkpoint_is_not_here_asks_for_a_shape(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    done = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, check=False, capsys=capsys)
    assert done.returncode == 2 and "has no config.json: pass --shape" in done.stderr


def test_a_config_path_reads_the_checkpoints_own_shape(tiny_qwen25_qwen_vocab, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    done = _memory("--config", "configs/sft/qwen2_5_vl_tiny_cpu.yaml", "--device", "cpu",
                   f"model.path={tiny_qwen25_qwen_vocab}", capsys=capsys)  # fmt: skip
    assert str(tiny_qwen25_qwen_vocab) in done.stdout and "151,936 rows" in done.stdout


def test_the_plan_moves_the_right_way():
    shape = SHAPES["qwen2.5-vl-7b"]
    base = Setup(stage="sft", world_size=8, sharding="fsdp", seq_len=8192)

    def peak(**kw):
        from dataclasses import replace

        return plan(shape, replace(base, **kw)).peak / GiB

    assert peak(gradient_checkpointing=False) > peak() + 20  # 28 layers of activations vs one
    assert peak(lm_head_chunk=0) > peak() + 5  # 4,096 positions x 152,064 rows whole vs one chunk
    assert peak(sharding="ddp") > peak() + 80  # fp32 weights, gradients and AdamW whole on every rank
    assert peak(lora_rank=64) < peak() and peak(world_size=16) < peak()
    grpo = Setup(stage="grpo", world_size=8, sharding="fsdp", seq_len=4096, rollout_batch=64, rollout_len=4096)
    assert plan(shape, grpo).rollout > 0


def test_the_grpo_host_plan_moves_the_right_way_and_prints_its_lines(capsys, monkeypatch):
    """Host memory of a GRPO step, apart from the device peak: a 1000x750 picture's patches are the processor's
    3,888 x 1,176 fp32 values; more samples per prompt share each prompt image; a larger original prompt image costs
    its RGB bytes once per group; SFT plans none."""
    from dataclasses import replace

    shape = SHAPES["qwen2.5-vl-7b"]
    patches, rgb = image_bytes(shape, 972)  # a 1000x750 picture at Qwen2.5-VL's default budget: 1008x756 px
    assert (patches, rgb) == (3888 * 1176 * 4, 1008 * 756 * 3)  # 3,888 patches of 3 x 2 x 14 x 14 fp32
    grpo = Setup(stage="grpo", world_size=8, sharding="fsdp", seq_len=8192, micro_batch=4, images=13,
                 image_tokens=972, rollout_batch=128, rollout_len=8192, group_size=8, episodes=128)  # fmt: skip
    p = plan(shape, grpo)
    shared = plan(shape, replace(grpo, group_size=16))  # more samples share each prompt image
    assert shared.host < p.host and shared.peak == p.peak
    eight_k = plan(shape, replace(grpo, prompt_pixels=7680 * 4320))  # 16 groups, each keeping its 8K original
    assert eight_k.host - p.host == pytest.approx(16 * (7680 * 4320 - 1008 * 756) * 3)
    assert not plan(shape, replace(grpo, stage="sft")).host_lines
    monkeypatch.chdir(ROOT)
    done = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                   "--image-tokens", 972, capsys=capsys)  # fmt: skip
    # 8 prompts x 8 samples, twice while a dynamic-sampling refill round runs; max_images 6: 5 tool images
    assert "16 groups x (17.4 MiB fp32 patches + 2.18 MiB RGB original at the model's size" in done.stdout
    assert "128 episodes x 5 x (17.4 MiB fp32 patches + 2.18 MiB RGB view)" in done.stdout
    assert "host per rank: " in done.stdout and _peak(done.stdout) > 0


def test_the_grpo_host_plan_is_what_a_real_step_holds(tmp_path, tiny_qwen25, monkeypatch):
    """The plan's host lines against the tensors and images a real GRPO step on the tiny checkpoint holds, counted
    in the step (each storage and each image once, whoever references it): 2 prompts of a 700x700 picture (seen at
    448x448) x 2 samples, each cropping the whole picture twice (scripted), so every image is seen at 256 tokens as
    the plan assumes. At the score stage the episodes and their encodings hold exactly the planned prompt and tool
    images; the update holds one collated micro-batch at a time, of the planned size."""
    import dataclasses
    import gc
    import json
    import weakref

    import numpy as np
    from PIL import Image

    from vagent.config import GRPOConfig, load_config
    from vagent.recipes import grpo
    from vagent.recipes.memory import build_parser, setup_from_config

    rng = np.random.default_rng(0)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (700, 700, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
            f.write(json.dumps({"id": f"p{i}", "source": "t", "images": [f"{i}.png"], "question": "What?",
                                "answer": "a", "answer_type": "exact"}) + "\n")  # fmt: skip
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 448, 448]}}</tool_call>'
    from_row = grpo.Task.from_row.__func__
    monkeypatch.setattr(grpo.Task, "from_row", classmethod(
        lambda cls, row, tools: dataclasses.replace(from_row(cls, row, tools), scripted_turns=[crop, crop])))  # fmt: skip
    held, collated = [], []  # bytes at the score stage; per collate, the collated patches alive with it

    def scored(ctx, groups, step, timer):
        out = score(ctx, groups, step, timer)
        parts = [p for t in out.trajectories for m in t.messages for p in m.content if p.type == "image"]
        assert len(parts) == 4 * 3 and all(p.image.size in ((700, 700), (448, 448)) for p in parts)
        tensors = [p.patches.pixel_values for p in parts] + [b for e in out.encoded for b in e.image_patches]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        images = {id(p.image): p.image.width * p.image.height * len(p.image.getbands()) for p in parts}
        held.append(sum(storages.values()) + sum(images.values()))
        return out

    def collate(samples, pad_id):
        gc.collect()
        batch = grpo_collate(samples, pad_id)
        alive = [ref() for ref in refs if ref() is not None]
        collated.append(sum(t.nbytes for t in alive) + batch["pixel_values"].nbytes)
        refs.append(weakref.ref(batch["pixel_values"]))
        return batch

    score, grpo_collate, refs = grpo._score_old_logprobs, grpo.collate, []
    monkeypatch.setattr(grpo, "_score_old_logprobs", scored)
    monkeypatch.setattr(grpo, "collate", collate)
    overrides = [f"out_dir={tmp_path / 'out'}", f"model.path={tiny_qwen25}", f"data.train={tmp_path / 'rows.jsonl'}",
                 "train.max_steps=1", "train.save_every=0", "train.tensorboard=false", "grpo.group_size=2",
                 "grpo.prompts_per_step=2", "grpo.rollout_batch_size=4", "grpo.micro_batch_size=2",
                 "grpo.dynamic_sampling=false", "rollout.max_images=3", "rollout.max_turns=3",
                 "rollout.max_new_tokens=4", "rewards.weights={accuracy: 1.0}", "rewards.options={}"]  # fmt: skip
    cfg = load_config(GRPOConfig, CONFIG_TINY_GRPO, overrides)
    grpo.train(cfg)
    args = build_parser().parse_args(["--config", "x", "--device", "cpu", "--image-tokens", "256",
                                      "--prompt-size", "700", "700"])  # fmt: skip
    planned = plan(shape_from_config_json(tiny_qwen25), setup_from_config(cfg, args, "grpo"))
    host = {name: value for name, value, _ in planned.host_lines}
    assert held == [host["prompt images"] + host["tool images"]]
    assert len(collated) == 2 and max(collated) == host["micro-batch patches"]  # 2 x 3 images, one batch at a time


def test_sharding_comes_from_the_flag_the_config_or_deepspeeds_file(tmp_path):
    from vagent.recipes.memory import _sharding

    cfg = type("C", (), {"train": TrainConfig(deepspeed="configs/deepspeed/zero3.json")})()
    assert _sharding(cfg, None) == "zero3" and _sharding(cfg, "fsdp") == "fsdp"
    cfg = type("C", (), {"train": TrainConfig(sharding="fsdp")})()
    assert _sharding(cfg, None) == "fsdp"

"""The memory plan: parameter counts against real models, every shipped training config planned (the 3B/7B ones fit
80 GiB per rank at their GPUs, and the memory guide's table is what the command prints), DPO's pairs and reference,
errors."""

import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from vagent.config import CONFIGS, DPOConfig, TrainConfig, load_config
from vagent.recipes.memory import STAGES, build_parser, setup_from_config
from vagent.training.memory import SHAPES, GiB, Setup, image_bytes, plan, shape_from_config_json

ROOT = Path(__file__).resolve().parent.parent
# every YAML `vagent memory` plans: the training stages' (configs/quickstart/ is a pipeline, configs/tiny/ a model)
PLANNED = sorted(f"configs/{stage}/{p.name}" for stage in STAGES for p in (ROOT / "configs" / stage).glob("*.yaml"))
# the 3B/7B configs the memory guide's table lists at 8 GPUs (the DeepSpeed ones are SFT's variants)
PRODUCTION = [c for c in PLANNED if "tiny" not in c and "zero" not in c]
GUIDE = ROOT / "docs" / "guide" / "memory.md"
CONFIG_TINY_GRPO = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"


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


def _line_gib(stdout: str, label: str) -> float:
    line = next(ln for ln in stdout.splitlines() if ln.strip().startswith(label))
    return float(re.search(r"([\d.]+) GiB", line)[1])


def test_the_shape_counts_every_parameter_of_a_real_checkpoint(tiny_qwen25, tiny_qwen25_qwen_vocab, tmp_path):
    """Qwen2.5-VL's layout and Qwen3-VL's (no decoder biases, q/k norms, LayerNorm vision blocks, a position table,
    DeepStack mergers; tied and untied)."""
    from transformers import AutoModelForImageTextToText

    from vagent.tiny_model import build_tiny_checkpoint

    qwen3 = [build_tiny_checkpoint(tmp_path / f"q3-{tied}", family="qwen3_vl", size="nano", tie_embeddings=tied)
             for tied in (False, True)]  # fmt: skip
    for path in (tiny_qwen25, tiny_qwen25_qwen_vocab, *qwen3):
        model = AutoModelForImageTextToText.from_pretrained(path)
        shape = shape_from_config_json(path)
        assert shape.params() == sum(p.numel() for p in model.parameters())
        assert shape.vision_params() == sum(p.numel() for p in model.model.visual.parameters())


def test_the_released_shapes_have_their_published_sizes():
    assert SHAPES["qwen2.5-vl-7b"].params() == pytest.approx(8.29e9, rel=0.002)  # "8.29B params" on the model card
    assert SHAPES["qwen2.5-vl-3b"].params() == pytest.approx(3.75e9, rel=0.002)
    # exact totals: Qwen3-VL-8B's safetensors hold 8,767,123,696 parameters (750 tensors); Qwen2.5-VL-32B's derivative
    # Lingshu-32B, of the same shape, 33,452,718,336 (its vision MLP is 3,456 wide, the 3B's and 7B's 3,420)
    assert SHAPES["qwen3-vl-8b"].params() == 8_767_123_696 and SHAPES["qwen2.5-vl-32b"].params() == 33_452_718_336
    assert SHAPES["qwen2.5-vl-7b"].params() == 8_292_166_656


def _lines(stdout: str) -> dict[str, float]:
    """The plan's lines, GiB by name."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\S.*?)\s+(-?\d+\.\d\d) GiB  ", stdout, re.M)}


def test_every_training_stage_is_planned_and_every_other_config_folder_is_named():
    """A stage added to ``CONFIGS`` that ``vagent memory`` does not plan, or a new folder under configs/, fails here
    rather than going unplanned."""
    assert set(CONFIGS) - {"tiny"} == set(STAGES)  # configs/tiny/ builds a model, it trains nothing
    folders = {p.name for p in (ROOT / "configs").iterdir() if p.is_dir()}
    assert folders == {*STAGES, "tiny", "quickstart", "deepspeed"}  # a pipeline of stages; DeepSpeed's JSON
    assert all(any(c.startswith(f"configs/{stage}/") for c in PLANNED) for stage in STAGES)


@pytest.mark.parametrize("config", PLANNED, ids=lambda c: c[len("configs/") : -len(".yaml")])
def test_every_shipped_training_config_is_planned(config, tiny_qwen25, capsys, monkeypatch):
    """Each YAML under configs/sft/, grpo/ and dpo/ (a new one too) plans at its launch line's ranks: a released
    model's config at that model's shape (the ``--shape`` of its own ``vagent memory`` line) fits 80 GiB per GPU, a
    tiny one plans on CPU at the tiny checkpoint's own shape."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / config).read_text()
    stage, launch = config.split("/")[1], text.splitlines()[0]
    ranks = int(re.search(r"--nproc_per_node (\d+)", launch)[1]) if launch.startswith("# Launch: torchrun") else 1
    if "tiny" in config:
        where = ["--device", "cpu", f"model.path={tiny_qwen25}"]
    else:
        shape = re.search(r"vagent memory --config \S+ .*--shape (\S+)", text)
        assert shape and shape[1] in SHAPES, f"{config}: its header's vagent memory line names no shape of SHAPES"
        assert shape[1].replace(".", "_").replace("-", "_") in config, f"{config} is not named after {shape[1]}"
        where = ["--shape", shape[1], "--gpu-memory", 80]
    done = _memory("--config", config, "--world-size", ranks, *where, capsys=capsys)
    train = load_config(CONFIGS[stage], config).train
    sharding = train.sharding if train.sharding == "fsdp" else Path(train.deepspeed or "ddp").stem
    assert done.stdout.startswith(f"{stage} memory plan per rank: ")
    assert f"{sharding} over {ranks} rank(s)" in done.stdout and "LM head" in done.stdout
    assert 0 < _peak(done.stdout) <= 80


def test_the_memory_guide_lists_every_released_models_config_with_what_its_memory_line_prints(capsys, monkeypatch):
    """docs/guide/memory.md's table: one row per config, each the peak (and GRPO's host memory) that the `vagent
    memory` line in the config's own header prints now."""
    monkeypatch.chdir(ROOT)
    rows = re.findall(r"^\| `(configs/[^`]+)` \| [^|]+ \| ([\d.]+) GiB \|(?: ([\d.]+) GiB)? \|$",
                      GUIDE.read_text(), re.M)  # fmt: skip
    assert sorted(config for config, _, _ in rows) == PRODUCTION
    for config, peak, host in rows:
        line = next(ln for ln in (ROOT / config).read_text().splitlines() if "vagent memory --config" in ln)
        args = shlex.split(line.split("vagent memory", 1)[1])
        assert args[:2] == ["--config", config] and "--world-size" in args, line
        done = _memory(*args, capsys=capsys)
        assert f"{_peak(done.stdout):.2f}" == peak, config
        planned_host = re.search(r"^host per rank: ([\d.]+) GiB", done.stdout, re.M)
        assert (planned_host[1] if planned_host else "") == host, config


def test_the_7b_grpo_and_sft_plans_at_8_ranks(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    grpo = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b")
    sft = _memory(
        "--config", "configs/sft/qwen2_5_vl_7b_fsdp.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b", capsys=capsys
    )  # the GRPO one through the `vagent` command itself, this one in process
    assert _peak(grpo.stdout) <= 80 and _peak(sft.stdout) <= 80
    # vLLM: the engine's own weights and its KV cache, freed while the update runs
    assert "vLLM KV cache" in grpo.stdout and "rollout.kv_cache_gb=12" in grpo.stdout
    assert "vLLM engine weights (bf16)" in grpo.stdout and "freed during the update" in grpo.stdout
    assert "rollout" not in sft.stdout and "vLLM" not in sft.stdout
    # the HF backend keeps its KV storage and the gathered whole-weights copy resident through the update
    hf = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                 "rollout.backend=hf", capsys=capsys)  # fmt: skip
    assert "rollout KV cache (kept across steps)" in hf.stdout and "rollout whole-weights copy (resident)" in hf.stdout
    assert _peak(hf.stdout) > _peak(grpo.stdout)
    awake = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                    "rollout.sleep=false", capsys=capsys)  # fmt: skip
    assert "resident" in awake.stdout and _peak(awake.stdout) > _peak(grpo.stdout)
    # sharded over 2 ranks (rollout.tensor_parallel_size), each rank holds half the engine's weights
    sharded = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                      "rollout.sleep=false", "rollout.tensor_parallel_size=2", capsys=capsys)  # fmt: skip
    weights = [_line_gib(out.stdout, "vLLM engine weights") for out in (awake, sharded)]
    assert "1/2 per rank" in sharded.stdout and abs(weights[1] - weights[0] / 2) < 0.02, weights
    assert _peak(sharded.stdout) < _peak(awake.stdout)


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
    # the export keeps every rollout round's RGB images, dropped groups' too (their patches are gone): 3 rounds
    seen = plan(shape, replace(grpo, seen_episodes=192))
    assert seen.host - p.host == pytest.approx((192 - 128) * 12 * rgb + (24 - 16) * rgb)  # 12 tool images each
    assert not plan(shape, replace(grpo, stage="sft")).host_lines
    monkeypatch.chdir(ROOT)
    done = _memory("--config", "configs/grpo/qwen2_5_vl_7b.yaml", "--world-size", 8, "--shape", "qwen2.5-vl-7b",
                   "--image-tokens", 972, capsys=capsys)  # fmt: skip
    # 8 prompts x 8 samples, twice while a dynamic-sampling refill round runs, three rounds' images for the export;
    # max_images 6: 5 tool images
    assert "16 groups x 17.4 MiB fp32 patches + 24 x 2.18 MiB RGB original at the model's size" in done.stdout
    assert "5 per episode: 128 x 17.4 MiB fp32 patches + 192 x 2.18 MiB RGB view" in done.stdout
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


# -- DPO: 2B sequences per micro-batch of B pairs, and the reference as the recipe holds it ------------------------

DPO_FSDP, DPO_LORA = "configs/dpo/qwen2_5_vl_3b_fsdp.yaml", "configs/dpo/qwen2_5_vl_3b_lora.yaml"


def _dpo_setup(config: str, *overrides: str, world_size: int = 8) -> Setup:
    args = build_parser().parse_args(["--config", config, "--world-size", str(world_size)])
    return setup_from_config(load_config(DPOConfig, ROOT / config, list(overrides)), args, "dpo")


def _by_name(p) -> dict[str, float]:
    return {name: value for name, value, _ in p.lines}


def test_a_dpo_micro_batch_of_b_pairs_plans_the_activations_of_2b_sequences():
    """One forward over the chosen and the rejected rows: twice the activations (text and vision) and head positions
    of SFT on the same B sequences at data.max_length, and the same weights, gradients and optimizer states."""
    shape = SHAPES["qwen2.5-vl-3b"]
    dpo = _dpo_setup(DPO_FSDP, "data.micro_batch_size=2")
    assert (dpo.micro_batch, dpo.seq_len, dpo.reference) == (4, 8192, "precomputed")
    sft = replace(dpo, stage="sft", micro_batch=2, reference=None)  # SFT of the same 2 sequences per side
    for change in ({}, {"freeze_vision": False}, {"gradient_checkpointing": False}, {"lm_head_chunk": 0}):
        d, s = _by_name(plan(shape, replace(dpo, **change))), _by_name(plan(shape, replace(sft, **change)))
        assert d["activations"] == pytest.approx(2 * s["activations"])
        assert d.get("vision activations", 0) == pytest.approx(2 * s.get("vision activations", 0))
        assert ("vision activations" in d) == ("freeze_vision" in change)
        for state in ("parameters", "gradients", "optimizer states", "gathered units"):
            assert d[state] == s[state]
        head = "LM head / log-prob buffers"
        assert d[head] == _by_name(plan(shape, replace(sft, micro_batch=4, **change)))[head]
        if change.get("lm_head_chunk") == 0:  # whole logits: the other 2 x 8192 x 0.5 positions' fp32 x 3 + bf16
            assert d[head] - s[head] == pytest.approx(2 * 8192 * 0.5 * shape.vocab * (3 * 4 + 2))
        else:  # one 1,024-position chunk at a time, whatever the batch
            assert d[head] == s[head]


def test_the_dpo_reference_adds_a_frozen_copy_only_where_the_recipe_loads_one(tiny_qwen25, capsys, monkeypatch):
    """As shipped, the 3B FSDP config precomputes the reference and the LoRA one disables the adapters: no reference
    weights. A frozen copy (dpo.precompute_ref=false) is fp32 shards plus its bf16 root unit, which FSDP2 leaves
    gathered after the copy's no-grad forward; under DDP a whole fp32 copy."""
    monkeypatch.chdir(ROOT)
    shape, at_8 = SHAPES["qwen2.5-vl-3b"], ("--world-size", 8, "--shape", "qwen2.5-vl-3b")
    pre = _memory("--config", DPO_FSDP, *at_8, capsys=capsys).stdout
    lora = _memory("--config", DPO_LORA, *at_8, capsys=capsys).stdout
    copy = _memory("--config", DPO_FSDP, *at_8, "dpo.precompute_ref=false", capsys=capsys).stdout
    for out in (pre, lora, copy):
        assert out.startswith("dpo memory plan per rank: ") and "1 x 2 x 8192" not in out
        assert "2 x 8192 tokens (1 pair: chosen and rejected)" in out and _peak(out) <= 80
    assert _lines(pre)["reference model"] == 0 and "dpo.precompute_ref" in pre
    assert _lines(lora)["reference model"] == 0 and "the policy with its adapters disabled" in lora
    # the root unit by hand: the tied embedding, the patch embedding, the 2x2 merger (its norm, 2 linears)
    root = 151936 * 2048 + 3 * 2 * 14 * 14 * 1280 + 1280 + (5120 * 5120 + 5120) + (5120 * 2048 + 2048)
    frozen = 4 * shape.params() / 8 + 2 * root
    exact = _by_name(plan(shape, _dpo_setup(DPO_FSDP, "dpo.precompute_ref=false")))
    assert exact["reference model"] == frozen
    assert _lines(copy)["reference model"] == round(frozen / GiB, 2) and "fp32 shards (1/8) + its bf16 root" in copy
    assert _peak(copy) == pytest.approx(_peak(pre) + frozen / GiB, abs=0.011)
    # one rank, DDP, fp32 (the tiny CPU config as shipped): the whole copy, as load_policy(dtype="float32") loads it
    tiny = _memory("--config", "configs/dpo/qwen2_5_vl_tiny_cpu.yaml", "--device", "cpu",
                   f"model.path={tiny_qwen25}", capsys=capsys).stdout  # fmt: skip
    params = shape_from_config_json(tiny_qwen25).params()
    assert "a frozen fp32 copy, whole on every rank" in tiny
    assert _lines(tiny)["reference model"] == round(4 * params / GiB, 2)
    assert "2 x 4096 tokens" not in tiny and "4 x 4096 tokens (2 pairs: chosen and rejected)" in tiny


def test_grpos_kl_reference_is_planned_as_dpos_frozen_copy(capsys, monkeypatch):
    """Both recipes load the reference the same way (load_sharded / load_policy in fp32): one plan for both."""
    monkeypatch.chdir(ROOT)
    at_8 = ("--world-size", 8, "--shape", "qwen2.5-vl-3b")
    grpo = _memory("--config", "configs/grpo/qwen2_5_vl_3b.yaml", *at_8, "grpo.kl_coef=0.05", capsys=capsys).stdout
    dpo = _memory("--config", DPO_FSDP, *at_8, "dpo.precompute_ref=false", capsys=capsys).stdout
    assert _lines(grpo)["reference model"] == _lines(dpo)["reference model"] > 2
    assert "the KL term's reference: a frozen copy in fp32 shards" in grpo
    lora = _memory("--config", "configs/grpo/qwen2_5_vl_3b_lora.yaml", *at_8, "grpo.kl_coef=0.05", capsys=capsys)
    assert _lines(lora.stdout)["reference model"] == 0 and "adapters disabled" in lora.stdout
    none = _memory("--config", "configs/grpo/qwen2_5_vl_3b.yaml", *at_8, capsys=capsys).stdout  # kl_coef 0
    assert "reference model" not in none


def test_a_frozen_fsdp_reference_keeps_its_root_unit_gathered_after_a_no_grad_forward(tiny_qwen25):
    """What the plan's FSDP reference term rests on (torch's FSDP2): the root's weights stay unsharded, in bf16, after
    a forward with no backward to reshard them; a decoder layer's go back to their fp32 shards."""
    import torch
    from torch.distributed.tensor import DTensor

    from vagent.training.distributed import DistEnv, shutdown
    from vagent.training.fsdp import load_sharded

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        reference = load_sharded(tiny_qwen25, env, bf16=True, prepare=lambda m: m.requires_grad_(False)).model
        text = reference.model.language_model
        assert isinstance(text.embed_tokens.weight, DTensor)
        ids = torch.randint(0, 100, (2, 16))
        with torch.no_grad():
            reference(input_ids=ids, attention_mask=torch.ones_like(ids))
        embed, layer = text.embed_tokens.weight, text.layers[0].self_attn.q_proj.weight
        assert not isinstance(embed, DTensor) and embed.dtype == torch.bfloat16
        assert isinstance(layer, DTensor) and layer.dtype == torch.float32
    finally:
        shutdown()


def test_grpo_and_dpo_refuse_deepspeeds_sharding(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for config in (DPO_FSDP, "configs/grpo/qwen2_5_vl_3b.yaml"):
        done = _memory("--config", config, "--shape", "qwen2.5-vl-3b", "--sharding", "zero3", check=False,
                       capsys=capsys)  # fmt: skip
        assert done.returncode == 2 and "does not train under DeepSpeed" in done.stderr and not done.stdout
    with pytest.raises(ValueError, match="2 sequences per pair"):
        plan(SHAPES["qwen2.5-vl-3b"], Setup(stage="dpo", micro_batch=3))

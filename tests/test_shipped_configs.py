"""Every shipped SFT, GRPO and DPO config runs on CPU as its model needs: the YAML as written, with only sizes overridden
(steps, batch, tokens, paths), on a tiny checkpoint with the structural choices of the model it targets (tied or
untied head, GQA ratio, windowed and full-attention vision blocks, Qwen's vocabulary: ``vagent.training.memory.SHAPES``,
the shapes ``vagent memory --shape`` knows). Configs launched with torchrun run on 2 ranks over gloo.

``MATRIX`` names every YAML under configs/sft/, configs/grpo/ and configs/dpo/ with its variants (KL on, temperature below 1, fp32,
text-only rows, two steps, GRPO's self-critic DPO term; a DPO config trains on preference pairs made from the same
rows); a YAML it does not name fails ``test_every_shipped_config_is_in_the_matrix``. Each run must
finish, log finite losses at every step (GRPO: an update at every step, the first-update ratio at 1, the sampler's
log-probs those the trainer scores), and leave a ``model/`` that ``load_policy`` loads, trained, with the frozen parts
unchanged and a tied head still tied; a LoRA run's adapter, applied to the base, gives that ``model/``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from data_pipelines.synthetic.pairs import wrong_answer_pairs
from data_pipelines.synthetic.zoom import zoom_rows
from vagent.config import DPOConfig, GRPOConfig, SFTConfig, load_config
from vagent.data import load_rows, write_rows
from vagent.model import is_vision_tower, load_policy
from vagent.training.memory import SHAPES, shape_from_config_json
from vagent.training.metrics import read_metrics
from vagent.training.publish import weights_dtype, write_model_as

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
STAGES = {"sft": SFTConfig, "grpo": GRPOConfig, "dpo": DPOConfig}
SHIPPED = sorted(f"{stage}/{p.name}" for stage in STAGES for p in (CONFIGS / stage).glob("*.yaml"))
# A config's target model, from its file name -> (the conftest fixture of its miniature, its SHAPES key)
TARGETS = {
    "3b": ("like_3b", "qwen2.5-vl-3b"),
    "7b": ("like_7b", "qwen2.5-vl-7b"),
    "32b": ("like_32b", "qwen2.5-vl-32b"),
    "8b": ("like_qwen3_8b", "qwen3-vl-8b"),
    "tiny": ("tiny_qwen25", None),
}
SIZE = (448, 336)  # small images keep a step quick; the tile stays 28 px (as in test_fsdp)


@dataclass(frozen=True)
class Variant:
    """A run of a config: ``extra`` overrides beyond the sizes (what the variant adds), the rows it trains on
    (``zoom``: images and gold crop trajectories; ``text``: no image anywhere), its steps, its ranks (None: 2 when
    the YAML's launch line is torchrun, else 1) and the bound on ``sampler_logprob_gap`` at every step (None: only
    finite and below the config's own ``grpo.max_sampler_gap``, which stops the run)."""

    name: str
    extra: tuple[str, ...] = ()
    rows: str = "zoom"
    steps: int = 1
    ranks: int | None = None
    max_gap: float | None = None


SHIPPED_AS_IS = Variant("as shipped")
# fp32 (the YAML's bf16 aside): the generation copy samples from exactly the trained weights. Measured on 2 ranks: gap
# 1.2e-7 and 1.3e-7 per token on like_3b under FSDP (bf16: 2.6e-4), 1.8e-7 on like_7b at T = 0.7 (bf16, T = 1: 1.8e-4)
FP32 = Variant("fp32", ("train.precision=fp32",), steps=2, max_gap=1e-3)
# below 1 the trainer must score softmax(z / T), the distribution the rollouts were drawn from
FP32_T07 = Variant("fp32, temperature 0.7", (*FP32.extra, "rollout.temperature=0.7"), max_gap=1e-3)
KL = Variant("kl", ("grpo.kl_coef=0.05",))
TEXT_ONLY = Variant("text-only", rows="text")
# Tool-Star's self-critic DPO term in each update (a random policy's 8-token turns are all cut by a cap, and a capped
# trajectory is chosen only with capped_chosen); the second step samples from the weights that update moved
SELF_CRITIC = Variant("self-critic", ("grpo.self_critic.enabled=true", "grpo.self_critic.capped_chosen=true"), steps=2)
MATRIX: dict[str, tuple[Variant, ...]] = {
    # its DDP alternative too: bf16 autocast over fp32 masters from a bf16 checkpoint, the frozen tower kept bit for bit
    "sft/qwen2_5_vl_3b_fsdp.yaml": (SHIPPED_AS_IS, TEXT_ONLY, Variant("ddp", ("train.sharding=ddp",))),
    "sft/qwen2_5_vl_3b_lora.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_3b_zero2.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_3b_zero3.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_7b_fsdp.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_7b_lora.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_7b_zero2.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_7b_zero3.yaml": (SHIPPED_AS_IS,),
    "sft/qwen2_5_vl_32b_lora_fsdp.yaml": (SHIPPED_AS_IS, TEXT_ONLY),
    "sft/qwen3_vl_8b_fsdp.yaml": (SHIPPED_AS_IS, TEXT_ONLY),
    # full fine-tuning under DDP on 2 ranks (its launch line's alternative): text-only micro-batches leave the
    # vision merger without a gradient unless every forward runs the tower ("Expected to have finished reduction",
    # raised by the second step's forward: two steps)
    "sft/qwen2_5_vl_tiny_cpu.yaml": (SHIPPED_AS_IS, Variant("text-only, 2 ranks", rows="text", ranks=2, steps=2)),
    "grpo/qwen2_5_vl_3b.yaml": (SHIPPED_AS_IS, FP32, KL, TEXT_ONLY, SELF_CRITIC),
    "grpo/qwen2_5_vl_3b_lora.yaml": (Variant("as shipped", steps=2), KL, TEXT_ONLY, SELF_CRITIC),
    "grpo/qwen2_5_vl_7b.yaml": (SHIPPED_AS_IS, FP32_T07),
    "grpo/qwen2_5_vl_7b_lora.yaml": (SHIPPED_AS_IS,),
    "grpo/qwen2_5_vl_7b_lora_fsdp.yaml": (Variant("as shipped", steps=2), KL, FP32),
    "grpo/qwen3_vl_8b.yaml": (SHIPPED_AS_IS, FP32, KL, TEXT_ONLY),
    "grpo/qwen2_5_vl_tiny_cpu.yaml": (
        SHIPPED_AS_IS,
        Variant("text-only, 2 ranks", rows="text", ranks=2, steps=2),
        Variant("self-critic", SELF_CRITIC.extra),  # one step: its two are test_self_critic's
    ),
    # preference pairs: a gold trajectory and the same turns ending in a wrong answer (data_pipelines.synthetic.pairs)
    "dpo/qwen2_5_vl_3b_fsdp.yaml": (SHIPPED_AS_IS,),
    "dpo/qwen2_5_vl_3b_lora.yaml": (SHIPPED_AS_IS,),
    "dpo/qwen2_5_vl_7b_fsdp.yaml": (SHIPPED_AS_IS,),
    "dpo/qwen2_5_vl_tiny_cpu.yaml": (SHIPPED_AS_IS, Variant("text-only, 2 ranks", rows="text", ranks=2, steps=2)),
}


def even_tokens(trajectories, rows):
    """Toy reward (test_grpo's): the share of sampled token ids that are even. A random model samples about half
    even ids, so rewards spread within every group and every step updates."""
    out = []
    for t in trajectories:
        ids = [i for m in t.messages if m.role == "assistant" for i, s in zip(m.token_ids, m.sampled, strict=True) if s]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
    return out


def _launch_line(config: str) -> str:
    return (CONFIGS / config).read_text().splitlines()[0]


def _ranks(config: str, variant: Variant) -> int:
    """2 for a config launched with torchrun (its sharding needs more than one rank to mean anything), else 1."""
    if variant.ranks is not None:
        return variant.ranks
    return 2 if _launch_line(config).startswith("# Launch: torchrun") else 1


def _target(config: str) -> tuple[str, str | None]:
    words = Path(config).stem.split("_")
    found = [TARGETS[w] for w in words if w in TARGETS]
    assert len(found) == 1, f"{config}: no miniature of its model in TARGETS (name it after one of {list(TARGETS)})"
    return found[0]


def _cases():
    for config, variants in MATRIX.items():
        for variant in variants:
            marks = [pytest.mark.slow] if _ranks(config, variant) > 1 else []  # 2 ranks: tens of seconds each
            yield pytest.param(config, variant, marks=marks, id=f"{config.replace('/', '-')[:-5]}-{variant.name}")


def test_every_shipped_config_is_in_the_matrix():
    """A YAML added under configs/sft/, configs/grpo/ or configs/dpo/ without a run here is a failure, not an untested
    config."""
    assert SHIPPED, "configs/sft, configs/grpo and configs/dpo hold no YAML"
    missing, stale = sorted(set(SHIPPED) - set(MATRIX)), sorted(set(MATRIX) - set(SHIPPED))
    assert not missing, f"shipped configs no test runs (add them to MATRIX): {missing}"
    assert not stale, f"MATRIX names configs that are not shipped: {stale}"
    for config, variants in MATRIX.items():
        assert any(v.name == "as shipped" and not v.extra and v.rows == "zoom" for v in variants), config
        _target(config)


# -- data -------------------------------------------------------------------------------------------------------

# Text-only rows: no image in the prompt or the gold turns (a question the model answers from text).
TEXT_QA = [("What is 2 + 3?", "5"), ("Which is larger, 7 or 4?", "7"), ("What is 6 minus 1?", "5"),
           ("How many sides has a triangle?", "3"), ("What is 2 times 4?", "8"), ("What is 9 minus 7?", "2")]  # fmt: skip


def _text_rows(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"text-{i}", "source": "test/text", "images": [], "videos": [], "question": q, "answer": a,
             "answer_type": "exact", "tools": [],
             "messages": [{"role": "assistant", "content": f"<think>Plain arithmetic.</think>\n<answer>{a}</answer>"}]}
            for i, (q, a) in enumerate(TEXT_QA)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(rows: Path, pool: Path) -> Path:
    """Preference rows beside ``rows``: each gold trajectory chosen, the same turns with the answer of another row of
    ``rows`` or ``pool`` rejected."""
    own = load_rows(rows)
    pairs, _ = wrong_answer_pairs([*own, *(r for r in load_rows(pool) if r.id not in {o.id for o in own})], seed=0)
    pairs = [p for p in pairs if p.id in {o.id for o in own}]
    assert pairs, f"{rows}: no row with another answer to draw a wrong one from"
    return write_rows(pairs, rows.with_name(f"{rows.stem}-pairs.jsonl"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """``(kind, checkpoint) -> (train, val)`` JSONL paths, each written once: zoom rows in the checkpoint's frame, or
    text-only rows; ``pairs=True`` gives their preference pairs (``_pairs``)."""
    root = tmp_path_factory.mktemp("shipped-data")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}
    frames: dict[Path, dict] = {}

    def make(kind: str, checkpoint: Path, pairs: bool = False) -> tuple[Path, Path]:
        if kind == "zoom" and checkpoint not in frames:
            frames[checkpoint] = load_policy(checkpoint, device="cpu").frame
        frame = frames[checkpoint] if kind == "zoom" else {}
        key = (kind, json.dumps(frame, sort_keys=True))  # the miniatures share the tiny model's frame: rows once
        if key not in made:
            out = root / f"{kind}-{len(made)}"
            if kind == "text":
                made[key] = _text_rows(out / "train.jsonl"), _text_rows(out / "val.jsonl")
            else:
                make_rows = lambda n, seed: zoom_rows(out, n, seed=seed, size=SIZE, clutter=20, **frame)  # noqa: E731
                made[key] = (write_rows(make_rows(8, 0), out / "train.jsonl"),
                             write_rows(make_rows(2, 1), out / "val.jsonl"))  # fmt: skip
        if pairs:
            train, val = made[key]
            return _pairs(train, val), _pairs(val, train)
        return made[key]

    return make


@pytest.fixture(scope="module")
def in_bf16(tmp_path_factory):
    """``checkpoint -> its copy in bf16``, made once: a config that trains in bf16 starts, as on the released
    checkpoints, from bf16 weights (so the published model must come back in bf16, its frozen parts bit for bit)."""
    root, made = tmp_path_factory.mktemp("bf16"), {}

    def make(checkpoint: Path) -> Path:
        if checkpoint not in made:
            made[checkpoint] = root / checkpoint.name
            write_model_as(checkpoint, made[checkpoint], torch.bfloat16)
        return made[checkpoint]

    return make


# -- running ----------------------------------------------------------------------------------------------------


def _overrides(stage: str, shipped, out: Path, model: Path, shape_name: str | None, train: Path, val: Path,
               steps: int) -> list[str]:  # fmt: skip
    """Sizes and paths only: every structural choice of the YAML (sharding, LoRA, DeepSpeed, precision, gradient
    checkpointing, the chunked head, frozen vision, clipping, dynamic sampling, a fixed KV storage, ...) stays."""
    sizes = [f"out_dir={out}", f"model.path={model}", "model.device=cpu", f"data.train={train}",
             f"train.max_steps={steps}", "train.tensorboard=false", "train.log_every=1"]  # fmt: skip
    if stage in ("sft", "dpo"):
        return [*sizes, f"data.val={val if shipped.data.val else 'null'}", "optim.grad_accum=1", "data.num_workers=1"]
    # a random policy's groups all get reward 0 from the real rewards and dynamic sampling would drop every one:
    # the toy reward spreads within each group, the config's own rewards still run and are logged
    weights = {**shipped.rewards.weights, "even_tokens": 1.0}
    # 4 samples of 8 tokens: a group's even-id shares almost never all agree; max_turns 1: a random model calls no tool
    sizes += ["rollout.max_turns=1", "rollout.max_new_tokens=8", "grpo.group_size=4", "grpo.prompts_per_step=1",
              "grpo.rollout_batch_size=4", f"rewards.weights={json.dumps(weights)}"]  # fmt: skip
    if shipped.rollout.backend == "vllm":  # this environment has no vLLM, and vLLM's CPU attention no head_dim 8: these
        sizes.append("rollout.backend=hf")  # configs roll out on vLLM in test_vllm_grpo.py, on head_dim-32 miniatures
    if shipped.grpo.mask_truncated:  # 8-token turns of a random policy are all cut by max_tokens: over-turn masking
        sizes.append("grpo.mask_truncated=false")  # would train on none of them (its own test is in test_grpo.py)
    if shipped.rollout.kv_cache_gb is not None:
        sizes.append(f"rollout.kv_cache_gb={_kv_budget(shipped.rollout.kv_cache_gb, model, shape_name)}")
    return sizes


def _kv_budget(gib: float, checkpoint: Path, shape_name: str | None) -> float:
    """A KV budget scaled by the miniature's KV bytes per token over its model's: the storage, allocated whole at the
    first rollout, holds as many episodes of ``max_total_tokens`` as on the real model (16 GiB of zeros on a CPU
    runner would be an OOM, not a test)."""
    assert shape_name is not None, "a KV budget for a model without a shape in SHAPES: scale it here"
    per_token = lambda shape: shape.layers * shape.kv_dim  # noqa: E731
    return gib * per_token(shape_from_config_json(checkpoint)) / per_token(SHAPES[shape_name])


# The recipes under torchrun: the child registers the toy reward, then runs the recipe's command line.
CHILD = """
import sys
sys.path.insert(0, {tests!r})
stage = sys.argv[1]
if stage == "grpo":
    import vagent.rewards as rewards
    from test_shipped_configs import even_tokens
    from vagent.recipes import grpo as recipe
    rewards.REWARDS["even_tokens"] = even_tokens
elif stage == "dpo":
    from vagent.recipes import dpo as recipe
else:
    from vagent.recipes import sft as recipe
recipe.main(sys.argv[2:])
"""


def _run(tmp_path: Path, stage: str, config: Path, overrides: list[str], ranks: int, monkeypatch) -> None:
    if ranks == 1:  # in this process: no interpreter start, no imports
        from vagent.recipes import dpo, grpo, sft
        from vagent.rewards import REWARDS

        monkeypatch.setitem(REWARDS, "even_tokens", even_tokens)
        recipe = {"grpo": grpo, "sft": sft, "dpo": dpo}[stage]
        recipe.train(load_config(STAGES[stage], config, overrides))
        return
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [*launcher, str(script), stage, "--config", str(config), *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert f" {ranks} rank(s) x " in result.stdout, result.stdout[-2000:]  # the recipe saw the world torchrun made


def _state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_policy(path, device="cpu", dtype="float32").model.state_dict().items()}


def _check_miniature(checkpoint: Path, shape_name: str | None) -> None:
    """The checkpoint has the structural choices of the target model (``SHAPES``): tie, GQA ratio, Qwen's
    tokenizer, a windowed and a full-attention vision block."""
    if shape_name is None:
        return
    shape, config = SHAPES[shape_name], json.loads((checkpoint / "config.json").read_text())
    mini = shape_from_config_json(checkpoint / "config.json")
    assert mini.tied == shape.tied and mini.layout == shape.layout
    assert mini.heads // mini.kv_heads == shape.heads // shape.kv_heads
    vision = config["vision_config"]
    if shape.layout == "qwen3-vl":  # DeepStack features, a position table, 16-px patches, interleaved mRoPE
        assert mini.deepstack >= 1 and mini.position_embeddings > 0 and mini.patch == shape.patch == 16
        assert config["text_config"]["rope_parameters"]["mrope_interleaved"]
        assert load_policy(checkpoint, device="cpu").coord_convention == "norm1000"  # the tools' boxes: 0-1000
    else:
        assert 0 < len(vision["fullatt_block_indexes"]) < vision["depth"]  # windowed blocks and full-attention ones
    assert mini.vocab >= 151_665  # every id of Qwen's tokenizer has its row


def _check_metrics(stage: str, out: Path, variant: Variant, kl: bool, critic: bool = False) -> None:
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "lr" in r]  # SFT's final eval_loss is a record of its own
    assert [r["step"] for r in steps] == list(range(1, variant.steps + 1)), records
    for r in steps:
        assert "loss" in r and math.isfinite(r["loss"]), f"step {r['step']} trained nothing: {r}"
        assert math.isfinite(r["grad_norm"]), r
        if stage == "grpo":
            assert r["ratio_check"] < 1e-3, r  # the old log-probs were scored by the weights that update
            assert math.isfinite(r["sampler_logprob_gap"]), r
            if variant.max_gap is not None:
                assert r["sampler_logprob_gap"] < variant.max_gap, r
            assert ("kl" in r) == kl and math.isfinite(r.get("kl", 0.0)), r
            if critic:  # the self-critic term found pairs and joined the update (ranks in lockstep)
                assert r["dpo/pairs"] >= 1 and math.isfinite(r["dpo/loss"]) and math.isfinite(r["dpo/reward_margin"]), r


def _check_model(out: Path, start: Path, shipped, steps: int) -> None:
    """``model/`` loads, trained, in the starting checkpoint's dtype whatever the backend (DDP, FSDP, ZeRO-2/3, LoRA);
    the frozen ViT blocks are unchanged bit for bit; a tied head is still tied; a LoRA run's adapter on the base gives
    ``model/`` (up to the rounding of a bf16 base)."""
    # the weights themselves (their safetensors headers), not what config.json says: one dtype, the start's
    assert weights_dtype(out / "model") == weights_dtype(start) and weights_dtype(start) is not None
    assert weights_dtype(out / "model") == getattr(
        torch, json.loads((out / "model" / "config.json").read_text())["dtype"]
    )
    saved = out / "checkpoints" / f"step-{steps:08d}" / "model"
    if saved.is_dir():  # a checkpoint keeps the fp32 masters (DeepSpeed's too, not its bf16 module)
        assert weights_dtype(saved) == torch.float32
    policy = load_policy(out / "model", device="cpu", dtype="float32")
    after, before = policy.model.state_dict(), _state(start)
    assert after.keys() == before.keys()
    assert all(torch.isfinite(v).all() for v in after.values())
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "no weight moved"
    if shipped.train.freeze_vision:
        vit = {k for k in before if is_vision_tower(k)}
        assert vit and not vit & changed, sorted(vit & changed)[:5]
    model = policy.model
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    if shipped.train.lora.enabled:
        from peft import PeftModel

        adapter = out / "checkpoints" / f"step-{steps:08d}" / "adapter"
        base = load_policy(start, device="cpu", dtype="float32").model
        merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
        dtype = weights_dtype(start)  # the merge is rounded to the base's dtype once
        for key, value in after.items():
            assert torch.allclose(
                merged[key].to(dtype).float(), value, atol=1e-6 if dtype == torch.float32 else 1e-2
            ), key


@pytest.mark.parametrize(("config", "variant"), list(_cases()))
def test_a_shipped_config_runs_on_a_miniature_of_its_model(request, tmp_path, rows, monkeypatch, config, variant):
    stage = config.split("/")[0]
    shipped = load_config(STAGES[stage], CONFIGS / config)
    fixture, shape_name = _target(config)
    checkpoint = request.getfixturevalue(fixture)
    if shipped.train.precision == "bf16":
        checkpoint = request.getfixturevalue("in_bf16")(checkpoint)
    _check_miniature(checkpoint, shape_name)
    train, val = rows(variant.rows, checkpoint, pairs=stage == "dpo")
    out = tmp_path / "run"
    overrides = [*_overrides(stage, shipped, out, checkpoint, shape_name, train, val, variant.steps), *variant.extra]
    _run(tmp_path, stage, CONFIGS / config, overrides, _ranks(config, variant), monkeypatch)
    ran = load_config(STAGES[stage], CONFIGS / config, overrides)
    grpo = stage == "grpo"
    _check_metrics(stage, out, variant, kl=grpo and ran.grpo.kl_coef > 0, critic=grpo and ran.grpo.self_critic.enabled)
    _check_model(out, checkpoint, shipped, variant.steps)

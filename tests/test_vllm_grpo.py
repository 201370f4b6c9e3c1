"""GRPO rolling out on vLLM (``rollout.backend=vllm``), on vLLM's CPU build: the engine gets the trained weights after
every update (the second step's sampler gap is that of the same weights, and a skipped sync is caught), LoRA and a
tied head sync, two FSDP ranks each run their own engine, and no engine outlives its run.

Run in the vLLM environment (``tests/test_vllm_backend.py`` says how); fp32 and the ``small`` preset.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from PIL import Image

import tests.vllm_required  # noqa: F401  (fails, or skips, this module without vLLM)
from data_pipelines.synthetic.zoom import zoom_rows
from vagent.config import GRPOConfig, load_config
from vagent.data import write_rows
from vagent.model import load_policy, masked_token_logprobs
from vagent.recipes import grpo
from vagent.rollout import RolloutLimits, Task, run
from vagent.rollout.vllm_backend import VLLMBackend
from vagent.tiny_model import build_tiny_checkpoint
from vagent.training.adapters import apply_lora
from vagent.training.metrics import read_metrics
from vagent.training.weight_sync import generation_weights

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
SIZE = (224, 168)  # small images keep a step quick


def even_tokens(trajectories, rows):
    """Toy reward (test_grpo's): the share of sampled token ids that are even; it spreads within every group of a
    random model, so every step updates."""
    out = []
    for t in trajectories:
        ids = [i for m in t.messages if m.role == "assistant" for i, s in zip(m.token_ids, m.sampled, strict=True) if s]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
    return out


@pytest.fixture(scope="module")
def rows(small, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-rows")
    frame = load_policy(small, device="cpu").frame
    return write_rows(zoom_rows(out, 8, seed=0, size=SIZE, clutter=10, **frame), out / "train.jsonl")


def _overrides(out_dir: Path, model: Path, rows: Path, *extra: str) -> list[str]:
    # lr 1e-3: one update moves the sampled tokens' log-probs far past the 1e-3 gap a stale engine must show
    return [f"out_dir={out_dir}", f"model.path={model}", f"data.train={rows}", "rollout.backend=vllm",
            "train.max_steps=2", "train.save_every=0", "train.save_final=false", "train.tensorboard=false",
            "train.precision=fp32", "optim.lr=1e-3", "optim.warmup_steps=0", "rollout.max_turns=2",
            "rollout.max_new_tokens=12", "grpo.inner_updates=2", "grpo.max_sampler_gap=1e-3",
            "rewards.weights={even_tokens: 1.0}", "rewards.options={}", *extra]  # fmt: skip


def _vllm_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "vllm" in " ".join(p.cmdline()).lower()]


def test_each_step_samples_from_the_weights_the_last_update_made(tmp_path, small, rows, monkeypatch):
    """Two steps with two update passes each (the old log-probs are scored, so the gap is checked before any update):
    at both steps the engine's log-probs are the trainer's (gap < 1e-3; fp32 measures ~1e-6), the sync is timed,
    the rollout-correction statistics are logged (token TIS on), and the engine is gone after the run."""
    monkeypatch.setitem(grpo.REWARDS, "even_tokens", even_tokens)
    cfg = load_config(GRPOConfig, CONFIG, _overrides(tmp_path, small, rows, "grpo.rollout_correction=token_tis"))
    grpo.train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["sampler_logprob_gap"] < 1e-3, r["sampler_logprob_gap"]
        assert r["grad_norm"] > 0
        assert 0.99 < r["rollout_corr/is_ratio_mean"] < 1.01 and r["rollout_corr/clipped_share"] == 0
        assert 0 <= r["rollout_corr/kl"] < 1e-4 and r["rollout_corr/is_ratio_max"] < 1.01
    assert not _vllm_children()


def test_an_engine_left_with_the_old_weights_stops_the_run_at_the_next_step(tmp_path, small, rows, monkeypatch):
    """The same run with the sync after the first update skipped: the second step's rollouts come from the old
    weights, and the sampler gap check stops the run before that step trains (so the test above can fail)."""
    monkeypatch.setitem(grpo.REWARDS, "even_tokens", even_tokens)
    load = VLLMBackend.load_weights
    calls = []

    def first_only(self, weights):
        calls.append(1)
        if len(calls) == 1:
            return load(self, weights)
        for _ in weights:  # consumed, as a real sync is, but never loaded
            pass
        return 0.0

    monkeypatch.setattr(VLLMBackend, "load_weights", first_only)
    cfg = load_config(GRPOConfig, CONFIG, _overrides(tmp_path, small, rows))
    with pytest.raises(grpo.SamplerMismatch, match="step 2"):
        grpo.train(cfg)
    assert len(calls) == 2
    assert not _vllm_children()


def test_lora_adapters_and_a_tied_head_reach_the_engine(tmp_path):
    """A tied-head checkpoint with LoRA adapters (random B, so they change the output): the merged weights streamed
    into the engine give the log-probs the adapted HF model scores, to 1e-5 at T = 0.7."""
    tied = build_tiny_checkpoint(tmp_path / "tied", size="small", tie_embeddings=True, seed=1)
    policy = load_policy(tied, device="cpu", dtype="float32")
    assert policy.model.config.get_text_config().tie_word_embeddings
    engine = VLLMBackend.for_policy(policy, max_model_len=2048, max_num_seqs=4, max_images=2)
    try:
        policy.model = apply_lora(
            policy.model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"]
        )
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        names = [name for name, _ in generation_weights(policy.model)]
        assert not any("lora_" in n or "base_layer" in n for n in names) and "lm_head.weight" not in names
        engine.load_weights(generation_weights(policy.model))
        limits = RolloutLimits(max_turns=1, max_new_tokens=24, temperature=0.7)
        task = Task(id="t", images=[Image.new("RGB", (112, 112), (200, 40, 40))], question="What color?")
        out = run(policy, [task], 3, limits, batch_size=3, backend=engine)
        min_pixels, max_pixels = policy.pixel_budget
        from vagent.data import encode_messages
        from vagent.data.batching import collate

        for t in out:
            enc = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                                  factor=policy.image_factor)  # fmt: skip
            with torch.no_grad():
                trainer, _ = masked_token_logprobs(policy.model, collate([enc], 0), enc.loss_mask[None],
                                                   temperature=0.7, suppress=tuple(policy.vision_placeholder_ids))  # fmt: skip
            mask = enc.loss_mask.bool()
            assert float((trainer[0][mask] - torch.tensor(t.logprobs)[mask]).abs().max()) < 1e-5
        # and the adapters matter: the base model's log-probs of the same tokens are far off
        with torch.no_grad(), policy.model.disable_adapter():
            base, _ = masked_token_logprobs(policy.model, collate([enc], 0), enc.loss_mask[None], temperature=0.7,
                                            suppress=tuple(policy.vision_placeholder_ids))  # fmt: skip
        assert float((base[0][mask] - torch.tensor(t.logprobs)[mask]).abs().mean()) > 1e-2
    finally:
        engine.close()


CHILD = """
import sys
from vagent.recipes import grpo
sys.path.insert(0, sys.argv[1])
from test_vllm_grpo import even_tokens
grpo.REWARDS["even_tokens"] = even_tokens
grpo.main(sys.argv[2:])
"""


def _torchrun(tmp_path: Path, args: list[str]) -> None:
    """GRPO's command line ``args`` on two ranks (torchrun, gloo), with the toy reward; it must exit 0."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*launcher, str(script), str(ROOT / "tests"), *args], capture_output=True, text=True,
                          env=env, timeout=900, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


def test_two_fsdp_ranks_each_roll_out_on_their_own_engine(tmp_path, small, rows):
    """torchrun, 2 ranks over gloo, FSDP2: each rank's engine is given the gathered full weights at every step (the
    gap, summed over both ranks, stays that of the same weights) and no engine process outlives the run."""
    args = ["--config", str(CONFIG), *_overrides(tmp_path / "run", small, rows, "train.sharding=fsdp",
                                                 "grpo.prompts_per_step=1")]  # fmt: skip
    before = {p.pid for p in psutil.process_iter()}
    _torchrun(tmp_path, args)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sampler_logprob_gap"] < 1e-3 for r in records), [r["sampler_logprob_gap"] for r in records]
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and "child.py" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, f"processes left after the run: {left}"


@pytest.mark.slow  # 25 s; the request stream and the sync into both shards are in test_vllm_backend's default run
def test_two_ranks_shard_one_engine_with_tensor_parallelism(tmp_path, small, rows):
    """rollout.tensor_parallel_size=2 on 2 FSDP ranks: one engine sharded over both, each rank rolling out its own
    prompts (multi-turn, tool calls returning when they do) on the group's one request stream, the weights synced to
    both shards at every step: the sampler gap stays that of the same weights at both steps, so each rank got back
    the tokens its own rows sampled, from the trained weights."""
    run = tmp_path / "run"
    args = ["--config", str(CONFIG), *_overrides(run, small, rows, "train.sharding=fsdp", "grpo.prompts_per_step=1",
                                                 "rollout.tensor_parallel_size=2")]  # fmt: skip
    _torchrun(tmp_path, args)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sampler_logprob_gap"] < 1e-3 for r in records), [r["sampler_logprob_gap"] for r in records]


@pytest.mark.slow  # two ranks, each starting an engine over Qwen's 151,936-row vocabulary: about 3 minutes
def test_the_3b_config_as_shipped_rolls_out_on_vllm_on_two_ranks(tmp_path, rows):
    """configs/grpo/qwen2_5_vl_3b.yaml (FSDP2, vLLM, token TIS, a fixed KV cache) with only sizes overridden, on a
    miniature of the 3B with its structural choices (tied head, GQA 8:1, Qwen's vocabulary) at head_dim 32: two
    steps on two CPU ranks, in fp32 (bf16 on a CPU is not what the gap bound is about), the gap below 1e-3 at each."""
    from vagent.tiny_model import TinyPreset

    preset = TinyPreset(hidden=256, layers=2, heads=8, kv_heads=1, intermediate=512, vision_hidden=32, vision_depth=2,
                        vision_heads=2)  # fmt: skip
    model = build_tiny_checkpoint(tmp_path / "like_3b", vocab="qwen", preset=preset, tie_embeddings=True)
    weights = "{accuracy: 1.0, format: 0.2, crop_iou: 0.5, tool_bonus: 0.2, invalid_calls: 0.2, call_budget: 1.0, overlong: 1.0, even_tokens: 1.0}"
    args = ["--config", str(ROOT / "configs" / "grpo" / "qwen2_5_vl_3b.yaml"), f"out_dir={tmp_path / 'run'}",
            f"model.path={model}", "model.device=cpu", f"data.train={rows}", "train.max_steps=2",
            "train.tensorboard=false", "train.save_final=false", "train.precision=fp32", "rollout.max_turns=1",
            "rollout.max_new_tokens=8", "rollout.kv_cache_gb=1", "grpo.group_size=4", "grpo.prompts_per_step=1",
            "grpo.rollout_batch_size=4", "grpo.mask_truncated=false", "grpo.max_sampler_gap=1e-3",
            f"rewards.weights={weights}"]  # fmt: skip
    _torchrun(tmp_path, args)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sampler_logprob_gap"] < 1e-3 for r in records), [r["sampler_logprob_gap"] for r in records]


def test_an_engine_put_to_sleep_is_given_the_weights_again_even_when_no_step_trained(tmp_path, small, rows,
                                                                                    monkeypatch):  # fmt: skip
    """GPU sleep (level 2) drops the engine's weights. Played on the CPU (where vLLM ignores sleep): a run whose rewards
    never differ trains nothing, yet every rollout after the engine slept first gives it the weights again."""
    monkeypatch.setitem(grpo.REWARDS, "flat", lambda trajectories, rows: [0.0] * len(trajectories))
    monkeypatch.setattr(VLLMBackend, "sleep", lambda self: setattr(self, "sleeping", True))
    load = VLLMBackend.load_weights
    calls = []

    def counting(self, weights):
        calls.append(self.sleeping)
        return load(self, weights)

    monkeypatch.setattr(VLLMBackend, "load_weights", counting)
    cfg = load_config(GRPOConfig, CONFIG, [*_overrides(tmp_path, small, rows), "rewards.weights={flat: 1.0}"])
    grpo.train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["kept_groups"] for r in records] == [0, 0]  # nothing trained
    assert calls == [False, True]  # the first sync at the start, then one because the engine slept


def test_the_sleep_cycle_wakes_weights_then_kv_cache_around_the_sync(policy_engine):
    """free_storage puts a GPU engine to sleep (level 2); it refuses turns until load_weights wakes it, weights first,
    then the KV cache (TRL's and verl's order). vLLM's own calls are recorded (the CPU build ignores sleep)."""
    policy, engine = policy_engine
    calls = []
    engine._sleep = True
    engine.llm.sleep = lambda level: calls.append(("sleep", level))
    engine.llm.wake_up = lambda tags: calls.append(("wake_up", tuple(tags)))
    try:
        engine.free_storage()
        assert engine.sleeping and calls == [("sleep", 2)]
        with pytest.raises(RuntimeError, match="asleep"):
            run(policy, [Task(id="t", images=[Image.new("RGB", (112, 112))], question="?")],
                limits=RolloutLimits(max_turns=1, max_new_tokens=4, temperature=0.0), backend=engine)  # fmt: skip
        engine.load_weights(generation_weights(policy.model))
        assert calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
        assert not engine.sleeping
    finally:
        engine._sleep = False
        del engine.llm.sleep, engine.llm.wake_up


@pytest.fixture(scope="module")
def policy_engine(small):
    policy = load_policy(small, device="cpu", dtype="float32")
    engine = VLLMBackend.for_policy(policy, max_model_len=2048, max_num_seqs=4, max_images=2)
    yield policy, engine
    engine.close()

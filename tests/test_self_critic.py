"""Self-critic DPO inside GRPO (Tool-Star): the pair rule on hand-written groups, the DPO step on a tiny checkpoint (it
raises its pairs' chosen-over-rejected log-ratio; capped and masked trajectories; the extra optimizer step outside the
schedule), GRPO with it on and off, and 2 ranks that find different numbers of pairs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vagent.algorithms import self_critic_pairs
from vagent.config import ConfigError, GRPOConfig, load_config
from vagent.data.encode import encode_messages
from vagent.model import load_policy, masked_token_logprobs
from vagent.training.backend import DDPBackend, build_optimizer, warmup_cosine
from vagent.training.distributed import DistEnv
from vagent.training.metrics import read_metrics
from vagent.training.self_critic import self_critic_step
from vagent.types import ContentPart, Message

ROOT = Path(__file__).resolve().parent.parent
GRPO_CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

# -- the pair rule ---------------------------------------------------------------------------------------------------


def _pairs(rewards, group_size=4, **kwargs):
    return self_critic_pairs(torch.tensor(rewards), group_size, **kwargs)


def test_each_group_pairs_its_best_against_its_worst_in_group_order():
    rewards = [0.1, 0.9, 0.4, 0.0,  # group 0: best 1, worst 3
               1.0, 0.2, 0.3, 0.6]  # group 1: best 4, worst 5  # fmt: skip
    assert _pairs(rewards) == [(1, 3), (4, 5)]


def test_ties_pick_the_earlier_sample_on_both_sides():
    assert _pairs([0.0, 1.0, 1.0, 0.0]) == [(1, 0)]
    assert _pairs([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.2]) == [(0, 2), (4, 7)]


def test_a_group_of_equal_rewards_makes_no_pair_even_at_margin_zero():
    assert _pairs([0.5] * 4) == []
    assert _pairs([0.3, 0.1 + 0.2, 0.3, 0.3]) == []  # 0.1 + 0.2 != 0.3 in floats: noise is no preference
    assert _pairs([0.5] * 4 + [1.0, 0.0, 0.0, 0.0] + [0.0] * 4) == [(4, 5)]  # only the middle group of three


def test_the_gap_must_exceed_the_margin():
    rewards = [1.0, 0.5, 0.5, 0.5,  0.8, 0.0, 0.8, 0.8]  # gaps 0.5 and 0.8  # fmt: skip
    assert _pairs(rewards, margin=0.49) == [(0, 1), (4, 5)]
    assert _pairs(rewards, margin=0.5) == [(4, 5)]  # a gap equal to the margin does not exceed it
    assert _pairs(rewards, margin=0.8) == []


def test_a_capped_sample_is_never_chosen_but_may_be_rejected():
    rewards = [1.0, 0.0, 0.6, 0.3,  0.9, 0.2, 0.5, 0.7]  # fmt: skip
    capped = torch.tensor([True, False, False, False, False, True, False, False])
    # group 0: the capped best gives way to the best that finished (2); group 1: the capped worst is still rejected
    assert _pairs(rewards, can_choose=~capped) == [(2, 1), (4, 5)]
    # a group whose only finished sample is its worst makes no pair (it would be chosen against itself)
    assert _pairs([1.0, 0.8, 0.0], 3, can_choose=torch.tensor([False, False, True])) == []
    # a sample without trained tokens (over-turn masking) is on neither side
    masked = torch.tensor([False, True, False, False, False, False, False, False])
    assert _pairs(rewards, can_choose=~capped & ~masked, can_reject=~masked) == [(2, 3), (4, 5)]


def test_max_pairs_keeps_the_largest_gaps_in_group_order():
    rewards = [0.2, 0.0,  1.0, 0.0,  0.5, 0.0,  1.0, 0.0]  # gaps 0.2, 1.0, 0.5, 1.0  # fmt: skip
    assert _pairs(rewards, 2, max_pairs=2) == [(2, 3), (6, 7)]
    assert _pairs(rewards, 2, max_pairs=3) == [(2, 3), (4, 5), (6, 7)]
    assert _pairs(rewards, 2, max_pairs=9) == _pairs(rewards, 2)


def test_bad_pair_rule_arguments_are_errors():
    with pytest.raises(ValueError, match="group_size"):
        _pairs([1.0, 0.0, 0.5], 2)
    with pytest.raises(ValueError, match="margin"):
        _pairs([1.0, 0.0], 2, margin=-0.1)


@pytest.mark.parametrize(("override", "message"), [("every=0", "every"), ("margin=-1", "margin"),
                                                   ("beta=0", "beta"), ("lr_scale=0", "lr_scale"),
                                                   ("loss_type=hinge", "loss_type")])  # fmt: skip
def test_bad_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, GRPO_CONFIG, [f"grpo.self_critic.{override}"])


# -- the DPO step on a tiny checkpoint -------------------------------------------------------------------------------

# Groups of 4 text trajectories (answers to one question) with hand-set rewards. A and B each make one pair: A (0, 1)
# with a reward gap of 1.0, B (5, 7) with 0.8; C makes one (8, 9); EQ none (its rewards are all equal).
GROUP_A = ("What is 2 + 3?", [("5", 1.0), ("6", 0.0), ("7", 0.5), ("8", 0.2)])
GROUP_B = ("Which is larger, 7 or 4?", [("4", 0.3), ("7", 0.9), ("9", 0.9), ("1", 0.1)])
GROUP_C = ("What is 6 minus 4?", [("2", 1.0), ("3", 0.0), ("4", 0.0), ("5", 0.0)])
GROUP_EQ = ("How many sides has a triangle?", [("3", 0.5), ("4", 0.5), ("5", 0.5), ("6", 0.5)])


def _trajectories(policy, groups):
    """The groups' trajectories encoded (a user question, an assistant answer: loss mask 1 on the answer), and their
    rewards, group after group."""
    min_pixels, max_pixels = policy.pixel_budget
    encoded, rewards = [], []
    for question, answers in groups:
        for answer, reward in answers:
            reply = f"<think>Count.</think><answer>{answer}</answer>"
            messages = [Message("user", [ContentPart("text", text=question)]),
                        Message("assistant", [ContentPart("text", text=reply)])]  # fmt: skip
            encoded.append(encode_messages(messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                                           factor=policy.image_factor))  # fmt: skip
            rewards.append(reward)
    return encoded, rewards


def _score(module):
    return lambda batch: masked_token_logprobs(module, batch, batch["loss_mask"])[0]


def _old(module, encoded, pad_id):
    """Per trajectory, its (T_i,) log-probs under ``module`` now: the weights that 'sampled' it (one batch)."""
    from vagent.data.batching import collate

    with torch.no_grad():
        lp = _score(module)(collate(encoded, pad_id))
    return [lp[i, : len(e.input_ids)] for i, e in enumerate(encoded)]


def _backend(policy, lr=1e-3):
    optimizer = build_optimizer(policy.model, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = warmup_cosine(optimizer, warmup_steps=0, total_steps=10, min_ratio=0.0)
    return DDPBackend(policy.model, CPU, optimizer=optimizer, scheduler=scheduler, max_grad_norm=1.0, bf16=False)


def _step(backend, policy, encoded, old, rewards, capped=None, **kwargs):
    settings = dict(group_size=4, margin=0.0, beta=0.5, loss_type="sigmoid", lr_scale=1.0, max_pairs=0,
                    pairs_per_micro=1)  # fmt: skip
    return self_critic_step(backend, encoded, old, rewards, capped or [False] * len(encoded),
                            **{**settings, **kwargs}, pad_id=policy.tokenizer.pad_token_id or 0, device=CPU.device,
                            score=_score(backend.module))  # fmt: skip


@pytest.fixture()
def fresh(tiny_qwen25):
    """A tiny policy of its own (the step trains it), in train mode as GRPO leaves it."""
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    policy.model.train()
    return policy


def test_a_dpo_step_raises_its_pairs_chosen_over_rejected_log_ratio(fresh):
    """Against the log-probs of the weights that sampled, the policy starts at log-ratio 0 (loss log 2); one step
    later, scored against the same reference, the chosen sides gained on the rejected ones. The step is outside the
    LR schedule: the rate stays and the schedule does not advance."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B, GROUP_EQ])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    before = backend.scheduler.last_epoch, backend.lr()
    first = _step(backend, fresh, encoded, old, rewards)
    assert first["dpo/pairs"] == 2.0 and first["dpo/reward_gap"] == pytest.approx((1.0 + 0.8) / 2)
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is its reference
    assert abs(first["dpo/chosen_logratio"]) < 1e-5 and abs(first["dpo/rejected_logratio"]) < 1e-5
    assert math.isfinite(first["dpo/grad_norm"]) and first["dpo/grad_norm"] > 0
    assert (backend.scheduler.last_epoch, backend.lr()) == before
    assert [g["lr"] for g in backend.optimizer.param_groups] == [1e-3] * len(backend.optimizer.param_groups)
    second = _step(backend, fresh, encoded, old, rewards)
    assert second["dpo/chosen_logratio"] > second["dpo/rejected_logratio"]
    assert second["dpo/reward_margin"] > 0.01 and second["dpo/accuracy"] == 1.0
    assert second["dpo/loss"] < first["dpo/loss"]


def test_capped_and_masked_trajectories_change_the_pairs_the_step_trains(fresh):
    """A's best is capped (never chosen: 2 against 1, gap 0.5); B's worst has no trained tokens (over-turn masking: on
    neither side, so B pairs 5 against 4, gap 0.6)."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B])
    encoded[7].loss_mask.zero_()
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    capped = [True] + [False] * 7
    record = _step(backend, fresh, encoded, old, rewards, capped=capped)
    assert record["dpo/pairs"] == 2.0 and record["dpo/reward_gap"] == pytest.approx((0.5 + 0.6) / 2)


def test_no_pair_no_step_and_max_pairs_keeps_the_widest_gap(fresh):
    backend = _backend(fresh)
    weights = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    encoded, rewards = _trajectories(fresh, [GROUP_EQ, GROUP_EQ])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    assert _step(backend, fresh, encoded, old, rewards) == {"dpo/pairs": 0.0}
    assert all(torch.equal(v, fresh.model.state_dict()[k]) for k, v in weights.items())
    encoded, rewards = _trajectories(fresh, [GROUP_B, GROUP_A])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    record = _step(backend, fresh, encoded, old, rewards, max_pairs=1)
    assert record["dpo/pairs"] == 1.0 and record["dpo/reward_gap"] == pytest.approx(1.0)  # A's, not B's 0.8


def test_lr_scale_scales_the_step(tiny_qwen25):
    """AdamW's first step moves each weight by lr x g / |g| (no decay here): a quarter of the rate, a quarter of the
    move, for the same gradients."""
    moves = []
    for scale in (1.0, 0.25):
        policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
        policy.model.train()
        start = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
        backend = _backend(policy)
        encoded, rewards = _trajectories(policy, [GROUP_A])
        _step(backend, policy, encoded, _old(backend.module, encoded, 0), rewards, lr_scale=scale)
        moves.append(torch.cat([(p.detach() - start[k]).flatten() for k, p in policy.model.named_parameters()]))
    assert moves[0].abs().max() == pytest.approx(1e-3, rel=1e-3)
    # a difference of fp32 weights near 1 is exact to their spacing, 1.2e-7
    assert torch.allclose(moves[1], 0.25 * moves[0], rtol=1e-3, atol=3e-7)
    assert float(moves[1].norm() / moves[0].norm()) == pytest.approx(0.25, rel=1e-4)


# -- GRPO with the step ----------------------------------------------------------------------------------------------


def _even_tokens(trajectories, rows):
    """test_grpo's toy reward: the share of even sampled ids (it spreads within every group of a random model)."""
    out = []
    for t in trajectories:
        ids = [i for m in t.messages if m.role == "assistant" for i, s in zip(m.token_ids, m.sampled, strict=True) if s]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
    return out


def test_grpo_with_self_critic_logs_dpo_beside_grpo_and_off_is_todays_run(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    """Two steps with the step every 2: the first step and the second's rollouts and update are those of the run
    without it (the stage draws no random number and runs after the update); the second step logs the dpo metrics
    beside GRPO's, and the final weights differ by the DPO step. A random policy's 6-token turns are all cut by
    max_tokens: capped_chosen lets them be chosen."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    base = [f"model.path={tiny_qwen25}", "train.max_steps=2", "train.save_every=0", "train.tensorboard=false",
            f"data.train={zoom_rows_file(16, 1000)}", "rollout.max_turns=1", "rollout.max_new_tokens=6",
            "rewards.weights={even_tokens: 1.0}", "rewards.options={}", "grpo.dynamic_sampling=false"]  # fmt: skip
    from vagent.recipes import grpo

    runs = {}
    for name, extra in (
        ("off", []),
        ("on", ["grpo.self_critic.enabled=true", "grpo.self_critic.every=2", "grpo.self_critic.capped_chosen=true"]),
    ):
        out = tmp_path / name
        model = grpo.train(load_config(GRPOConfig, GRPO_CONFIG, [*base, f"out_dir={out}", *extra]))
        runs[name] = read_metrics(out / "metrics.jsonl"), load_policy(model, device="cpu").model.state_dict()
    (off, off_weights), (on, on_weights) = runs["off"], runs["on"]
    untimed = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "dpo/", "peak_mem"))}  # noqa: E731
    assert [untimed(r) for r in on] == [untimed(r) for r in off]  # the same rewards, losses, grad norms, ...
    assert not any(k.startswith("dpo/") for r in off for k in r) and not any(k.startswith("dpo/") for k in on[0])
    record = on[1]
    assert record["dpo/pairs"] >= 1 and "time/self_critic" in record
    for key in ("dpo/loss", "dpo/reward_margin", "dpo/chosen_logratio", "dpo/rejected_logratio", "dpo/grad_norm"):
        assert math.isfinite(record[key]), key
    assert record["dpo/reward_gap"] > 0
    assert any(not torch.equal(off_weights[k], on_weights[k]) for k in off_weights)


# -- two ranks -------------------------------------------------------------------------------------------------------

# Each rank steps on its own groups: rank 1 finds no pair (DDP) or fewer than rank 0 (FSDP). Every rank runs as many
# micro-batches as rank 0 (a rank that skipped one would hang the all-reduce or the gathers), and the step equals
# one process stepping on every rank's groups.
SCENARIOS = {"ddp": ([GROUP_A, GROUP_B], [GROUP_EQ, GROUP_EQ]), "fsdp": ([GROUP_A, GROUP_B], [GROUP_C, GROUP_EQ])}

CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import test_self_critic as t
from vagent.training.distributed import init_distributed, shutdown
env = init_distributed("cpu", timeout_s=60)  # a rank left waiting fails in a minute instead of hanging
records = {{kind: t.two_steps(sys.argv[1], kind, t.SCENARIOS[kind][env.rank], env) for kind in t.SCENARIOS}}
if env.rank == 0:
    open(sys.argv[2], "w").write(json.dumps(records))
shutdown()
"""


def two_steps(checkpoint, kind, groups, env):
    """Two self-critic steps of a fresh policy on ``groups`` (the second scores the first's result), as ``kind``
    (``ddp``, or ``fsdp`` with its shards) on ``env``'s ranks."""
    from vagent.training.adapters import touch_vision_every_forward
    from vagent.training.fsdp import FSDPBackend, shard_model

    policy = load_policy(checkpoint, device="cpu", dtype="float32")
    policy.model.train()
    if kind == "fsdp":
        shard_model(policy.model, env, bf16=False)
    elif env.world_size > 1:  # as build_backend: text-only rows must still give the vision merger a gradient
        touch_vision_every_forward(policy.model, always=False)
    optimizer = build_optimizer(policy.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = warmup_cosine(optimizer, warmup_steps=0, total_steps=10, min_ratio=0.0)
    common = dict(optimizer=optimizer, scheduler=scheduler, max_grad_norm=1.0)
    backend = (FSDPBackend(policy.model, env, **common) if kind == "fsdp" else
               DDPBackend(policy.model, env, **common, bf16=False))  # fmt: skip
    encoded, rewards = _trajectories(policy, groups)
    old = _old(backend.module, encoded, policy.tokenizer.pad_token_id or 0)
    settings = dict(group_size=4, margin=0.0, beta=0.5, loss_type="sigmoid", lr_scale=1.0, max_pairs=0,
                    pairs_per_micro=1, pad_id=policy.tokenizer.pad_token_id or 0, device=env.device,
                    score=_score(backend.module))  # fmt: skip
    return [self_critic_step(backend, encoded, old, rewards, [False] * len(encoded), **settings) for _ in range(2)]


@pytest.mark.slow  # two torchrun ranks: 27 s on 2 shared cores
def test_two_ranks_with_different_pair_counts_step_as_one_process(tmp_path, tiny_qwen25):
    script, out = tmp_path / "child.py", tmp_path / "records.json"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run([*launcher, str(script), str(tiny_qwen25), str(out)], capture_output=True, text=True,
                            env=env, timeout=300, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = json.loads(out.read_text())
    for kind, (rank0, rank1) in SCENARIOS.items():
        alone = two_steps(tiny_qwen25, "ddp", [*rank0, *rank1], CPU)  # one process, every rank's groups
        assert records[kind][0]["dpo/pairs"] == alone[0]["dpo/pairs"] == (2.0 if kind == "ddp" else 3.0)
        for two, one in zip(records[kind], alone, strict=True):
            for key, value in one.items():
                assert two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (kind, key)
        assert alone[1]["dpo/reward_margin"] > alone[0]["dpo/reward_margin"]

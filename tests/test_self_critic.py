"""Self-critic DPO inside GRPO (Tool-Star): the pair rule on hand-written groups, the DPO step on a tiny checkpoint (it
raises its pairs' chosen-over-rejected log-ratio; capped and masked trajectories; the extra optimizer step outside the
schedule), GRPO with it on and off, and 2 ranks that find different numbers of pairs."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vagent.algorithms import self_critic_pairs
from vagent.config import ConfigError, GRPOConfig, load_config
from vagent.data.batching import collate
from vagent.data.encode import encode_messages
from vagent.model import load_policy, masked_token_logprobs
from vagent.training.backend import DDPBackend, build_optimizer, warmup_cosine
from vagent.training.distributed import DistEnv
from vagent.training.metrics import read_metrics
from vagent.training.self_critic import SelfCritic
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
                                                   ("beta=0", "beta"), ("coef=0", "coef"),
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
    with torch.no_grad():
        lp = _score(module)(collate(encoded, pad_id))
    return [lp[i, : len(e.input_ids)] for i, e in enumerate(encoded)]


def _backend(policy, lr=1e-3, max_grad_norm=1.0, total_steps=10):
    optimizer = build_optimizer(policy.model, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = warmup_cosine(optimizer, warmup_steps=0, total_steps=total_steps, min_ratio=0.0)
    return DDPBackend(policy.model, CPU, optimizer=optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm,
                      bf16=False)  # fmt: skip


def _critic(backend, policy, encoded, rewards, capped=None, env=CPU, **kwargs):
    settings = dict(group_size=4, margin=0.0, max_pairs=0, capped_chosen=False, coef=1.0, beta=0.5,
                    loss_type="sigmoid", pairs_per_micro=1)  # fmt: skip
    return SelfCritic(encoded, rewards, capped or [False] * len(encoded), **{**settings, **kwargs},
                      pad_id=policy.tokenizer.pad_token_id or 0, device=env.device, score=_score(backend.module))  # fmt: skip


def _other_loss(backend, encoded, last, normalizer=None):
    """Another objective's micro-batch (the NLL of ``encoded``'s sampled tokens over ``normalizer``, their count when
    None) accumulated as the update accumulates its PPO loss (``last``: it closes the optimizer step's)."""
    batch = collate(encoded, 0)
    mask = batch["loss_mask"]
    with backend.accumulating(last=last):
        lp = _score(backend.module)(batch)
        backend.backward(-(lp * mask).sum() / (normalizer or mask[:, 1:].sum()))


def _update(backend, critic, old, other=None):
    """One optimizer step as GRPO's update takes it: ``other``'s loss (standing in for the PPO loss), then the critic's
    DPO micro-batches closing the accumulation. Returns (the dpo record, the step's grad norm)."""
    if other is not None:
        _other_loss(backend, other, last=False)
    record = critic.backward(backend, old)
    return record, backend.step()


@pytest.fixture()
def fresh(tiny_qwen25):
    """A tiny policy of its own (the step trains it), in train mode as GRPO leaves it."""
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    policy.model.train()
    return policy


def test_the_dpo_term_raises_its_pairs_chosen_over_rejected_log_ratio(fresh):
    """Against the log-probs of the weights that sampled, the policy starts at log-ratio 0 (loss log 2); one update
    later, scored against the same reference, the chosen sides gained on the rejected ones. The term adds no optimizer
    step: AdamW and the schedule advance once per update, as without it."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B, GROUP_EQ])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    first, grad_norm = _update(backend, _critic(backend, fresh, encoded, rewards), old)
    assert first["dpo/pairs"] == 2.0 and first["dpo/reward_gap"] == pytest.approx((1.0 + 0.8) / 2)
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is its reference
    assert abs(first["dpo/chosen_logratio"]) < 1e-5 and abs(first["dpo/rejected_logratio"]) < 1e-5
    assert math.isfinite(grad_norm) and grad_norm > 0 and first["time/self_critic"] >= 0
    assert backend.scheduler.last_epoch == 1
    assert {int(state["step"]) for state in backend.optimizer.state.values()} == {1}
    second, _ = _update(backend, _critic(backend, fresh, encoded, rewards), old)
    assert second["dpo/chosen_logratio"] > second["dpo/rejected_logratio"]
    assert second["dpo/reward_margin"] > 0.01 and second["dpo/accuracy"] == 1.0
    assert second["dpo/loss"] < first["dpo/loss"]


def test_capped_and_masked_trajectories_change_the_pairs_the_term_trains(fresh):
    """A's best is capped (never chosen: 2 against 1, gap 0.5); B's worst has no trained tokens (over-turn masking: on
    neither side, so B pairs 5 against 4, gap 0.6)."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B])
    encoded[7].loss_mask.zero_()
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    capped = [True] + [False] * 7
    critic = _critic(backend, fresh, encoded, rewards, capped=capped)
    assert critic.micro == [[(2, 1)], [(5, 4)]]
    record, _ = _update(backend, critic, old)
    assert record["dpo/pairs"] == 2.0 and record["dpo/reward_gap"] == pytest.approx((0.5 + 0.6) / 2)


def test_no_pair_no_term_and_max_pairs_keeps_the_widest_gap(fresh):
    """Without a pair the update must close its own accumulation: backward refuses to run (its micro-batches would
    sync nothing and divide by 0)."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_EQ, GROUP_EQ])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    critic = _critic(backend, fresh, encoded, rewards)
    assert critic.pairs == 0 and critic.record == {"dpo/pairs": 0.0}
    with pytest.raises(RuntimeError, match="no pair"):
        critic.backward(backend, old)
    assert all(p.grad is None for p in fresh.model.parameters())
    encoded, rewards = _trajectories(fresh, [GROUP_B, GROUP_A])
    old = _old(backend.module, encoded, fresh.tokenizer.pad_token_id or 0)
    record, _ = _update(backend, _critic(backend, fresh, encoded, rewards, max_pairs=1), old)
    assert record["dpo/pairs"] == 1.0 and record["dpo/reward_gap"] == pytest.approx(1.0)  # A's, not B's 0.8


def _flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def test_coef_weighs_the_dpo_gradient_beside_the_other_loss(fresh):
    """The accumulated gradient is the other loss's + coef x the DPO loss's: a quarter of the coef, a quarter of the
    DPO part, the other part untouched (gradients are read before the step, which clips them together)."""
    backend = _backend(fresh)
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B])
    other, _ = _trajectories(fresh, [GROUP_C])
    old = _old(backend.module, encoded, 0)
    parts = {}
    for name, coef, with_other in (("dpo", 1.0, False), ("quarter", 0.25, False), ("both", 0.25, True)):
        if with_other:
            _other_loss(backend, other, last=False)
        _critic(backend, fresh, encoded, rewards, coef=coef).backward(backend, old)
        parts[name] = _flat_grad(fresh.model)
        backend.optimizer.zero_grad(set_to_none=True)
    _other_loss(backend, other, last=True)
    parts["other"] = _flat_grad(fresh.model)
    assert parts["dpo"].norm() > 0 and parts["other"].norm() > 0
    # float32 sums of the same micro-batches in another order: equal to their rounding
    assert torch.allclose(parts["quarter"], 0.25 * parts["dpo"], rtol=1e-5, atol=1e-8)
    assert torch.allclose(parts["both"], parts["other"] + parts["quarter"], rtol=1e-4, atol=1e-7)


def test_after_momentum_the_dpo_term_moves_the_update_along_its_gradient_not_the_momentum(fresh):
    """What the term adds to an update that follows others: 30 AdamW steps of another objective (momentum built up,
    the second moment past its first steps' bias correction), then the same update from the same state with and
    without the term. The term enters AdamW's first moment as 0.1 x grad DPO, as the update's own gradient does, and
    the weights move by it along -grad DPO as AdamW scales it (/ sqrt(v)), not along the momentum. This step's first
    version (2f27396), a second AdamW step on grad DPO alone after the update, measured on this setup: cosine 0.26 with
    the scaled -grad DPO and 0.96 with the previous update's direction."""
    backend = _backend(fresh, max_grad_norm=0.0, total_steps=100)  # no clipping: the difference is the term's alone
    encoded, rewards = _trajectories(fresh, [GROUP_A, GROUP_B])
    other, _ = _trajectories(fresh, [GROUP_C])
    for _ in range(30):
        _other_loss(backend, other, last=True)
        backend.step()
    old = _old(backend.module, encoded, 0)
    _critic(backend, fresh, encoded, rewards).backward(backend, old)
    g = _flat_grad(fresh.model)  # (P,) grad DPO at the weights the update starts from
    backend.optimizer.zero_grad(set_to_none=True)
    params = list(fresh.model.parameters())
    snapshot = [copy.deepcopy(x.state_dict()) for x in (fresh.model, backend.optimizer, backend.scheduler)]
    previous = _adam_direction(backend.optimizer, params)  # (P,) where the momentum points
    after, moments = [], []
    for with_term in (True, False):
        for x, state in zip((fresh.model, backend.optimizer, backend.scheduler), snapshot, strict=True):
            x.load_state_dict(copy.deepcopy(state))
        if with_term:
            _update(backend, _critic(backend, fresh, encoded, rewards), old, other=other)
            scale = _adam_moment(backend.optimizer, params, "exp_avg_sq").sqrt() + 1e-8  # (P,) sqrt(v) it divided by
        else:
            _other_loss(backend, other, last=True)
            backend.step()
        after.append(torch.cat([p.detach().flatten().clone() for p in params]))
        moments.append(_adam_moment(backend.optimizer, params, "exp_avg", corrected=False))
    assert torch.allclose(moments[0] - moments[1], 0.1 * g, atol=1e-7)  # (1 - beta1) x coef x grad DPO
    added = after[0] - after[1]  # (P,) what the term moved
    cos = lambda a, b: float(F.cosine_similarity(a, b, dim=0))  # noqa: E731
    assert cos(added, -g / scale) > 0.9  # measured 0.96
    assert abs(cos(added, -previous)) < 0.2  # measured -0.06


def _adam_moment(optimizer, params, key, corrected=True):
    """(P,) AdamW's ``key`` moment of ``params`` (0 where it holds none), divided by its bias correction."""
    states = [optimizer.state.get(p, {}) for p in params]
    step = float(next(s["step"] for s in states if s))
    beta = 0.9 if key == "exp_avg" else 0.999
    held = [s[key] if key in s else torch.zeros_like(p) for s, p in zip(states, params, strict=True)]
    flat = torch.cat([x.flatten() for x in held])
    return flat / (1 - beta**step) if corrected else flat


def _adam_direction(optimizer, params):
    """(P,) the direction AdamW's next step takes with no new gradient: m / (sqrt(v) + eps), bias-corrected."""
    return _adam_moment(optimizer, params, "exp_avg") / (_adam_moment(optimizer, params, "exp_avg_sq").sqrt() + 1e-8)


# -- GRPO with the term ----------------------------------------------------------------------------------------------


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
    """Two steps with the term every 2: the first step is the run without it, grad norm included; the second's
    rollouts, rewards and PPO statistics are too (the term draws no random number and adds to the gradient only),
    its gradient is not, and it logs the dpo metrics beside GRPO's. One optimizer step per GRPO step (the shipped
    tiny config): the term's log-ratios are taken before it, at the weights that sampled (loss log 2). With a margin
    no group clears (the rewards are shares in [0, 1]), a step with the term logs 0 pairs and trains exactly as
    without it (one step: its record holds the gradient's norm). A random policy's 6-token turns are all cut by max_tokens: capped_chosen lets them be chosen."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    base = [f"model.path={tiny_qwen25}", "train.max_steps=2", "train.save_every=0", "train.tensorboard=false",
            f"data.train={zoom_rows_file(16, 1000)}", "rollout.max_turns=1", "rollout.max_new_tokens=6",
            "rewards.weights={even_tokens: 1.0}", "rewards.options={}", "grpo.dynamic_sampling=false"]  # fmt: skip
    from vagent.recipes import grpo

    runs = {}
    critic = ["grpo.self_critic.enabled=true", "grpo.self_critic.capped_chosen=true"]
    for name, extra in (("off", []), ("on", [*critic, "grpo.self_critic.every=2"]),
                        ("no_pair", [*critic, "grpo.self_critic.margin=1", "train.max_steps=1"])):  # fmt: skip
        out = tmp_path / name
        model = grpo.train(load_config(GRPOConfig, GRPO_CONFIG, [*base, f"out_dir={out}", *extra]))
        runs[name] = read_metrics(out / "metrics.jsonl"), load_policy(model, device="cpu").model.state_dict()
    (off, off_weights), (on, on_weights), (none, _) = runs["off"], runs["on"], runs["no_pair"]
    untimed = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "dpo/", "peak_mem"))}  # noqa: E731
    assert untimed(on[0]) == untimed(off[0])  # the same rewards, loss, grad norm, ...
    but_gradient = lambda r: {k: v for k, v in untimed(r).items() if k != "grad_norm"}  # noqa: E731
    assert but_gradient(on[1]) == but_gradient(off[1]) and on[1]["grad_norm"] != off[1]["grad_norm"]
    assert not any(k.startswith("dpo/") for r in off for k in r) and not any(k.startswith("dpo/") for k in on[0])
    record = on[1]
    assert record["dpo/pairs"] >= 1 and record["time/self_critic"] > 0
    for key in ("dpo/loss", "dpo/reward_margin", "dpo/chosen_logratio", "dpo/rejected_logratio", "dpo/accuracy"):
        assert math.isfinite(record[key]), key
    assert record["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4) and abs(record["dpo/chosen_logratio"]) < 1e-4
    assert record["dpo/reward_gap"] > 0
    assert any(not torch.equal(off_weights[k], on_weights[k]) for k in off_weights)
    assert len(none) == 1 and untimed(none[0]) == untimed(off[0]) and none[0]["dpo/pairs"] == 0.0


# -- two ranks -------------------------------------------------------------------------------------------------------

# Each rank updates on its own groups: rank 1 finds no pair (DDP) or fewer than rank 0 (FSDP). Every rank runs as
# many DPO micro-batches as rank 0 after its other loss's (a rank that skipped one would hang the all-reduce or the
# gathers), and the update equals one process updating on every rank's groups.
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
    """Two updates of a fresh policy on ``groups`` (the second scores the first's result), each another loss on the
    groups and the DPO term, as ``kind`` (``ddp``, or ``fsdp`` with its shards) on ``env``'s ranks. Returns the dpo
    records with the update's grad norm."""
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
    records = []
    for _ in range(2):
        # the other loss's share: its summed NLL over a constant, so that the ranks' shares add up to one process's
        _other_loss(backend, encoded, last=False, normalizer=100.0)
        record, grad_norm = _update(backend, _critic(backend, policy, encoded, rewards, env=env), old)
        records.append({k: v for k, v in record.items() if not k.startswith("time/")} | {"grad_norm": grad_norm})
    return records


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

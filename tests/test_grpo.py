"""GRPO: the math against hand-worked examples, masking, and the recipe end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BOTH_VOCABS_QWEN_SLOW

from vagent.algorithms import (
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    loss_normalizer,
    policy_loss,
    sampled_logprobs,
)
from vagent.config import ConfigError, GRPOConfig, load_config
from vagent.data import load_rows
from vagent.data.batching import collate
from vagent.data.encode import encode_messages
from vagent.model import load_policy, policy_logits
from vagent.recipes import grpo
from vagent.recipes.alarms import Alarms
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"


def test_group_advantages_by_hand():
    # group 1: rewards (1, 0): mean 0.5, unbiased std sqrt(0.5) (verl and TRL: torch.std's default) -> +-0.707
    # (the population std, 0.5, gave +-1); group 2 all equal -> 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    assert adv.tolist() == pytest.approx([0.5**0.5, -(0.5**0.5), 0.0, 0.0], abs=1e-5)
    # a group of 8 as verl's compute_grpo_outcome_advantage writes it: (r - mean) / (std + eps)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    expected = (rewards - rewards.mean()) / (torch.std(rewards) + 1e-6)
    assert group_advantages(rewards, 8).tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # Dr. GRPO: no std scaling: (3, 1, 2) -> mean 2 -> (1, -1, 0)
    assert group_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, scale_by_std=False).tolist() == [1.0, -1.0, 0.0]
    assert informative_groups(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2).tolist() == [True, False]
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_negative_scale_weights_only_the_losers():
    # group (1, 0, 0, 0): mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> (+1.5, -0.5 x 3); the losers' share is scaled
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    full = group_advantages(rewards, 4)
    half = group_advantages(rewards, 4, negative_scale=0.5)
    winners = group_advantages(rewards, 4, negative_scale=0.0)
    assert half[0] == full[0] == winners[0] == pytest.approx(1.5, abs=1e-4)
    assert half[1:4].tolist() == pytest.approx((full[1:4] / 2).tolist())
    assert winners[1:].tolist() == [0.0] * 7  # a solved group stays at 0 either way
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="negative_scale"):
            load_config(GRPOConfig, None, [f"grpo.negative_scale={bad}"])


def test_a_dynamic_sampling_refill_rolls_out_only_what_the_missing_groups_need():
    assert grpo._refill_size(8, kept=6, rolled=8) == 3  # 2 missing at 3 kept in 4: ceil(2 * 8 / 6)
    assert grpo._refill_size(8, kept=7, rolled=8) == 2
    assert grpo._refill_size(8, kept=4, rolled=16) == 8  # 4 missing at 1 in 4 kept: capped at a whole round
    assert grpo._refill_size(8, kept=0, rolled=8) == 8  # no share known yet
    assert grpo._refill_size(1, kept=0, rolled=3) == 1


def test_clipped_loss_by_hand_with_clip_higher():
    # one sequence, tokens 1..3 sampled; ratios e^0.5=1.65, e^-0.5=0.61, 1.0 against old log-probs 0
    lp = torch.tensor([[0.0, 0.5, -0.5, 0.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[0, 1, 1, 1]])
    # A = +1: token 1 ratio 1.65 > 1 + 0.28 -> clipped to 1.28 (no gradient); token 2: 0.61 < 0.8 but for A > 0
    # min(r A, clip(r) A) = r A (unclipped, keeps its gradient); token 3: 1
    per_token, stats = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert per_token[0].tolist() == pytest.approx([0.0, -1.28, -math.exp(-0.5), -1.0])
    assert float(stats["clip_frac"]) == 1.0  # one token clipped
    assert float(stats["ratio_max_dev"]) == pytest.approx(math.exp(0.5) - 1)
    aggregate(per_token, mask, "token", 3).backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, -math.exp(-0.5) / 3, -1 / 3])
    # A = -1: the symmetric case clips token 2 at 1 - 0.2 (ratio 0.61 -> 0.8 wins the min of -r A)
    per_token, _ = policy_loss(lp.detach(), old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert per_token[0].tolist() == pytest.approx([0.0, math.exp(0.5), 0.8, 1.0])


def test_aggregation_and_k3():
    per_token = torch.tensor([[0.0, 2.0, 4.0], [0.0, 6.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    assert float(aggregate(per_token, mask, "token", 3)) == pytest.approx(4.0)  # (2 + 4 + 6) / 3
    assert float(aggregate(per_token, mask, "sequence", 2)) == pytest.approx(4.5)  # (3 + 6) / 2
    # k3 at ref - lp = log 2: 2 - log 2 - 1
    kl = kl_k3(torch.zeros(1, 2), torch.full((1, 2), math.log(2)), torch.tensor([[0, 1]]))
    assert kl[0].tolist() == pytest.approx([0.0, 1 - math.log(2)])


def test_sequence_aggregation_leaves_a_fully_masked_trajectory_out_of_its_denominator():
    # one trajectory over-turn masking took out (mask all 0), one kept with token losses 2 and 4: the mini-batch's
    # loss is the kept one's own mean, 3 (its denominator counted the masked one too: 1.5, half of it)
    per_token = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 4.0]])
    mask = torch.tensor([[0, 0, 0], [0, 1, 1]])
    trained = [int(m.sum()) for m in mask]
    assert float(aggregate(per_token, mask, "sequence", loss_normalizer(trained, "sequence"))) == pytest.approx(3.0)
    assert float(aggregate(per_token[1:], mask[1:], "sequence", loss_normalizer(trained[1:], "sequence"))) == 3.0
    assert loss_normalizer([0, 0], "sequence") == 0.0  # the caller floors the all-rank sum at 1: the loss is 0
    assert loss_normalizer(trained, "token") == 2.0


def test_dr_grpo_divides_the_summed_token_loss_by_a_constant():
    # TRL's loss_type="dr_grpo": sum / (sequences x max completion length), whatever the sequences' lengths: two
    # sequences of 1 and 2 trained tokens, at most 8 each -> (2 + 4 + 6) / 16; a masked one still counts in the batch
    per_token = torch.tensor([[0.0, 2.0, 4.0], [0.0, 6.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    normalizer = loss_normalizer([2, 1], "dr_grpo", max_tokens=8)
    assert normalizer == 16.0 and float(aggregate(per_token, mask, "dr_grpo", normalizer)) == pytest.approx(12 / 16)
    assert loss_normalizer([2, 0], "dr_grpo", max_tokens=8) == 16.0
    with pytest.raises(ValueError, match="max_tokens"):
        loss_normalizer([2, 1], "dr_grpo")
    assert load_config(GRPOConfig, CONFIG, ["grpo.aggregation=dr_grpo"]).grpo.aggregation == "dr_grpo"
    with pytest.raises(ConfigError, match="aggregation"):
        load_config(GRPOConfig, CONFIG, ["grpo.aggregation=seq_mean"])


def _hand_written_warmup_cosine(step, warmup_steps, total_steps, min_ratio):
    # training/backend.py's schedule before it was built on transformers', kept as the reference for its values
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def test_the_lr_schedule_is_transformers_cosine_with_min_lr_at_the_values_it_had(monkeypatch):
    """Every recipe's schedule (SFT, DPO, and GRPO over its optimizer steps) comes from transformers'
    get_cosine_with_min_lr_schedule_with_warmup and gives the hand-written one's values at every step, past the end
    included, with and without warmup (a warmup as long as the run too)."""
    import transformers

    from vagent.training import backend

    built = []
    real = transformers.get_cosine_with_min_lr_schedule_with_warmup
    monkeypatch.setattr(backend, "get_cosine_with_min_lr_schedule_with_warmup",
                        lambda *a, **kw: built.append(kw) or real(*a, **kw))  # fmt: skip
    for warmup, total, floor in [(0, 10, 0.0), (2, 6, 0.0), (3, 20, 0.1), (10, 40, 0.05), (5, 5, 0.1), (4, 2, 0.0)]:
        weight = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([weight], lr=2.0)
        scheduler = backend.warmup_cosine(optimizer, warmup_steps=warmup, total_steps=total, min_ratio=floor)
        assert built.pop() == {"num_warmup_steps": warmup, "num_training_steps": total, "min_lr_rate": floor}
        for step in range(total + 5):
            expected = 2.0 * _hand_written_warmup_cosine(step, warmup, total, floor)
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-12), (warmup, total, step)
            optimizer.step()
            scheduler.step()


def _plain_ppo_clip(lp, old, adv, mask, clip_low, clip_high):
    # the loss before the guards, written out: -min(r A, clip(r) A) on sampled tokens
    mask = mask.to(lp.dtype)
    ratio = torch.exp((lp - old) * mask)
    a = adv.unsqueeze(-1)
    return -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * a) * mask


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_stale_token_leaves_the_policy_loss_and_its_gradient_finite(sign):
    # log-ratios of +-1000: exp overflows float32 (max ~e^88.7) without the clamp; both advantage signs
    lp = torch.tensor([[0.0, 1000.0, -1000.0, 0.1]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1]])
    per_token, stats = policy_loss(lp, torch.zeros(1, 4), torch.tensor([sign]), mask)
    aggregate(per_token, mask, "token", 3).backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert float(lp.grad[0, 3]) != 0.0  # the ordinary token still learns


def test_dual_clip_caps_a_negative_advantage_token_at_c_abs_a_with_no_gradient():
    # A = -2, ratios e^3 = 20 (r |A| = 40 > 3 |A| = 6: capped), e^0.5 = 1.65 (3.3 < 6: plain PPO-clip)
    lp = torch.tensor([[0.0, 3.0, 0.5]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1]])
    per_token, stats = policy_loss(lp, torch.zeros(1, 3), torch.tensor([-2.0]), mask, dual_clip=3.0)
    assert per_token[0].tolist() == pytest.approx([0.0, 6.0, 2 * math.exp(0.5)])
    assert float(stats["dual_clip_frac"]) == 1.0
    per_token.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 2 * math.exp(0.5)])
    # off: the same token pushes with its full ratio
    off, stats = policy_loss(lp.detach(), torch.zeros(1, 3), torch.tensor([-2.0]), mask, dual_clip=None)
    assert float(off[0, 1]) == pytest.approx(2 * math.exp(3.0)) and float(stats["dual_clip_frac"]) == 0.0
    # positive advantages are never capped (their clip already bounds the ratio at 1 + clip_high)
    _, stats = policy_loss(lp.detach(), torch.zeros(1, 3), torch.tensor([2.0]), mask)
    assert float(stats["dual_clip_frac"]) == 0.0


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0])
def test_a_dual_clip_at_or_below_one_is_an_error(bad):
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), dual_clip=bad)


def test_with_no_guard_active_the_policy_loss_is_plain_ppo_clip():
    # log-ratios within +-3 (far inside +-20), advantages of both signs with r |A| < 3 |A|: no guard bites, so
    # value and gradient must be the old formula's, bit for bit
    torch.manual_seed(0)
    old = torch.randn(4, 6) - 2
    lp = (old + torch.empty(4, 6).uniform_(-1.0, 1.0)).requires_grad_()
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1]])
    per_token, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert float(stats["dual_clip_frac"]) == 0.0 and float(stats["clip_frac"]) > 0  # the clip does bite
    (grad,) = torch.autograd.grad(aggregate(per_token, mask, "token", 10), lp)
    expected = _plain_ppo_clip(lp, old, adv, mask, 0.2, 0.28)
    (expected_grad,) = torch.autograd.grad(aggregate(expected, mask, "token", 10), lp)
    assert torch.equal(per_token, expected) and torch.equal(grad, expected_grad)


def test_k3_is_finite_and_capped_for_a_token_far_from_the_reference():
    # ref - lp = 1000: exp overflows without the clamp; k3 >= 0 and capped at 10
    lp = torch.tensor([[-1000.0, 0.0, -0.5]], requires_grad=True)
    kl = kl_k3(lp, torch.zeros(1, 3), torch.ones(1, 3))
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    kl = kl.detach()
    assert float(kl.max()) <= 10.0 and float(kl[0, 0]) == 10.0
    assert float(kl[0, 2]) == pytest.approx(math.exp(0.5) - 0.5 - 1)  # an ordinary token is untouched
    assert float(kl_k3(torch.zeros(1, 1), torch.tensor([[1000.0]]), torch.ones(1, 1))) <= 10.0  # the other side


def test_observation_and_prompt_tokens_get_zero_gradient_in_the_policy_loss(policy):
    from PIL import Image

    from vagent.rollout import RolloutLimits, Task, rollout

    image = Image.new("RGB", (448, 336), (30, 120, 200))
    call = '<tool_call>{"name": "crop", "arguments": {"bbox": [10, 10, 120, 120]}}</tool_call>'
    torch.manual_seed(0)
    t = rollout(policy, Task(id="t", question="What?", images=[image], scripted_turns=[call, None]),
                RolloutLimits(max_turns=2, max_new_tokens=12, temperature=1.0))  # fmt: skip
    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
    assert enc.input_ids.tolist() == t.token_ids and enc.loss_mask.tolist() == t.loss_mask
    batch = collate([enc], policy.tokenizer.pad_token_id)
    mask = batch["loss_mask"]
    assert (
        int(mask.sum()) > 0 and int((batch["input_ids"][mask.bool()] == policy.model.config.image_token_id).sum()) == 0
    )
    logits = policy_logits(policy.model, batch)
    logits.retain_grad()
    lp, _ = sampled_logprobs(logits, batch["input_ids"], mask)
    per_token, _ = policy_loss(lp, lp.detach() - 0.1, torch.tensor([1.0]), mask)  # ratio e^0.1: inside the clip
    aggregate(per_token, mask, "token", float(mask.sum())).backward()
    grad = logits.grad[0, :-1].abs().sum(-1)  # position t scores token t + 1
    trained = mask[0, 1:].bool()
    assert torch.all(grad[~trained] == 0) and torch.all(grad[trained] > 0)
    policy.model.zero_grad()
    # the update's scorer keeps only the logits from the first sampled token on, with the same log-probs
    from vagent.recipes.grpo import _scored_logprobs

    with torch.no_grad():
        kept, _ = _scored_logprobs(policy.model, batch)
    assert torch.allclose(kept, lp.detach(), atol=1e-5) and kept.shape == lp.shape


def test_unknown_reward_names_and_deepspeed_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="containment"):
        grpo.train(load_config(GRPOConfig, CONFIG, [f"out_dir={tmp_path}", "rewards.weights={containment: 1.0}"]))
    with pytest.raises(ConfigError, match="DDP"):
        load_config(GRPOConfig, CONFIG, ["train.deepspeed=configs/deepspeed/zero2.json"])


def _overrides(out_dir, model, rows):
    return [f"out_dir={out_dir}", f"model.path={model}", "train.max_steps=4", "train.save_every=2",
            "train.tensorboard=false", f"data.train={rows}"]  # fmt: skip


@pytest.mark.parametrize("checkpoint", BOTH_VOCABS_QWEN_SLOW, indirect=True)
def test_grpo_steps_change_the_policy_and_log_every_stage(tmp_path, checkpoint, zoom_rows_file, monkeypatch):
    before = {k: v.clone() for k, v in load_policy(checkpoint, device="cpu").model.state_dict().items()}
    # The config's rewards are all 0 for a random policy, whose groups are then uninformative (Qwen's vocabulary
    # almost never samples a stop token): a small reward that spreads within every group makes each step update.
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    weights = "{accuracy: 1.0, format: 0.2, crop_iou: 0.5, tool_bonus: 0.2, invalid_calls: 0.2, overlong: 0.5, even_tokens: 0.1}"
    overrides = [*_overrides(tmp_path, checkpoint, zoom_rows_file(16, 1000)), "grpo.inner_updates=2", f"rewards.weights={weights}"]  # fmt: skip
    model_dir = grpo.train(load_config(GRPOConfig, CONFIG, overrides))
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    updated = [r for r in records if "ratio_check" in r]
    assert len(updated) == 4, "a step had no informative group"
    for r in updated:
        assert r["ratio_check"] < 1e-5  # the first update's ratio is 1 (old log-probs from the same weights)
        assert r["sampler_logprob_gap"] < 1e-3  # the engine's log-probs agree with the training forward
    for key in ("reward", "accuracy", "reward/crop_iou", "reward/format", "tool_calls_per_traj", "tool_failure_rate", "tool_call_rate", "stop/answered", "stop/max_tokens",
                "response_len", "kept_groups", "time/gen", "time/tools", "time/reward", "time/logprob", "time/update"):  # fmt: skip
        assert key in records[0], key
    for key in ("entropy", "clip_frac", "approx_kl", "grad_norm"):
        assert key in updated[0], key
    after = load_policy(model_dir, device="cpu").model.state_dict()
    assert sum(not torch.equal(before[k], after[k]) for k in before) > 0.5 * len(before)
    assert list((tmp_path / "rollouts").glob("*.html")), "the rollouts of a checkpointed step are written to look at"


def _weights(model_dir):
    return load_policy(model_dir, device="cpu").model.state_dict()


def _val_rows(tmp_path):
    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.data import write_rows

    write_rows(zoom_rows(tmp_path / "val", 3, seed=99), tmp_path / "val" / "val.jsonl")
    return tmp_path / "val" / "val.jsonl"


def test_validation_leaves_training_alone_and_a_run_that_never_beats_its_start_hands_it_back(
    tmp_path, tiny_qwen25, zoom_rows_file
):
    plain = grpo.train(
        load_config(GRPOConfig, CONFIG, _overrides(tmp_path / "plain", tiny_qwen25, zoom_rows_file(16, 1000)))
    )
    val = _val_rows(tmp_path)
    kept = grpo.train(load_config(GRPOConfig, CONFIG, [*_overrides(tmp_path / "kept", tiny_qwen25, zoom_rows_file(16, 1000)),
                                                       f"val.rows={val}", "val.every=2", "val.keep_best=true"]))  # fmt: skip

    def training(out):
        return [
            (r["step"], r["reward"], r["response_len"]) for r in read_metrics(out / "metrics.jsonl") if "reward" in r
        ]

    # greedy validation runs under a forked RNG: the training draws are those of the run without it
    assert training(tmp_path / "kept") == training(tmp_path / "plain")
    records = [r for r in read_metrics(tmp_path / "kept" / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in records] == [0, 2, 4]
    for r in records:
        assert 0 <= r["val/accuracy"] <= 1 and 0 <= r["val/answered"] <= 1 and math.isfinite(r["val/reward"])
    # a random policy answers nothing right: every validation ties with the start, and ties keep the earlier step
    assert all(r["val/accuracy"] == 0 for r in records) and records[-1]["val/best_step"] == 0
    start, trained, published = _weights(tiny_qwen25), _weights(plain), _weights(kept)
    assert any(not torch.equal(start[k], trained[k]) for k in start), "the run must have moved the weights"
    assert all(torch.equal(start[k], published[k]) for k in start), "model/ must be the start it never beat"
    # byte for byte too: the quickstart then reuses its SFT evaluation instead of running the same policy again
    from quickstart.run import _same_weights

    assert _same_weights(kept, tiny_qwen25) and not _same_weights(plain, tiny_qwen25)
    assert [d.name for d in (tmp_path / "kept" / "best").iterdir()] == ["step-00000000"]
    assert (tmp_path / "kept" / "rollouts" / "val-step-00000004.html").is_file()


def test_sampled_validation_draws_the_same_numbers_each_time_and_leaves_training_alone(
    tmp_path, tiny_qwen25, zoom_rows_file
):
    rows = zoom_rows_file(16, 1000)
    plain = tmp_path / "plain"
    grpo.train(load_config(GRPOConfig, CONFIG, [*_overrides(plain, tiny_qwen25, rows), "optim.lr=1e-30"]))
    val = [f"val.rows={_val_rows(tmp_path)}", "val.every=2", "val.temperature=1.0", "val.samples=2"]
    sampled = tmp_path / "sampled"
    grpo.train(load_config(GRPOConfig, CONFIG, [*_overrides(sampled, tiny_qwen25, rows), "optim.lr=1e-30", *val]))

    def training(out):
        return [
            (r["step"], r["reward"], r["response_len"]) for r in read_metrics(out / "metrics.jsonl") if "reward" in r
        ]

    assert training(sampled) == training(plain)  # validation samples under a forked RNG
    steps = [0, 2, 4]
    episodes = {step: [json.loads(line) for line in (sampled / "rollouts" / f"val-step-{step:08d}.jsonl").open()]
                for step in steps}  # fmt: skip
    ids = list(dict.fromkeys(t["task_id"] for t in episodes[0]))
    for step in steps:  # 3 rows x 2 samples, each row's two samples together
        assert [t["task_id"] for t in episodes[step]] == [i for i in ids for _ in range(2)] and len(ids) == 3
    # lr 1e-30: the weights do not move (fp32), the same policy at every validation, and each validation draws the same numbers
    texts = {step: [t["token_ids"] for t in episodes[step]] for step in steps}
    assert texts[0] == texts[2] == texts[4]
    assert texts[0][0] != texts[0][1] or texts[0][2] != texts[0][3], "two samples at temperature 1 differ"
    records = [r for r in read_metrics(sampled / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in records] == steps and len({r["val/reward"] for r in records}) == 1


def _scripted_val_run(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch, per_row, *overrides):
    """A 4-step GRPO run validating every 2 steps on 3 val rows, whose per-row accuracies at steps 0, 2 and 4 are
    ``per_row`` (the training rows keep the real reward): (the published model dir, the val records)."""
    import vagent.rewards as rewards

    val = _val_rows(tmp_path)
    val_ids = {r.id for r in load_rows(val)}
    scripted = iter(per_row)
    real = rewards.REWARDS["accuracy"]

    def accuracy(trajectories, rows):
        if {t.task_id for t in trajectories} <= val_ids:
            return list(next(scripted))
        return real(trajectories, rows)

    monkeypatch.setitem(rewards.REWARDS, "accuracy", accuracy)
    out = tmp_path / "run"
    model_dir = grpo.train(load_config(GRPOConfig, CONFIG, [
        *_overrides(out, tiny_qwen25, zoom_rows_file(16, 1000)), f"val.rows={val}", "val.every=2", "val.keep_best=true",
        *overrides,
    ]))  # fmt: skip
    return model_dir, [r for r in read_metrics(out / "metrics.jsonl") if "val/accuracy" in r]


def test_keep_best_publishes_the_step_with_the_best_validation_accuracy(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    per_row = [[0.0] * 3, [1.0] * 3, [0.5] * 3]  # steps 0, 2, 4: step 2 is the best
    model_dir, records = _scripted_val_run(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch, per_row)
    out = tmp_path / "run"
    assert [r["val/best_step"] for r in records] == [0, 2, 2]
    step2, published = _weights(out / "checkpoints" / "step-00000002" / "model"), _weights(model_dir)
    assert all(torch.equal(step2[k], published[k]) for k in step2)
    assert [d.name for d in (out / "best").iterdir()] == ["step-00000002"]
    state = json.loads((out / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert state["best_val"] == {"step": 2, "accuracy": 1.0}


@pytest.mark.parametrize(
    ("per_row", "best_steps", "p_values"),
    [  # p of the exact sign test against the kept step: one row of three better 0.5, three 0.125
        ([[0, 0, 0], [1, 0, 0], [1, 1, 1]], [0, 0, 4], [0.5, 0.125]),
        # step 4 leads the kept step 0 by one row (p 0.5) and the last validation, step 2, by two (p 0.25): the
        # test is against the kept step
        ([[1, 0, 0], [0, 0, 0], [1, 1, 0]], [0, 0, 0], [1.0, 0.5]),
    ],
)
def test_keep_alpha_swaps_the_kept_step_only_for_a_lead_a_paired_test_resolves(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch, per_row, best_steps, p_values
):
    _, records = _scripted_val_run(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch, per_row, "val.keep_alpha=0.3")
    assert [r["val/best_step"] for r in records] == best_steps
    assert [r["val/gain_p"] for r in records[1:]] == pytest.approx(p_values) and "val/gain_p" not in records[0]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    kept = best_steps[-1] // 2
    assert state["best_val"] == {"step": best_steps[-1], "accuracy": pytest.approx(sum(per_row[kept]) / 3),
                                 "rows": per_row[kept]}  # fmt: skip


def test_keep_alpha_tests_each_rows_mean_over_its_samples(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch):
    # 2 samples a row, in row order: rows score 0, 0, 0 at step 0; 1, 0.5, 0 at step 2 (p 0.25); 1, 1, 1 at step 4
    per_sample = [[0] * 6, [1, 1, 1, 0, 0, 0], [1] * 6]
    _, records = _scripted_val_run(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch, per_sample,
                                   "val.keep_alpha=0.2", "val.temperature=0.7", "val.samples=2")  # fmt: skip
    assert [r["val/best_step"] for r in records] == [0, 0, 4]
    assert records[1]["val/gain_p"] == pytest.approx(0.25)


def test_beats_best_tests_against_the_kept_step_at_p_up_to_alpha_and_else_compares_accuracies(tmp_path, capsys):
    from vagent.recipes.grpo import _Validation
    from vagent.training.distributed import DistEnv

    val = _Validation.__new__(_Validation)  # the decision alone: no model, no rows to roll out
    val.cfg = load_config(GRPOConfig, CONFIG, ["val.rows=v.jsonl", "val.keep_best=true", "val.keep_alpha=0.125"])
    val.env, val.warned, val.out = (
        DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
        False,
        tmp_path,
    )
    val.best, val.last_accuracy, record = {"step": 0, "accuracy": 0.0, "rows": [0.0] * 3}, 1.0, {}
    assert val._beats_best([1.0] * 3, record) and record["val/gain_p"] == 0.125  # p == alpha: kept
    val.last_accuracy, record = 2 / 3, {}
    assert not val._beats_best([1.0, 1.0, 0.0], record) and record["val/gain_p"] == 0.25
    val.best["rows"] = [1.0, 1.0, 0.0]
    assert not val._beats_best([1.0, 1.0, 0.0], {})  # a tie keeps the earlier step
    # a kept step without per-row accuracies (a checkpoint from a run without the test): accuracies alone, one warning
    val.best = {"step": 2, "accuracy": 0.0}
    val.last_accuracy = 1 / 3
    assert val._beats_best([1.0, 0.0, 0.0], {}) and val._beats_best([0.0, 1.0, 0.0], {})
    assert capsys.readouterr().out.count("has no per-row accuracies") == 1
    val.resume({"step": 2, "accuracy": 0.5, "rows": [1.0, 0.0, 0.0]}, same_rows=False)  # other val rows since
    assert val.best == {"step": 2, "accuracy": 0.5}


def test_val_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match="val.keep_best needs val.rows"):
        load_config(GRPOConfig, CONFIG, ["val.keep_best=true"])
    with pytest.raises(ConfigError, match="train.save_final=false publishes nothing"):  # best models never pruned
        load_config(GRPOConfig, CONFIG, ["val.keep_best=true", "val.rows=v.jsonl", "train.save_final=false"])
    with pytest.raises(ConfigError, match="val.every"):
        load_config(GRPOConfig, CONFIG, ["val.every=-1"])
    with pytest.raises(ConfigError, match="greedy rollouts of a row are all the same"):
        load_config(GRPOConfig, CONFIG, ["val.samples=4"])
    with pytest.raises(ConfigError, match="val.temperature >= 0"):
        load_config(GRPOConfig, CONFIG, ["val.temperature=-1"])
    with pytest.raises(ConfigError, match="val.keep_alpha must be in"):
        load_config(GRPOConfig, CONFIG, ["val.keep_alpha=0.05", "val.rows=v.jsonl"])  # without keep_best
    for alpha in ("0", "1.5", ".nan"):
        with pytest.raises(ConfigError, match="val.keep_alpha must be in"):
            load_config(GRPOConfig, CONFIG, [f"val.keep_alpha={alpha}", "val.rows=v.jsonl", "val.keep_best=true"])


KILL_AT_STEP = """
import os, signal, sys
from vagent.training import metrics
log = metrics.MetricsLogger.log
def killing_log(self, step, values):
    log(self, step, values)
    if step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
metrics.MetricsLogger.log = killing_log
from vagent.recipes import grpo
grpo.main(sys.argv[2:])
"""


@pytest.mark.slow
def test_a_killed_grpo_run_resumes_to_the_same_rewards(tmp_path, tiny_qwen25, zoom_rows_file):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    val = [f"val.rows={_val_rows(tmp_path)}", "val.every=2", "val.keep_best=true"]

    def run(out, kill_at=-1):  # -1: never (step 0 is logged: the validation before the first step)
        cmd = [sys.executable, "-c", KILL_AT_STEP, str(kill_at), "--config", str(CONFIG), *_overrides(out, tiny_qwen25, zoom_rows_file(16, 1000)),
               *val]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)

    full = run(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = run(tmp_path / "killed", kill_at=3)
    assert killed.returncode == -9
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stderr[-2000:]

    def curve(out):
        return [(r["step"], r.get("reward"), r.get("response_len"), r.get("val/reward"), r.get("val/best_step"))
                for r in read_metrics(out / "metrics.jsonl")]  # fmt: skip

    assert curve(tmp_path / "killed") == curve(tmp_path / "full")
    # the best directory the checkpoint named survived the kill, and no other is left
    assert [d.name for d in (tmp_path / "killed" / "best").iterdir()] == [
        d.name for d in (tmp_path / "full" / "best").iterdir()
    ]


def _even_tokens(trajectories, rows):
    """Toy reward: the share of sampled token ids that are even. A random model samples about half even ids,
    so rewards spread within every group, and the policy can move every position's distribution."""
    out = []
    for t in trajectories:
        ids = [i for m in t.messages if m.role == "assistant" for i, s in zip(m.token_ids, m.sampled, strict=True) if s]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)))
    return out


@pytest.mark.slow  # about 45 s on 2 cores
def test_grpo_raises_the_mean_reward_on_a_toy_task(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch):
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    before = {k: v.clone() for k, v in load_policy(tiny_qwen25, device="cpu").model.state_dict().items()}
    cfg = load_config(GRPOConfig, CONFIG, [
        f"out_dir={tmp_path}", f"model.path={tiny_qwen25}", "train.max_steps=14", "train.save_every=0",
        "train.tensorboard=false", f"data.train={zoom_rows_file(16, 1001)}", "rewards.weights={even_tokens: 1.0}", "rewards.options={}",
        "rollout.max_turns=1", "rollout.max_new_tokens=4", "grpo.prompts_per_step=4", "grpo.group_size=8",
        "grpo.dynamic_sampling=false", "optim.lr=3e-2", "seed=1",
    ])  # fmt: skip
    model_dir = grpo.train(cfg)
    curve = [r["reward"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    # measured: 0.49 at the first steps, 0.95+ at the last (a random model samples half even ids)
    assert sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.2, curve
    after = load_policy(model_dir, device="cpu").model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_every_pass_makes_the_optimizer_steps_the_lr_schedule_counts(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    # 2 prompts x 4 samples = 8 trajectories in 5 mini-batches (sizes 1, 2, 1, 2, 2): 5 optimizer steps a step, so
    # a 2-step run's cosine (0.5 x (1 + cos(pi x steps done / 10))) is at half the peak when the second step starts
    overrides = [f"out_dir={tmp_path}", f"model.path={tiny_qwen25}", "train.max_steps=2", "train.save_every=0",
                 "train.tensorboard=false", f"data.train={zoom_rows_file(16, 1000)}", "grpo.mini_batches=5",
                 "grpo.dynamic_sampling=false", "rewards.weights={even_tokens: 1.0}", "rewards.options={}"]  # fmt: skip
    grpo.train(load_config(GRPOConfig, CONFIG, overrides))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["lr"] == pytest.approx(1e-4) and records[1]["lr"] == pytest.approx(0.5e-4)


def test_grpo_at_temperature_07_trains_on_the_sampled_distribution(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch):
    """Rollouts at T = 0.7 with a nucleus: the trainer scores softmax(z / 0.7) cut as the sampler cut it, so the
    sampler's log-probs agree with the trainer's, the first update's ratio is 1 (inner_updates=2: the old log-probs
    come from their own pass) and the entropy logged is that of the tempered distribution (below T = 1's)."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    entropy = {}
    for temperature, top_p in ((0.7, 0.95), (1.0, 1.0)):
        out = tmp_path / f"t{temperature}"
        overrides = [*_overrides(out, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=2", "rollout.max_turns=1",
                     "grpo.inner_updates=2", f"rollout.temperature={temperature}", f"rollout.top_p={top_p}",
                     "rewards.weights={even_tokens: 1.0}", "rewards.options={}", "train.lm_head_chunk=0"]  # fmt: skip
        grpo.train(load_config(GRPOConfig, CONFIG, overrides))
        updated = [r for r in read_metrics(out / "metrics.jsonl") if "ratio_check" in r]
        assert updated, "no step updated"
        for r in updated:
            assert r["ratio_check"] < 1e-5 and r["sampler_logprob_gap"] < 1e-3
        entropy[temperature] = updated[0]["entropy"]
    assert entropy[0.7] < entropy[1.0]


def test_a_sampler_that_draws_from_another_distribution_stops_the_run_with_one_line(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    """The health check: rollouts at T = 0.5 scored as if at T = 1 (what a generator with other weights looks like
    to the trainer) stop the run at the first step, naming the check; grpo.max_sampler_gap=0 trains anyway."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    monkeypatch.setattr(grpo, "_head_args", lambda cfg: (True, 0, (1.0, 1.0)))
    overrides = [*_overrides(tmp_path, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=1", "rollout.max_turns=1",
                 "rollout.temperature=0.5", "rewards.weights={even_tokens: 1.0}", "rewards.options={}"]  # fmt: skip
    with pytest.raises(grpo.SamplerMismatch, match="max_sampler_gap") as info:
        grpo.train(load_config(GRPOConfig, CONFIG, overrides))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path / "metrics.jsonl")  # stopped first
    grpo.train(load_config(GRPOConfig, CONFIG, [*overrides, "grpo.max_sampler_gap=0", f"out_dir={tmp_path / 'off'}"]))
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        load_config(GRPOConfig, CONFIG, [*overrides, "rollout.temperature=0"])


def test_dynamic_sampling_balances_the_global_batch_over_ranks(monkeypatch):
    """Rank 0 kept 3 informative groups, rank 1 none: the global batch has 3, so each rank trains on 1 and rank 1
    takes rank 0's first surplus group (before, the per-rank minimum skipped the step on both)."""
    from vagent.training.distributed import DistEnv

    kept = {0: [("a", [1.0]), ("b", [2.0]), ("c", [3.0])], 1: []}
    counts = [len(kept[0]), len(kept[1])]
    n = min(4, sum(counts) // 2)
    monkeypatch.setattr(grpo, "all_gather_object", lambda _: [kept[0][n:], kept[1][n:]])
    out = {r: grpo._balance_groups(kept[r], counts, n, DistEnv(r, 2, r, torch.device("cpu"))) for r in (0, 1)}
    assert out == {0: [("a", [1.0])], 1: [("b", [2.0])]}
    # every rank with enough keeps its first n and exchanges nothing
    monkeypatch.setattr(grpo, "all_gather_object", lambda _: pytest.fail("no exchange needed"))
    assert grpo._balance_groups(kept[0], [3, 2], 2, DistEnv(0, 2, 0, torch.device("cpu"))) == kept[0][:2]


def _episode(task_id, prompt, pixels=4):
    """A trajectory whose prompt part (shared by its group, as the engine shares it) and one tool image carry patches."""
    from vagent.types import ContentPart, ImagePatches, Message, Trajectory

    tool = ContentPart("image", image=prompt.image, patches=ImagePatches(torch.zeros(pixels, 8), torch.ones(1, 3)))
    return Trajectory(task_id, [Message("user", [prompt]), Message("tool", [tool])])


def test_a_rank_whose_groups_all_count_holds_no_more_patches_through_refills_than_the_plan(monkeypatch):
    """Dynamic sampling over 4 ranks where only this one's groups are informative: the global batch stays short, so
    every rank rolls out both refill rounds, and this one keeps every group it rolls out. Those beyond its
    prompts_per_step are trained nowhere here (dropped, or sent without patches to a rank short of groups), so their
    patches go after each round: at no time does it hold the patches of more episodes than ``vagent memory`` plans
    (a step's and a round's), and by the time the rollout's memory goes back to the system only the groups it trains
    hold theirs."""
    import dataclasses
    import types

    from PIL import Image

    from vagent.recipes.memory import _episodes
    from vagent.training.distributed import DistEnv
    from vagent.types import ContentPart, ImagePatches

    cfg = GRPOConfig()
    cfg.grpo = dataclasses.replace(cfg.grpo, group_size=2, prompts_per_step=2, dynamic_sampling=True,
                                   max_refill_rounds=2)  # fmt: skip
    world = 4
    rolled, held_at_round, held_at_trim = [], [], []

    def roll_out(ctx, generator, batch_rows, components, timer):
        held_at_round.append(sum(bool(t.patches) for t in rolled) + len(batch_rows) * 2)  # with this round's own
        out = []
        for row in batch_rows:  # a group shares its prompt part, as the engine's samples do
            prompt = ContentPart("image", image=Image.new("RGB", (28, 28)),
                                 patches=ImagePatches(torch.zeros(4, 8), torch.ones(1, 3)))  # fmt: skip
            out += [_episode(row, prompt), _episode(row, prompt)]
        rolled.extend(out)
        return out, [0.0, 1.0] * len(batch_rows)  # every group informative

    monkeypatch.setattr(grpo, "_roll_out", roll_out)
    monkeypatch.setattr(grpo, "all_gather_object", lambda mine: [mine] + [[] if isinstance(mine, list) else 0] * 3)
    monkeypatch.setattr(grpo, "trim_host_memory", lambda: held_at_trim.append(sum(bool(t.patches) for t in rolled)))
    backend = types.SimpleNamespace(free_storage=lambda: None)
    ctx = types.SimpleNamespace(cfg=cfg, env=DistEnv(0, world, 0, torch.device("cpu")),
                                rows=[f"p{i}" for i in range(64)], generation_policy=lambda: None,
                                generation_backend=lambda policy: backend)  # fmt: skip
    groups = grpo._collect_groups(ctx, 0, {})
    assert groups.rounds == 3 and len(rolled) == 3 * 2 * 2  # both refills ran; every group kept on this rank
    assert groups.n_groups == 6 // world  # the global batch: 6 groups over 4 ranks
    assert max(held_at_round) <= _episodes(cfg.grpo) == 8  # before the fix: 12 at the third round
    assert held_at_trim == [len(groups.trajectories)] and all(t.patches for t in groups.trajectories)


def test_micro_batches_mark_the_last_and_hold_one_collated_batch_at_a_time(monkeypatch):
    """``last`` comes from the chunking itself (gradient accumulation syncs on it), and a batch is emptied before the
    next is collated: a loop that keeps its loop variable still holds one micro-batch's copy of the images, not two."""
    import gc
    import types
    import weakref

    from vagent.data.encode import Encoded

    def encoded(n):
        return Encoded(input_ids=torch.ones(n, dtype=torch.long), loss_mask=torch.ones(n, dtype=torch.long),
                       image_patches=[torch.zeros(16, 8)], image_grid_thw=torch.tensor([[1, 4, 4]]),
                       mm_token_type_ids=torch.zeros(n, dtype=torch.int32), logprobs=torch.zeros(n))  # fmt: skip

    alive_at_collate, made = [], []

    def counted(samples, pad_id):
        gc.collect()
        alive_at_collate.append(sum(ref() is not None for ref in made))
        batch = collate(samples, pad_id)
        made.append(weakref.ref(batch["pixel_values"]))
        return batch

    monkeypatch.setattr(grpo, "collate", counted)
    cfg = GRPOConfig()
    cfg.grpo.micro_batch_size = 2
    ctx = types.SimpleNamespace(cfg=cfg, env=types.SimpleNamespace(device=torch.device("cpu")),
                                policy=types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad_token_id=0)))  # fmt: skip
    seen = []
    for idx, batch, last in grpo._micro_batches(ctx, [encoded(3 + i) for i in range(5)], [4, 0, 3, 1, 2]):
        seen.append((idx, last, tuple(batch["pixel_values"].shape)))
    assert seen == [([4, 0], False, (32, 8)), ([3, 1], False, (32, 8)), ([2], True, (16, 8))]
    assert alive_at_collate == [0, 0, 0]  # before: the previous batch, still named by `batch`, at each collate
    assert not list(grpo._micro_batches(ctx, [], []))


def test_alarms_say_once_when_tool_use_collapses_or_episodes_mostly_hit_a_cap(capsys):
    """The first 3 steps call tools in 80% of episodes; at step 5 only 10% do (below a quarter of 80%): one alarm,
    said once, in the console and in that step's record. Later steps stay quiet; a capped majority has its own."""
    from vagent.config import GRPOAlgoConfig
    from vagent.training.distributed import DistEnv

    alarms = Alarms(GRPOAlgoConfig(), DistEnv(0, 1, 0, torch.device("cpu")))
    stops = {f"stop/{r}": 0.0 for r in grpo.STOP_REASONS}
    records = [{"tool_call_rate": rate, **stops, "stop/answered": 1.0} for rate in (0.8, 0.8, 0.8, 0.5, 0.1, 0.05)]
    for step, record in enumerate(records):
        alarms.check(step, record)
    assert [("alarm/tool_collapse" in r) for r in records] == [False, False, False, False, True, False]
    capped = {"tool_call_rate": 0.8, **stops, "stop/max_tokens": 0.4, "stop/max_turns": 0.3}
    again = dict(capped)
    alarms.check(6, capped)
    alarms.check(7, again)
    assert capped.get("alarm/capped") == 1.0 and "alarm/capped" not in again
    out = capsys.readouterr().out
    assert out.count("tool use is collapsing") == 1 and out.count("stopped on a cap") == 1


def test_a_spent_call_budget_is_a_cap_masked_logged_and_alarmed_like_the_others(capsys):
    """rollout.max_tool_calls stops an episode with max_calls: a cap, so grpo.mask_truncated masks it, its share is
    logged as stop/max_calls, and a capped majority made of it raises the cap alarm (which names it)."""
    from vagent.config import GRPOAlgoConfig
    from vagent.training.distributed import DistEnv

    assert set(grpo.CAPS) == {"max_turns", "max_tokens", "max_images", "max_calls"} and set(grpo.CAPS) < set(
        grpo.STOP_REASONS
    )
    record = {"tool_call_rate": 0.9, **{f"stop/{r}": 0.0 for r in grpo.STOP_REASONS}, "stop/max_calls": 0.7}
    Alarms(GRPOAlgoConfig(), DistEnv(0, 1, 0, torch.device("cpu"))).check(0, record)
    assert record.get("alarm/capped") == 1.0 and "calls 70%" in capsys.readouterr().out


def test_over_turn_masking_trains_nothing_on_episodes_cut_by_a_cap(tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch):
    """One turn of 6 tokens: a random policy's every episode is cut by max_tokens. With grpo.mask_truncated they keep
    their rewards (the groups still count) but the update trains on none of them (the weights stay, masked_share 1);
    without it the same step trains on them."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    base = [*_overrides(tmp_path, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=1", "rollout.max_turns=1",
            "rollout.max_new_tokens=6", "rewards.weights={even_tokens: 1.0}", "rewards.options={}",
            "grpo.dynamic_sampling=false"]  # fmt: skip
    before = load_policy(tiny_qwen25, device="cpu").model.state_dict()
    for masked in (True, False):
        out = tmp_path / f"masked-{masked}"
        model = grpo.train(load_config(GRPOConfig, CONFIG, [*base, f"out_dir={out}", f"grpo.mask_truncated={masked}"]))
        record = next(r for r in read_metrics(out / "metrics.jsonl") if "masked_share" in r)
        assert record["stop/max_tokens"] == 1.0 and record["reward"] > 0
        after = load_policy(model, device="cpu").model.state_dict()
        changed = sum(not torch.equal(before[k], after[k]) for k in before)
        assert (record["masked_share"], record["loss"], changed == 0) == (
            (1.0, 0.0, True) if masked else (0.0, record["loss"], False)
        )


def test_the_sampler_checks_compare_the_tokens_of_episodes_over_turn_masking_keeps_out_of_the_loss(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    """Every episode is cut by max_tokens and masked (grpo.mask_truncated): the update trains on no token, yet the
    sampler gap and the ratio check compare every sampled token and log how many. A synthetic gap with a known
    answer: the engine "recorded" log-probs log 4 below those it drew from, and the old log-probs are raised by 0.1
    after scoring (two mini-batches: the ratio is checked, not 1 by construction). The gap is log 4 and the first
    update's ratio deviates by 1 - e^-0.1 (both were logged as 0.0 over no tokens); with the health check on, the run
    stops before it trains."""
    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    rollout, score = grpo.run, grpo._score_old_logprobs

    def gapped(*args, **kwargs):
        out = rollout(*args, **kwargs)
        for t in out:
            t.logprobs = [lp - math.log(4) if m else lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True)]
        return out

    def stale(ctx, groups, step, timer):
        out = score(ctx, groups, step, timer)  # the gap is measured here, against the unshifted old log-probs
        out.old = [old + 0.1 for old in out.old]
        return out

    monkeypatch.setattr(grpo, "run", gapped)
    monkeypatch.setattr(grpo, "_score_old_logprobs", stale)
    base = [*_overrides(tmp_path, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=1", "rollout.max_turns=1",
            "rollout.max_new_tokens=6", "rewards.weights={even_tokens: 1.0}", "rewards.options={}",
            "grpo.dynamic_sampling=false", "grpo.mask_truncated=true", "grpo.mini_batches=2"]  # fmt: skip
    grpo.train(load_config(GRPOConfig, CONFIG, [*base, "grpo.max_sampler_gap=0"]))
    [record] = read_metrics(tmp_path / "metrics.jsonl")
    assert record["stop/max_tokens"] == 1.0 and record["masked_share"] == 1.0 and record["loss"] == 0.0
    trajectories = 2 * 4  # prompts_per_step x group_size, none dropped
    assert record["sampler_logprob_gap_tokens"] == record["response_len"] * trajectories > 0
    assert record["sampler_logprob_gap"] == pytest.approx(math.log(4), rel=1e-4)
    assert record["ratio_check_tokens"] == record["response_len"] * trajectories / 2  # the first mini-batch's
    assert record["ratio_check"] == pytest.approx(1 - math.exp(-0.1), rel=1e-3)
    with pytest.raises(grpo.SamplerMismatch, match="differ from the trainer's by 1.39"):
        grpo.train(load_config(GRPOConfig, CONFIG, [*base, f"out_dir={tmp_path / 'checked'}"]))


def _half_informative(trajectories, rows):
    """``_even_tokens`` for half of the prompts (by a hash of their id), 0 for the others: those groups' rewards are
    all equal, and dynamic sampling drops them."""
    import zlib

    even = _even_tokens(trajectories, rows)
    return [e if zlib.crc32(row.id.encode()) % 2 else 0.0 for e, row in zip(even, rows, strict=True)]


def test_the_score_stage_encodes_the_engines_patches_and_the_step_lets_them_go(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    """Every episode crops once (a scripted turn). The score stage encodes each kept trajectory from the very tensors
    the engine made when it showed each image (no image is resized or processed again); once the step is done
    nothing holds them, neither the episodes kept for the checkpoint's export nor any encoding, before the next
    step rolls out; a dropped group's patches go as soon as it is dropped."""
    import dataclasses
    import gc
    import weakref

    import vagent.data.encode as encode

    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [10, 20, 120, 90]}}</tool_call>'
    from_row = grpo.Task.from_row.__func__
    monkeypatch.setattr(grpo.Task, "from_row", classmethod(
        lambda cls, row, tools: dataclasses.replace(from_row(cls, row, tools), scripted_turns=[crop])))  # fmt: skip
    resized = []  # the encoder resizing an image: it runs the processor on it again
    monkeypatch.setattr(encode, "resize_to_budget", lambda image, **kw: resized.append(image) or image)
    refs, dropped, alive_at_next_step = [], [], []
    score, collect = grpo._score_old_logprobs, grpo._collect_groups

    def scored(ctx, groups, step, timer):
        out = score(ctx, groups, step, timer)
        for t, enc in zip(out.trajectories, out.encoded, strict=True):
            assert len(t.patches) == len(t.images) == 2  # the prompt image and the crop
            assert all(a is p.pixel_values for a, p in zip(enc.image_patches, t.patches, strict=True))
            refs.extend(weakref.ref(p.pixel_values) for p in t.patches)
        return out

    def collected(ctx, consumed, timer):
        groups = collect(ctx, consumed, timer)
        kept = {id(t) for t in groups.trajectories}
        dropped.extend(t for t in groups.seen if id(t) not in kept)
        return groups

    def before_step(step, total):
        gc.collect()
        alive_at_next_step.append(sum(r() is not None for r in refs))

    monkeypatch.setattr(grpo, "_score_old_logprobs", scored)
    monkeypatch.setattr(grpo, "_collect_groups", collected)
    monkeypatch.setitem(__import__("vagent.rewards", fromlist=["REWARDS"]).REWARDS, "half", _half_informative)
    overrides = [*_overrides(tmp_path, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=2",
                 "rollout.max_turns=2", "rollout.max_new_tokens=6", "rewards.weights={half: 1.0}",
                 "rewards.options={}"]  # fmt: skip
    grpo.train(load_config(GRPOConfig, CONFIG, overrides), before_step=before_step)
    assert refs and not resized
    assert alive_at_next_step[1:] == [0]  # at step 2's start, nothing of step 1's patches is left
    assert dropped and all(not t.patches for t in dropped)
    assert list((tmp_path / "rollouts").glob("*_images/*.png")), "the export still writes the episodes' images"


def test_token_tis_weights_each_sampled_tokens_loss_by_its_capped_importance_ratio(
    tmp_path, tiny_qwen25, zoom_rows_file, monkeypatch
):
    """A synthetic engine/trainer gap with a known answer: every recorded sampler log-prob is log 4 below the
    trainer's, so pi_old / pi_sampler = 4 on every sampled token. With grpo.rollout_correction=token_tis (cap 2) each
    token's loss is doubled: the same step's gradient is exactly twice the uncorrected one's; every ratio is over the
    cap, the ratio's mean is 4 and the k3 KL is 4 - 1 - log 4, logged either way."""

    import vagent.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "even_tokens", _even_tokens)
    rollout = grpo.run

    def gapped(*args, **kwargs):
        out = rollout(*args, **kwargs)
        for t in out:  # the sampler "recorded" lower log-probs than it drew from
            t.logprobs = [lp - math.log(4) if m else lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True)]
        return out

    monkeypatch.setattr(grpo, "run", gapped)
    records = {}
    for mode in ("none", "token_tis"):
        overrides = [*_overrides(tmp_path / mode, tiny_qwen25, zoom_rows_file(16, 1000)), "train.max_steps=1",
                     "rollout.max_turns=1", "grpo.max_sampler_gap=0", "optim.max_grad_norm=1e9",
                     "rewards.weights={even_tokens: 1.0}", "rewards.options={}", f"grpo.rollout_correction={mode}"]  # fmt: skip
        grpo.train(load_config(GRPOConfig, CONFIG, overrides))
        [records[mode]] = read_metrics(tmp_path / mode / "metrics.jsonl")
    off, tis = records["none"], records["token_tis"]
    assert off["reward"] == tis["reward"]  # the same samples
    assert tis["grad_norm"] == pytest.approx(2 * off["grad_norm"], rel=1e-4)
    for r in (off, tis):
        assert r["rollout_corr/clipped_share"] == 1.0
        assert r["rollout_corr/is_ratio_mean"] == pytest.approx(4.0, rel=1e-4)
        assert r["rollout_corr/kl"] == pytest.approx(3 - math.log(4), rel=1e-4)
        assert r["sampler_logprob_gap"] == pytest.approx(math.log(4), rel=1e-4)

"""GRPO with verifiable multimodal rewards: turn a cold-started policy into one that uses tools well.

    torchrun --nproc_per_node N tools/train.py --config configs/grpo/<name>.yaml [key=value ...]
    vagent grpo --config configs/grpo/<name>.yaml [key=value ...]

Each step reads top to bottom in timed stages (verl's driver loop):

    gen      the rollout engine runs ``prompts_per_step`` prompts x ``group_size`` samples on each rank
             (tools run inside it, concurrently with generation; ``tools`` reports the time rows spent
             waiting on them)
    reward   the configured rewards (``vagent.rewards``), each component kept for the log
    (dynamic sampling: groups whose rewards are all equal carry no signal; they are dropped and more
             prompts rolled out, up to ``max_refill_rounds``, each refill only as many as the missing groups
             need at the share kept so far; all ranks keep the same number of groups)
    logprob  the one encoder re-encodes each kept trajectory to exactly its sampled ids (checked), and a
             forward pass scores them with the current weights: the "old" log-probs (the sampler's own
             log-probs differ by batching/cache numerics, so the ratio is taken against these; the
             first update's ratio is then exactly 1, which is checked and logged as ``ratio_check``); fully
             on-policy (one pass, one mini-batch, no KL) this pass is skipped and the update's own detached
             log-probs serve as the old ones
    update   ``inner_updates`` passes of ``mini_batches`` optimizer steps each: PPO-clip with
             clip-higher, token- or sequence-level aggregation over the whole mini-batch on all ranks,
             optional k3 KL to the frozen initial policy

Checkpoints and ``resume=auto`` work as in SFT (the data position is the number of prompts consumed).
Rollouts of the latest step are written under ``out_dir/rollouts/`` (JSONL + HTML viewer) at every
checkpoint.

With ``val.rows`` the policy answers held-out rows greedily before the first step, every ``val.every`` steps
and after the last (``val/*`` in the metrics, the trajectories under ``rollouts/val-step-*``). With
``val.keep_best`` the weights of the best validation accuracy, the start included, are kept under
``out_dir/best/`` and published as ``model/``: on a small budget one draw of prompts and samples can undo what
SFT taught, and the held-out check hands back the start instead.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vagent.algorithms import aggregate, group_advantages, informative_groups, kl_k3, policy_loss, sampled_logprobs
from vagent.config import ConfigError, GRPOConfig, config_to_dict
from vagent.data import Row, encode_messages, load_rows, write_rows
from vagent.data.batching import collate
from vagent.model import Policy, load_policy, masked_token_logprobs, policy_logits
from vagent.recipes.common import (
    build_backend,
    config_from_argv,
    load_trainable,
    peak_memory_gb,
    publish_model,
    resume_point,
    resume_training,
    save_checkpoint,
    say,
    to_device,
    tool_services,
    uses_bf16,
)
from vagent.rewards import REWARDS, combine
from vagent.rollout import RolloutLimits, Task, run
from vagent.rollout.export import write_html, write_jsonl
from vagent.toolbox import TOOLS
from vagent.training import checkpoint as ckpt
from vagent.training.backend import autocast
from vagent.training.distributed import DistEnv, all_reduce_min, all_reduce_sum, barrier, init_distributed, shutdown
from vagent.training.metrics import MetricsLogger
from vagent.types import Trajectory


def main(argv: list[str] | None = None) -> int:
    train(config_from_argv(GRPOConfig, sys.argv[1:] if argv is None else argv))
    return 0


def train(cfg: GRPOConfig, before_step: Callable[[int, int], None] | None = None) -> Path:
    """Run GRPO; returns the final HF model dir (``out_dir/model``). ``before_step(step, total_steps)``, if given, runs
    before each step's rollouts (the quickstart hands CPU threads over with it)."""
    unknown = sorted(set(cfg.rewards.weights) - set(REWARDS))
    if unknown:
        raise ConfigError(f"rewards.weights names unknown reward(s) {unknown}; known: {sorted(REWARDS)}")
    env = init_distributed(cfg.model.device)
    try:
        return _train(cfg, env, Path(cfg.out_dir), before_step)
    finally:
        shutdown()


def _train(cfg: GRPOConfig, env: DistEnv, out: Path, before_step: Callable[[int, int], None] | None) -> Path:
    t_start = time.perf_counter()
    root = out / "checkpoints"
    resume_from = resume_point(cfg.train.resume, env, root)
    bf16 = uses_bf16(cfg.train, env)
    algo = cfg.grpo

    # -- model (and the frozen reference for the KL term) ------------------------------------------------
    policy, model, model_path = load_trainable(cfg.model, cfg.train, out, env, resume_from, cfg.seed)
    reference = None
    if algo.kl_coef > 0 and not cfg.train.lora.enabled:  # with LoRA the reference is the model, adapters off
        reference = load_policy(model_path, device=env.device, dtype="float32").model.requires_grad_(False)

    # -- prompts ------------------------------------------------------------------------------------------
    train_path = _prompts(cfg, env, out, policy)
    rows = load_rows(train_path, known_tools=TOOLS)
    per_round = algo.prompts_per_step * env.world_size
    total_steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * len(rows) / per_round)
    optimizer_steps = total_steps * algo.inner_updates * algo.mini_batches
    backend = build_backend(cfg.train, cfg.optim, model, env, total_steps=optimizer_steps, bf16=bf16,
                            micro_batch_size=algo.micro_batch_size, grad_accum=1, find_unused=False)  # fmt: skip
    services = tool_services(cfg.toolbox)
    limits = RolloutLimits(**{k: v for k, v in config_to_dict(cfg.rollout).items() if k != "tools"})
    say(env, f"grpo: {len(rows)} prompts, {env.world_size} rank(s) x {algo.prompts_per_step} prompts x "
             f"{algo.group_size} samples per step -> {total_steps} steps ({optimizer_steps} optimizer steps)")  # fmt: skip

    fingerprint = {"config": config_to_dict(cfg), "train_data": ckpt.file_digest(train_path)}
    val = _Validation(cfg, env, out, load_rows(cfg.val.rows, known_tools=TOOLS) if cfg.val.rows else [], limits,
                      services, bf16)  # fmt: skip
    if val.rows:
        fingerprint["val_data"] = ckpt.file_digest(cfg.val.rows)
    state = resume_training(resume_from, backend, fingerprint, cfg.train.allow_changes, env)
    start_step, consumed = state.get("step", 0), state.get("prompts_consumed", 0)
    logger = MetricsLogger(out, enabled=env.is_main, resume_step=start_step, tensorboard=cfg.train.tensorboard,
                           wandb_project=cfg.train.wandb_project, config=fingerprint["config"])  # fmt: skip
    val.resume(state.get("best_val"))
    if val.rows and start_step == 0:
        val(0, policy, backend, logger)

    # -- loop -----------------------------------------------------------------------------------------------
    bar = tqdm(total=total_steps, initial=start_step, desc="grpo", disable=not env.is_main, dynamic_ncols=True)
    last: list[Trajectory] = []
    for step in range(start_step, total_steps):
        if before_step is not None:
            before_step(step, total_steps)
        timer: dict[str, float] = defaultdict(float)
        t_step = time.perf_counter()

        # gen + reward, with dynamic sampling refills
        kept: list[tuple[list[Trajectory], Row, list[float]]] = []  # per group: samples, row, rewards
        seen: list[Trajectory] = []
        components: dict[str, list[float]] = defaultdict(list)
        rounds, rolled, enough = 0, 0, 0
        while True:
            # a refill rolls out only what the kept groups lack, scaled by the share kept so far
            n_prompts = algo.prompts_per_step if not rounds else _refill_size(algo.prompts_per_step, enough, rolled)
            batch_rows = _rows_for(rows, consumed, env, n_prompts, cfg.seed)
            consumed += n_prompts * env.world_size
            rolled += n_prompts
            tasks = [Task.from_row(row, cfg.data.tools) for row in batch_rows]
            model.eval()
            t0 = time.perf_counter()
            with torch.no_grad(), autocast(env.device, bf16):
                trajectories = run(policy, tasks, algo.group_size, limits, batch_size=algo.rollout_batch_size,
                                   **services)  # fmt: skip
            timer["gen"] += time.perf_counter() - t0
            timer["tools"] += sum(t.metrics.get("tool_wait_s", 0.0) for t in trajectories) / max(1, len(trajectories))
            t0 = time.perf_counter()
            per_sample_rows = [row for row in batch_rows for _ in range(algo.group_size)]
            totals, parts = combine(trajectories, per_sample_rows, cfg.rewards.weights, cfg.rewards.options)
            timer["reward"] += time.perf_counter() - t0
            for t, total in zip(trajectories, totals, strict=True):
                t.reward = total
            seen += trajectories
            for name, values in parts.items():
                components[f"reward/{name}"] += values
            components["accuracy"] += REWARDS["accuracy"](trajectories, per_sample_rows)  # logged even if unweighted
            rewards = torch.tensor(totals)
            keep = informative_groups(rewards, algo.group_size) if algo.dynamic_sampling else None
            for g, row in enumerate(batch_rows):
                if keep is None or keep[g]:
                    group = trajectories[g * algo.group_size : (g + 1) * algo.group_size]
                    kept.append((group, row, totals[g * algo.group_size : (g + 1) * algo.group_size]))
            rounds += 1
            enough = all_reduce_min(torch.tensor([len(kept)], device=env.device)).item()
            if not algo.dynamic_sampling or enough >= algo.prompts_per_step or rounds > algo.max_refill_rounds:
                break
        n_groups = min(int(enough), algo.prompts_per_step)  # the same on every rank (DDP steps in lockstep)
        kept = kept[:n_groups]
        last = seen

        lr = backend.lr()  # the rate this step's updates use
        update_stats: dict[str, float] = {}
        if n_groups:
            update_stats = _update(cfg, policy, backend, reference, kept, env, bf16, timer, step)
        if update_stats.get("ratio_check", 0.0) > 1e-3:  # the old log-probs were not scored by these weights
            say(
                env,
                f"warning: step {step + 1}: first-update ratio deviates from 1 by {update_stats['ratio_check']:.2e}",
            )
        timer["step"] = time.perf_counter() - t_step
        done = step + 1
        bar.update(1)
        record = _metrics(seen, components, kept, n_groups, rounds, update_stats, timer, env)
        bar.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record['accuracy']:.2f}")
        if done % cfg.train.log_every == 0 or done == total_steps:
            logger.log(done, {**record, "lr": lr, "peak_mem_gb": peak_memory_gb(env)})
        if val.rows and (done == total_steps or (cfg.val.every and done % cfg.val.every == 0)):
            bar.clear()
            val(done, policy, backend, logger)
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done != total_steps:
            _save(cfg, backend, policy, root, done, consumed, fingerprint, env, last, out, val)
    bar.close()

    final = _save(cfg, backend, policy, root, total_steps, consumed, fingerprint, env, last, out, val)
    logger.close()
    if cfg.val.keep_best and val.best is not None:
        final = val.directory(val.best["step"])
        say(env, f"keeping step {val.best['step']} (val accuracy {val.best['accuracy']:.3f}; the last step "
                 f"{val.last_accuracy:.3f})")  # fmt: skip
    model_dir = publish_model(final, out, env)  # the final (or the best) model at a stable path
    say(env, f"done: {total_steps} steps in {time.perf_counter() - t_start:.0f}s; model at {model_dir}")
    return model_dir


class _Validation:
    """Greedy rollouts of held-out rows scored with the training rewards, and (``val.keep_best``) the weights of the
    best accuracy so far under ``out/best/step-N/model``.

    A best directory is only deleted once a committed checkpoint names a later best, so a resumed run always
    finds the one its checkpoint recorded; directories a killed attempt wrote after its last checkpoint are
    deleted on resume. Validation runs under a forked RNG and takes nothing from training's random numbers (with
    tool calls the engine's batches follow tool timing, so runs are not bit-identical anyway: README, GRPO).
    """

    def __init__(self, cfg: GRPOConfig, env: DistEnv, out: Path, rows: list[Row], limits: RolloutLimits,
                 services: dict[str, Any], bf16: bool) -> None:  # fmt: skip
        self.cfg, self.env, self.out, self.rows, self.services, self.bf16 = cfg, env, out, rows, services, bf16
        self.limits = dataclasses.replace(limits, temperature=0.0)
        self.best: dict[str, Any] | None = None  # {"step", "accuracy"}
        self.last_accuracy = float("nan")

    def directory(self, step: int) -> Path:
        return self.out / "best" / f"step-{step:08d}"

    def resume(self, best: dict[str, Any] | None) -> None:
        """Adopt the checkpoint's best (None on a fresh run) and delete every other best directory."""
        self.best = best if self.cfg.val.keep_best else None
        self.prune()

    def prune(self) -> None:
        if self.env.is_main and (self.out / "best").is_dir():
            keep = self.directory(self.best["step"]).name if self.best else None
            for d in (self.out / "best").iterdir():
                if d.name != keep:
                    shutil.rmtree(d, ignore_errors=True)
        barrier()

    def __call__(self, step: int, policy: Policy, backend, logger: MetricsLogger) -> None:
        env = self.env
        t0 = time.perf_counter()
        mine = self.rows[env.rank :: env.world_size]
        backend.module.eval()
        devices = [env.device] if env.device.type == "cuda" else []
        with torch.no_grad(), autocast(env.device, self.bf16), torch.random.fork_rng(devices=devices):
            tasks = [Task.from_row(row, self.cfg.data.tools) for row in mine]
            trajectories = run(policy, tasks, 1, self.limits, batch_size=self.cfg.grpo.rollout_batch_size,
                               **self.services)  # fmt: skip
        totals, parts = combine(trajectories, mine, self.cfg.rewards.weights, self.cfg.rewards.options)
        correct = parts["accuracy"] if "accuracy" in parts else REWARDS["accuracy"](trajectories, mine)
        sums = all_reduce_sum(torch.tensor([sum(correct), sum(totals), sum(t.stop_reason == "answered" for t in
                                            trajectories), sum(len(t.tool_results) for t in trajectories),
                                            len(mine)], dtype=torch.float64, device=env.device)).tolist()  # fmt: skip
        n = max(sums[4], 1.0)
        record = {"val/accuracy": sums[0] / n, "val/reward": sums[1] / n, "val/answered": sums[2] / n,
                  "val/tool_calls_per_traj": sums[3] / n, "time/val": time.perf_counter() - t0}  # fmt: skip
        self.last_accuracy = record["val/accuracy"]
        if self.cfg.val.keep_best and (self.best is None or self.last_accuracy > self.best["accuracy"]):
            self.best = {"step": step, "accuracy": self.last_accuracy}
            if env.is_main:
                tmp = self.out / "best" / f".tmp-step-{step:08d}"
                shutil.rmtree(tmp, ignore_errors=True)
                ckpt.save_model(backend.model, policy.processor, tmp / "model")
                shutil.rmtree(self.directory(step), ignore_errors=True)
                tmp.rename(self.directory(step))
            barrier()
        if self.best is not None:
            record["val/best_step"] = self.best["step"]
        logger.log(step, record)
        if env.is_main:
            write_jsonl(trajectories, self.out / "rollouts" / f"val-step-{step:08d}.jsonl")
            write_html(trajectories, self.out / "rollouts" / f"val-step-{step:08d}.html",
                       title=f"GRPO validation at step {step} (rank 0, greedy)")  # fmt: skip
        say(env, f"val at step {step}: accuracy {record['val/accuracy']:.3f}, reward {record['val/reward']:.3f} "
                 f"({len(self.rows)} rows, greedy, {record['time/val']:.0f}s)")  # fmt: skip


def _refill_size(wanted: int, kept: int, rolled: int) -> int:
    """Prompts a dynamic-sampling refill rolls out on each rank: the groups still missing, divided by the share
    of rolled-out prompts kept so far (one prompt at the least, ``wanted`` at the most).

    >>> _refill_size(8, kept=6, rolled=8)  # 2 missing, 3 of 4 kept: 3 more
    3
    >>> _refill_size(8, kept=0, rolled=8)  # nothing kept yet: a whole round
    8
    """
    if kept == 0:
        return wanted
    return max(1, min(wanted, math.ceil((wanted - kept) * rolled / kept)))


def _rows_for(rows: list[Row], consumed: int, env: DistEnv, per_rank: int, seed: int) -> list[Row]:
    """This rank's prompts of the round starting at global position ``consumed`` in an endless stream of
    epochs, each a fresh (seed, epoch) permutation."""
    positions = [divmod(consumed + env.rank * per_rank + k, len(rows)) for k in range(per_rank)]  # (epoch, index)
    orders = {epoch: np.random.default_rng([seed, epoch]).permutation(len(rows)) for epoch, _ in positions}
    return [rows[int(orders[epoch][i])] for epoch, i in positions]


def _scored_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], share_prefix: bool = True, chunk_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs of the sampled tokens and their summed entropy. With ``chunk_size`` the head runs on the
    sampled positions, that many at a time (``masked_token_logprobs``); with 0, ``sampled_logprobs`` over whole
    logits from the position that predicts the batch's first sampled token on (the prompt needs no head)."""
    mask = batch["loss_mask"]
    if chunk_size:
        return masked_token_logprobs(model, batch, mask, chunk_size=chunk_size, share_prefix=share_prefix)
    width = mask.shape[1]
    first = int(mask.float().argmax(dim=1).min()) if mask.any() else width - 1  # earliest sampled token
    start = max(first - 1, 0)  # position start predicts token start + 1
    # (B, width - start, V)
    logits = policy_logits(model, batch, logits_to_keep=width - start, share_prefix=share_prefix)
    lp, entropy = sampled_logprobs(logits, batch["input_ids"][:, start:], mask[:, start:])
    return torch.nn.functional.pad(lp, (start, 0)), entropy


def _update(cfg: GRPOConfig, policy: Policy, backend, reference, kept, env: DistEnv, bf16: bool,
            timer: dict[str, float], step: int) -> dict[str, float]:  # fmt: skip
    """logprob + update stages on the kept groups. Returns summed statistics for the log."""
    algo = cfg.grpo
    t0 = time.perf_counter()
    trajectories = [t for group, _, _ in kept for t in group]
    rewards = torch.tensor([r for _, _, group_rewards in kept for r in group_rewards])
    advantages = group_advantages(
        rewards, algo.group_size, scale_by_std=algo.scale_by_std, negative_scale=algo.negative_scale
    )  # (N,)
    min_pixels, max_pixels = policy.pixel_budget
    encoded = []
    for t in trajectories:
        enc = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
        if enc.input_ids.tolist() != t.token_ids:  # the one-encoder contract; a bug if it ever fires
            raise RuntimeError(f"re-encoding trajectory {t.task_id} did not give back its sampled ids")
        encoded.append(enc)
    pad_id = policy.tokenizer.pad_token_id or 0
    module = backend.module
    head = (cfg.train.share_prefix, cfg.train.lm_head_chunk)  # how _scored_logprobs runs the LM head
    policy.model.train()

    def batches(order: list[int]):
        for start in range(0, len(order), algo.micro_batch_size):
            idx = order[start : start + algo.micro_batch_size]
            yield idx, to_device(collate([encoded[i] for i in idx], pad_id), env.device)

    # old (and reference) log-probs with the weights that sampled, in the mode the update runs in. On-policy
    # (one pass, one optimizer step, no KL) the update's own detached log-probs are the old ones: the same
    # weights, the same forward, so the ratio is 1 by construction and this whole pass is skipped (as TRL
    # does). Otherwise the ratio check below is a real test of that equality.
    on_policy = algo.inner_updates == 1 and algo.mini_batches == 1 and algo.kl_coef == 0
    old: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    ref: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    sampler_gap, sampled_total = 0.0, 0
    with torch.no_grad(), autocast(env.device, bf16):
        for idx, batch in batches([] if on_policy else list(range(len(encoded)))):
            lp, _ = _scored_logprobs(module, batch, *head)
            ref_lp = None
            if reference is not None:
                ref_lp, _ = _scored_logprobs(reference, batch, *head)
            elif algo.kl_coef > 0:  # LoRA: the reference is the base model, adapters disabled
                with policy.model.disable_adapter():
                    ref_lp, _ = _scored_logprobs(policy.model, batch, *head)
            for row, i in enumerate(idx):
                n = len(encoded[i].input_ids)
                old[i] = lp[row, :n].detach()
                ref[i] = ref_lp[row, :n] if ref_lp is not None else old[i]
                mask = encoded[i].loss_mask.bool()
                sampler = torch.tensor(trajectories[i].logprobs, device=env.device)
                sampler_gap += float((old[i] - sampler)[mask.to(env.device)].abs().sum())
                sampled_total += int(mask.sum())
    timer["logprob"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    stats: Counter[str] = Counter()
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n = len(encoded)
    for inner in range(algo.inner_updates):
        order = torch.randperm(n, generator=generator).tolist() if algo.inner_updates > 1 else list(range(n))
        size = math.ceil(n / algo.mini_batches)
        for m, start in enumerate(range(0, n, size)):
            members = order[start : start + size]
            local = (
                sum(int(encoded[i].loss_mask.sum()) for i in members) if algo.aggregation == "token" else len(members)
            )
            normalizer = max(float(all_reduce_sum(torch.tensor([float(local)], device=env.device))), 1.0)
            micro = list(batches(members))
            for k, (idx, batch) in enumerate(micro):
                mask = batch["loss_mask"]
                width = mask.shape[1]
                adv = advantages[idx].to(env.device)
                with backend.accumulating(last=k == len(micro) - 1):
                    lp, entropy = _scored_logprobs(module, batch, *head)
                    if on_policy:
                        for row, i in enumerate(idx):
                            old[i] = lp[row, : len(encoded[i].input_ids)].detach()
                    old_lp = torch.stack([torch.nn.functional.pad(old[i], (0, width - len(old[i]))) for i in idx])
                    per_token, st = policy_loss(lp, old_lp, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high)
                    if algo.kl_coef > 0:
                        ref_lp = torch.stack([torch.nn.functional.pad(ref[i], (0, width - len(ref[i]))) for i in idx])
                        kl = kl_k3(lp, ref_lp, mask)
                        per_token = per_token + algo.kl_coef * kl
                        stats["kl"] += float(kl.sum())
                    backend.backward(aggregate(per_token, mask, algo.aggregation, normalizer))
                stats["entropy"] += float(entropy)
                stats["clip_frac"] += float(st["clip_frac"])
                stats["approx_kl"] += float(st["approx_kl"])
                stats["tokens"] += float(mask[:, 1:].sum())
                if inner == 0 and m == 0:  # weights still those that scored `old`: the ratio must be 1
                    stats["ratio_check"] = max(stats["ratio_check"], float(st["ratio_max_dev"]))
            stats["grad_norm"] += backend.step()
            stats["optimizer_steps"] += 1
    timer["update"] = time.perf_counter() - t0
    if on_policy:  # the training-vs-sampler gap, from the update's own log-probs
        for i, t in enumerate(trajectories):
            mask = encoded[i].loss_mask.bool().to(env.device)
            sampler_gap += float((old[i] - torch.tensor(t.logprobs, device=env.device))[mask].abs().sum())
            sampled_total += int(mask.sum())
    stats["sampler_logprob_gap"] = sampler_gap / max(1, sampled_total)
    return dict(stats)


def _metrics(seen: list[Trajectory], components: dict[str, list[float]], kept, n_groups: int, rounds: int,
             update: dict[str, float], timer: dict[str, float], env: DistEnv) -> dict[str, Any]:  # fmt: skip
    """Per-step means over every trajectory rolled out on every rank (kept or not)."""
    calls = sum(len(t.tool_results) for t in seen)
    sums = {
        "reward": sum(t.reward or 0.0 for t in seen),
        **{name: sum(values) for name, values in components.items()},
        "tool_calls_per_traj": calls,
        "response_len": sum(sum(t.loss_mask) for t in seen),
        "answered": sum(t.stop_reason == "answered" for t in seen),
    }
    keys = sorted(sums)
    totals = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(len(seen)), float(calls),
                            float(sum(1 for t in seen for r in t.tool_results if r["error"]))], device=env.device))  # fmt: skip
    count, all_calls, failed = float(totals[-3]), float(totals[-2]), float(totals[-1])
    record: dict[str, Any] = {k: float(v) / max(count, 1.0) for k, v in zip(keys, totals[:-3].tolist(), strict=True)}
    record["tool_failure_rate"] = failed / all_calls if all_calls else 0.0
    record["kept_groups"] = n_groups
    record["refill_rounds"] = rounds - 1
    if update:
        tokens = max(update["tokens"], 1.0)
        for key in ("entropy", "clip_frac", "approx_kl", "kl"):
            if key in update:
                record[key] = update[key] / tokens
        record["grad_norm"] = update["grad_norm"] / max(update["optimizer_steps"], 1.0)
        record["ratio_check"] = update["ratio_check"]
        record["sampler_logprob_gap"] = update["sampler_logprob_gap"]
    for stage in ("gen", "tools", "reward", "logprob", "update", "step"):
        record[f"time/{stage}"] = timer.get(stage, 0.0)
    return record


def _prompts(cfg: GRPOConfig, env: DistEnv, out: Path, policy: Policy) -> str:
    """The configured rows, or (data.train = None) a synthetic zoom set written once by rank 0."""
    if cfg.data.train:
        return cfg.data.train
    path = out / "data" / "prompts.jsonl"
    if env.is_main and not path.is_file():
        from data_pipelines.synthetic.zoom import zoom_rows

        rows = zoom_rows(path.parent, cfg.data.synthetic_rows, seed=cfg.seed + 1000, **policy.frame)
        write_rows(rows, path)
        say(env, f"wrote {len(rows)} synthetic zoom prompts to {path}")
    barrier()
    return str(path)


def _save(cfg: GRPOConfig, backend, policy: Policy, root: Path, step: int, consumed: int,
          fingerprint: dict[str, Any], env: DistEnv, last: list[Trajectory], out: Path, val: _Validation) -> Path:  # fmt: skip
    final = save_checkpoint(backend, policy.processor, root, step,
                            {**fingerprint, "prompts_consumed": consumed, "best_val": val.best}, env,
                            cfg.train.keep_last)  # fmt: skip
    val.prune()  # the checkpoint names the best from now on: older best directories can go
    if env.is_main and last:  # what the policy did at this step, to look at
        write_jsonl(last, out / "rollouts" / f"step-{step:08d}.jsonl")
        write_html(last, out / "rollouts" / f"step-{step:08d}.html", title=f"GRPO step {step} (rank 0)")
    return final


if __name__ == "__main__":
    raise SystemExit(main())

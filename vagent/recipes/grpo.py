"""GRPO with verifiable multimodal rewards: turn a cold-started policy into one that uses tools well.

    torchrun --nproc_per_node N tools/train.py --config configs/grpo/<name>.yaml [key=value ...]
    vagent grpo --config configs/grpo/<name>.yaml [key=value ...]

Each step reads top to bottom in timed stages (verl's driver loop), one function each, handing the next stage
a small dataclass (``_Groups``, ``_Scored``):

    sync     ``rollout.backend=vllm``: stream the trained weights into the rank's vLLM engine (whole tensors, LoRA
             merged; ``vagent.training.weight_sync``) and reset its caches; hf under ``train.sharding=fsdp``: gather
             the trained shards into the whole-weights copy that generates (``vagent.training.fsdp.InferenceCopy``);
             hf under DDP: the trained model generates itself
    gen      the rollout engine runs ``prompts_per_step`` prompts x ``group_size`` samples on each rank
             (tools run inside it, concurrently with generation; ``tools`` reports the time rows spent
             waiting on them)
    reward   the configured rewards (``vagent.rewards``), each component kept for the log
    (dynamic sampling: groups whose rewards are all equal carry no signal; they are dropped and more
             prompts rolled out, up to ``max_refill_rounds``, each refill only as many as the missing groups
             need at the share kept so far; decided over the global batch, as verl filters it: ranks short
             of groups take the others' surplus, so every rank trains on the same number)
             -> ``_collect_groups`` returns ``_Groups``
    adv      group advantages; the one encoder re-encodes each kept trajectory to exactly its sampled ids (checked)
    logprob  a forward pass scores them with the current weights: the "old" log-probs (the sampler's own
             log-probs differ by batching/cache numerics, so the ratio is taken against these; the
             first update's ratio is then exactly 1, which is checked and logged as ``ratio_check``); fully
             on-policy (one pass, one mini-batch, no KL) this pass is skipped and the update's own detached
             log-probs serve as the old ones
             -> ``_score_old_logprobs`` returns ``_Scored``
    update   ``inner_updates`` passes of ``mini_batches`` optimizer steps each: PPO-clip with
             clip-higher, token- or sequence-level aggregation over the whole mini-batch on all ranks,
             optional k3 KL to the frozen initial policy (``_update_policy``; statistics summed over ranks);
             every ``every`` steps with ``grpo.self_critic`` (Tool-Star), the last optimizer step's loss adds
             ``coef`` x DPO on pairs of the same groups, best against worst reward, against the old log-probs
             (``vagent.training.self_critic``)

Checkpoints and ``resume=auto`` work as in SFT (the data position is the number of prompts consumed).
Rollouts of the latest step are written under ``out_dir/rollouts/`` (JSONL + HTML viewer) at every
checkpoint.

With ``val.rows`` the policy answers held-out rows (greedily, or ``val.samples`` times each at
``val.temperature``) before the first step, every ``val.every`` steps and after the last (``val/*`` in the
metrics, the trajectories under ``rollouts/val-step-*``). With
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
import typing
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from vagent.algorithms import (
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    loss_normalizer,
    policy_loss,
    rollout_correction,
    sampled_logprobs,
)
from vagent.config import ConfigError, GRPOConfig, config_to_dict
from vagent.data import Row, encode_messages, load_rows
from vagent.data.batching import collate
from vagent.data.encode import Encoded
from vagent.eval.metrics import sign_flip_p
from vagent.model import Policy, load_policy, masked_token_logprobs, policy_logits
from vagent.recipes.alarms import CAPS, Alarms
from vagent.recipes.common import (
    build_backend,
    config_from_argv,
    gathered_state_dict,
    load_trainable,
    peak_memory_gb,
    publish_model,
    resume_point,
    resume_training,
    save_checkpoint,
    saved,
    say,
    to_device,
    tool_services,
    trim_host_memory,
    uses_bf16,
)
from vagent.recipes.judged import JudgedRewards
from vagent.rewards import REWARDS, check_rewards
from vagent.rollout import HFBackend, RolloutLimits, Task, run
from vagent.rollout.export import write_html, write_jsonl
from vagent.rollout.vllm_backend import VLLMBackend, engine_device, vllm_unsupported
from vagent.toolbox import TOOLS, ToolServices
from vagent.training import checkpoint as ckpt
from vagent.training.backend import TrainBackend, autocast
from vagent.training.distributed import (
    DistEnv,
    all_gather_object,
    all_reduce_min,
    all_reduce_sum,
    barrier,
    init_distributed,
    shutdown,
)
from vagent.training.fsdp import InferenceCopy, load_sharded
from vagent.training.metrics import MetricsLogger
from vagent.training.self_critic import SelfCritic
from vagent.training.weight_sync import generation_weights
from vagent.types import StopReason, Trajectory

STOP_REASONS = typing.get_args(StopReason)  # the same keys on every rank: all are logged, 0 when none stopped so


def main(argv: list[str] | None = None) -> int:
    train(config_from_argv(GRPOConfig, sys.argv[1:] if argv is None else argv))
    return 0


def train(cfg: GRPOConfig, before_step: Callable[[int, int], None] | None = None) -> Path | None:
    """Run GRPO; returns the final HF model dir (``out_dir/model``; None under ``train.save_final=false``).
    ``before_step(step, total_steps)``, if given, runs before each step's rollouts (the quickstart hands CPU threads
    over with it)."""
    try:  # before any process starts: a misspelt reward or option would fail only after the first rollout
        check_rewards(cfg.rewards.weights, cfg.rewards.options)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"rewards: {e.args[0]}") from None
    env = init_distributed(cfg.model.device)
    try:
        return _train(cfg, env, Path(cfg.out_dir), before_step)
    finally:
        shutdown()


@dataclasses.dataclass
class _Run:
    """What every step uses and no step changes: the config, the processes, the policy and its backend, the frozen
    reference, the prompts, the rollout settings and (``train.sharding=fsdp``) the whole-weights copy that
    generates."""

    cfg: GRPOConfig
    env: DistEnv
    out: Path
    policy: Policy
    backend: TrainBackend
    reference: torch.nn.Module | None
    rows: list[Row]
    limits: RolloutLimits
    services: ToolServices
    judged: JudgedRewards  # the weighted rewards, calling the judge endpoint when ``judge`` is weighted
    bf16: bool
    total_steps: int
    inference: InferenceCopy | None

    # made at the first rollout, kept for the run (KV storage, decode graphs; vLLM: the engine)
    sampler: HFBackend | VLLMBackend | None = None
    stale: bool = True  # vLLM: the engine holds other weights than the trained ones (set after each update)

    def generation_policy(self) -> Policy:
        """The policy the rollout engine samples from: the trained model itself, or under FSDP the inference copy
        refreshed from the shards in place; with vLLM, the engine is given the trained weights first if it holds
        older ones. A collective under FSDP: every rank calls it at the same point."""
        if self.cfg.rollout.backend == "vllm":
            engine = self.generation_backend(self.policy)
            assert isinstance(engine, VLLMBackend)
            if self.stale or engine.sleeping:  # asleep it has lost its weights (level 2), whether or not a step trained
                engine.load_weights(generation_weights(self.backend.module, dtype=engine.dtype))
                self.stale = False
            return self.policy
        if self.inference is None:
            return self.policy
        return dataclasses.replace(self.policy, model=self.inference.refresh(self.backend.model))

    def generation_backend(self, policy: Policy) -> HFBackend | VLLMBackend:
        """One generation backend for the whole run, over ``policy`` (the same model object at every step, its
        weights updated in place): its KV storage and decode graphs are made once, not every refill round, and
        with ``rollout.kv_cache_gb`` the storage is sized once from that budget. With vLLM, one engine per rank."""
        if self.sampler is None:
            rollout, gb = self.cfg.rollout, self.cfg.rollout.kv_cache_gb
            if rollout.backend == "vllm":
                self.sampler = _vllm_engine(self.cfg, policy, self.env, self.bf16)
            else:
                budget = {"kv_cache_bytes": int(gb * 2**30), "row_tokens": rollout.max_total_tokens,
                          "row_limit": self.cfg.grpo.rollout_batch_size} if gb else {}  # fmt: skip
                self.sampler = HFBackend(policy, attention=rollout.attention, **budget)
        return self.sampler

    def close(self) -> None:
        """End the vLLM engine (its memory, and any process of its own): at the end of the run, also after an error."""
        if isinstance(self.sampler, VLLMBackend):
            self.sampler.close()
        self.sampler = None


def _vllm_engine(cfg: GRPOConfig, policy: Policy, env: DistEnv, bf16: bool) -> VLLMBackend:
    """The rank's colocated vLLM engine over ``model.path`` (``rollout.backend=vllm``), in the update's compute
    dtype."""
    rollout, tp = cfg.rollout, cfg.rollout.tensor_parallel_size
    return VLLMBackend.for_policy(
        policy, dtype=torch.bfloat16 if bf16 else policy.dtype, max_model_len=rollout.max_total_tokens,
        max_num_seqs=rollout.max_num_seqs or cfg.grpo.rollout_batch_size * tp, max_images=rollout.max_images,
        seed=cfg.seed + 1_000_003 * (env.rank // tp), gpu_memory_utilization=rollout.gpu_memory_utilization,
        kv_cache_gb=rollout.kv_cache_gb, sleep=rollout.sleep, watchdog_s=rollout.watchdog_s, tensor_parallel_size=tp,
        tp_ranks=True,  # the weight sync reaches each shard in its own rank
    )  # fmt: skip


@dataclasses.dataclass
class _Groups:
    """The collect stage's result: the groups kept for the update and everything rolled out for the log.

    Attributes:
        trajectories: The kept groups' samples, group after group (``n_groups * group_size``).
        rewards: Their total rewards, in the same order.
        seen: Every trajectory rolled out this step on this rank, kept or not.
        components: Per reward component (and ``accuracy``), the values of ``seen``.
        n_groups: Groups kept, the same on every rank.
        rounds: Rollout rounds run (1 + dynamic-sampling refills).
        consumed: The global prompt position after this step.
    """

    trajectories: list[Trajectory]
    rewards: list[float]
    seen: list[Trajectory]
    components: dict[str, list[float]]
    n_groups: int
    rounds: int
    consumed: int


@dataclasses.dataclass
class _Scored:
    """The scoring stage's result: what the update trains on.

    Attributes:
        trajectories: The kept trajectories (``_Groups.trajectories``).
        encoded: Each kept trajectory re-encoded (its token ids, loss mask 1 = sampled, media).
        trained: (N,) bool: the trajectory adds to the loss (false: over-turn masking took it out; its sampled tokens
            are still scored, so the sampler check and the ratio check see them).
        advantages: (N,) group-normalized advantages.
        old: Per trajectory, (T_i,) log-probs of the weights that sampled (filled by the update when on-policy).
        ref: Per trajectory, (T_i,) log-probs of the frozen reference (``old`` without a KL term).
        on_policy: One pass, one mini-batch, no KL: the update's own detached log-probs are the old ones.
        sampler_gap: Summed |old - sampler| log-prob over sampled tokens (scored so far), trained or masked.
        sampled: Sampled tokens that sum covers.
    """

    trajectories: list[Trajectory]
    encoded: list[Encoded]
    trained: torch.Tensor
    advantages: torch.Tensor
    old: list[torch.Tensor]
    ref: list[torch.Tensor]
    on_policy: bool
    sampler_gap: float = 0.0
    sampled: int = 0


def _train(cfg: GRPOConfig, env: DistEnv, out: Path, before_step: Callable[[int, int], None] | None) -> Path | None:
    t_start = time.perf_counter()
    root = out / "checkpoints"
    resume_from = resume_point(cfg.train.resume, env, root)
    ctx, fingerprint = _setup(cfg, env, out, resume_from)
    try:
        val = _Validation(cfg, env, out, load_rows(cfg.val.rows, known_tools=TOOLS) if cfg.val.rows else [], ctx.limits,
                          ctx.services, ctx.bf16)  # fmt: skip
        if val.rows:
            fingerprint["val_data"] = ckpt.file_digest(cfg.val.rows)
        state = resume_training(resume_from, ctx.backend, fingerprint, cfg.train.allow_changes, env)
        start_step, consumed = state.get("step", 0), state.get("prompts_consumed", 0)
        logger = MetricsLogger(out, enabled=env.is_main, resume_step=start_step, tensorboard=cfg.train.tensorboard,
                               wandb_project=cfg.train.wandb_project, config=fingerprint["config"])  # fmt: skip
        val.resume(state.get("best_val"), same_rows=state.get("val_data") == fingerprint.get("val_data"))
        if val.rows and start_step == 0:
            generator = ctx.generation_policy()
            val(0, generator, ctx.backend, logger, ctx.generation_backend(generator))
            ctx.generation_backend(generator).free_storage()  # its memory back for the update / the save

        alarms = Alarms(cfg.grpo, env)
        bar = tqdm(total=ctx.total_steps, initial=start_step, desc="grpo", disable=not env.is_main, dynamic_ncols=True)
        last: list[Trajectory] = []
        for step in range(start_step, ctx.total_steps):
            if before_step is not None:
                before_step(step, ctx.total_steps)
            last = []  # the previous step's episodes (exported if it saved) are not held through this one
            record, last, consumed = _step(ctx, step, consumed)
            alarms.check(step, record)
            done = step + 1
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record['accuracy']:.2f}")
            if done % cfg.train.log_every == 0 or done == ctx.total_steps:
                logger.log(done, {**record, "peak_mem_gb": peak_memory_gb(env)})
            if val.rows and (done == ctx.total_steps or (cfg.val.every and done % cfg.val.every == 0)):
                bar.clear()
                generator = ctx.generation_policy()
                val(done, generator, ctx.backend, logger, ctx.generation_backend(generator))
                ctx.generation_backend(generator).free_storage()  # its memory back for the update / the save
            if cfg.train.save_every and done % cfg.train.save_every == 0 and done != ctx.total_steps:
                _save(ctx, root, done, consumed, fingerprint, last, val)
        bar.close()

        final = _save(ctx, root, ctx.total_steps, consumed, fingerprint, last, val, checkpoint=cfg.train.save_final)
        logger.close()
        if final and cfg.val.keep_best and val.best is not None:
            final = val.directory(val.best["step"])
            say(env, f"keeping step {val.best['step']} (val accuracy {val.best['accuracy']:.3f}; the last step "
                     f"{val.last_accuracy:.3f})")  # fmt: skip
        model_dir = (
            publish_model(final, out, env, Path(cfg.model.path)) if final else None
        )  # the final (or the best) model at a stable path
        say(env, f"done: {ctx.total_steps} steps in {time.perf_counter() - t_start:.0f}s; {saved(model_dir)}")
        return model_dir
    finally:
        ctx.close()  # the vLLM engine ends with the run, also after an error


def _setup(cfg: GRPOConfig, env: DistEnv, out: Path, resume_from: Path | None) -> tuple[_Run, dict[str, Any]]:
    """Model (and the frozen reference for the KL term), prompts, backend, rollout settings; and the fingerprint a
    resume checks."""
    bf16 = uses_bf16(cfg.train, env)
    algo = cfg.grpo
    policy, model, model_path = load_trainable(cfg.model, cfg.train, out, env, resume_from, cfg.seed, no_dropout=True)
    if env.rank:  # every rank seeded alike for LoRA's init; sampling noise must differ between ranks
        torch.manual_seed(cfg.seed + 1_000_003 * env.rank)
    fsdp = cfg.train.sharding == "fsdp"
    if cfg.rollout.backend == "vllm":  # refused now, not at the first rollout
        why = vllm_unsupported(policy.model.config, engine_device(env.device))  # and on this rank's GPU
        if why:
            raise ConfigError(f"rollout.backend=vllm: {why}")
    reference = None
    if algo.kl_coef > 0 and not cfg.train.lora.enabled:  # with LoRA the reference is the model, adapters off
        if fsdp:  # sharded like the policy (it runs the same micro-batches in lockstep), loaded straight into shards
            reference = load_sharded(model_path, env, bf16=bf16, prepare=lambda m: m.requires_grad_(False)).model
        else:
            reference = load_policy(model_path, device=env.device, dtype="float32").model.requires_grad_(False)
    # the whole-weights copy of the sharded model, allocated empty (refresh fills it)
    # (vLLM keeps its own copy: the shards are streamed into it instead)
    copy = fsdp and cfg.rollout.backend == "hf"
    inference = InferenceCopy(model, torch.bfloat16 if bf16 else torch.float32) if copy else None

    train_path = cfg.data.train
    rows = load_rows(train_path, known_tools=TOOLS)
    per_round = algo.prompts_per_step * env.world_size
    total_steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * len(rows) / per_round)
    optimizer_steps = total_steps * algo.inner_updates * algo.mini_batches
    backend = build_backend(cfg.train, cfg.optim, model, env, total_steps=optimizer_steps, bf16=bf16,
                            micro_batch_size=algo.micro_batch_size, grad_accum=1, find_unused=False)  # fmt: skip
    limits = RolloutLimits(
        **{
            k: v
            for k, v in config_to_dict(cfg.rollout).items()
            if k in RolloutLimits.fields()  # the episode's limits and sampling; the rest picks the engine
        },
        seed=cfg.seed,
    )
    say(env, f"grpo: {len(rows)} prompts, {env.world_size} rank(s) x {algo.prompts_per_step} prompts x "
             f"{algo.group_size} samples per step -> {total_steps} steps ({optimizer_steps} optimizer steps)"
             f"{', fsdp' if fsdp else ''}")  # fmt: skip
    ctx = _Run(cfg=cfg, env=env, out=out, policy=policy, backend=backend, reference=reference, rows=rows,
               limits=limits, services=tool_services(cfg.toolbox),
               judged=JudgedRewards(cfg.rewards.weights, cfg.rewards.options, cfg.judge, out), bf16=bf16,
               total_steps=total_steps,
               inference=inference)  # fmt: skip
    return ctx, {"config": config_to_dict(cfg), "train_data": ckpt.file_digest(train_path)}


def _step(ctx: _Run, step: int, consumed: int) -> tuple[dict[str, Any], list[Trajectory], int]:
    """One GRPO step in timed stages: gen + reward (with refills), old log-probs, update. Returns the step's log
    record, every trajectory rolled out on this rank, and the new prompt position."""
    timer: dict[str, float] = defaultdict(float)
    t_step = time.perf_counter()
    lr = ctx.backend.lr()  # the rate this step's updates use
    groups = _collect_groups(ctx, consumed, timer)
    update_stats: dict[str, float] = {}
    dpo: dict[str, float] = {}
    if groups.n_groups:
        scored = _score_old_logprobs(ctx, groups, step, timer)
        critic = _self_critic(ctx, scored, step)  # None but on every `every`-th step
        update_stats = _update_policy(ctx, scored, step, timer, critic)
        ctx.stale = True  # the engine (vLLM) is given these weights before it samples again
        dpo = critic.record if critic else {}
        del scored, critic  # their encodings hold the step's patches
    for t in groups.seen:  # trained on: the patches go now (a checkpoint's export reads the messages' images)
        t.release_patches()
    trim_host_memory()
    if update_stats.get("ratio_check", 0.0) > 1e-3:  # the old log-probs were not scored by these weights
        say(
            ctx.env,
            f"warning: step {step + 1}: first-update ratio deviates from 1 by {update_stats['ratio_check']:.2e}",
        )
    timer["step"] = time.perf_counter() - t_step
    return {**_metrics(groups, update_stats, timer, ctx.env), **dpo, "lr": lr}, groups.seen, groups.consumed


class SamplerMismatch(RuntimeError):
    """The rollouts were not drawn from the distribution the trainer scores (see ``_check_sampler``)."""


def _check_sampler(ctx: _Run, step: int, scored: _Scored) -> None:
    """Stop the run, before the step's first optimizer step, when the sampler's recorded log-probs and the
    trainer's scoring of the same tokens (``scored``, this rank's so far) disagree by more than
    ``grpo.max_sampler_gap`` per token over all ranks (a collective: every rank calls it at the same point and
    raises alike).

    The PPO ratio is taken against the trainer's own old log-probs, so a generator that samples from other weights
    (an inference copy with an uninitialized tied head, adapters it does not run) or from another temperature
    trains on without a word: rewards near 0 and groups dropped. The gap says so at the first step.
    """
    limit = ctx.cfg.grpo.max_sampler_gap
    if not limit:
        return
    sums = all_reduce_sum(torch.tensor([scored.sampler_gap, float(scored.sampled)], dtype=torch.float64,
                                       device=ctx.env.device))  # fmt: skip
    gap = float(sums[0]) / max(float(sums[1]), 1.0)
    if gap <= limit:
        return
    raise SamplerMismatch(
        f"step {step + 1}: the sampler's log-probs differ from the trainer's by {gap:.3g} per token (limit "
        f"grpo.max_sampler_gap={limit:g}): the rollouts came from other weights or another distribution than the "
        "one trained (likely causes: a generation copy that is not the trained model, e.g. an untied or "
        "uninitialized LM head or adapters not applied; rollout.temperature/top_p not applied in scoring; bf16 "
        "numerics above the limit). Set grpo.max_sampler_gap=0 to train anyway."
    )


def _collect_groups(ctx: _Run, consumed: int, timer: dict[str, float]) -> _Groups:
    """gen + reward stages: roll out ``prompts_per_step`` prompts x ``group_size`` samples on each rank and score
    them; with dynamic sampling, drop the groups whose rewards are all equal and refill (see the module
    docstring). Every rank keeps the same number of groups."""
    algo, env = ctx.cfg.grpo, ctx.env
    t0 = time.perf_counter()
    generator = ctx.generation_policy()  # gathered once: the weights do not change until the update
    timer["sync"] = time.perf_counter() - t0  # FSDP: the all-gather into the inference copy
    kept: list[tuple[list[Trajectory], list[float]]] = []  # per group: samples, rewards
    seen: list[Trajectory] = []
    components: dict[str, list[float]] = defaultdict(list)
    target = algo.prompts_per_step * env.world_size  # groups the step trains on, over all ranks
    rounds, rolled, counts = 0, 0, [0] * env.world_size
    while True:
        # a refill rolls out only what the kept groups lack over all ranks, scaled by the share kept so far
        n_prompts = algo.prompts_per_step
        if rounds:
            wanted = _refill_size(target, sum(counts), rolled * env.world_size)
            n_prompts = min(algo.prompts_per_step, math.ceil(wanted / env.world_size))
        batch_rows = _rows_for(ctx.rows, consumed, env, n_prompts, ctx.cfg.seed)
        consumed += n_prompts * env.world_size
        rolled += n_prompts
        trajectories, totals = _roll_out(ctx, generator, batch_rows, components, timer)
        seen += trajectories
        rewards = torch.tensor(totals)
        keep = informative_groups(rewards, algo.group_size) if algo.dynamic_sampling else None
        for g in range(len(batch_rows)):
            span = slice(g * algo.group_size, (g + 1) * algo.group_size)
            if keep is None or keep[g]:
                kept.append((trajectories[span], totals[span]))
            else:  # never trained on: its patches go before a refill rolls out more
                for t in trajectories[span]:
                    t.release_patches()
        # Beyond its prompts_per_step groups this rank trains on none (they are dropped, or sent without patches to
        # a rank short of groups): their patches go now, not after the last round, so a rank whose groups are all
        # informative while the others' are not holds at most one step's groups and one round's (vagent memory's 2x).
        for t in (t for group, _ in kept[algo.prompts_per_step :] for t in group):
            t.release_patches()
        rounds += 1
        counts = all_gather_object(len(kept))  # the decision is the global batch's (verl filters globally)
        if not algo.dynamic_sampling or sum(counts) >= target or rounds > algo.max_refill_rounds:
            break
    # KV grown on demand goes back for the update (a budget stays); vLLM on a GPU sleeps until the next sync
    ctx.generation_backend(generator).free_storage()
    n = min(algo.prompts_per_step, sum(counts) // env.world_size)
    for t in (t for group, _ in kept[n:] for t in group):  # not trained here; sent to every rank when one is short of
        t.release_patches()  # groups, where patches would be 8x the images' bytes (a rank that takes one encodes it anew)
    trim_host_memory()  # the rollout's temporaries (processor, forwards) and the patches just released go back
    kept = _balance_groups(kept, counts, n, env)
    return _Groups(trajectories=[t for group, _ in kept for t in group], rewards=[r for _, rs in kept for r in rs],
                   seen=seen, components=components, n_groups=len(kept), rounds=rounds, consumed=consumed)  # fmt: skip


Group = tuple[list[Trajectory], list[float]]  # a group's samples and their rewards


def _balance_groups(kept: list[Group], counts: list[int], n: int, env: DistEnv) -> list[Group]:
    """``n`` groups on every rank (the update steps in lockstep) out of the groups all ranks kept (``counts``, in
    rank order): a rank keeps its first ``n``, and ranks short of ``n`` take, in rank order, the surplus the others
    send (pickled, only when some rank is short). One rank with few informative groups no longer shrinks every
    rank's batch to its own count."""
    if min(counts) >= n:
        return kept[:n]
    pool = [group for surplus in all_gather_object(kept[n:]) for group in surplus]  # every rank's extras
    start = sum(max(0, n - c) for c in counts[: env.rank])  # what the ranks before this one took
    return kept[:n] + pool[start : start + max(0, n - len(kept))]


def _roll_out(ctx: _Run, generator: Policy, batch_rows: list[Row], components: dict[str, list[float]],
              timer: dict[str, float]) -> tuple[list[Trajectory], list[float]]:  # fmt: skip
    """One round of gen + reward: ``group_size`` samples of each row, their total rewards (set on the
    trajectories too) and each component appended to ``components``."""
    algo = ctx.cfg.grpo
    tasks = [Task.from_row(row, ctx.cfg.data.tools) for row in batch_rows]
    ctx.backend.model.eval()
    t0 = time.perf_counter()
    with torch.no_grad(), autocast(ctx.env.device, ctx.bf16):
        trajectories = run(generator, tasks, algo.group_size, ctx.limits, batch_size=algo.rollout_batch_size,
                           agent=ctx.cfg.rollout.agent, services=ctx.services, tool_workers=ctx.cfg.rollout.tool_workers,
                           backend=ctx.generation_backend(generator), keep_patches=True)  # fmt: skip
    timer["gen"] += time.perf_counter() - t0
    timer["tools"] += sum(t.metrics.get("tool_wait_s", 0.0) for t in trajectories) / max(1, len(trajectories))
    t0 = time.perf_counter()
    per_sample_rows = [row for row in batch_rows for _ in range(algo.group_size)]
    totals, parts = ctx.judged.combine(trajectories, per_sample_rows, algo.group_size)
    timer["reward"] += time.perf_counter() - t0
    for t, total in zip(trajectories, totals, strict=True):
        t.reward = total
    for name, values in parts.items():
        components[f"reward/{name}"] += values
    components["accuracy"] += REWARDS["accuracy"](trajectories, per_sample_rows)  # logged even if unweighted
    return trajectories, totals


def _score_old_logprobs(ctx: _Run, groups: _Groups, step: int, timer: dict[str, float]) -> _Scored:
    """adv + old_log_prob stages: group advantages; re-encode each kept trajectory to exactly its sampled ids
    (checked) and score it with the weights that sampled, in the mode the update runs in (and the reference's
    log-probs for the KL term). On-policy (one pass, one optimizer step, no KL) the update's own detached
    log-probs are the old ones: the same weights, the same forward, so the ratio is 1 by construction and this
    pass is skipped (as TRL does); otherwise the update's ratio check is a real test of that equality."""
    env, policy, algo = ctx.env, ctx.policy, ctx.cfg.grpo
    t0 = time.perf_counter()
    advantages = group_advantages(torch.tensor(groups.rewards), algo.group_size, scale_by_std=algo.scale_by_std,
                                  negative_scale=algo.negative_scale)  # (N,)  # fmt: skip
    min_pixels, max_pixels = policy.pixel_budget
    encoded, trained = [], []
    for t in groups.trajectories:
        # each image part's patches as the engine made them, by reference: no image is processed again or held twice
        enc = encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
        if enc.input_ids.tolist() != t.token_ids:  # the one-encoder contract; a bug if it ever fires
            raise RuntimeError(f"re-encoding trajectory {t.task_id} did not give back its sampled ids")
        # over-turn masking: its reward counted, no loss from it; its loss mask stays (1 = sampled): its tokens are
        # still scored and compared with the sampler's (early in a run most episodes are capped)
        trained.append(not (algo.mask_truncated and t.stop_reason in CAPS))
        encoded.append(enc)
    timer["adv"] = time.perf_counter() - t0
    on_policy = algo.inner_updates == 1 and algo.mini_batches == 1 and algo.kl_coef == 0
    n = len(encoded)
    head = _head_args(ctx)  # how _scored_logprobs runs the LM head, at the sampler's temperature and top_p
    scored = _Scored(trajectories=groups.trajectories, encoded=encoded, trained=torch.tensor(trained, dtype=torch.bool),
                     advantages=advantages, old=[torch.empty(0)] * n, ref=[torch.empty(0)] * n,
                     on_policy=on_policy)  # fmt: skip
    policy.model.train()
    t0 = time.perf_counter()
    with torch.no_grad(), ctx.backend.accumulating(last=True):  # the update's precision: autocast or FSDP's policy
        for idx, batch, _ in _micro_batches(ctx, encoded, [] if on_policy else list(range(n))):
            lp, _ = _scored_logprobs(ctx.backend.module, batch, *head)
            ref_lp = None
            if ctx.reference is not None:
                ref_lp, _ = _scored_logprobs(ctx.reference, batch, *head)
            elif algo.kl_coef > 0:  # LoRA: the reference is the base model, adapters disabled
                with policy.model.disable_adapter():
                    ref_lp, _ = _scored_logprobs(policy.model, batch, *head)
            for row, i in enumerate(idx):
                scored.old[i] = lp[row, : len(encoded[i].input_ids)].detach()
                scored.ref[i] = ref_lp[row, : len(encoded[i].input_ids)] if ref_lp is not None else scored.old[i]
                _add_sampler_gap(scored, i, env.device)
    timer["logprob"] = time.perf_counter() - t0
    if not on_policy:  # every old log-prob is scored: check before any update (on-policy: _update_policy does)
        _check_sampler(ctx, step, scored)
    return scored


def _self_critic(ctx: _Run, scored: _Scored, step: int) -> SelfCritic | None:
    """Tool-Star's self-critic term on every ``every``-th step (a collective): the pairs of the groups about to be
    trained, scored as the update scores, whose DPO loss joins the update's last optimizer step."""
    algo, critic, trajectories = ctx.cfg.grpo, ctx.cfg.grpo.self_critic, scored.trajectories
    if not critic.enabled or (step + 1) % critic.every:
        return None
    # as the update trains them: a masked trajectory's loss mask all 0 (it is on neither side of a pair)
    encoded = [e if keep else dataclasses.replace(e, loss_mask=torch.zeros_like(e.loss_mask))
               for e, keep in zip(scored.encoded, scored.trained.tolist(), strict=True)]  # fmt: skip
    return SelfCritic(
        encoded, [t.reward or 0.0 for t in trajectories], [t.stop_reason in CAPS for t in trajectories],
        group_size=algo.group_size, margin=critic.margin, max_pairs=critic.max_pairs,
        capped_chosen=critic.capped_chosen, coef=critic.coef, beta=critic.beta, loss_type=critic.loss_type,
        pairs_per_micro=max(1, algo.micro_batch_size // 2), pad_id=ctx.policy.tokenizer.pad_token_id or 0,
        device=ctx.env.device, score=lambda batch: _scored_logprobs(ctx.backend.module, batch, *_head_args(ctx))[0],
    )  # fmt: skip


def _head_args(ctx: _Run) -> tuple[bool, int, tuple[float, float], tuple[int, ...]]:
    """``_scored_logprobs``'s share_prefix, chunk_size, sampling (the rollout's temperature and top_p) and the tokens
    the samplers never draw (the vision placeholders): the old log-probs, the update and the reference all score the
    distribution the rollouts were drawn from."""
    cfg = ctx.cfg
    return (cfg.train.share_prefix, cfg.train.lm_head_chunk, (cfg.rollout.temperature, cfg.rollout.top_p),
            tuple(ctx.policy.vision_placeholder_ids))  # fmt: skip


def _micro_batches(ctx: _Run, encoded: list[Encoded], order: list[int]) -> Iterator[tuple[list[int], dict, bool]]:
    """``(indices, collated batch on the device, last)`` of ``grpo.micro_batch_size`` trajectories of ``order`` at a
    time; ``last`` marks the final one (where gradient accumulation syncs). A batch is emptied before the next is
    collated, so one micro-batch's copy of its images is held at a time (as ``vagent memory`` plans), whatever the
    caller's loop variable still names: take what outlives it (log-probs) before asking for the next."""
    pad_id = ctx.policy.tokenizer.pad_token_id or 0
    size = ctx.cfg.grpo.micro_batch_size
    for start in range(0, len(order), size):
        idx = order[start : start + size]
        batch = to_device(collate([encoded[i] for i in idx], pad_id), ctx.env.device)
        yield idx, batch, start + size >= len(order)
        batch.clear()


def _add_sampler_gap(scored: _Scored, i: int, device: torch.device) -> None:
    """Add trajectory ``i``'s |training - sampler| log-prob over its sampled tokens to ``scored``."""
    mask = scored.encoded[i].loss_mask.bool().to(device)  # 1 = sampled
    sampler = torch.tensor(scored.trajectories[i].logprobs, device=device)
    scored.sampler_gap += float((scored.old[i] - sampler)[mask].abs().sum())
    scored.sampled += int(mask.sum())


def _update_policy(ctx: _Run, scored: _Scored, step: int, timer: dict[str, float],
                   critic: SelfCritic | None = None) -> dict[str, float]:  # fmt: skip
    """update stage: ``inner_updates`` passes of ``mini_batches`` optimizer steps each (PPO-clip with clip-higher,
    token- or sequence-level aggregation over the whole mini-batch on all ranks, optional k3 KL; ``critic``'s DPO
    loss joins the last). Returns the statistics summed over every rank (``ratio_check``: the largest first-update
    |ratio - 1| on any rank)."""
    algo, env, encoded = ctx.cfg.grpo, ctx.env, scored.encoded
    t0 = time.perf_counter()
    stats: Counter[str] = Counter()
    generator = torch.Generator().manual_seed(ctx.cfg.seed * 1_000_003 + step)
    n = len(encoded)
    for inner in range(algo.inner_updates):
        order = torch.randperm(n, generator=generator).tolist() if algo.inner_updates > 1 else list(range(n))
        parts = min(algo.mini_batches, n)  # as even as can be: every pass makes the steps the LR schedule counts
        for m in range(parts):
            members = order[m * n // parts : (m + 1) * n // parts]
            trained = [int(encoded[i].loss_mask.sum()) if scored.trained[i] else 0 for i in members]
            local = loss_normalizer(trained, algo.aggregation, max_tokens=_max_sampled(ctx.limits))
            normalizer = max(float(all_reduce_sum(torch.tensor([float(local)], device=env.device))), 1.0)
            dpo = critic if critic and critic.pairs and inner == algo.inner_updates - 1 and m == parts - 1 else None
            # collated one at a time: a list of them would hold every image of the mini-batch again, on the device
            for idx, batch, last in _micro_batches(ctx, encoded, members):
                with ctx.backend.accumulating(last=last and dpo is None):
                    loss, ratio_dev = _micro_batch_loss(ctx, scored, idx, batch, normalizer, stats)
                    ctx.backend.backward(loss)
                if inner == 0 and m == 0:  # weights still those that scored `old`: the ratio must be 1
                    stats["ratio_check"] = max(stats["ratio_check"], ratio_dev)
                    stats["ratio_tokens"] += sum(int(encoded[i].loss_mask.sum()) for i in idx)
            if scored.on_policy:  # one mini-batch of every trajectory: the update's log-probs are the old ones
                for i in range(n):
                    _add_sampler_gap(scored, i, env.device)
                _check_sampler(ctx, step, scored)  # before the optimizer step: a mismatched batch never trains
            if dpo is not None:  # its micro-batches close this step's accumulation: one gradient, clipped together
                dpo.backward(ctx.backend, scored.old)
            stats["grad_norm"] += ctx.backend.step()
            stats["optimizer_steps"] += 1
    timer["update"] = time.perf_counter() - t0
    stats["sampler_gap"], stats["sampled"] = scored.sampler_gap, scored.sampled
    stats["trajectories"] = n
    stats["masked"] = int((~scored.trained).sum())
    return _reduce_stats(stats, env)


def _max_sampled(limits: RolloutLimits) -> int:
    """The most tokens one episode can sample (Dr. GRPO's constant: TRL's ``max_completion_length``)."""
    return min(limits.max_turns * limits.max_new_tokens, limits.max_total_tokens)


def _micro_batch_loss(ctx: _Run, scored: _Scored, idx: list[int], batch: dict[str, torch.Tensor], normalizer: float,
                      stats: Counter[str]) -> tuple[torch.Tensor, float]:  # fmt: skip
    """The micro-batch's share of its mini-batch's loss (PPO-clip, plus the k3 KL); its statistics are added to
    ``stats``. Returns (the loss, its largest |ratio - 1|)."""
    algo = ctx.cfg.grpo
    sampled = batch["loss_mask"]  # (B, T) 1 = sampled
    # (B, T) 1 = trained: sampled, in a trajectory over-turn masking kept
    mask = sampled * scored.trained[idx].to(sampled.device, sampled.dtype).unsqueeze(1)
    width = mask.shape[1]
    lp, entropy = _scored_logprobs(ctx.backend.module, batch, *_head_args(ctx))  # (B, T) every sampled token
    if scored.on_policy:
        for row, i in enumerate(idx):
            scored.old[i] = lp[row, : len(scored.encoded[i].input_ids)].detach()
    old_lp = torch.stack([F.pad(scored.old[i], (0, width - len(scored.old[i]))) for i in idx])  # (B, T)
    adv = scored.advantages[idx].to(ctx.env.device)  # (B,)
    per_token, st = policy_loss(lp, old_lp, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                                dual_clip=algo.dual_clip)  # fmt: skip
    sampler_lp = torch.stack([F.pad(torch.tensor(scored.trajectories[i].logprobs, dtype=torch.float32),
                                    (0, width - len(scored.trajectories[i].logprobs))) for i in idx]).to(lp.device)  # fmt: skip
    weights, corr = rollout_correction(old_lp, sampler_lp, mask, cap=algo.rollout_correction_cap)  # (B, T)
    if algo.rollout_correction == "token_tis":  # the engine's draws re-weighted toward the trainer's distribution
        per_token = per_token * weights
    for key in ("is_ratio", "is_clipped", "sampler_kl"):
        stats[key] += float(corr[key])
    stats["is_ratio_max"] = max(stats["is_ratio_max"], float(corr["is_ratio_max"]))
    if algo.kl_coef > 0:
        ref_lp = torch.stack([F.pad(scored.ref[i], (0, width - len(scored.ref[i]))) for i in idx])  # (B, T)
        kl = kl_k3(lp, ref_lp, mask)
        per_token = per_token + algo.kl_coef * kl
        stats["kl"] += float(kl.detach().sum())
    loss = aggregate(per_token, mask, algo.aggregation, normalizer)
    stats["loss"] += float(loss.detach())
    stats["entropy"] += float(entropy)  # over every sampled token, masked trajectories' too
    stats["scored_tokens"] += float(sampled[:, 1:].sum())
    stats["clip_frac"] += float(st["clip_frac"])
    stats["dual_clip_frac"] += float(st["dual_clip_frac"])
    stats["approx_kl"] += float(st["approx_kl"])
    stats["tokens"] += float(mask[:, 1:].sum())
    return loss, _ratio_deviation(lp, old_lp, sampled)


def _ratio_deviation(lp: torch.Tensor, old_lp: torch.Tensor, sampled: torch.Tensor) -> float:
    """The largest |pi / pi_old - 1| over every sampled token (``(B, T)`` each), trained or masked: the ratio check
    must see the tokens over-turn masking keeps out of the loss. 0 when nothing was sampled."""
    picked = sampled.bool()
    if not picked.any():
        return 0.0
    log_ratio = (lp.detach() - old_lp)[picked].clamp(-20.0, 20.0)  # a stale token: a large finite deviation
    return float((log_ratio.exp() - 1).abs().max())


# Update statistics that are sums over trajectories: added over ranks for the log (the grad norm is global already).
_SUMMED = (
    "loss",
    "entropy",
    "clip_frac",
    "dual_clip_frac",
    "approx_kl",
    "kl",
    "tokens",
    "scored_tokens",
    "sampler_gap",
    "sampled",
    "ratio_tokens",
    "is_ratio",
    "is_clipped",
    "sampler_kl",
    "trajectories",
    "masked",
)


def _reduce_stats(stats: Counter[str], env: DistEnv) -> dict[str, float]:
    """``stats`` with the ``_SUMMED`` keys added over ranks and ``ratio_check`` the largest on any rank."""
    keys = [k for k in _SUMMED if k in stats]  # the same keys on every rank (kl iff kl_coef > 0)
    totals = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=env.device))
    out = {**stats, **dict(zip(keys, totals.tolist(), strict=True))}
    worst = all_reduce_min(torch.tensor([-stats["ratio_check"], -stats["is_ratio_max"]], dtype=torch.float64,
                                        device=env.device))  # fmt: skip
    out["ratio_check"] = max(0.0, -float(worst[0]))
    out["is_ratio_max"] = -float(worst[1])
    return out


def _metrics(groups: _Groups, update: dict[str, float], timer: dict[str, float], env: DistEnv) -> dict[str, Any]:
    """Per-step means over every trajectory rolled out on every rank (kept or not), and the update's statistics."""
    seen = groups.seen
    calls = sum(len(t.tool_results) for t in seen)
    sums = {
        "reward": sum(t.reward or 0.0 for t in seen),
        **{name: sum(values) for name, values in groups.components.items()},
        "tool_calls_per_traj": calls,
        "tool_call_rate": sum(bool(t.tool_results) for t in seen),  # episodes that called a tool at all
        "response_len": sum(sum(t.loss_mask) for t in seen),
        "answered": sum(t.stop_reason == "answered" for t in seen),
        **{f"stop/{reason}": sum(t.stop_reason == reason for t in seen) for reason in STOP_REASONS},
    }
    keys = sorted(sums)
    totals = all_reduce_sum(torch.tensor([float(sums[k]) for k in keys] + [float(len(seen)), float(calls),
                            float(sum(1 for t in seen for r in t.tool_results if r.error))], device=env.device))  # fmt: skip
    count, all_calls, failed = float(totals[-3]), float(totals[-2]), float(totals[-1])
    record: dict[str, Any] = {k: float(v) / max(count, 1.0) for k, v in zip(keys, totals[:-3].tolist(), strict=True)}
    record["tool_failure_rate"] = failed / all_calls if all_calls else 0.0
    record["kept_groups"] = groups.n_groups
    record["refill_rounds"] = groups.rounds - 1
    if update:
        tokens = max(update["tokens"], 1.0)
        for key in ("clip_frac", "dual_clip_frac", "approx_kl", "kl"):
            if key in update:
                record[key] = update[key] / tokens
        record["entropy"] = update["entropy"] / max(update["scored_tokens"], 1.0)
        steps = max(update["optimizer_steps"], 1.0)
        record["loss"] = update["loss"] / steps  # the mean mini-batch objective
        record["grad_norm"] = update["grad_norm"] / steps
        # the health checks over every sampled token, trained or masked, with how many they compared: none compared
        # is no measurement (NaN), never a gap of 0
        record["ratio_check"] = update["ratio_check"] if update["ratio_tokens"] else math.nan
        record["ratio_check_tokens"] = update["ratio_tokens"]
        record["sampler_logprob_gap"] = update["sampler_gap"] / update["sampled"] if update["sampled"] else math.nan
        record["sampler_logprob_gap_tokens"] = update["sampled"]
        record["masked_share"] = update["masked"] / max(update["trajectories"], 1.0)  # capped, trained on nothing
        # the engine/trainer gap over every update pass (verl's rollout_corr): KL(sampler || trainer) by k3, the
        # importance ratio pi_old / pi_sampler, and the share of tokens whose ratio passed the cap
        record["rollout_corr/kl"] = update["sampler_kl"] / tokens
        record["rollout_corr/is_ratio_mean"] = update["is_ratio"] / tokens
        record["rollout_corr/is_ratio_max"] = update["is_ratio_max"]
        record["rollout_corr/clipped_share"] = update["is_clipped"] / tokens
    for stage in ("sync", "gen", "tools", "reward", "adv", "logprob", "update", "step"):
        record[f"time/{stage}"] = timer.get(stage, 0.0)
    return record


class _Validation:
    """Rollouts of held-out rows (greedy, or ``val.samples`` each at ``val.temperature``) scored with the training
    rewards, and (``val.keep_best``) the weights of the best mean accuracy so far under ``out/best/step-N/model``.

    A best directory is only deleted once a committed checkpoint names a later best, so a resumed run always
    finds the one its checkpoint recorded; directories a killed attempt wrote after its last checkpoint are
    deleted on resume. Validation runs under a forked RNG and takes nothing from training's random numbers (with
    tool calls the engine's batches follow tool timing, so runs are not bit-identical anyway: README, GRPO).
    """

    def __init__(self, cfg: GRPOConfig, env: DistEnv, out: Path, rows: list[Row], limits: RolloutLimits,
                 services: ToolServices, bf16: bool) -> None:  # fmt: skip
        self.cfg, self.env, self.out, self.rows, self.services, self.bf16 = cfg, env, out, rows, services, bf16
        self.limits = dataclasses.replace(limits, temperature=cfg.val.temperature)
        self.judged = JudgedRewards(cfg.rewards.weights, cfg.rewards.options, cfg.judge, out)
        self.best: dict[str, Any] | None = None  # {"step", "accuracy"} (+ "rows", per-row, with keep_alpha)
        self.last_accuracy = float("nan")
        self.warned = False  # the kept step had no per-row accuracies to test against

    def directory(self, step: int) -> Path:
        return self.out / "best" / f"step-{step:08d}"

    def resume(self, best: dict[str, Any] | None, same_rows: bool = True) -> None:
        """Adopt the checkpoint's best (None on a fresh run; its per-row accuracies only if ``same_rows``: the val
        rows did not change since) and delete every other best directory."""
        self.best = best if self.cfg.val.keep_best else None
        if self.best is not None and not same_rows:
            self.best = {k: v for k, v in self.best.items() if k != "rows"}
        self.prune()

    def prune(self) -> None:
        if self.env.is_main and (self.out / "best").is_dir():
            keep = self.directory(self.best["step"]).name if self.best else None
            for d in (self.out / "best").iterdir():
                if d.name != keep:
                    shutil.rmtree(d, ignore_errors=True)
        barrier()

    def __call__(self, step: int, policy: Policy, backend: TrainBackend, logger: MetricsLogger,
                 sampler: HFBackend | None = None) -> None:  # fmt: skip
        """Validate ``policy`` (the one that generates: under FSDP the refreshed whole-weights copy) with the run's
        generation backend ``sampler`` (None: a new one)."""
        env = self.env
        t0 = time.perf_counter()
        mine = self.rows[env.rank :: env.world_size]
        backend.module.eval()
        devices = [env.device] if env.device.type == "cuda" else []
        samples = self.cfg.val.samples
        with torch.no_grad(), autocast(env.device, self.bf16), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.cfg.seed + env.rank)  # every validation draws the same numbers (when it samples)
            tasks = [Task.from_row(row, self.cfg.data.tools) for row in mine]
            trajectories = run(policy, tasks, samples, self.limits, batch_size=self.cfg.grpo.rollout_batch_size,
                               agent=self.cfg.rollout.agent, services=self.services, backend=sampler,
                               tool_workers=self.cfg.rollout.tool_workers)  # fmt: skip
        per_sample_rows = [row for row in mine for _ in range(samples)]
        totals, parts = self.judged.combine(trajectories, per_sample_rows, samples)
        correct = parts["accuracy"] if "accuracy" in parts else REWARDS["accuracy"](trajectories, per_sample_rows)
        sums = all_reduce_sum(torch.tensor([sum(correct), sum(totals), sum(t.stop_reason == "answered" for t in
                                            trajectories), sum(len(t.tool_results) for t in trajectories),
                                            len(trajectories)], dtype=torch.float64, device=env.device)).tolist()  # fmt: skip
        n = max(sums[4], 1.0)
        record = {"val/accuracy": sums[0] / n, "val/reward": sums[1] / n, "val/answered": sums[2] / n,
                  "val/tool_calls_per_traj": sums[3] / n, "time/val": time.perf_counter() - t0}  # fmt: skip
        self.last_accuracy = record["val/accuracy"]
        per_row = self._per_row(correct, samples) if self.cfg.val.keep_alpha < 1 else None
        if self.cfg.val.keep_best and self._beats_best(per_row, record):
            self.best = {"step": step, "accuracy": self.last_accuracy}
            if per_row is not None:
                self.best["rows"] = per_row
            state_dict = gathered_state_dict(backend)  # every rank: a gather under sharding
            if env.is_main:
                tmp = self.out / "best" / f".tmp-step-{step:08d}"
                shutil.rmtree(tmp, ignore_errors=True)
                ckpt.save_model(backend.model, policy.processor, tmp / "model", state_dict=state_dict)
                shutil.rmtree(self.directory(step), ignore_errors=True)
                tmp.rename(self.directory(step))
            barrier()
        if self.best is not None:
            record["val/best_step"] = self.best["step"]
        logger.log(step, record)
        if env.is_main:
            write_jsonl(trajectories, self.out / "rollouts" / f"val-step-{step:08d}.jsonl")
            write_html(trajectories, self.out / "rollouts" / f"val-step-{step:08d}.html",
                       title=f"GRPO validation at step {step} (rank 0, {self.decoding})")  # fmt: skip
        say(env, f"val at step {step}: accuracy {record['val/accuracy']:.3f}, reward {record['val/reward']:.3f} "
                 f"({len(self.rows)} rows, {self.decoding}, {record['time/val']:.0f}s)")  # fmt: skip

    def _per_row(self, correct: list[float], samples: int) -> list[float]:
        """Each val row's accuracy (the mean of its samples), in the rows' order, gathered from every rank."""
        mine = torch.tensor(correct, dtype=torch.float64).view(-1, samples).mean(dim=1)
        rows = torch.zeros(len(self.rows), dtype=torch.float64, device=self.env.device)
        rows[self.env.rank :: self.env.world_size] = mine.to(self.env.device)
        return all_reduce_sum(rows).tolist()

    def _beats_best(self, per_row: list[float] | None, record: dict[str, Any]) -> bool:
        """Whether the validation just run replaces the kept weights: a higher accuracy, and with ``val.keep_alpha``
        below 1 a one-sided paired sign-flip test against the kept step's per-row accuracies at p <= keep_alpha
        (logged as ``val/gain_p``). A kept step without per-row accuracies (from a checkpoint written without the
        test) is compared by its accuracy alone, with a warning."""
        if self.best is None:
            return True
        if per_row is None:
            return self.last_accuracy > self.best["accuracy"]
        kept = self.best.get("rows")
        if kept is None or len(kept) != len(per_row):
            if not self.warned:
                say(self.env, f"warning: the kept val step {self.best['step']} has no per-row accuracies of these "
                              "rows to test against (a checkpoint written without val.keep_alpha, or other val "
                              "rows); comparing accuracies alone until a step replaces it")  # fmt: skip
                self.warned = True
            return self.last_accuracy > self.best["accuracy"]
        diffs = [a - b for a, b in zip(per_row, kept, strict=True)]
        record["val/gain_p"] = sign_flip_p(diffs)
        return sum(diffs) > 0 and record["val/gain_p"] <= self.cfg.val.keep_alpha

    @property
    def decoding(self) -> str:
        """How the val rows are answered: "greedy", or "2 samples at temperature 0.7"."""
        val = self.cfg.val
        if not val.temperature:
            return "greedy"
        return f"{val.samples} sample{'s' if val.samples > 1 else ''} at temperature {val.temperature:g}"


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
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    share_prefix: bool = True,
    chunk_size: int = 0,
    sampling: tuple[float, float] = (1.0, 1.0),
    suppress: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs of the sampled tokens under the distribution the sampler drew from (``sampling``: its
    temperature and top_p, as verl and TRL divide the logits by the temperature in both the old-log-prob pass and
    the update, ``suppress`` out of it) and that distribution's summed entropy. With ``chunk_size`` (or any warping
    or suppression) the head runs on the sampled positions, ``chunk_size`` (1,024 when 0) at a time
    (``masked_token_logprobs``); with 0 and none of them, ``sampled_logprobs`` over whole logits from the position
    that predicts the batch's first sampled token on."""
    mask = batch["loss_mask"]
    temperature, top_p = sampling
    if chunk_size or sampling != (1.0, 1.0) or suppress:
        return masked_token_logprobs(model, batch, mask, chunk_size=chunk_size or 1024, temperature=temperature,
                                     top_p=top_p, share_prefix=share_prefix, suppress=suppress)  # fmt: skip
    width = mask.shape[1]
    first = int(mask.float().argmax(dim=1).min()) if mask.any() else width - 1  # earliest sampled token
    start = max(first - 1, 0)  # position start predicts token start + 1
    # (B, width - start, V)
    logits = policy_logits(model, batch, logits_to_keep=width - start, share_prefix=share_prefix)
    lp, entropy = sampled_logprobs(logits, batch["input_ids"][:, start:], mask[:, start:])
    return torch.nn.functional.pad(lp, (start, 0)), entropy


def _save(ctx: _Run, root: Path, step: int, consumed: int, fingerprint: dict[str, Any], last: list[Trajectory],
          val: _Validation, checkpoint: bool = True) -> Path | None:  # fmt: skip
    """The step's checkpoint (None when ``checkpoint`` is off: ``train.save_final``) and its rollouts."""
    final = None
    if checkpoint:
        final = save_checkpoint(ctx.backend, ctx.policy.processor, root, step,
                                {**fingerprint, "prompts_consumed": consumed, "best_val": val.best}, ctx.env,
                                ctx.cfg.train.keep_last)  # fmt: skip
        val.prune()  # the checkpoint names the best from now on: older best directories can go
    if ctx.env.is_main and last:  # what the policy did at this step, to look at
        write_jsonl(last, ctx.out / "rollouts" / f"step-{step:08d}.jsonl")
        write_html(last, ctx.out / "rollouts" / f"step-{step:08d}.html", title=f"GRPO step {step} (rank 0)")
    return final


if __name__ == "__main__":
    raise SystemExit(main())

"""DPO: learn from preference pairs (a better and a worse trajectory for one prompt) against a frozen reference.

    torchrun --nproc_per_node N tools/train.py --config configs/dpo/<name>.yaml [key=value ...]
    vagent dpo --config configs/dpo/<name>.yaml [key=value ...]        (one process, or under torchrun)

Reads top to bottom: config -> processes -> resume decision -> model -> pairs -> optimizer/backend -> reference ->
loop (fetch the step's micro-batches of pairs, count the step's pairs over all ranks; per micro-batch the reference's
log-probs, then the policy's of chosen and rejected in one forward and the backward of its share of the step-mean
loss; step) -> periodic eval / checkpoint -> final save.

The reference is the starting checkpoint (``model.path``), frozen, and is scored one of three ways:

* a copy loaded beside the policy (sharded like it under ``train.sharding=fsdp``) scores each micro-batch;
* with LoRA, the policy itself with its adapters disabled (peft's ``disable_adapter``, as TRL does): no copy;
* with ``dpo.precompute_ref``, once before the first step: the policy, which is still the reference then, scores every
  pair, and the log-probs are kept by pair index in ``out_dir/reference_logprobs.pt``; no reference runs during
  training. A resume reads them back (and has a copy of the reference score them again if the file is gone or was
  scored for other data or settings); a fresh run always scores them.

The reference runs in the precision the policy trains in (autocast, or FSDP's mixed-precision policy), so before the
first update the policy's log-ratios are 0 up to rounding.

Exact resume as in SFT: the pair order is a function of (seed, epoch) and the data position is the step number.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vagent.algorithms import length_normalized
from vagent.config import DPOConfig, config_to_dict
from vagent.data import load_rows
from vagent.model import Policy, load_policy
from vagent.recipes.common import (
    build_backend,
    config_from_argv,
    load_trainable,
    peak_memory_gb,
    publish_model,
    resume_point,
    resume_training,
    save_checkpoint,
    saved,
    say,
    to_device,
    uses_bf16,
)
from vagent.toolbox import TOOLS
from vagent.training import checkpoint as ckpt
from vagent.training.backend import TrainBackend
from vagent.training.data import rank_micro_batches
from vagent.training.distributed import DistEnv, all_gather_object, all_reduce_sum, init_distributed, shutdown
from vagent.training.fsdp import load_sharded
from vagent.training.metrics import MetricsLogger
from vagent.training.preference import PreferenceDataset, pair_logprobs, preference_loss

Batch = dict[str, torch.Tensor]
Scorer = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]


def main(argv: list[str] | None = None) -> int:
    train(config_from_argv(DPOConfig, sys.argv[1:] if argv is None else argv))
    return 0


def train(cfg: DPOConfig) -> Path | None:
    """Run DPO; returns the final HF model dir (``out_dir/model``; None under ``train.save_final=false``)."""
    env = init_distributed(cfg.model.device)
    try:
        return _train(cfg, env, Path(cfg.out_dir))
    finally:
        shutdown()


@dataclasses.dataclass
class _Run:
    """What every step uses: the config, the processes, the policy and its backend, and the reference (a frozen copy,
    or with LoRA none: the policy with its adapters disabled) or its precomputed log-probs per split, (N, 2) each."""

    cfg: DPOConfig
    env: DistEnv
    policy: Policy
    backend: TrainBackend
    reference: torch.nn.Module | None = None
    table: dict[str, torch.Tensor] | None = None

    @property
    def average(self) -> bool:
        return length_normalized(self.cfg.dpo.loss_type)

    def logprobs(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) chosen and rejected sequence log-probs of ``model``, normalized as the loss type asks."""
        train = self.cfg.train
        return pair_logprobs(model, batch, average=self.average, chunk_size=train.lm_head_chunk,
                             share_prefix=train.share_prefix)  # fmt: skip


def _train(cfg: DPOConfig, env: DistEnv, out: Path) -> Path | None:
    t_start = time.perf_counter()
    root = out / "checkpoints"
    resume_from = resume_point(cfg.train.resume, env, root)
    bf16 = uses_bf16(cfg.train, env)

    # -- model, pairs -------------------------------------------------------------------------------------------
    policy, model, model_path = load_trainable(cfg.model, cfg.train, out, env, resume_from, cfg.seed, no_dropout=True)
    sets, fingerprint = _setup_data(cfg, env, policy)
    train_set, val_set = sets["train"], sets.get("val")
    accum, world = cfg.optim.grad_accum, env.world_size
    total_steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * train_set.batches_per_epoch / (world * accum))
    say(env, f"dpo: {len(train_set.pairs)} pairs ({len(train_set.skipped)} skipped), {train_set.batches_per_epoch} "
             f"micro-batches/epoch, {world} rank(s) x {accum} accum -> {total_steps} steps; {cfg.dpo.loss_type} loss, "
             f"beta {cfg.dpo.beta}")  # fmt: skip

    # -- optimizer, schedule, backend, reference ---------------------------------------------------------------
    text_only = any(not any(p.type == "image" for m in side for p in m.content)
                    for pair in train_set.pairs for side in pair)  # fmt: skip
    backend = build_backend(cfg.train, cfg.optim, model, env, total_steps=total_steps, bf16=bf16,
                            micro_batch_size=cfg.data.micro_batch_size, grad_accum=accum, find_unused=text_only)  # fmt: skip
    start_step = resume_training(resume_from, backend, fingerprint, cfg.train.allow_changes, env).get("step", 0)
    ctx = _Run(cfg=cfg, env=env, policy=policy, backend=backend)
    _setup_reference(ctx, model_path, sets, fingerprint, resumed=resume_from is not None, out=out, bf16=bf16)
    logger = MetricsLogger(out, enabled=env.is_main, resume_step=start_step, tensorboard=cfg.train.tensorboard,
                           wandb_project=cfg.train.wandb_project, config=fingerprint["config"])  # fmt: skip

    # -- loop ---------------------------------------------------------------------------------------------------
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=None, num_workers=cfg.data.num_workers,
        sampler=list(rank_micro_batches(start_step, total_steps, env.rank, world, accum)),
    )  # fmt: skip
    batches = iter(loader)
    bar = tqdm(total=total_steps, initial=start_step, desc="dpo", disable=not env.is_main, dynamic_ncols=True)
    model.train()
    for step in range(start_step, total_steps):
        record = _step(ctx, batches, accum)
        done = step + 1
        record["epoch"] = done * world * accum / train_set.batches_per_epoch
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracy']:.2f}")
        if done % cfg.train.log_every == 0 or done == total_steps:
            logger.log(done, {**record, "peak_mem_gb": peak_memory_gb(env)})
        if val_set is not None and cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != total_steps:
            logger.log(done, _evaluate(ctx, val_set))
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done != total_steps:
            save_checkpoint(backend, policy.processor, root, done, fingerprint, env, cfg.train.keep_last)
    bar.close()

    # -- final eval and save -----------------------------------------------------------------------------------
    if val_set is not None:
        scores = _evaluate(ctx, val_set)
        logger.log(total_steps, scores)
        say(env, f"eval loss {scores['eval/loss']:.4f}, reward accuracy {scores['eval/rewards/accuracy']:.3f}")
    final = None
    if cfg.train.save_final:
        final = save_checkpoint(backend, policy.processor, root, total_steps, fingerprint, env, cfg.train.keep_last)
    logger.close()
    model_dir = (
        publish_model(final, out, env, Path(cfg.model.path)) if final else None
    )  # the final model at a stable path
    say(env, f"done: {total_steps} steps in {time.perf_counter() - t_start:.0f}s; {saved(model_dir)}")
    return model_dir


def _setup_data(cfg: DPOConfig, env: DistEnv, policy: Policy) -> tuple[dict[str, PreferenceDataset], dict[str, Any]]:
    """The ``train`` and (``data.val``) ``val`` pairs, and the fingerprint of config and data a resume checks."""
    min_pixels, max_pixels = policy.pixel_budget
    common = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor,
                  default_tools=cfg.data.tools, max_length=cfg.data.max_length, agent=cfg.data.agent,
                  micro_batch_size=cfg.data.micro_batch_size, group_batches=cfg.data.group_batches, seed=cfg.seed)  # fmt: skip
    sets = {"train": PreferenceDataset(load_rows(cfg.data.train, known_tools=TOOLS), policy.processor,
                                       group_by_length=cfg.data.group_by_length, **common)}  # fmt: skip
    if cfg.data.val:
        sets["val"] = PreferenceDataset(load_rows(cfg.data.val, known_tools=TOOLS), policy.processor,
                                        group_by_length=True, **common)  # fmt: skip
    for rid, why in sets["train"].skipped:
        say(env, f"skipped row {rid}: {why}")
    fingerprint = {"config": config_to_dict(cfg), "train_data": ckpt.file_digest(cfg.data.train),
                   "val_data": ckpt.file_digest(cfg.data.val)}  # fmt: skip
    return sets, fingerprint


# -- the reference ------------------------------------------------------------------------------------------------


def _load_reference(ctx: _Run, model_path: Path, bf16: bool) -> torch.nn.Module:
    """A frozen copy of the starting checkpoint, sharded like the policy under FSDP (it runs the same micro-batches
    in lockstep, loaded straight into its shards), else whole in fp32 (autocast computes in the policy's precision)."""
    cfg, env = ctx.cfg, ctx.env
    frozen = lambda m: m.requires_grad_(False)  # noqa: E731
    if cfg.train.sharding == "fsdp":
        return load_sharded(model_path, env, bf16=bf16, attn_implementation=cfg.model.attn_implementation,
                            prepare=frozen).model  # fmt: skip
    policy = load_policy(
        model_path, device=env.device, dtype="float32", attn_implementation=cfg.model.attn_implementation
    )
    return frozen(policy.model).eval()


def _setup_reference(ctx: _Run, model_path: Path, sets: dict[str, PreferenceDataset], fingerprint: dict[str, Any], *,
                     resumed: bool, out: Path, bf16: bool) -> None:  # fmt: skip
    """Set ``ctx.reference`` or ``ctx.table`` (see the module docstring)."""
    cfg, env = ctx.cfg, ctx.env
    lora = cfg.train.lora.enabled
    if not cfg.dpo.precompute_ref:
        if not lora:  # with LoRA the reference is the policy, adapters off
            ctx.reference = _load_reference(ctx, model_path, bf16)
        say(env, f"reference: {'the policy with its adapters disabled' if lora else f'a frozen copy of {model_path}'}")
        return
    path = out / "reference_logprobs.pt"
    # what the log-probs depend on: a resume whose key differs (train.allow_changes) scores them again
    key = {"model": str(model_path), "bf16": bf16, "average": ctx.average,
           **{f"{split}_data": fingerprint[f"{split}_data"] for split in ("train", "val")},
           **{f"{split}_ids": data.ids for split, data in sets.items()}}  # fmt: skip
    saved = torch.load(path, map_location="cpu", weights_only=False) if resumed and path.is_file() else None
    if saved is not None and saved["key"] == key:
        ctx.table = saved["logprobs"]
        say(env, f"reference: the log-probs in {path}")
        return
    if lora:  # the base model, whatever the adapters have learned so far
        scorer = _adapters_off(ctx)
    elif resumed:  # the policy has moved: a copy of the starting checkpoint scores, then goes
        reference = _load_reference(ctx, model_path, bf16)
        scorer = lambda batch: ctx.logprobs(reference, batch)  # noqa: E731
    else:  # before the first step the policy is the reference
        scorer = lambda batch: ctx.logprobs(ctx.backend.module, batch)  # noqa: E731
    t0 = time.perf_counter()
    ctx.table = {split: _score_all(ctx, data, scorer) for split, data in sets.items()}
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"key": key, "logprobs": ctx.table}, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
    say(env, f"reference: scored {sum(len(d.pairs) for d in sets.values())} pairs once in "
             f"{time.perf_counter() - t0:.1f}s, kept in {path}")  # fmt: skip


def _adapters_off(ctx: _Run) -> Scorer:
    """The reference under LoRA: the policy's peft model with its adapters disabled (called directly, not through
    DDP: a no-grad forward needs no gradient sync)."""

    def score(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with ctx.policy.model.disable_adapter():
            return ctx.logprobs(ctx.policy.model, batch)

    return score


def _score_all(ctx: _Run, data: PreferenceDataset, score: Scorer) -> torch.Tensor:
    """(N, 2) the reference's chosen and rejected log-probs of every pair of ``data``, micro-batches of pairs of
    similar length split over the ranks. Every rank runs as many forwards (sharded weights gather in lockstep): a
    rank past the end repeats the last micro-batch and keeps nothing from it."""
    env, size = ctx.env, data.micro_batch_size
    order = sorted(range(len(data.pairs)), key=data.lengths.__getitem__)  # similar lengths: little padding
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    mine: dict[int, tuple[float, float]] = {}
    ctx.backend.module.eval()
    with torch.no_grad():
        for c in range(env.rank, math.ceil(len(chunks) / env.world_size) * env.world_size, env.world_size):
            batch = to_device(data.encode(chunks[min(c, len(chunks) - 1)]), env.device)
            with ctx.backend.accumulating(last=True):  # the policy's precision: autocast or FSDP's policy
                chosen, rejected = score(batch)
            if c < len(chunks):
                for i, a, b in zip(chunks[c], chosen.tolist(), rejected.tolist(), strict=True):
                    mine[i] = (a, b)
    ctx.backend.module.train()
    table = torch.zeros(len(data.pairs), 2)
    for part in all_gather_object(mine):
        for i, pair in part.items():
            table[i] = torch.tensor(pair)
    return table


def _reference_logprobs(ctx: _Run, batch: Batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) chosen and rejected log-probs of the reference for a micro-batch of ``split`` (no gradient)."""
    if ctx.table is not None:
        rows = ctx.table[split][batch["pair_index"].cpu()]  # (B, 2)
        return rows[:, 0], rows[:, 1]
    with torch.no_grad():
        if ctx.reference is not None:
            return ctx.logprobs(ctx.reference, batch)
        return _adapters_off(ctx)(batch)


# -- the step and the eval ---------------------------------------------------------------------------------------


def _loss(ctx: _Run, batch: Batch, split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    dpo, train = ctx.cfg.dpo, ctx.cfg.train
    reference = _reference_logprobs(ctx, batch, split)
    return preference_loss(ctx.backend.module, batch, reference, beta=dpo.beta, loss_type=dpo.loss_type,
                           label_smoothing=dpo.label_smoothing, chunk_size=train.lm_head_chunk,
                           share_prefix=train.share_prefix)  # fmt: skip


def _means(sums: dict[str, torch.Tensor], env: DistEnv) -> dict[str, float]:
    """Per-pair means of the summed statistics over every rank, and the pair count."""
    keys = sorted(sums)  # the same order on every rank
    totals = all_reduce_sum(torch.stack([sums[k].to(env.device) for k in keys]))
    pairs = max(float(totals[keys.index("pairs")]), 1.0)
    return {k: (float(v) if k == "pairs" else float(v) / pairs) for k, v in zip(keys, totals, strict=True)}


def _step(ctx: _Run, batches: Iterator[Batch], accum: int) -> dict[str, float]:
    """One optimizer step over this rank's next ``accum`` micro-batches of pairs: each backpropagates its share of the
    step's mean loss over every pair of the step on every rank. Returns the step's log record."""
    env, backend = ctx.env, ctx.backend
    t0 = time.perf_counter()
    micro = [to_device(next(batches), env.device) for _ in range(accum)]
    # the step's pairs over all micro-batches and ranks (the loss is the step's pair mean; the last micro-batch of an
    # epoch may be smaller), and its real tokens
    local = [float(sum(len(b["pair_index"]) for b in micro)), float(sum(int(b["attention_mask"].sum()) for b in micro))]
    totals = all_reduce_sum(torch.tensor(local, device=env.device))
    n_pairs = max(float(totals[0]), 1.0)
    lr = backend.lr()
    sums: dict[str, torch.Tensor] = {}
    for k, batch in enumerate(micro):
        with backend.accumulating(last=k == len(micro) - 1):
            loss_sum, stats = _loss(ctx, batch, "train")
            backend.backward(loss_sum / n_pairs)
        for key, value in stats.items():
            sums[key] = sums.get(key, 0) + value
    grad_norm = backend.step()
    elapsed = time.perf_counter() - t0
    return {**_means(sums, env), "lr": lr, "grad_norm": grad_norm, "tokens": int(totals[1]),
            "tokens_per_s": float(totals[1]) / elapsed, "step_s": elapsed}  # fmt: skip


def _evaluate(ctx: _Run, val_set: PreferenceDataset) -> dict[str, float]:
    """Per-pair means of the loss and its statistics over every val pair once (micro-batches split over ranks; every
    rank runs as many forwards, a rank past the end repeating the last and counting nothing from it)."""
    env, module = ctx.env, ctx.backend.module
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    n = val_set.batches_per_epoch
    with torch.no_grad():
        for g in range(env.rank, math.ceil(n / env.world_size) * env.world_size, env.world_size):
            batch = to_device(val_set[min(g, n - 1)], env.device)
            with ctx.backend.accumulating(last=True):
                _, stats = _loss(ctx, batch, "val")
            for key, value in stats.items():
                sums[key] = sums.get(key, 0) + (value if g < n else 0 * value)
    module.train()
    return {f"eval/{k}": v for k, v in _means(sums, env).items()}


if __name__ == "__main__":
    raise SystemExit(main())

"""SFT cold start: teach the tool-use format on gold trajectories before RL.

    torchrun --nproc_per_node N tools/train.py --config configs/sft/<name>.yaml [key=value ...]
    vagent sft --config configs/sft/<name>.yaml [key=value ...]        (one process, or under torchrun)

Reads top to bottom: config -> processes -> resume decision -> model -> data -> optimizer/backend ->
loop (fetch the step's micro-batches, count the step's trained tokens over all ranks, forward/backward
each micro-batch's share of the step-mean loss, step) -> periodic eval / checkpoint -> final save.

Exact resume: the batch order is a function of (seed, epoch) and the data position is the step number,
so a run killed at any instant (a checkpoint write included) and resumed from its newest complete
checkpoint (weights, optimizer, schedule, every rank's RNG) repeats the uninterrupted run's losses
bit for bit on CPU.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vagent.algorithms import token_nll_sum, trained_positions, trained_token_count
from vagent.config import SFTConfig, TrainConfig, config_to_dict
from vagent.data import load_rows
from vagent.model import Policy, liger_token_nll_sum, masked_token_logprobs, policy_logits
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
from vagent.training.data import SFTDataset, rank_micro_batches
from vagent.training.distributed import DistEnv, all_reduce_sum, init_distributed, shutdown
from vagent.training.metrics import MetricsLogger


def main(argv: list[str] | None = None) -> int:
    train(config_from_argv(SFTConfig, sys.argv[1:] if argv is None else argv))
    return 0


def train(cfg: SFTConfig, before_step: Callable[[int, int], None] | None = None) -> Path | None:
    """Run SFT; returns the final HF model dir (``out_dir/model``; None under ``train.save_final=false``).
    ``before_step(step, total_steps)``, if given, runs before each optimizer step (the quickstart hands CPU threads
    over with it)."""
    env = init_distributed(cfg.model.device)
    out = Path(cfg.out_dir)
    try:
        return _train(cfg, env, out, before_step)
    finally:
        shutdown()


def _train(cfg: SFTConfig, env: DistEnv, out: Path, before_step: Callable[[int, int], None] | None) -> Path | None:
    t_start = time.perf_counter()
    root = out / "checkpoints"
    resume_from = resume_point(cfg.train.resume, env, root)
    bf16 = uses_bf16(cfg.train, env)

    # -- model, data ------------------------------------------------------------------------------------
    policy, model, _ = load_trainable(cfg.model, cfg.train, out, env, resume_from, cfg.seed)
    train_set, val_set, fingerprint = _setup_data(cfg, env, out, policy)
    accum, world = cfg.optim.grad_accum, env.world_size
    total_steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * train_set.batches_per_epoch / (world * accum))
    say(env, f"sft: {len(train_set.lengths)} conversations ({len(train_set.skipped)} skipped), "
              f"{train_set.batches_per_epoch} micro-batches/epoch, {world} rank(s) x {accum} accum -> "
              f"{total_steps} steps; {sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable params"
              f"{' (fsdp: the shards of this rank)' if cfg.train.sharding == 'fsdp' else ''}")  # fmt: skip

    # -- optimizer, schedule, backend -----------------------------------------------------------------------
    text_only = any(not any(p.type == "image" for m in c for p in m.content) for c in train_set.conversations)
    backend = build_backend(cfg.train, cfg.optim, model, env, total_steps=total_steps, bf16=bf16,
                            micro_batch_size=cfg.data.micro_batch_size, grad_accum=accum, find_unused=text_only)  # fmt: skip
    start_step = resume_training(resume_from, backend, fingerprint, cfg.train.allow_changes, env).get("step", 0)
    logger = MetricsLogger(out, enabled=env.is_main, resume_step=start_step, tensorboard=cfg.train.tensorboard,
                           wandb_project=cfg.train.wandb_project, config=fingerprint["config"])  # fmt: skip

    # -- loop ---------------------------------------------------------------------------------------------
    # its own generator: iterating a DataLoader draws a seed, which from the global RNG would shift a resumed run's
    # dropout masks (LoRA's) off the uninterrupted run's
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=None, num_workers=cfg.data.num_workers,
        sampler=list(rank_micro_batches(start_step, total_steps, env.rank, world, accum)),
        generator=torch.Generator().manual_seed(cfg.seed),
    )  # fmt: skip
    batches = iter(loader)
    bar = tqdm(total=total_steps, initial=start_step, desc="sft", disable=not env.is_main, dynamic_ncols=True)
    model.train()
    for step in range(start_step, total_steps):
        if before_step is not None:
            before_step(step, total_steps)
        record = _step(backend, batches, accum, env, cfg.train)
        done = step + 1
        record["epoch"] = done * world * accum / train_set.batches_per_epoch
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        if done % cfg.train.log_every == 0 or done == total_steps:
            logger.log(done, {**record, "peak_mem_gb": peak_memory_gb(env)})
        if val_set is not None and cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != total_steps:
            logger.log(done, {"eval_loss": _eval_loss(backend, val_set, env, cfg.train)})
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done != total_steps:
            save_checkpoint(backend, policy.processor, root, done, fingerprint, env, cfg.train.keep_last)
    bar.close()

    # -- final eval and save -------------------------------------------------------------------------------
    if val_set is not None:
        eval_loss = _eval_loss(backend, val_set, env, cfg.train)
        logger.log(total_steps, {"eval_loss": eval_loss})
        say(env, f"eval loss {eval_loss:.4f}")
    final = None
    if cfg.train.save_final:
        final = save_checkpoint(backend, policy.processor, root, total_steps, fingerprint, env, cfg.train.keep_last)
    logger.close()
    model_dir = (
        publish_model(final, out, env, Path(cfg.model.path)) if final else None
    )  # the final model at a stable path
    say(env, f"done: {total_steps} steps in {time.perf_counter() - t_start:.0f}s; {saved(model_dir)}")
    return model_dir


def _setup_data(cfg: SFTConfig, env: DistEnv, out: Path,
                policy: Policy) -> tuple[SFTDataset, SFTDataset | None, dict[str, Any]]:  # fmt: skip
    """The training and (``data.val``) eval sets, and the fingerprint of config and data a resume checks."""
    train_path, val_path = cfg.data.train, cfg.data.val
    min_pixels, max_pixels = policy.pixel_budget
    common = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor,
                  default_tools=cfg.data.tools, max_length=cfg.data.max_length,
                  micro_batch_size=cfg.data.micro_batch_size, group_batches=cfg.data.group_batches,
                  agent=cfg.data.agent, frame_budget=cfg.data.frame_budget)  # fmt: skip
    train_set = SFTDataset(load_rows(train_path, known_tools=TOOLS), policy.processor, seed=cfg.seed,
                           group_by_length=cfg.data.group_by_length, **common)  # fmt: skip
    val_set = None
    if val_path:
        val_set = SFTDataset(load_rows(val_path, known_tools=TOOLS), policy.processor, seed=cfg.seed,
                             group_by_length=True, **common)  # fmt: skip
    for rid, why in train_set.skipped:
        say(env, f"skipped row {rid}: {why}")
    fingerprint = {"config": config_to_dict(cfg), "train_data": ckpt.file_digest(train_path),
                   "val_data": ckpt.file_digest(val_path)}  # fmt: skip
    return train_set, val_set, fingerprint


def _step(backend: TrainBackend, batches: Iterator[dict[str, torch.Tensor]], accum: int, env: DistEnv,
          train: TrainConfig) -> dict[str, float]:  # fmt: skip
    """One optimizer step over this rank's next ``accum`` micro-batches: each backpropagates its share of the step's
    token-mean loss over all micro-batches on all ranks. Returns the step's log record."""
    t0 = time.perf_counter()
    micro = [to_device(next(batches), env.device) for _ in range(accum)]
    # counts over the whole step (all micro-batches, all ranks): the loss is the step's token mean
    counts = torch.tensor([float(trained_token_count(b["loss_mask"])) for b in micro], device=env.device)
    padded = sum(b["attention_mask"].numel() for b in micro)
    real = sum(int(b["attention_mask"].sum()) for b in micro)
    totals = all_reduce_sum(torch.tensor([float(counts.sum()), float(real), float(padded)], device=env.device))
    n_trained = max(float(totals[0]), 1.0)
    lr = backend.lr()
    loss_sum = torch.zeros((), device=env.device)
    for k, batch in enumerate(micro):
        with backend.accumulating(last=k == len(micro) - 1):
            nll = _nll_sum(backend.module, batch, train)
            backend.backward(nll / n_trained)
        loss_sum += nll.detach()
    grad_norm = backend.step()
    loss = float(all_reduce_sum(loss_sum)) / n_trained
    elapsed = time.perf_counter() - t0
    return {
        "loss": loss, "lr": lr, "grad_norm": grad_norm, "trained_tokens": int(totals[0]), "tokens": int(totals[1]),
        "padding_waste": 1 - float(totals[1]) / float(totals[2]), "tokens_per_s": float(totals[1]) / elapsed,
        "step_s": elapsed,
    }  # fmt: skip


def _nll_sum(module: torch.nn.Module, batch: dict[str, torch.Tensor], train: TrainConfig) -> torch.Tensor:
    """Summed NLL of the micro-batch's trained tokens: the chunked head (``train.lm_head_chunk``), liger-kernel's
    fused kernel, or (chunk 0) the head on the trained positions whole."""
    mask = batch["loss_mask"]
    if train.lm_head_kernel == "liger":
        return liger_token_nll_sum(module, batch, mask, share_prefix=train.share_prefix)
    if train.lm_head_chunk:
        logprobs, _ = masked_token_logprobs(module, batch, mask, chunk_size=train.lm_head_chunk,
                                            share_prefix=train.share_prefix)  # fmt: skip
        return -logprobs.sum()
    logits = policy_logits(module, batch, share_prefix=train.share_prefix, positions=trained_positions(mask))
    return token_nll_sum(logits, batch["input_ids"], mask)


def _eval_loss(backend: TrainBackend, val_set: SFTDataset, env: DistEnv, train: TrainConfig) -> float:
    """Token-mean loss over every val conversation once (micro-batches split over ranks)."""
    backend.module.eval()
    sums = torch.zeros(2, device=env.device)
    n = val_set.batches_per_epoch
    with torch.no_grad():
        # every rank runs as many forwards (sharded weights are gathered in lockstep): a rank past the end
        # repeats the last micro-batch and counts nothing from it
        for g in range(env.rank, math.ceil(n / env.world_size) * env.world_size, env.world_size):
            batch = to_device(val_set[min(g, n - 1)], env.device)
            with backend.accumulating(last=True):
                nll = _nll_sum(backend.module, batch, train)  # every rank runs it: FSDP gathers in lockstep
            if g < n:
                sums[0] += nll
                sums[1] += trained_token_count(batch["loss_mask"])
    backend.module.train()
    all_reduce_sum(sums)
    return float(sums[0] / sums[1].clamp(min=1))


if __name__ == "__main__":
    raise SystemExit(main())

"""Pieces every recipe builds the same way from its config: tool services, and the training scaffolding SFT and
GRPO share (resume decision, model preparation, optimizer and backend, atomic checkpoints)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import resource
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from vagent.config import ModelConfig, OptimConfig, ToolboxConfig, TrainConfig, load_config
from vagent.model import Policy, load_policy
from vagent.toolbox import ToolServices
from vagent.training import checkpoint as ckpt
from vagent.training.adapters import apply_lora, disable_dropout, freeze_vision, touch_vision_every_forward
from vagent.training.backend import DDPBackend, DeepSpeedBackend, TrainBackend, build_optimizer, warmup_cosine
from vagent.training.distributed import DistEnv, barrier, broadcast_object
from vagent.training.fsdp import FSDPBackend, load_sharded, shard_model
from vagent.training.merge import ADAPTER_DIR, merge_lora
from vagent.training.publish import weights_dtype, write_model_as

__all__ = [
    "FREE_KEYS",
    "build_backend",
    "check_resume",
    "config_from_argv",
    "freeze_and_checkpoint",
    "gathered_state_dict",
    "load_trainable",
    "peak_memory_gb",
    "prepare_model",
    "publish_model",
    "resume_point",
    "resume_training",
    "save_checkpoint",
    "saved",
    "say",
    "to_device",
    "tool_services",
    "uses_bf16",
]

# Keys that may change between a checkpoint and its resume without changing what is trained.
FREE_KEYS = {"out_dir", "train.resume", "train.allow_changes", "train.log_every", "train.eval_every",
             "train.save_every", "train.keep_last", "train.tensorboard", "train.wandb_project",
             "data.num_workers", "model.device", "train.lm_head_chunk", "train.lm_head_kernel"}  # fmt: skip
# LoRA's dropout in SFT when train.lora.dropout is unset (GRPO and DPO train without dropout)
SFT_LORA_DROPOUT = 0.05


def tool_services(cfg: ToolboxConfig) -> ToolServices:
    """The ``search`` backend and ``code`` sandbox a rollout needs (``services`` of ``rollout``/``run``)."""
    from vagent.toolbox.sandbox import Sandbox
    from vagent.toolbox.search import BM25Backend, HTTPBackend

    search = None
    if cfg.search_corpus:
        search = BM25Backend(cfg.search_corpus)
    elif cfg.search_url:
        search = HTTPBackend(cfg.search_url, cache_dir=cfg.search_cache_dir)
    sandbox = Sandbox(
        timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb, allow_unsandboxed=cfg.allow_unsandboxed_code
    )
    return ToolServices(search=search, sandbox=sandbox)


def say(env: DistEnv, message: str) -> None:
    """Print on rank 0 only."""
    if env.is_main:
        print(message, flush=True)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def peak_memory_gb(env: DistEnv) -> float:
    """Peak GPU memory allocated, or on CPU the process's max RSS."""
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB


def trim_host_memory() -> None:
    """Hand the host memory freed so far back to the system (glibc's ``malloc_trim``; a no-op on other C libraries).

    glibc keeps freed blocks inside its heaps while live ones sit above them (a rollout's kept patches above the
    processor's and the forwards' temporaries, made in the same threads), so without this a process's resident set
    stays well above what it holds, and climbs from step to step on a busy node."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def resume_point(resume: str, env: DistEnv, root: Path) -> Path | None:
    """Rank 0 picks the checkpoint (``train.resume``: auto | none | a dir) and every rank follows it."""
    choice = None
    if env.is_main:
        if resume == "auto":
            choice = ckpt.find_resume(root)
        elif resume != "none":
            choice = Path(resume)
            ckpt.read_state(choice)  # raises ResumeError if incomplete
    choice = broadcast_object(str(choice) if choice else None)
    return Path(choice) if choice else None


def check_resume(saved: dict[str, Any], current: dict[str, Any], allow_changes: bool) -> list[str]:
    """Keys of the config and data fingerprint that changed since the checkpoint (FREE_KEYS aside).

    Raises:
        ckpt.ResumeError: something changed and ``allow_changes`` is off.
    """
    changed = [k for k in ckpt.changed_keys(saved, current) if k.removeprefix("config.") not in FREE_KEYS]
    if changed and not allow_changes:
        raise ckpt.ResumeError(
            "the checkpoint was trained with different settings: " + ", ".join(changed)
            + ". Set train.allow_changes=true to resume anyway, train.resume=none to start over, "
            "or use another out_dir."
        )  # fmt: skip
    return changed


def uses_bf16(cfg: TrainConfig, env: DistEnv) -> bool:
    """bf16 compute (autocast or DeepSpeed bf16, fp32 master weights): asked for, or ``auto`` on CUDA."""
    return cfg.precision == "bf16" or (cfg.precision == "auto" and env.device.type == "cuda")


def load_trainable(model_cfg: ModelConfig, train_cfg: TrainConfig, out: Path, env: DistEnv, resume_from: Path | None,
                   seed: int, no_dropout: bool = False) -> tuple[Policy, torch.nn.Module, Path]:  # fmt: skip
    """The policy to train on ``env.device``: the configured checkpoint, or on a full-weights resume the checkpoint's
    own model dir; then frozen, checkpointed and LoRA-wrapped as configured (``prepare_model``). Weights are fp32
    masters, except that LoRA under bf16 keeps its frozen base in bf16 (the adapters train in fp32: peft's and TRL's
    layout), half the base's memory and no per-forward cast of it. Under ``train.sharding=fsdp`` the model comes back
    already sharded (``load_sharded``: built on the meta device, rank 0's checkpoint broadcast into the shards).
    ``no_dropout`` (GRPO, DPO: they compare log-probs of separate passes) sets every dropout to 0 and says so once.
    Returns (policy, the trained module, the starting model dir)."""
    model_path = Path(model_cfg.path)  # required by the config (require_paths): never a toy fallback
    # LoRA resumes its adapter onto the base; DeepSpeed restores the weights from its own checkpoint
    full_weights = resume_from is not None and not train_cfg.lora.enabled and not train_cfg.deepspeed
    # bf16 comes from autocast (DDP), FSDP's mixed-precision policy or DeepSpeed's bf16 mode, over fp32 master weights;
    # FSDP resumes from the consolidated model/ too
    model_dir = resume_from / "model" if full_weights else model_path
    fsdp = train_cfg.sharding == "fsdp"
    bf16_base = train_cfg.lora.enabled and uses_bf16(train_cfg, env)  # nothing of the base trains
    torch.manual_seed(seed)  # dropout: the same on every rank
    if fsdp:  # straight into the shards: no rank holds the whole fp32 model, as loading whole and sharding did
        adapter = resume_from / ADAPTER_DIR if resume_from is not None and train_cfg.lora.enabled else None
        policy = load_sharded(model_dir, env, bf16=uses_bf16(train_cfg, env),
                              attn_implementation=model_cfg.attn_implementation,
                              prepare=lambda model: wrap_model(train_cfg, model, env, seed, no_dropout),
                              base_dtype=torch.bfloat16 if bf16_base else torch.float32, adapter=adapter,
                              seed=seed)  # fmt: skip
    else:
        policy = load_policy(model_dir, device=env.device, dtype="bfloat16" if bf16_base else "float32",
                             attn_implementation=model_cfg.attn_implementation)  # fmt: skip
    policy.model.config.use_cache = False
    model = policy.model if fsdp else prepare_model(train_cfg, policy, resume_from, env, seed, no_dropout=no_dropout)
    if no_dropout:
        turned_off = disable_dropout(model)
        say(env, f"dropout off in every module ({turned_off} were on): the log-probs of two passes of the same "
                 "weights must agree")  # fmt: skip
    return policy, model, model_path


def resume_training(resume_from: Path | None, backend: TrainBackend, fingerprint: dict[str, Any],
                    allow_changes: bool, env: DistEnv) -> dict[str, Any]:  # fmt: skip
    """Restore optimizer, schedule and this rank's RNG from ``resume_from`` after checking that the config and
    data ``fingerprint`` match (``check_resume``). Returns the checkpoint's trainer state, or {} for a fresh run."""
    if resume_from is None:
        return {}
    state = ckpt.read_state(resume_from)
    for key in check_resume({k: state.get(k) for k in fingerprint}, fingerprint, allow_changes):
        say(env, f"warning: {key} changed since {resume_from} (train.allow_changes=true)")
    backend.load(resume_from)
    if not ckpt.load_rng(resume_from, env.rank):
        say(env, f"note: {resume_from} has no RNG state for rank {env.rank} (world size changed)")
    say(env, f"resumed from {resume_from} at step {state['step']}")
    return state


def prepare_model(cfg: TrainConfig, policy: Policy, resume_from: Path | None, env: DistEnv, seed: int,
                  no_dropout: bool = False) -> torch.nn.Module:  # fmt: skip
    """Freeze, checkpoint and wrap ``policy.model`` as configured (``wrap_model``), restoring a resumed adapter;
    ``policy.model`` becomes the trained module (the peft model with LoRA)."""
    model = wrap_model(cfg, policy.model, env, seed, no_dropout)
    if cfg.lora.enabled:
        if resume_from is not None and not cfg.deepspeed:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(str(resume_from / ADAPTER_DIR / "adapter_model.safetensors")))
        policy.model = model
    return model


def wrap_model(cfg: TrainConfig, model: torch.nn.Module, env: DistEnv, seed: int, no_dropout: bool) -> torch.nn.Module:
    """Freeze the vision tower, turn on activation checkpointing and wrap with LoRA as configured (``load_sharded``
    runs it on the meta model before sharding). Returns the trained module: ``model``, or peft's wrapper of it.
    LoRA's dropout is ``train.lora.dropout``, unset: 0.05, or 0 with ``no_dropout``; its adapters start from
    ``lora_init`` with ``seed``."""
    freeze_and_checkpoint(cfg, model, env)
    if not cfg.lora.enabled:
        return model
    lora = cfg.lora
    dropout = lora.dropout if lora.dropout is not None else 0.0 if no_dropout else SFT_LORA_DROPOUT
    return apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=dropout, target_modules=lora.target_modules,
                      seed=seed)  # fmt: skip


def freeze_and_checkpoint(cfg: TrainConfig, model: torch.nn.Module, env: DistEnv) -> None:
    """Freeze the vision tower and turn on activation checkpointing as configured."""
    if cfg.freeze_vision:
        frozen = freeze_vision(model)
        say(env, f"froze {frozen:,} vision tower parameters")
    if cfg.gradient_checkpointing:
        # non-reentrant: works with frozen inputs (LoRA, frozen vision) without enable_input_require_grads
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_backend(train: TrainConfig, optim: OptimConfig, model: torch.nn.Module, env: DistEnv, *,
                  total_steps: int, micro_batch_size: int, grad_accum: int, bf16: bool,
                  find_unused: bool) -> TrainBackend:  # fmt: skip
    """AdamW + warmup/cosine over ``model``'s trainable parameters, under DDP, FSDP2 (``train.sharding=fsdp``: the
    model is sharded in place first unless ``load_sharded`` built it sharded, so AdamW's state lives on the fp32
    shards) or DeepSpeed (``train.deepspeed``)."""
    if train.sharding == "fsdp":
        if not isinstance(model, FSDPModule):  # load_trainable's model comes sharded (load_sharded)
            shard_model(model, env, bf16=bf16)  # which makes every forward run the vision tower
    elif env.world_size > 1:  # a micro-batch without images must still give the merger a gradient on every rank
        touch_vision_every_forward(model, always=bool(train.deepspeed))  # ZeRO-3 gathers in no-grad forwards too
    optimizer = build_optimizer(model, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                                eps=optim.eps, vision_lr_scale=optim.vision_lr_scale,
                                fused=not train.deepspeed)  # fmt: skip
    scheduler = warmup_cosine(optimizer, warmup_steps=optim.warmup_steps, total_steps=total_steps,
                              min_ratio=optim.min_lr_ratio)  # fmt: skip
    if train.sharding == "fsdp":
        return FSDPBackend(model, env, optimizer=optimizer, scheduler=scheduler, max_grad_norm=optim.max_grad_norm)
    if train.deepspeed:
        return DeepSpeedBackend(model, env, config_path=train.deepspeed, optimizer=optimizer, scheduler=scheduler,
                                max_grad_norm=optim.max_grad_norm, bf16=bf16, micro_batch_size=micro_batch_size,
                                grad_accum=grad_accum)  # fmt: skip
    return DDPBackend(model, env, optimizer=optimizer, scheduler=scheduler, max_grad_norm=optim.max_grad_norm,
                      bf16=bf16, find_unused=find_unused)  # fmt: skip


def gathered_state_dict(backend: TrainBackend) -> dict[str, torch.Tensor] | None:
    """The weights a save writes, gathered from the shards onto rank 0 (FSDP, DeepSpeed; a collective every rank
    calls): the whole model's, or with LoRA the trainable adapters' alone (all a LoRA save writes; the frozen base
    is never gathered). None where ``backend.model`` holds them whole (DDP: ``save_pretrained`` reads the model).
    """
    if hasattr(backend.model, "peft_config"):  # DeepSpeed: its fp32 masters, not the bf16 module it computes with
        return backend.adapter_state_dict() if isinstance(backend, (DeepSpeedBackend, FSDPBackend)) else None
    if isinstance(backend, (DeepSpeedBackend, FSDPBackend)):
        return backend.full_state_dict()
    return None


def save_checkpoint(backend: TrainBackend, processor: Any, root: Path, step: int, state: dict[str, Any],
                    env: DistEnv, keep_last: int) -> Path:  # fmt: skip
    """Write checkpoint ``step`` atomically (see ``vagent.training.checkpoint``); every rank calls it."""
    tmp = ckpt.begin_checkpoint(root, step, env)
    state_dict = gathered_state_dict(backend)
    if env.is_main:
        ckpt.save_model(backend.model, processor, tmp / "model", state_dict=state_dict)
    backend.save(tmp)
    ckpt.save_rng(tmp, env.rank)
    return ckpt.commit_checkpoint(root, tmp, step, {"step": step, "world_size": env.world_size, **state}, env,
                                  keep_last)  # fmt: skip


def config_from_argv(cls: type, argv: Sequence[str]) -> Any:
    """``[--config FILE] [key=value ...]`` -> a validated ``cls`` config (the recipes' command line)."""
    argv = list(argv)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    return load_config(cls, config_path, argv)


def saved(model_dir: Path | None) -> str:
    """The run's last words on what it left: the published model, or nothing (``train.save_final=false``)."""
    return f"model at {model_dir}" if model_dir else "no checkpoint saved (train.save_final=false)"


def publish_model(checkpoint: Path, out: Path, env: DistEnv, source: Path) -> Path:
    """The run's final model at ``out/model``, replacing an older one atomically, in the dtype of the ``source``
    checkpoint's weights whatever the backend trained in (``vagent.training.publish``: the checkpoints hold fp32
    masters for an exact resume, a bf16 release is published in bf16): the checkpoint's HF model dir, or a LoRA
    checkpoint's adapter merged into its base (rank 0, on the CPU, one weight at a time: ``vagent.training.merge``;
    the only merged copy a LoRA run writes, in the base files' own dtype)."""
    model_dir = out / "model"
    if env.is_main:
        tmp = out / ".tmp-model"
        shutil.rmtree(tmp, ignore_errors=True)
        if (checkpoint / "model").is_dir():
            dtype = weights_dtype(source)
            if dtype is None or dtype == weights_dtype(checkpoint / "model"):
                shutil.copytree(checkpoint / "model", tmp)
            else:
                write_model_as(checkpoint / "model", tmp, dtype)
        else:
            merge_lora(checkpoint / ADAPTER_DIR, tmp)
        shutil.rmtree(model_dir, ignore_errors=True)
        tmp.rename(model_dir)
    barrier()
    return model_dir

"""Train backends: what differs between plain DDP, FSDP2 and DeepSpeed ZeRO, behind one small interface.

A recipe's step reads the same with either backend::

    for micro in micro_batches:
        with backend.accumulating(last=micro is micro_batches[-1]):
            loss = step_sum_loss(backend.module, micro) / step_trained_tokens
            backend.backward(loss)
    grad_norm = backend.step()

``backward`` takes the micro-batch's share of the *step's* mean loss (its summed token loss divided by
the step's trained tokens over all ranks). The backends undo their own averaging so the gradient is
exactly that of the step mean: DDP averages gradients over ranks (x world_size), DeepSpeed also divides
each micro-batch's loss by its gradient accumulation steps (x world_size x grad_accum).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from vagent.model import is_vision_tower
from vagent.training.distributed import DistEnv

__all__ = [
    "DDPBackend",
    "DeepSpeedBackend",
    "TrainBackend",
    "autocast",
    "build_optimizer",
    "clip_and_step",
    "warmup_cosine",
]


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on ``device`` (fp32 master weights stay as they are), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    vision_lr_scale: float = 1.0,
    fused: bool = True,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on biases and norm weights (1-D tensors).

    ``vision_lr_scale`` multiplies the learning rate of the vision tower's patch embedding and ViT blocks (the
    merger, which projects into the language model, keeps ``lr``), as Qwen-VL fine-tuning recipes give the
    vision tower its own, lower rate. The language model's groups come first, so group 0 (the rate the logs
    report) is at ``lr`` whenever the language model trains.

    ``fused``: torch's fused kernel where every parameter allows it (on CPU one step over the tiny model's 4.7M
    parameters took 3 ms instead of 18 ms); DeepSpeed, which flattens and partitions the parameters, asks for
    the plain one.
    """
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            vision = vision_lr_scale != 1.0 and is_vision_tower(name)
            groups.setdefault((vision, param.ndim >= 2), []).append(param)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    order = [(False, True), (False, False), (True, True), (True, False)]
    fused = fused and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                          for group in groups.values() for p in group)  # fmt: skip
    return torch.optim.AdamW(
        [{"params": groups[key], "weight_decay": weight_decay if key[1] else 0.0,
          "lr": lr * (vision_lr_scale if key[0] else 1.0)} for key in order if key in groups],
        lr=lr, betas=betas, eps=eps, fused=fused or None,
    )  # fmt: skip


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
) -> LambdaLR:
    """Linear warmup to the peak lr over ``warmup_steps``, then cosine decay to ``peak * min_ratio`` at
    ``total_steps``: transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` (HF Trainer's
    ``cosine_with_min_lr``), with two choices of vagent's own. The warmup counts from 1: step s < ``warmup_steps``
    runs at (s + 1) / ``warmup_steps`` of the peak (transformers' first step runs at 0, an optimizer step that moves
    nothing but Adam's moments). Past ``total_steps`` the rate stays at the floor (transformers' cosine climbs again:
    a resumed run given more steps would warm back up). The factor for step s (0-based, the step about to run) is:

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = warmup_cosine(opt, warmup_steps=2, total_steps=6, min_ratio=0.0)
    >>> [round(sched.lr_lambdas[0](s), 3) for s in range(8)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    """
    cosine = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps, min_lr_rate=min_ratio
    ).lr_lambdas[0]
    end = max(total_steps, warmup_steps + 1)  # where the cosine reaches the floor (at once when there is no decay)

    def factor(step: int) -> float:
        return float(cosine(step + 1 if step < warmup_steps else min(step, end)))  # transformers' floor is int 0

    return LambdaLR(optimizer, factor)  # replaces transformers' own: the optimizer's base rates are untouched


class TrainBackend(Protocol):
    """One optimizer over one model, possibly sharded/replicated over ranks."""

    model: torch.nn.Module  # the unwrapped model (peft or HF) for saving and eval
    module: torch.nn.Module  # what to call forward on (DDP / DeepSpeed engine / the model itself)
    loss_scale: float  # what ``backward`` multiplies the step-mean loss share by (callers pass it unscaled)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> float: ...
    def lr(self) -> float: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...


class DDPBackend:
    """Plain PyTorch: the model on ``env.device``, wrapped in DDP when world_size > 1 (gloo on CPU, nccl on
    GPU); AdamW + warmup/cosine; bf16 autocast with fp32 master weights when ``bf16``. ``find_unused``: some
    batches leave parameters without gradients (text-only rows and the vision tower).

    Every rank holds the full optimizer state (identical on all ranks), so rank 0 alone saves it.
    """

    def __init__(self, model: torch.nn.Module, env: DistEnv, *, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, max_grad_norm: float, bf16: bool, find_unused: bool = False) -> None:  # fmt: skip
        self.model = model
        self.env = env
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.bf16 = bf16
        self.loss_scale = float(env.world_size)
        if env.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            device_ids = [env.device.index] if env.device.type == "cuda" else None
            # find_unused: a batch without images leaves the vision tower without gradients, which DDP must
            # be told about (it costs a graph traversal per step, so only when the data has such rows)
            self.module = DDP(model, device_ids=device_ids, find_unused_parameters=find_unused)
        else:
            self.module = model

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """Forward/backward of one micro-batch; gradients are all-reduced only on the ``last`` one."""
        sync = contextlib.nullcontext() if last or self.module is self.model else self.module.no_sync()
        with sync, autocast(self.env.device, self.bf16):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()

    def step(self) -> float:
        """Clip, step, advance the schedule, zero the gradients. Returns the pre-clip global grad norm."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, directory: Path) -> None:
        if self.env.is_main:
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
            torch.save(state, directory / "optimizer.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "optimizer.pt", map_location=self.env.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class DeepSpeedBackend:
    """DeepSpeed ZeRO-2/3 from a JSON config (``configs/deepspeed/``). The JSON's ``"auto"`` values are filled
    from the recipe (micro-batch, accumulation, clipping, bf16); AdamW and the schedule are vagent's, so
    both backends train the same way. Needs the ``gpu`` extra (``pip install 'vagent[gpu]'``).
    """

    def __init__(self, model: torch.nn.Module, env: DistEnv, *, config_path: str, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, max_grad_norm: float, bf16: bool, micro_batch_size: int,
                 grad_accum: int) -> None:  # fmt: skip
        try:
            import deepspeed
        except ImportError:
            raise ImportError(
                f"train.deepspeed={config_path} needs DeepSpeed, which is not installed: "
                "pip install 'vagent[gpu]' (or set train.deepspeed=null to train with DDP)"
            ) from None
        config = load_deepspeed_config(config_path, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                                       world_size=env.world_size, max_grad_norm=max_grad_norm, bf16=bf16)  # fmt: skip
        self.config = config
        self.model = model
        self.env = env
        self.scheduler = scheduler
        self.module, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.zero_stage = int(config.get("zero_optimization", {}).get("stage", 0))
        # DeepSpeed divides each micro-batch loss by its accumulation steps and averages over ranks.
        self.loss_scale = float(env.world_size * grad_accum)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # DeepSpeed counts micro-steps itself and syncs at the boundary

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss * self.loss_scale)
        self.module.step()  # a no-op until the accumulation boundary

    def step(self) -> float:
        norm = self.module.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, directory: Path) -> None:
        self.module.save_checkpoint(str(directory / "deepspeed"), tag="state")  # every rank writes its shard

    def load(self, directory: Path) -> None:
        self.module.load_checkpoint(str(directory / "deepspeed"), tag="state")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0's CPU in fp32, None elsewhere (a collective: every rank walks every
        parameter).

        The trained weights come from DeepSpeed's fp32 masters (``safe_get_full_fp32_param``, reduced from every
        rank's partition), not from the module it computes with, which is bf16 under bf16 compute: a checkpoint holds
        the masters as under DDP and FSDP. Frozen weights have no master: the module's (gathered under ZeRO-3),
        upcast exactly; they are the loaded values whenever the source checkpoint is bf16 or the compute fp32 (from an
        fp32 checkpoint under bf16, DeepSpeed holds them rounded)."""
        whole = self._masters(self.model.parameters())
        if whole is None:
            return None
        # the state dict's names, a tied head's too (the embedding's tensor under both names), and its buffers
        return {name: whole[id(value)] if id(value) in whole else value.detach().cpu()
                for name, value in self.model.state_dict(keep_vars=True).items()}  # fmt: skip

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """LoRA: the trainable parameters (the adapters) from DeepSpeed's fp32 masters, on rank 0's CPU under the
        model's state-dict names; None elsewhere. A collective."""
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        whole = self._masters(p for _, p in named)
        return None if whole is None else {name: whole[id(p)] for name, p in named}

    def _masters(self, params: Iterable[torch.nn.Parameter]) -> dict[int, torch.Tensor] | None:
        """``{id(param): its whole fp32 value on the CPU}`` on rank 0, None elsewhere; every rank walks ``params``
        in the same order (each is a collective)."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        whole: dict[int, torch.Tensor] = {}
        for param in params:
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None:
                with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
                    full = param.detach().clone()
            if self.env.is_main:
                whole[id(param)] = full.float().cpu() if full.is_floating_point() else full.cpu()
            del full
        return whole if self.env.is_main else None


def load_deepspeed_config(path: str | Path, *, micro_batch_size: int, grad_accum: int, world_size: int,
                          max_grad_norm: float, bf16: bool) -> dict[str, Any]:  # fmt: skip
    """Read a DeepSpeed JSON and fill its ``"auto"`` values from the recipe; a value set in the JSON that
    contradicts the recipe is an error (two sources of truth for the batch size train differently)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the DeepSpeed config {path}: {e}") from None
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": max_grad_norm,
    }
    for key, value in wanted.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
        elif config[key] != value:
            raise ValueError(f'{path}: {key}={config[key]} contradicts the recipe\'s {value}; set it to "auto"')
    config.setdefault("bf16", {})
    if config["bf16"].get("enabled", "auto") == "auto":
        config["bf16"]["enabled"] = bf16
    if "optimizer" in config or "scheduler" in config:
        raise ValueError(f"{path}: leave out 'optimizer' and 'scheduler'; vagent passes its AdamW and schedule")
    return config


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                  max_grad_norm: float) -> float:  # fmt: skip
    """Clip the trainable parameters' gradients (0 = no clipping), step the optimizer and the schedule, zero the
    gradients. Returns the pre-clip global grad norm (over every rank's shard when the parameters are DTensors,
    as under FSDP2)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2

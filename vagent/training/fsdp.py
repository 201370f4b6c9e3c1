"""FSDP2 (``torch.distributed.fsdp.fully_shard``): weights, gradients and AdamW state sharded over the ranks.

Under DDP every rank holds the whole model in fp32 with its gradients and AdamW moments: 16 bytes a
parameter, 112 GB for Qwen2.5-VL-7B before a single activation. ``train.sharding=fsdp`` shards each decoder
layer and each vision block as one FSDP unit (the ``_no_split_modules`` classes transformers declares) and
the rest (embeddings, LM head, the vision patch embedding and merger) as the root unit, so a rank holds
``16 / world_size`` bytes a parameter plus the one or two layers gathered at a time.

Precision: the sharded parameters and AdamW's state stay fp32. With bf16 compute the units gather their
weights as bf16 and reduce-scatter gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``) instead of autocasting fp32 weights as DDP does. Both run on CPU over gloo with torch 2.14
(tests/test_fsdp.py: fp32 on 2 ranks, the bf16 policy in a group of one) and on CUDA over NCCL. With LoRA
(torchtune's layout) the frozen base is sharded in bf16 under bf16 compute and the adapters in fp32, in the same
units; only the adapters have gradients and AdamW state.

Collectives must line up on every rank, so every rank runs the same modules in the same order. A micro-batch
without images would skip the vision tower on one rank while another rank gathers its blocks (a hang, or
gradients reduced for different parameter sets): ``touch_vision_every_forward`` (``vagent.training.adapters``)
runs the tower on a 4-patch dummy image whose output enters the forward times zero whenever a forward reached the
language model without it (verl and EasyR1 do the same for text-only batches). vagent shows videos as image
frames, so a forward runs the tower at most once.

Checkpoints (``save``/``load`` and ``full_state_dict``): ``model/`` is a consolidated HF dir gathered with
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` and written by rank 0 (with LoRA, ``adapter/``
instead: ``adapter_state_dict`` gathers the adapters alone); the optimizer is saved sharded with
``torch.distributed.checkpoint`` (``optimizer/``, every rank writes its shard; a different world size reshards on
load), the schedule by rank 0. A resume loads the consolidated ``model/`` (with LoRA: the base and ``adapter/``)
through ``load_sharded``.

Loading (``load_sharded``, as torchtune does it): every rank builds the model on the meta device, prepares and
shards it, allocates only its own shards, and rank 0 alone reads the checkpoint and broadcasts it one tensor at a time
into the shards (``set_model_state_dict(broadcast_from_rank0=True)``). Loading whole on every rank and sharding after
(``load_policy`` then ``shard_model``) held the whole fp32 model on each rank first: 30 GB per rank at 7B, 60 GB with
GRPO's fp32 KL reference, however many ranks share the work (measured on CPU: ``benchmarks/fsdp_load.py``).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from vagent.model import (
    Policy,
    PolicyLoadError,
    checkpoint_family,
    patch_embeds_as_matmul,
    resolve_attn_implementation,
)
from vagent.training.adapters import touch_vision_every_forward
from vagent.training.backend import clip_and_step
from vagent.training.distributed import DistEnv, broadcast_object
from vagent.training.weight_sync import generation_weights

__all__ = ["FSDPBackend", "InferenceCopy", "load_sharded", "shard_model"]


def _ensure_process_group(env: DistEnv) -> None:
    """FSDP needs a process group even in a world of one (``torchrun --nproc_per_node 1``, or a plain launch):
    a single-process group over an in-memory store."""
    if not dist.is_initialized():
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=env.device if env.device.type == "cuda" else None)  # fmt: skip


def shard_model(model: torch.nn.Module, env: DistEnv, *, bf16: bool) -> torch.nn.Module:
    """Shard ``model`` in place: one FSDP unit per decoder layer and per vision block, the root unit for the rest.

    Args:
        model: An HF Qwen-VL model (fp32 weights on ``env.device``), or peft's LoRA wrapper of one (a frozen base in
            any dtype, fp32 adapters: each unit shards both, and gathers them in the compute dtype).
        env: This process's rank and device.
        bf16: Gather weights as bf16 for compute, reduce gradients in fp32.

    Returns:
        The same module, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.

    Raises:
        ValueError: the model declares no layer classes to shard by (``_no_split_modules``).
    """
    _ensure_process_group(env)
    classes = set(getattr(model, "_no_split_modules", None) or [])
    mesh = init_device_mesh(env.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    units = [m for m in model.modules() if type(m).__name__ in classes]
    if not units:
        raise ValueError(f"train.sharding=fsdp: {type(model).__name__} names no layer classes (_no_split_modules)")
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    touch_vision_every_forward(model, always=True)  # the units' collectives run in no_grad forwards too
    # policy_logits(positions=...) hands the LM head zero positions inside the forward and runs it on the kept
    # hidden states afterwards; the forward's empty logits are a view nothing writes to, which FSDP warns about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def load_sharded(path: str | Path, env: DistEnv, *, bf16: bool, attn_implementation: str | None = None,
                 prepare: Callable[[torch.nn.Module], torch.nn.Module | None] | None = None,
                 base_dtype: torch.dtype = torch.float32, adapter: Path | None = None,
                 seed: int = 0) -> Policy:  # fmt: skip
    """Load the checkpoint dir ``path`` straight into FSDP shards: what ``load_policy`` then ``shard_model`` give
    (fp32 master weights, the same values, buffers and ties), without any rank holding the whole fp32 model.

    Every rank builds the model from its config on the meta device (no memory), applies ``prepare`` and the
    Conv3d-as-matmul patch, shards it (``shard_model``) and allocates its own shards on ``env.device``. ``to_empty``
    leaves every tensor uninitialized: the buffers no checkpoint holds (``persistent=False``: the text and vision RoPE
    inverse frequencies) are recomputed there, and a tied LM head (Qwen2.5-VL-3B) is tied again. Rank 0
    then reads the checkpoint onto its CPU and ``set_model_state_dict(broadcast_from_rank0=True)`` broadcasts it one
    tensor at a time, each rank keeping its shard. Memory: rank 0 reads the checkpoint in its stored dtype, which
    transformers leaves as views of the mapped file (page cache, no copy); every other rank holds its shards and one
    whole tensor in flight; on a GPU, every rank's device the shards and one whole tensor. Measured on CPU ranks:
    ``benchmarks/fsdp_load.py``. A collective: every rank calls it.

    Args:
        path: HF checkpoint dir (the configured model or a resume's consolidated ``model/``).
        env: This process's rank and device.
        bf16: As for ``shard_model``.
        attn_implementation: As for ``load_policy``.
        prepare: Called on the whole (meta) model before sharding: freezing, activation checkpointing, LoRA. When
            it returns a module (peft's wrapper), that module is the one sharded and returned.
        base_dtype: The dtype of the checkpoint's weights in the shards: fp32 masters, or bf16 for a frozen LoRA base
            (the adapters stay fp32; FSDP gathers both in the compute dtype).
        adapter: LoRA: a peft adapter dir whose weights the adapters resume from; None = the adapters start from
            ``lora_init(name, shape, seed)``, the values the unsharded path starts from.
        seed: As for ``lora_init``.

    Returns:
        A ``Policy`` whose model is an ``FSDPModule`` in eval mode; the processor comes from ``path`` as in
        ``load_policy``.

    Raises:
        PolicyLoadError: as ``load_policy``.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    path = Path(path)
    family = checkpoint_family(path)
    attn = resolve_attn_implementation(attn_implementation, env.device)
    try:
        config = AutoConfig.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PolicyLoadError(f"could not load {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=base_dtype, attn_implementation=attn)
    if (path / "generation_config.json").is_file():  # from_pretrained reads it (EOS ids, pad id); from_config not
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    patch_embeds_as_matmul(model)
    if prepare is not None:
        model = prepare(model) or model
    # the names and shapes set_model_state_dict expects (peft's, with LoRA)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shard_model(model, env, bf16=bf16)
    model.to_empty(device=env.device)
    _rebuild_non_persistent_buffers(model)
    # a plain module's to_empty unties a tied head (see InferenceCopy); FSDP2's keeps the tie on torch 2.14, but a head
    # untied here would load the embedding's values and then train apart from it: tie again, whatever to_empty did
    model.tie_weights()
    full, error = {}, None
    if dist.get_rank() == 0:
        try:
            full = _checkpoint_state_dict(path)
            if any(".lora_" in name for name in shapes):
                full = _with_adapters(full, shapes, adapter, seed)
        except PolicyLoadError as e:
            error = str(e)
        except Exception as e:  # a missing or corrupt adapter file: said on every rank, not left to hang them
            error = f"could not load the adapter of {adapter}: {type(e).__name__}: {str(e).splitlines()[0]}"
    if (error := broadcast_object(error)) is not None:  # not the others left waiting in the broadcast
        raise PolicyLoadError(error)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    return Policy(model=model, processor=processor, family=family, path=path)


def _checkpoint_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights on this (rank 0's) CPU, named as the model names them, in the dtype they are stored
    in: views of the mapped safetensors file rather than an fp32 copy (the fp32 shards copy bf16 values exactly).
    transformers reads them, so the released checkpoints' older key names (``model.layers.*``, ``visual.*``), sharded
    files and a tied head (one tensor under both names) load as with ``load_policy``."""
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PolicyLoadError(f"could not load {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return model.state_dict()


def _with_adapters(base: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], adapter: Path | None,
                   seed: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The state dict of a peft-wrapped model from its base checkpoint's (``base``, HF names) and its adapters' values:
    each name of ``shapes`` (peft's: ``base_model.model.<HF name>``, an adapted layer's weight under ``.base_layer.``) from
    the base, each LoRA factor from ``adapter`` (peft's file names the factors without the adapter's name) or, on a
    fresh start, ``lora_init``.

    Raises:
        PolicyLoadError: a name neither the base nor the adapter holds.
    """
    from safetensors.torch import load_file

    from vagent.training.adapters import lora_init

    saved = load_file(str(adapter / "adapter_model.safetensors")) if adapter is not None else None
    full: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if ".lora_" in name:
            if saved is None:
                full[name] = lora_init(name, shape, seed)
                continue
            key = re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", name)  # ...lora_A.default.weight -> ...lora_A.weight
            if key not in saved:
                raise PolicyLoadError(f"{adapter}/adapter_model.safetensors has no {key}")
            full[name] = saved[key]
            continue
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if hf not in base:
            raise PolicyLoadError(f"the checkpoint has no weight for {hf}")
        full[name] = base[hf]
    return full


@torch.no_grad()
def _rebuild_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers no checkpoint holds (``persistent=False``; in Qwen-VL the RoPE inverse frequencies of the
    text and vision rotary embeddings) after ``to_empty`` left them uninitialized: the model's own ``_init_weights``
    on the modules that own them, which is what ``from_pretrained`` runs for them (torchtune re-runs ``rope_init``).
    Each is NaN before, so one that the init does not write is an error here rather than garbage in every forward.

    Raises:
        RuntimeError: a non-persistent buffer the model's init does not recompute.
    """
    owners: dict[str, torch.nn.Module] = {}
    buffers: dict[str, torch.Tensor] = {}
    for name, buffer in model.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._non_persistent_buffers_set:
            buffer.fill_(math.nan if buffer.is_floating_point() else -1)
            owners[owner_name], buffers[name] = owner, buffer
    for owner in owners.values():
        model._init_weights(owner)
    unwritten = [name for name, buffer in buffers.items()
                 if (buffer.isnan() if buffer.is_floating_point() else buffer == -1).any()]  # fmt: skip
    if unwritten:
        raise RuntimeError(f"{type(model).__name__}'s init does not rebuild the non-persistent buffers {unwritten[:4]}; "
                           "load it with load_policy")  # fmt: skip


class InferenceCopy:
    """Whole weights for generation, next to the sharded model that trains.

    The rollout engine decodes rows of different lengths and tool timings on each rank, so its forward calls do
    not line up across ranks, and it calls inner modules (``model.model``) whose FSDP hooks would not gather the
    root's weights. Keeping the model unsharded during generation (``reshard_after_forward=False``) has both
    problems; so each rollout phase first gathers the trained weights into this plain HF model, one parameter
    at a time (``refresh``: the only extra transient is one whole fp32 parameter, at most the embedding), and
    generation then runs without collectives. Memory: the copy stays resident in the compute dtype, 2 bytes a
    parameter in bf16 (Qwen2.5-VL-7B: 15 GB per rank; 3B: 7.5 GB), 4 in fp32.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Allocate an uninitialized copy of ``model`` (sharded or not; peft's LoRA wrapper: of its base model) in
        ``dtype`` on the model's device."""
        device = next(model.parameters()).device  # a shard's (DTensor) device is its rank's
        base = model.get_base_model() if hasattr(model, "peft_config") else model
        hf_class = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
        with torch.device("meta"):
            copy = hf_class._from_config(base.config, dtype=dtype)
        copy.to_empty(device=device)
        # to_empty gives every parameter its own storage, tied ones too (Qwen2.5-VL-3B ties its LM head to the
        # input embedding): tie them again, or the head would keep whatever the allocator left there, since the
        # sharded model lists a tied pair once and refresh() writes it once
        copy.tie_weights()
        copy.generation_config = base.generation_config
        copy.requires_grad_(False).eval()
        self.model = copy
        self.dtype = dtype

    @torch.no_grad()
    def refresh(self, sharded: torch.nn.Module) -> torch.nn.Module:
        """Copy the current weights of ``sharded`` in (a collective: every rank calls it); returns the copy. With LoRA
        the copy gets each adapted layer's merged weight (``generation_weights``): it generates as the trained model
        does, without adapters of its own."""
        params = dict(self.model.named_parameters())
        written = set()
        for name, full in generation_weights(sharded, self.dtype):
            if name not in params:
                raise RuntimeError(f"the trained model's {name} has no place in the inference copy")
            params[name].copy_(full)
            written.add(name)
            del full
        if written != set(params):  # a parameter of the copy that nothing wrote would generate from garbage
            raise RuntimeError(f"the inference copy's parameters {sorted(set(params) ^ written)[:4]} do not match "
                               "the trained model's (a tie the copy lacks, or a wrapper that renames them)")  # fmt: skip
        buffers = dict(self.model.named_buffers())
        base = sharded.get_base_model() if hasattr(sharded, "peft_config") else sharded
        for name, buffer in base.named_buffers():  # buffers are not sharded (RoPE inverse frequencies)
            buffers[name].copy_(buffer)
        return self.model


class FSDPBackend:
    """The ``TrainBackend`` of ``train.sharding=fsdp`` (see the module docstring). Build the optimizer over the
    model after ``shard_model``, so AdamW's state is allocated on the fp32 shards."""

    def __init__(self, model: torch.nn.Module, env: DistEnv, *, optimizer: torch.optim.Optimizer,
                 scheduler: LambdaLR, max_grad_norm: float) -> None:  # fmt: skip
        if not isinstance(model, FSDPModule):
            raise TypeError("FSDPBackend needs a model sharded by shard_model first")
        self.model = model
        self.module = model
        self.env = env
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        # FSDP averages reduce-scattered gradients over ranks, as DDP does
        self.loss_scale = float(dist.get_world_size())

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Every micro-batch reduce-scatters its gradients into the fp32 shards, where they accumulate: holding
        unsharded gradients across micro-batches (``set_requires_gradient_sync(False)``) would cost the whole
        model's gradients per rank, the memory sharding is for. Compute precision comes from the sharding's
        mixed-precision policy, not autocast."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()

    def step(self) -> float:
        """Clip (the norm of the sharded gradients is reduced over ranks), step, advance the schedule."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's fp32 weights on rank 0's CPU (gathered from every rank; a collective), None elsewhere."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return state if self.env.is_main else None

    def adapter_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trainable parameters (LoRA's adapters), whole, on rank 0's CPU under the model's state-dict names, None
        elsewhere: one gathered parameter at a time (a collective), never the frozen base."""
        state = {}
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                whole = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
                if self.env.is_main:
                    state[name] = whole.cpu()
        return state if self.env.is_main else None

    def save(self, directory: Path) -> None:
        """Every rank writes its optimizer shard under ``directory/optimizer`` (torch.distributed.checkpoint);
        rank 0 the schedule. ``directory`` is the checkpoint's temp dir, renamed into place when complete."""
        state = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.save({"optimizer": state}, checkpoint_id=str(directory / "optimizer"))
        if self.env.is_main:
            torch.save({"scheduler": self.scheduler.state_dict()}, directory / "scheduler.pt")

    def load(self, directory: Path) -> None:
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=str(directory / "optimizer"))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        scheduler = torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(scheduler["scheduler"])

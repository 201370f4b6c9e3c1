"""A memory plan per rank for SFT, GRPO and DPO: arithmetic over the model's shape, no model built.

``plan(shape, setup)`` adds up what one rank holds at its peak: the weights (fp32 masters, sharded or not, and
the bf16 copies compute reads), gradients, AdamW's two fp32 moments, the activations autograd keeps for one
micro-batch at the config's token limit (with or without gradient checkpointing), the language-model head's
buffers (chunked or whole logits), the frozen reference where the loss has one (GRPO's KL term, DPO) and, for GRPO,
the rollout's KV cache and the whole weights generation needs. A DPO micro-batch of B pairs is one forward over 2B
sequences (the chosen rows, then the rejected ones): its activations and head buffers are those of 2B sequences.
``vagent memory --config ...`` prints it; ``benchmarks/memory_plan.py`` checks it against measured peaks.

The reference is resident only as a frozen copy, which the recipes load in fp32 (autocast or FSDP's mixed-precision
policy computes in bf16): whole on every rank, or under FSDP in fp32 shards plus its root unit (embeddings, head,
patch embedding, merger), which stays gathered after the copy's no-grad forward (FSDP2 does not reshard a root after
its forward, and no backward comes to reshard it). With LoRA the reference is the policy with its adapters disabled, and with
DPO's ``precompute_ref`` its log-probs are scored once before training (no-grad forwards, below the step's peak) and
kept on the host, 2 floats per pair: neither adds device memory.

For GRPO it also plans the host memory (CPU RAM, apart from the device peak) of the step's episodes: each image is
held once, as the processor's fp32 patches (``3 x temporal_patch x patch**2 x 4`` bytes per patch, 8x the image's
RGB bytes at the model's size) plus the RGB image the messages keep for the export: a tool output at the model's
size, once; a prompt image once per group, as given (its original, which the tools cut from).
``benchmarks/episode_memory.py`` measures it.

What it counts, per parameter (P all, T trainable, N ranks):

| sharding | weights | gradients | AdamW | working set |
|---|---|---|---|---|
| ddp   | 4P fp32 (+2T bf16 autocast copies) | 4T (+4T DDP buckets, N > 1) | 8T | - |
| ddp, LoRA, bf16 | 2(P-T) bf16 frozen base + 4T fp32 adapters + 2T autocast copies | as ddp | 8T | - |
| zero2 | 2P bf16 + 4T/N fp32 masters | 4T/N (+ reduce buckets) | 8T/N | - |
| zero3 | 2P/N bf16 + 4T/N fp32 masters | 4T/N | 8T/N | bf16 unit gathers |
| fsdp  | 4P/N fp32 shards | 4T/N | 8T/N | bf16 unit gathers, fp32 unit gradients |
| fsdp, LoRA | 2(P-T)/N bf16 frozen base (4 without bf16) + 4T/N fp32 adapters | 4T/N | 8T/N | bf16 unit gathers, one layer's adapter gradients |

FSDP2 (``fully_shard`` per decoder layer and vision block, the rest in the root unit) gathers the root unit for
the whole forward/backward and two layer units at a time (the current one and the prefetched next); a unit's
gradient exists unsharded in fp32 until its reduce-scatter. Activations per token and layer follow what autograd
saves in a Qwen2 decoder layer (norm inputs and outputs, q/k/v, rotary copies, the repeated GQA keys/values,
attention output, MLP gate/up/activation/product): about 12H + 4·kv + 4I elements; with gradient checkpointing
only the layer input (H) per layer, plus one layer recomputed in backward. Attention is flash/memory-efficient
(no T² matrix) on CUDA; on CPU the masked SDPA kernel keeps heads x T x T probabilities per layer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["SHAPES", "MemoryPlan", "ModelShape", "Setup", "fits", "image_bytes", "plan", "shape_from_config_json"]

GiB = 2**30
Sharding = Literal["ddp", "fsdp", "zero2", "zero3"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the plan needs, in one of two layouts (``layout``):

    * ``qwen2.5-vl`` (Qwen2-VL too): GQA decoder with q/k/v biases, SwiGLU MLPs; a vision tower of RMSNorm blocks with
      gated MLPs and a 2x2 patch merger.
    * ``qwen3-vl``: the decoder without biases, with q/k RMSNorms and its own ``head_dim``; a vision tower of LayerNorm
      blocks with plain two-layer MLPs, learned position embeddings, a biased patch embedding, the merger, and one
      DeepStack merger per ``deepstack_visual_indexes`` entry (Qwen3-VL's intermediate ViT features fed to the first
      decoder layers). Counted from transformers' ``modeling_qwen3_vl.py``: 8,767,123,696 for Qwen3-VL-8B, its
      weights' own count.
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    vision_hidden: int
    vision_depth: int
    vision_intermediate: int
    vision_heads: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    source: str = ""
    layout: Literal["qwen2.5-vl", "qwen3-vl"] = "qwen2.5-vl"
    head_dim: int = 0  # 0 = hidden // heads (Qwen2.5-VL); Qwen3-VL sets it (128)
    position_embeddings: int = 0  # qwen3-vl: the vision tower's learned position table
    deepstack: int = 0  # qwen3-vl: DeepStack mergers

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_size

    def layer_params(self) -> int:
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        if self.layout == "qwen3-vl":  # no biases; q_norm and k_norm of head_dim
            return h * (q + 2 * kv) + q * h + 2 * self.head_size + 3 * h * i + 2 * h
        return h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * i + 2 * h

    def vision_block_params(self) -> int:
        v, i = self.vision_hidden, self.vision_intermediate
        if self.layout == "qwen3-vl":  # 2 LayerNorms (weight + bias), qkv + proj, fc1 + fc2, all biased
            return 4 * v + (3 * v * v + 3 * v) + (v * v + v) + (v * i + i) + (i * v + v)
        return 2 * v + (3 * v * v + 3 * v) + (v * v + v) + 2 * (v * i + i) + (i * v + v)

    def merger_params(self) -> int:
        """The 2x2 patch merger(s): the projection into the language model (it trains even with a frozen tower);
        Qwen3-VL's DeepStack mergers too."""
        merged = self.vision_hidden * self.merge**2
        mlp = (merged * merged + merged) + (merged * self.hidden + self.hidden)
        if self.layout == "qwen3-vl":  # LayerNorm over the vision width, and per DeepStack merger over the merged one
            return 2 * self.vision_hidden + mlp + self.deepstack * (2 * merged + mlp)
        return self.vision_hidden + mlp

    def vision_params(self) -> int:
        """Patch embedding (and position table), blocks and the merger(s)."""
        patch = 3 * self.temporal_patch * self.patch**2 * self.vision_hidden
        if self.layout == "qwen3-vl":
            patch += self.vision_hidden + self.position_embeddings * self.vision_hidden  # its bias; the table
        return patch + self.vision_depth * self.vision_block_params() + self.merger_params()

    def text_params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + head

    def params(self) -> int:
        return self.text_params() + self.vision_params()


# The released checkpoints' config.json (huggingface.co/Qwen/...): text and vision_config. Qwen2.5-VL-32B's vision
# intermediate size (3456, not the 3B/7B's 3420) gives its published total, 33,452,718,336 parameters.
SHAPES: dict[str, ModelShape] = {
    "qwen2.5-vl-3b": ModelShape(vocab=151936, hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008,
                                tied=True, vision_hidden=1280, vision_depth=32, vision_intermediate=3420,
                                vision_heads=16, source="Qwen/Qwen2.5-VL-3B-Instruct config.json"),
    "qwen2.5-vl-7b": ModelShape(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944,
                                tied=False, vision_hidden=1280, vision_depth=32, vision_intermediate=3420,
                                vision_heads=16, source="Qwen/Qwen2.5-VL-7B-Instruct config.json"),
    "qwen2.5-vl-32b": ModelShape(vocab=152064, hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648,
                                 tied=False, vision_hidden=1280, vision_depth=32, vision_intermediate=3456,
                                 vision_heads=16, source="Qwen/Qwen2.5-VL-32B-Instruct config.json"),
    "qwen3-vl-4b": ModelShape(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, intermediate=9728,
                              tied=True, vision_hidden=1024, vision_depth=24, vision_intermediate=4096, vision_heads=16,
                              patch=16, layout="qwen3-vl", head_dim=128, position_embeddings=2304, deepstack=3,
                              source="Qwen/Qwen3-VL-4B-Instruct config.json"),
    "qwen3-vl-8b": ModelShape(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288,
                              tied=False, vision_hidden=1152, vision_depth=27, vision_intermediate=4304, vision_heads=16,
                              patch=16, layout="qwen3-vl", head_dim=128, position_embeddings=2304, deepstack=3,
                              source="Qwen/Qwen3-VL-8B-Instruct config.json"),
}  # fmt: skip


def shape_from_config_json(path: str | Path) -> ModelShape:
    """The shape of an HF Qwen-VL checkpoint dir (or its config.json).

    Raises:
        ValueError: no readable config.json, or one without the text/vision sizes.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    text, vision = cfg.get("text_config") or cfg, cfg.get("vision_config") or {}
    qwen3 = "deepstack_visual_indexes" in vision
    try:
        vision_hidden = vision.get("embed_dim") or vision["hidden_size"]  # Qwen2-VL names it embed_dim
        return ModelShape(
            vocab=text["vocab_size"], hidden=text["hidden_size"], layers=text["num_hidden_layers"],
            heads=text["num_attention_heads"], kv_heads=text.get("num_key_value_heads", text["num_attention_heads"]),
            intermediate=text["intermediate_size"],
            tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            vision_hidden=vision_hidden, vision_depth=vision["depth"],
            vision_intermediate=vision.get("intermediate_size") or vision_hidden * vision.get("mlp_ratio", 4),
            vision_heads=vision["num_heads"], patch=vision.get("patch_size", 14),
            temporal_patch=vision.get("temporal_patch_size", 2), merge=vision.get("spatial_merge_size", 2),
            source=str(file), layout="qwen3-vl" if qwen3 else "qwen2.5-vl",
            head_dim=text.get("head_dim", 0) if qwen3 else 0,
            position_embeddings=vision.get("num_position_embeddings", 0) if qwen3 else 0,
            deepstack=len(vision.get("deepstack_visual_indexes") or []),
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(f"{file} has no {e.args[0]!r}: not a Qwen-VL config") from None


@dataclass(frozen=True)
class Setup:
    """How the model is trained, from a config (``vagent memory`` builds it)."""

    stage: Literal["sft", "grpo", "dpo"]
    world_size: int = 1
    sharding: Sharding = "ddp"
    bf16: bool = True
    device: Literal["cuda", "cpu"] = "cuda"
    gradient_checkpointing: bool = True
    freeze_vision: bool = False
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    micro_batch: int = 1  # sequences per forward (DPO: 2 per pair, the chosen and the rejected)
    seq_len: int = 4096  # tokens per sequence at the config's limit (images included)
    images: int = 1  # images per sequence (their patches run through the vision tower)
    image_tokens: int = 256  # language-model tokens per image (patches / merge^2)
    trained_fraction: float = 0.5  # share of a sequence's tokens the loss reads (answers; GRPO: sampled)
    lm_head_chunk: int = 1024  # 0 = whole logits
    # how the loss's reference log-probs are made (GRPO with kl_coef > 0, DPO): a frozen copy beside the policy, the
    # policy with its LoRA adapters disabled, or (DPO's precompute_ref) once before training; None: no reference
    reference: Literal["copy", "adapters", "precomputed"] | None = None
    rollout_batch: int = 0  # GRPO: sequences generated at once
    rollout_len: int = 0  # GRPO: tokens per generated sequence (prompt + all turns)
    kv_cache_gb: float | None = None  # GRPO: the rollout's KV storage sized once (rollout.kv_cache_gb)
    engine: Literal["hf", "vllm"] = "hf"  # GRPO: what generates (rollout.backend)
    engine_sleeps: bool = True  # GRPO on vLLM: the engine frees its weights and KV cache for the update (rollout.sleep)
    engine_tp: int = 1  # GRPO on vLLM: ranks one engine is sharded over (rollout.tensor_parallel_size)
    group_size: int = 1  # GRPO: samples per prompt (they share the prompt image's patches)
    episodes: int = 0  # GRPO: episodes a step holds at most on a rank (their images are on the host until its end)
    prompt_pixels: int = 0  # GRPO: pixels of a prompt image as given (the messages keep it); 0 = at the model's size
    # GRPO: episodes whose messages (with their RGB images) a step keeps for its rollout export: every rollout round's,
    # dropped groups' too, whose patches are gone; 0 = ``episodes``
    seen_episodes: int = 0


@dataclass
class MemoryPlan:
    """Bytes per rank by component; ``peak`` is the larger of the update and (GRPO) the rollout phase, on the device.
    ``host`` is GRPO's host memory (CPU RAM) for the step's episodes, not in ``peak``."""

    lines: list[tuple[str, float, str]] = field(default_factory=list)  # (what, bytes, how)
    state: float = 0.0
    update: float = 0.0
    rollout: float = 0.0
    host_lines: list[tuple[str, float, str]] = field(default_factory=list)
    host: float = 0.0

    @property
    def peak(self) -> float:
        return self.state + max(self.update, self.rollout)

    def render(self) -> str:
        width = max(len(name) for name, _, _ in self.lines + self.host_lines)
        out = [f"  {name:<{width}}  {value / GiB:8.2f} GiB  {how}" for name, value, how in self.lines]
        if self.host_lines:
            out += ["host memory (CPU RAM, not in the peak):"]
            out += [f"  {name:<{width}}  {value / GiB:8.2f} GiB  {how}" for name, value, how in self.host_lines]
            out += [f"host per rank: {self.host / GiB:.2f} GiB"]
        return "\n".join([*out, f"peak per rank: {self.peak / GiB:.2f} GiB"])


def _lora_params(shape: ModelShape, setup: Setup) -> int:
    h, q, kv, i, r = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, setup.lora_rank
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    return shape.layers * sum(r * (a + b) for name, (a, b) in sizes.items() if name in setup.lora_targets)


def _state(shape: ModelShape, s: Setup, p: MemoryPlan) -> tuple[int, int]:
    """Weights, gradients, optimizer; returns (all parameters, trainable parameters)."""
    n, total = s.world_size, shape.params()
    if s.lora_rank:
        adapters = _lora_params(shape, s)
        total, trainable = total + adapters, adapters
    else:
        tower = shape.vision_params() - shape.merger_params()  # freeze_vision leaves the merger training
        trainable = total - (tower if s.freeze_vision else 0)
    if s.sharding == "ddp" and s.lora_rank and s.bf16:  # the frozen base loads in bf16, the adapters train in fp32
        weights = 2 * (total - trainable) + 4 * trainable + 2 * trainable  # + autocast's bf16 copy of the adapters
        grads = 4 * trainable + (4 * trainable if n > 1 else 0)
        how = "bf16 frozen base + fp32 adapters + their bf16 autocast copies"
    elif s.sharding == "ddp":
        weights = 4 * total + (2 * trainable if s.bf16 else 0)  # autocast caches a bf16 copy of trained weights
        grads = 4 * trainable + (4 * trainable if n > 1 else 0)  # DDP's reduce buckets hold a second copy
        how = "fp32 masters" + (" + bf16 autocast copies" if s.bf16 else "")
    elif s.sharding == "fsdp" and s.lora_rank:  # the frozen base sharded in its load dtype, the adapters fp32
        base = 2 if s.bf16 else 4
        weights, grads = (base * (total - trainable) + 4 * trainable) / n, 4 * trainable / n
        how = f"{'bf16' if s.bf16 else 'fp32'} frozen base + fp32 adapters, shards (1/{n})"
    elif s.sharding == "fsdp":
        weights, grads, how = 4 * total / n, 4 * trainable / n, f"fp32 shards (1/{n})"
    elif s.sharding == "zero2":
        weights = 2 * total + 4 * trainable / n
        grads = 4 * trainable / n + 2 * min(trainable, 5e8)  # + reduce bucket (5e8 elements, bf16)
        how = f"bf16 whole + fp32 masters (1/{n})"
    else:  # zero3
        weights, grads, how = 2 * total / n + 4 * trainable / n, 4 * trainable / n, f"bf16 + fp32 masters (1/{n})"
    optim = 8 * trainable / (1 if s.sharding == "ddp" else n)
    p.lines += [("parameters", weights, f"{total / 1e9:.3f}B params, {how}"),
                ("gradients", grads, f"{trainable / 1e9:.3f}B trainable, fp32"
                 + (f" (1/{n})" if s.sharding != "ddp" else "")),
                ("optimizer states", optim, "AdamW: 2 fp32 moments per trainable param"
                 + (f" (1/{n})" if s.sharding != "ddp" else ""))]  # fmt: skip
    p.state += weights + grads + optim
    _reference(shape, s, total, p)
    if s.sharding in ("fsdp", "zero3"):
        root = _root_params(shape)
        unit = max(shape.layer_params(), shape.vision_block_params())
        # bf16 gathers, fp32 unsharded grads of one unit (with LoRA: one layer's adapters)
        unit_grads = trainable / shape.layers if s.lora_rank else min(trainable, root + unit)
        gathered = 2 * (root + 2 * unit) + 4 * unit_grads
        p.lines.append(("gathered units", gathered, "bf16 root + 2 layers, fp32 grads of one unit before reduce"))
        p.update += gathered
    return total, trainable


def _root_params(shape: ModelShape) -> int:
    """The root FSDP unit: embeddings, head, patch embedding and merger (every decoder layer and vision block is a
    unit of its own)."""
    return (
        shape.vocab * shape.hidden * (1 if shape.tied else 2)
        + shape.vision_params()
        - (shape.vision_depth * shape.vision_block_params())
    )


def _reference(shape: ModelShape, s: Setup, total: int, p: MemoryPlan) -> None:
    """The frozen reference of GRPO's KL term and of DPO, as the recipes hold it (see the module docstring)."""
    if s.reference is None:
        return
    what = "the KL term's reference" if s.stage == "grpo" else "DPO's reference"
    if s.reference == "adapters":
        ref, how = 0.0, f"none resident: {what} is the policy with its adapters disabled"
    elif s.reference == "precomputed":
        ref, how = 0.0, "none resident: scored once before training (dpo.precompute_ref), 2 floats per pair on the host"
    elif s.sharding == "fsdp":
        n, root = s.world_size, _root_params(shape)
        ref = 4 * total / n + (2 if s.bf16 else 4) * root
        how = (f"{what}: a frozen copy in fp32 shards (1/{n}) + its {'bf16' if s.bf16 else 'fp32'} root unit "
               f"({root / 1e9:.3f}B), left gathered after its forward")  # fmt: skip
    else:
        ref, how = 4 * total, f"{what}: a frozen fp32 copy, whole on every rank"
    p.lines.append(("reference model", ref, how))
    p.state += ref


def _activations(shape: ModelShape, s: Setup, p: MemoryPlan) -> None:
    a = 2 if s.bf16 else 4
    tokens = s.micro_batch * s.seq_len
    h, kv, i = shape.hidden, shape.kv_dim, shape.intermediate
    per_layer_token = (12 * h + 4 * kv + 4 * i) * a
    attention = 0.0
    if s.device == "cpu":  # the masked SDPA math kernel keeps its softmax output for backward
        attention = s.micro_batch * shape.heads * s.seq_len**2 * 4
    full = shape.layers * (per_layer_token * tokens + attention)
    if s.gradient_checkpointing:
        kept = shape.layers * h * tokens * a + per_layer_token * tokens + attention  # inputs + 1 recomputed layer
        how = f"checkpointed: layer inputs + 1 layer recomputed (without: {full / GiB:.2f} GiB)"
    else:
        kept = full
        ckpt = shape.layers * h * tokens * a + per_layer_token * tokens + attention
        how = f"{shape.layers} layers kept (with gradient checkpointing: {ckpt / GiB:.2f} GiB)"
    rows = f"{s.micro_batch} x {s.seq_len} tokens"
    if s.stage == "dpo":
        pairs = s.micro_batch // 2
        rows += f" ({pairs} pair{'s' if pairs > 1 else ''}: chosen and rejected)"
    p.lines.append(("activations", kept, f"{rows}, {how}"))
    p.update += kept
    if s.images and not s.freeze_vision:  # a frozen tower gets no gradient: nothing of it is kept
        patches = s.micro_batch * s.images * s.image_tokens * shape.merge**2
        v, vi = shape.vision_hidden, shape.vision_intermediate
        per_block = (12 * v + 4 * vi) * a * patches
        kept = (shape.vision_depth * v * patches * a + per_block) if s.gradient_checkpointing else (
            shape.vision_depth * per_block)  # fmt: skip
        p.lines.append(("vision activations", kept, f"{patches:,} patches"))
        p.update += kept
    # the loss's tokens: their fp32 logits, softmax and gradient, whole or one chunk at a time
    rows = int(s.micro_batch * s.seq_len * s.trained_fraction)
    width = min(s.lm_head_chunk, rows) if s.lm_head_chunk else rows
    # log-softmax output + its gradient + gather's gradient (fp32), the compute-dtype logits under bf16, and the
    # head weight's gradient of one chunk before autograd adds it to the others
    head = width * shape.vocab * (3 * 4 + (a if s.bf16 else 0)) + shape.vocab * shape.hidden * (
        4 + (a if s.bf16 else 0)
    )
    how = f"chunks of {width:,} positions" if s.lm_head_chunk else f"whole logits of {rows:,} positions"
    p.lines.append(("LM head / log-prob buffers", head, f"{how} x {shape.vocab:,} rows (log-softmax, 2 gradients)"))
    p.update += head


def _rollout(shape: ModelShape, s: Setup, total: int, p: MemoryPlan) -> None:
    a = 2 if s.bf16 else 4
    # sized once from rollout.kv_cache_gb, the KV storage is kept for the whole run (through every update):
    # resident, like the weights; grown on demand, it reaches the rollout batch at full length and is freed before
    # the update
    row = 2 * shape.layers * shape.kv_dim * a * s.rollout_len
    logits = s.rollout_batch * shape.vocab * 4 * 2  # last position's logits and the sampler's softmax
    if s.engine == "vllm":
        # the engine holds its own weights (bf16), whatever the sharding (under DDP too: it does not read the trained
        # model) and its KV cache, sized once; sleeping, it frees both while the update runs. Sharded over a TP group,
        # a rank holds 1/N of the weights and of each of the group's N x rollout_batch sequences' KV heads (one whole
        # head at the least: beyond N = kv_heads vLLM replicates them), and samples all N x rollout_batch rows
        tp = s.engine_tp
        engine = 2 * total // tp
        kv = s.kv_cache_gb * GiB if s.kv_cache_gb else row * s.rollout_batch * max(1, tp // shape.kv_heads)
        logits *= tp
        when = "freed during the update (rollout.sleep)" if s.engine_sleeps else "resident"
        shard = f", 1/{s.engine_tp} per rank" if s.engine_tp > 1 else ""
        p.lines.append((f"vLLM engine weights (bf16{shard})", engine, when))
        sized = f"rollout.kv_cache_gb={s.kv_cache_gb:g}" if s.kv_cache_gb else f"{s.rollout_batch} sequences"
        if tp > 1 and not s.kv_cache_gb:
            sized = f"1/{tp} of the heads of {tp} x {s.rollout_batch} sequences"
        p.lines.append(("vLLM KV cache", kv, f"{sized} x {s.rollout_len} tokens; {when}"))
        if s.engine_sleeps:
            p.rollout = engine + kv + logits
        else:
            p.state += engine + kv
            p.rollout = logits
        return
    if s.kv_cache_gb:
        kv = s.kv_cache_gb * GiB
        p.lines.append(("rollout KV cache (kept across steps)", kv, f"rollout.kv_cache_gb={s.kv_cache_gb:g}: "
                        f"{int(min(kv // row, s.rollout_batch))} rows"))  # fmt: skip
        p.state += kv
    else:
        kv = row * s.rollout_batch
        p.lines.append(("rollout KV cache", kv, f"{s.rollout_batch} sequences x {s.rollout_len} tokens"))
    gathered = 0.0
    if s.sharding in ("fsdp", "zero3"):
        gathered = 2 * total  # generation reads whole weights: a bf16 copy, refreshed in place and kept resident
        p.lines.append(("rollout whole-weights copy (resident)", gathered, "bf16 copy for generation"))
        p.state += gathered
    p.rollout = logits + (0 if s.kv_cache_gb else kv)


def image_bytes(shape: ModelShape, image_tokens: int) -> tuple[int, int]:
    """(fp32 patch bytes, uint8 RGB bytes) of one image of ``image_tokens`` language-model tokens at the model's size.

    >>> image_bytes(SHAPES["qwen2.5-vl-7b"], 972)  # a 1000x750 picture: 1008x756 px, 3,888 patches of 1,176 values
    (18289152, 2286144)
    """
    patches = image_tokens * shape.merge**2
    return patches * 3 * shape.temporal_patch * shape.patch**2 * 4, patches * shape.patch**2 * 3


def _host(shape: ModelShape, s: Setup, p: MemoryPlan) -> None:
    """GRPO's host memory: every image of the step's episodes once (a prompt image once per group, with its
    original), the RGB images of every episode the step rolled out (the export's), then one micro-batch's patches
    as ``collate`` concatenates them."""
    patches, rgb = image_bytes(shape, s.image_tokens)
    seen = s.seen_episodes or s.episodes
    groups, seen_groups, tools = s.episodes / s.group_size, seen / s.group_size, max(s.images - 1, 0)
    original = 3 * s.prompt_pixels if s.prompt_pixels else rgb
    given = f"of {s.prompt_pixels:,} px" if s.prompt_pixels else "at the model's size (--prompt-size W H: as given)"
    p.host_lines.append(("prompt images", groups * patches + seen_groups * original, f"{groups:g} groups x "
                         f"{patches / 2**20:.1f} MiB fp32 patches + {seen_groups:g} x {original / 2**20:.2f} MiB RGB "
                         f"original {given}"))  # fmt: skip
    p.host_lines.append(("tool images", tools * (s.episodes * patches + seen * rgb), f"{tools} per episode: "
                         f"{s.episodes} x {patches / 2**20:.1f} MiB fp32 patches + {seen} x {rgb / 2**20:.2f} MiB "
                         f"RGB view"))  # fmt: skip
    batch = s.micro_batch * s.images * patches
    p.host_lines.append(("micro-batch patches", batch, f"collate's copy: {s.micro_batch} x {s.images} images"))
    p.host += sum(value for _, value, _ in p.host_lines)


def plan(shape: ModelShape, setup: Setup) -> MemoryPlan:
    """The per-rank memory of ``setup`` on ``shape`` (see the module docstring for what is counted)."""
    if setup.world_size < 1 or setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("world_size, micro_batch and seq_len must be positive")
    if setup.stage == "dpo" and setup.micro_batch % 2:
        raise ValueError(f"a DPO micro-batch is 2 sequences per pair, got micro_batch {setup.micro_batch}")
    p = MemoryPlan()
    total, _ = _state(shape, setup, p)
    _activations(shape, setup, p)
    if setup.stage == "grpo":
        _rollout(shape, setup, total, p)
        _host(shape, setup, p)
    return p


def fits(p: MemoryPlan, gpu_gib: float) -> bool:
    return p.peak <= gpu_gib * GiB and math.isfinite(p.peak)

"""``vagent memory``: the per-rank memory plan of an SFT, GRPO or DPO config, before anything is loaded.

    vagent memory --config configs/grpo/qwen2_5_vl_7b.yaml --world-size 8 [--gpu-memory 80] [key=value ...]

Reads the config (``key=value`` overrides as in the recipes), the model's shape from ``model.path``'s config.json,
``--shape NAME`` (``vagent.training.memory.SHAPES``: the released 3B/7B shapes, the tiny presets), or, for a
config that builds its tiny model, that preset; and prints ``vagent.training.memory.plan``, whose last line is
``peak per rank: X GiB``. With ``--gpu-memory`` a plan that does not fit exits 2 with one line saying by how much.
The sharding is ``--sharding``, else ``train.sharding`` where the config has it, else ZeRO-2/3 from
``train.deepspeed``'s file name, else DDP (GRPO and DPO do not train under DeepSpeed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vagent.config import CONFIGS, ConfigError, DPOConfig, GRPOConfig, SFTConfig, load_config
from vagent.tiny_model import PRESETS, QWEN_VOCAB_ROWS
from vagent.training.memory import SHAPES, GiB, ModelShape, Setup, plan, shape_from_config_json

STAGES = ("sft", "grpo", "dpo")

__all__ = ["STAGES", "build_parser", "main", "model_shape", "named_shapes", "setup_from_config", "tiny_shape"]


def tiny_shape(size: str, vocab: int = QWEN_VOCAB_ROWS) -> ModelShape:
    """A ``vagent.tiny_model`` preset with Qwen's vocabulary (``make-tiny-model --vocab qwen --size SIZE``)."""
    p = PRESETS[size]
    return ModelShape(vocab=vocab, hidden=p.hidden, layers=p.layers, heads=p.heads, kv_heads=p.kv_heads,
                      intermediate=p.intermediate, tied=False, vision_hidden=p.vision_hidden,
                      vision_depth=p.vision_depth, vision_intermediate=2 * p.vision_hidden,
                      vision_heads=p.vision_heads, source=f"vagent.tiny_model preset {size!r}, {vocab:,} rows")  # fmt: skip


def named_shapes() -> dict[str, ModelShape]:
    """``--shape`` names: the released 3B/7B shapes and the tiny presets on Qwen's vocabulary."""
    return {**SHAPES, **{size: tiny_shape(size) for size in ("nano", "tiny", "small")}}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="vagent memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="An SFT, GRPO or DPO YAML (configs/sft/, grpo/, dpo/).")
    p.add_argument("--stage", choices=STAGES, help="Default: the config's folder name.")
    p.add_argument("--world-size", type=int, default=1, help="Ranks (GPUs) the run uses.")
    p.add_argument("--gpu-memory", type=float, help="GiB per GPU: exit 2 when the plan does not fit.")
    p.add_argument("--sharding", choices=["ddp", "fsdp", "zero2", "zero3"], help="Overrides the config's.")
    p.add_argument("--shape", choices=sorted(named_shapes()), help="A named shape instead of model.path's config.json.")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: fp32 unless train.precision=bf16, and attention keeps T x T probabilities.")  # fmt: skip
    p.add_argument(
        "--images", type=int, help="Images per sequence (default: 1 for SFT and DPO, rollout.max_images GRPO)."
    )
    p.add_argument("--image-tokens", type=int, help="Language-model tokens per image (default: model.max_pixels / 784, "
                   "for GRPO at most rollout.max_total_tokens / images / 2). A 1000x750 picture at Qwen2.5-VL's "
                   "default pixel budget is 972.")  # fmt: skip
    p.add_argument("--prompt-size", type=int, nargs=2, metavar=("W", "H"),
                   help="GRPO: a prompt image's size as given (the episodes keep its original for the export and the "
                   "tools). Default: at the model's size.")  # fmt: skip
    p.add_argument("--trained-fraction", type=float, default=0.5,
                   help="Share of a sequence's tokens the loss reads (gold answers, sampled tokens).")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value overrides of the config.")
    return p


def model_shape(cfg: Any, shape: str | None) -> ModelShape:
    """``--shape``, else ``model.path``'s config.json.

    Raises:
        ConfigError: model.path has no config.json (and no ``--shape`` was given).
    """
    if shape:
        return named_shapes()[shape]
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ConfigError(f"model.path {cfg.model.path} has no config.json: pass --shape "
                              f"({', '.join(sorted(named_shapes()))}) to plan without the checkpoint")  # fmt: skip
        try:
            return shape_from_config_json(cfg.model.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    raise ConfigError(f"no model to plan for: set model.path or pass --shape ({', '.join(sorted(named_shapes()))})")


def _sharding(cfg: Any, given: str | None) -> str:
    if given:
        return given
    configured = getattr(cfg.train, "sharding", "ddp")  # train.sharding: ddp | fsdp (DeepSpeed has its own key)
    if configured != "ddp":
        return configured
    if cfg.train.deepspeed:
        return "zero3" if "zero3" in Path(cfg.train.deepspeed).name else "zero2"
    return "ddp"


def setup_from_config(cfg: SFTConfig | GRPOConfig | DPOConfig, args: argparse.Namespace, stage: str) -> Setup:
    train = cfg.train
    bf16 = train.precision == "bf16" or (train.precision == "auto" and args.device == "cuda")
    common = dict(stage=stage, world_size=args.world_size, sharding=_sharding(cfg, args.sharding), bf16=bf16,
                  device=args.device, gradient_checkpointing=train.gradient_checkpointing,
                  freeze_vision=train.freeze_vision, lora_rank=train.lora.r if train.lora.enabled else 0,
                  lora_targets=tuple(train.lora.target_modules), trained_fraction=args.trained_fraction,
                  lm_head_chunk=train.lm_head_chunk)  # fmt: skip
    image_tokens = args.image_tokens or cfg.model.max_pixels // (28 * 28)
    lora = train.lora.enabled
    if stage in ("sft", "dpo"):
        images = 1 if args.images is None else args.images
        if stage == "sft":
            return Setup(**common, micro_batch=cfg.data.micro_batch_size, seq_len=cfg.data.max_length, images=images,
                         image_tokens=image_tokens)  # fmt: skip
        # B pairs are one forward over 2B sequences (collate_pairs: the chosen rows, then the rejected ones)
        reference = "precomputed" if cfg.dpo.precompute_ref else "adapters" if lora else "copy"
        return Setup(**common, micro_batch=2 * cfg.data.micro_batch_size, seq_len=cfg.data.max_length, images=images,
                     image_tokens=image_tokens, reference=reference)  # fmt: skip
    images = cfg.rollout.max_images if args.images is None else args.images
    tokens = args.image_tokens or min(image_tokens, cfg.rollout.max_total_tokens // max(images, 1) // 2)
    return Setup(**common, micro_batch=cfg.grpo.micro_batch_size, seq_len=cfg.rollout.max_total_tokens,
                 images=images, image_tokens=tokens,
                 reference=("adapters" if lora else "copy") if cfg.grpo.kl_coef > 0 else None,
                 rollout_batch=cfg.grpo.rollout_batch_size, rollout_len=cfg.rollout.max_total_tokens,
                 kv_cache_gb=cfg.rollout.kv_cache_gb, engine=cfg.rollout.backend, engine_sleeps=cfg.rollout.sleep,
                 engine_tp=cfg.rollout.tensor_parallel_size,
                 group_size=cfg.grpo.group_size,
                 episodes=_episodes(cfg.grpo), seen_episodes=_seen_episodes(cfg.grpo),
                 prompt_pixels=args.prompt_size[0] * args.prompt_size[1] if args.prompt_size else 0)  # fmt: skip


def _episodes(algo: Any) -> int:
    """Episodes one GRPO step holds at most on a rank: its groups, and while a dynamic-sampling refill round runs, the
    groups kept so far and that round's (at most a step's each: the recipe releases a rank's groups beyond its
    step's share after every round, as a rank whose groups are all informative keeps rolling out while the others
    refill)."""
    step = algo.prompts_per_step * algo.group_size
    return 2 * step if algo.dynamic_sampling and algo.max_refill_rounds else step


def _seen_episodes(algo: Any) -> int:
    """Episodes one GRPO step rolls out at most on a rank: a step's per round (a refill rolls out no more), the first
    and ``max_refill_rounds`` more; their messages stay until the step's rollout export, dropped groups' too."""
    step = algo.prompts_per_step * algo.group_size
    return (1 + algo.max_refill_rounds) * step if algo.dynamic_sampling else step


def run(args: argparse.Namespace) -> int:
    stage = args.stage or Path(args.config).parent.name
    if stage not in STAGES:
        raise ConfigError(f"cannot tell the stage of {args.config} from its folder: pass --stage sft, grpo or dpo")
    cfg = load_config(CONFIGS[stage], args.config, args.overrides)
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be positive, got {args.world_size}")
    if stage != "sft" and args.sharding in ("zero2", "zero3"):
        raise ConfigError(f"--sharding {args.sharding}: {stage.upper()} does not train under DeepSpeed (ddp or fsdp)")
    shape = model_shape(cfg, args.shape)
    setup = setup_from_config(cfg, args, stage)
    result = plan(shape, setup)
    print(f"{stage} memory plan per rank: {shape.source}; {setup.sharding} over {setup.world_size} rank(s), "
          f"{'bf16' if setup.bf16 else 'fp32'} on {setup.device}, "
          f"{'LoRA r=' + str(setup.lora_rank) if setup.lora_rank else 'full fine-tuning'}")  # fmt: skip
    print(result.render())
    if args.gpu_memory is not None and result.peak > args.gpu_memory * GiB:
        print(f"vagent memory: does not fit: peak {result.peak / GiB:.2f} GiB per rank > --gpu-memory "
              f"{args.gpu_memory:g} GiB", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except (ConfigError, ValueError) as e:
        print(f"vagent memory: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

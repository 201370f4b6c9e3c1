"""The ``vagent`` command. Only subcommands that work are listed; each is a thin shell over a recipe
or a library function, so ``vagent X --help`` is the reference for X."""

from __future__ import annotations

import argparse
import sys

from vagent.tiny_model import PRESETS, TINY_FAMILIES  # cheap: transformers is imported only when building

__all__ = ["main"]


def _make_tiny_model(args: argparse.Namespace) -> int:
    from vagent.config import TinyModelConfig, load_config
    from vagent.tiny_model import build_tiny_checkpoint

    overrides = [
        f"{k}={v}"
        for k, v in (("family", args.family), ("size", args.size), ("vocab_size", args.vocab_size), ("seed", args.seed))
        if v is not None
    ]
    cfg = load_config(TinyModelConfig, args.config, overrides)
    out = build_tiny_checkpoint(
        args.out,
        family=cfg.family,
        size=cfg.size,
        vocab_size=cfg.vocab_size,
        seed=cfg.seed,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
    )
    print(f"wrote a random {cfg.family} ({cfg.size}) checkpoint to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from vagent.media import load_image
    from vagent.model import load_policy

    policy = load_policy(args.model, device=args.device, dtype=args.dtype, attn_implementation=args.attn)
    images = [load_image(path) for path in args.image]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
    inputs = policy.prepare([{"role": "user", "content": content}], images)
    generation = policy.generate(inputs, max_new_tokens=args.max_new_tokens, temperature=args.temperature)[0]
    print(policy.tokenizer.decode(generation.token_ids, skip_special_tokens=True))
    print(
        f"[{len(generation.token_ids)} tokens, stop={generation.stop}, prompt {inputs['input_ids'].shape[1]} tokens]",
        file=sys.stderr,
    )
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from vagent.recipes import quickstart

    return quickstart.main((["--config", args.config] if args.config else []) + args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vagent", description="Train vision-language models to think with images.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="Build a random-weight Qwen-VL checkpoint dir with a fresh tokenizer.")
    p.add_argument("--out", required=True, help="Checkpoint dir to write.")
    p.add_argument("--config", help="YAML with TinyModelConfig fields (configs/tiny/).")
    p.add_argument("--family", choices=TINY_FAMILIES)
    p.add_argument("--size", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--min-pixels", type=int, default=28 * 28 * 4, help="Processor's minimum image size in pixels.")
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 256, help="Processor's maximum image size in pixels.")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("generate", help="Generate text for an image prompt with a checkpoint dir.")
    p.add_argument("--model", required=True, help="HF checkpoint dir (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).")
    p.add_argument("--image", action="append", default=[], help="Image path; repeat for several.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    p.add_argument("--device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])
    p.set_defaults(func=_generate)

    p = sub.add_parser("quickstart", help="The default job: tiny model, generated image, one multi-turn rollout.")
    p.add_argument("--config", help="YAML with QuickstartConfig fields (configs/quickstart/).")
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value overrides.")
    p.set_defaults(func=_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vagent.config import ConfigError
    from vagent.media import MediaError
    from vagent.model import PolicyLoadError

    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard "Loading weights" bars drown the trajectory print-out
    try:
        return args.func(args)
    except (ConfigError, PolicyLoadError, MediaError) as e:
        print(f"vagent {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""The training launcher: one entry for every stage, chosen by the config's directory.

    torchrun --nproc_per_node N tools/train.py --config configs/sft/<name>.yaml [key=value ...]
    python tools/train.py --config configs/sft/qwen2_5_vl_tiny_cpu.yaml          (one process)

configs/sft/* runs vagent.recipes.sft, configs/grpo/* vagent.recipes.grpo, configs/dpo/* vagent.recipes.dpo
(``--stage`` names the stage for a config kept elsewhere).
"""

import argparse
import sys
from pathlib import Path

from vagent.cli import main as cli_main

STAGES = {"sft": "sft", "grpo": "grpo", "dpo": "dpo"}  # configs/<dir>/ -> `vagent <command>`


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="configs/<stage>/<name>.yaml")
    parser.add_argument("--stage", choices=sorted(STAGES), help="default: the config's directory name")
    args, overrides = parser.parse_known_args(argv)
    stage = args.stage or Path(args.config).parent.name
    if stage not in STAGES:
        parser.error(f"cannot tell the stage of {args.config} (not under configs/<stage>/); pass --stage")
    return cli_main([STAGES[stage], "--config", args.config, *overrides])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

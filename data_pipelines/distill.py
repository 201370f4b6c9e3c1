"""Distillation by rejection sampling: roll a checkpoint out on rows, keep the trajectories whose reward passes
a threshold, and write them as SFT rows (real end-to-end trajectories make a stronger cold start than
stitched ones).

    python -m data_pipelines.distill --model CKPT --data rows.jsonl --out DIR --samples 4 \
        --rewards accuracy=1.0,format=0.2 --min-reward 1.0 [--tools crop,zoom_in] [--per-row 1]

For a judge (UnifiedReward-Think's rejection sampling), the rows are judgment rows and the reward ``judgment``:
``--rewards judgment=1.0 --min-reward 1.0 --tools none`` keeps the judge's own well-formed judgments that match
the labels.

Each kept trajectory becomes its row with ``messages`` = the assistant and tool turns as the policy saw
them (tool images saved as PNG under ``DIR/images``); the prompt is rebuilt by SFT from the row, as for
every gold trajectory. ``--per-row`` keeps at most that many trajectories per row (best reward first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from vagent.data import Row, load_rows, write_rows
from vagent.rewards import check_rewards, combine
from vagent.types import Trajectory

__all__ = ["add_rollout_arguments", "distill_rows", "reward_options", "roll_out", "trajectory_messages"]


def trajectory_messages(trajectory: Trajectory, image_dir: Path) -> list[dict]:
    """The assistant/tool turns of a trajectory as row ``messages`` (tool images written to ``image_dir``)."""
    image_dir.mkdir(parents=True, exist_ok=True)
    first = next(i for i, m in enumerate(trajectory.messages) if m.role == "assistant")
    out = []
    for message in trajectory.messages[first:]:
        parts = []
        for part in message.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            elif part.type == "image":
                path = part.path
                if part.image is not None:
                    digest = hashlib.blake2b(part.image.tobytes(), digest_size=8).hexdigest()
                    path = str(image_dir / f"{trajectory.task_id}-{digest}.png")
                    part.image.save(path)
                parts.append({"type": "image", "path": str(path)})
        if message.role == "assistant":  # the text the policy wrote, as one string
            out.append({"role": "assistant", "content": message.plain_text})
        else:
            out.append({"role": message.role, "content": parts})
    return out


def distill_rows(rows: list[Row], trajectories: list[Trajectory], rewards: list[float], n_samples: int, *,
                 min_reward: float, per_row: int, image_dir: Path) -> list[Row]:  # fmt: skip
    """Rows with the kept trajectories as gold ``messages`` (ids ``<row id>-d<k>``)."""
    out = []
    for i, row in enumerate(rows):
        group = list(zip(trajectories[i * n_samples : (i + 1) * n_samples],
                         rewards[i * n_samples : (i + 1) * n_samples], strict=True))  # fmt: skip
        kept = sorted((g for g in group if g[1] >= min_reward and g[0].stop_reason == "answered"), key=lambda g: -g[1])
        for k, (trajectory, reward) in enumerate(kept[:per_row]):
            out.append(Row(**{**row.__dict__, "id": f"{row.id}-d{k}", "source": f"distilled/{row.source}",
                              "messages": trajectory_messages(trajectory, image_dir),
                              "extra": {**row.extra, "distill_reward": reward}}))  # fmt: skip
    return out


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a checkpoint rolled out on rows (shared with ``data_pipelines.hard_rows``)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rewards", default="accuracy=1.0", help="name=weight,... from vagent.rewards.REWARDS")
    parser.add_argument("--reward-options", default="", help="Keyword arguments of the rewards, name.key=value,... "
                        "(as rewards.options), e.g. judgment.format_weight=0 to score a judge's verdicts alone.")  # fmt: skip
    parser.add_argument("--tools", default=None, help="Comma-separated tools offered to every row, replacing a row's own "
                        "list (a note says how many), as vagent rollout/eval --tools do; 'none' for none. Default: "
                        "each row's own list, else crop.")  # fmt: skip
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=8, help="Rows rolled out together.")
    parser.add_argument("--seed", type=int, default=0)


def reward_options(text: str) -> dict[str, dict[str, Any]]:
    """``--reward-options`` as ``combine``'s options: ``"judgment.format_weight=0,x.k=v"`` -> ``{"judgment":
    {"format_weight": 0}, "x": {"k": "v"}}`` (a value is read as JSON when it is JSON, else kept as a string). Items
    are split at the commas outside brackets and quotes, so a JSON list or object keeps its own.

    >>> reward_options("judgment.format_weight=0,judgment.tolerance=0.5")
    {'judgment': {'format_weight': 0, 'tolerance': 0.5}}
    >>> reward_options('x.labels=["A", "B"],x.k=v')
    {'x': {'labels': ['A', 'B'], 'k': 'v'}}
    """
    options: dict[str, dict[str, Any]] = {}
    for item in filter(None, (part.strip() for part in _top_level_items(text))):
        name, dot, rest = item.partition(".")
        key, eq, value = rest.partition("=")
        if not (name and dot and key and eq):
            raise SystemExit(f"--reward-options: {item!r} is not name.key=value")
        try:
            options.setdefault(name, {})[key] = json.loads(value)
        except json.JSONDecodeError:
            options.setdefault(name, {})[key] = value
    return options


def _top_level_items(text: str) -> list[str]:
    """``text`` split at its commas outside ``[]``, ``{}`` and double quotes."""
    items, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "[{":
            depth += 1
        elif not quoted and char in "]}":
            depth -= 1
        elif not quoted and depth == 0 and char == ",":
            items.append(text[start:i])
            start = i + 1
        if depth < 0:
            raise SystemExit(f"--reward-options: a closing bracket with no opening one at {text[: i + 1]!r}")
    if depth or quoted:
        raise SystemExit(f"--reward-options: {'a quote' if quoted else 'a bracket'} is never closed in {text!r}")
    return [*items, text[start:]]


def roll_out(args: argparse.Namespace) -> tuple[list[Row], list[Trajectory], list[float]]:
    """Load the rows and the checkpoint, roll out ``--samples`` per row, score them with ``--rewards``:
    (rows, trajectories row by row, total rewards)."""
    import torch

    from vagent.model import load_policy
    from vagent.rollout import RolloutLimits, Task, run
    from vagent.toolbox import TOOLS

    weights = {k: float(v) for k, v in (item.split("=") for item in args.rewards.split(","))}
    options = reward_options(args.reward_options)  # checked before the model loads: a typo fails at once
    unweighted = sorted(set(options) - set(weights))
    if unweighted:  # combine reads the options of weighted rewards only: a misspelt name would be ignored
        raise SystemExit(f"--reward-options names {unweighted}, not in --rewards {sorted(weights)}")
    try:
        check_rewards(weights, options)
    except (KeyError, TypeError) as e:
        raise SystemExit(f"--rewards/--reward-options: {e.args[0]}") from None
    rows = load_rows(args.data, known_tools=TOOLS)
    tools = None if args.tools is None else [] if args.tools == "none" else args.tools.split(",")
    tasks = [Task.from_row(r, ["crop"] if tools is None else tools) for r in rows]
    if tools is not None:  # the flag wins over the rows' own lists, as vagent rollout's and eval's --tools
        if overridden := sum(1 for r in rows if r.tools is not None and list(r.tools) != tools):
            print(f"note: --tools {args.tools} replaces the tools of {overridden} of {len(rows)} rows", file=sys.stderr)
        for task in tasks:
            task.tools = list(tools)
    policy = load_policy(args.model)
    torch.manual_seed(args.seed)
    limits = RolloutLimits(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    trajectories = run(policy, tasks, args.samples, limits, batch_size=args.batch_size)
    per_sample = [row for row in rows for _ in range(args.samples)]
    totals, _ = combine(trajectories, per_sample, weights, options)
    return rows, trajectories, totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    add_rollout_arguments(parser)
    parser.add_argument("--out", required=True)
    parser.add_argument("--min-reward", type=float, default=1.0)
    parser.add_argument("--per-row", type=int, default=1)
    args = parser.parse_args(argv)

    rows, trajectories, totals = roll_out(args)
    out = Path(args.out)
    kept = distill_rows(rows, trajectories, totals, args.samples, min_reward=args.min_reward, per_row=args.per_row,
                        image_dir=out / "images")  # fmt: skip
    if not kept:
        raise SystemExit(f"no trajectory reached reward {args.min_reward} ({len(trajectories)} rolled out): nothing "
                         "to write")  # fmt: skip
    path = write_rows(kept, out / "rows.jsonl")
    print(f"kept {len(kept)} of {len(trajectories)} trajectories (reward >= {args.min_reward}) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

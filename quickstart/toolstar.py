"""Tool-Star's reward, plain and with self-critic, on the search-and-code task (the tools proof's last stage).

Two GRPO runs from the tools proof's SFT policy, on its train prompts, with its seed, steps and every other setting:
the reward is Tool-Star's hierarchical one alone (``vagent.rewards.tool_star``: -1 for a format violation, 0 for a
wrong answer, else the F1 plus 0.1 when the episode used two kinds of tool), once plain and once with
``grpo.self_critic`` (Tool-Star's self-critic DPO on each step's own groups). Each run's last step is evaluated
greedily on the test rows: the comparison is of the two trainings, so no val step is picked. There is no target on
which one wins; the report states what was measured, with 95% intervals, beside the SFT start.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from quickstart.run import Proof, _evaluate, grpo_config
from vagent.config import check_config
from vagent.eval.runner import read_samples, well_formed_share
from vagent.recipes import grpo
from vagent.training.metrics import read_metrics

# The runs' names (their eval dirs are these with spaces as dashes), and whether each adds the self-critic.
VARIANTS = {"grpo tool-star": False, "grpo tool-star + self-critic": True}
REWARDS = {"tool_star": 1.0}
Z = 1.96


def toolstar_runs(cfg: Any, out: Path, sft_model: Path, data: dict[str, Path], proof: Proof,
                  evaluation: Any) -> dict[str, tuple[Path, dict[str, Any]]]:  # fmt: skip
    """Train both variants from ``sft_model`` (``cfg.toolstar_steps`` steps each) and evaluate each greedily on the
    test rows: {name: (its eval dir, its metrics)}."""
    results: dict[str, tuple[Path, dict[str, Any]]] = {}
    if not cfg.toolstar_steps:
        return results
    for name, critic in VARIANTS.items():
        config = grpo_config(cfg, out, sft_model, data, dataclasses.replace(proof, rewards=REWARDS))
        config.out_dir = str(out / _slug(name))
        config.train.max_steps = cfg.toolstar_steps
        config.val.keep_best = False  # the last step: what the training did, not which step a selection picked
        config.grpo.self_critic.enabled = critic
        print(f"\n{name}: {cfg.toolstar_steps} GRPO steps from the SFT policy, reward tool_star", flush=True)
        model = grpo.train(check_config(config))
        results[name] = _evaluate(name, model, list(proof.tools), evaluation)
    return results


def _slug(name: str) -> str:
    return name.replace(" + ", "-").replace(" ", "-")


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its normal-approximation 95% interval."""
    n = len(values)
    if not n:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, mean - Z * sd / math.sqrt(n), mean + Z * sd / math.sqrt(n)


def _kinds(sample: dict[str, Any]) -> int:
    """How many kinds of tool an episode called."""
    return len(set(sample["tool_calls"]))


def toolstar_section(out: Path, results: dict[str, tuple[Path, dict[str, Any]]], start: str, steps: int) -> list[str]:
    """The report's Tool-Star section: each variant and its SFT start ``start`` on the test rows (F1 with its 95%
    interval, the paired change from the start with its interval, EM, calls, episodes with two kinds of tool,
    Tool-Star's format violations) and each variant's training (reward, and the self-critic's pairs)."""
    names = [start, *(n for n in VARIANTS if n in results)]
    if len(names) == 1:
        return []
    samples = {name: read_samples(results[name][0] / "samples.jsonl") for name in names}
    base = {s["id"]: s["f1"] for s in samples[start]}
    lines = [
        "## Tool-Star's reward, plain and with self-critic (no target)",
        "",
        f"Both from `{start}`, {steps} GRPO steps each, same seed and prompts, with Tool-Star's reward alone (format "
        "violation -1, wrong 0, else F1 + 0.1 with two kinds of tool); each run's last step, greedy on the test rows. "
        "Intervals are 95% (normal approximation; the change is paired by row).",
        "",
        "| policy | F1 [95% CI] | change from SFT, points [95% CI] | EM | tool calls / episode | episodes with 2+ "
        "kinds of tool | Tool-Star format violations |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name in names:
        rows = samples[name]
        f1, low, high = mean_interval([s["f1"] for s in rows])
        change = "-"
        if name != start:
            delta, d_low, d_high = mean_interval([s["f1"] - base[s["id"]] for s in rows])
            change = f"{delta * 100:+.1f} [{d_low * 100:+.1f}, {d_high * 100:+.1f}]"
        calls = sum(len(s["tool_calls"]) for s in rows) / len(rows)
        several = sum(_kinds(s) > 1 for s in rows) / len(rows)
        lines.append(f"| {name} | {f1:.3f} [{low:.3f}, {high:.3f}] | {change} | {_mean(rows, 'em'):.3f} | {calls:.2f} "
                     f"| {several:.1%} | {1 - well_formed_share(rows):.1%} |")  # fmt: skip
    trained = [n for n in VARIANTS if n in results]
    lines += ["", *_training(out, trained), "", "![Tool-Star runs](toolstar.png)" if _plot(out, trained) else "", ""]
    return lines


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(s[key] for s in rows) / len(rows) if rows else 0.0


def _training(out: Path, names: list[str]) -> list[str]:
    """Per variant: its mean reward over the first and the last three steps, and (self-critic) its pairs and how
    often the chosen side gained on the rejected."""
    lines = []
    for name in names:
        records = [r for r in read_metrics(out / _slug(name) / "metrics.jsonl") if "reward" in r]
        if not records:
            continue
        first, last = (sum(r["reward"] for r in part) / len(part) for part in (records[:3], records[-3:]))
        line = f"- {name}: mean Tool-Star reward {first:+.3f} over its first 3 steps, {last:+.3f} over its last 3"
        critic = [r for r in records if "dpo/accuracy" in r]
        if critic:
            pairs = sum(r.get("dpo/pairs", 0) for r in critic)
            gained = sum(r["dpo/accuracy"] for r in critic) / len(critic)
            line += f"; self-critic on {len(critic)} steps ({pairs:g} pairs), chosen side ahead on {gained:.0%}"
        lines.append(line + ".")
    return lines


def _plot(out: Path, names: list[str]) -> bool:
    """toolstar.png: each variant's mean Tool-Star reward and tool calls per episode by step; False with no steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: [r for r in read_metrics(out / _slug(name) / "metrics.jsonl") if "reward" in r] for name in names}
    if not any(runs.values()):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["reward"] for r in records], marker=".", label=name)
        axes[1].plot(steps, [r.get("tool_calls_per_traj", 0.0) for r in records], marker=".", label=name)
    for ax, title in zip(axes, ("mean Tool-Star reward", "tool calls per episode"), strict=True):
        ax.set_xlabel("GRPO step")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "toolstar.png", dpi=110)
    plt.close(fig)
    return True

"""Tool-Star's reward, plain and with self-critic, on the search-and-code task (the tools proof's last stage).

Two GRPO runs from the tools proof's SFT policy, on its GRPO prompts, with its seed, steps and every other setting:
the reward is Tool-Star's hierarchical one alone (``vagent.rewards.tool_star``: -1 for a format violation, 0 for a
wrong answer, else the F1 plus 0.1 when the episode used two kinds of tool), once plain and once with
``grpo.self_critic`` (a DPO term inside each GRPO update on the step's own groups: Tool-Star's pair rule, not its
separate offline DPO stage). Each run's last step is evaluated greedily on the test rows: the comparison is of the
two trainings, so no val step is picked. There is no target on which one wins; the report states what was measured,
with 95% intervals, beside the SFT start.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from data_pipelines.synthetic.tools import TOOLS
from quickstart.run import Proof, evaluate_policy, grpo_config
from vagent.config import GRPOSelfCriticConfig, GRPOValConfig, check_config
from vagent.eval.runner import read_samples
from vagent.recipes import grpo
from vagent.training.metrics import read_metrics

# The runs' names, and whether each adds the self-critic; their dirs are ``_slug(name)`` (``evaluate_policy``'s).
VARIANTS = {"grpo tool-star": False, "grpo tool-star, self-critic": True}
REWARDS = {"tool_star": 1.0}
BOOTSTRAP = 2000  # resamples of the test rows for a paired change's interval


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
        config.val = GRPOValConfig()  # the last step is what is compared: no val step is picked, none is run
        config.grpo.self_critic.enabled = critic
        print(f"\n{name}: {cfg.toolstar_steps} GRPO steps from the SFT policy, reward tool_star", flush=True)
        model = grpo.train(check_config(config))
        results[name] = evaluate_policy(name, model, list(proof.tools), evaluation)
    return results


def _slug(name: str) -> str:
    return name.replace(" ", "-").replace(",", "")


def paired_interval(diffs: list[float], seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-row differences and its 95% percentile-bootstrap interval over rows."""
    if not diffs:
        return 0.0, 0.0, 0.0
    rng, n = random.Random(seed), len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(BOOTSTRAP))
    return sum(diffs) / n, means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def violated(sample: dict[str, Any]) -> bool:
    """Whether Tool-Star's reward scored the episode -1 (``tool_star_format_ok``): no answer, an empty one, a turn
    that broke the grammar, or a tag or call that failed to parse."""
    return (sample["stop_reason"] != "answered" or not (sample["prediction"] or "").strip()
            or sample["malformed_answer"] or bool(sample["parse_errors"]))  # fmt: skip


def several_kinds(sample: dict[str, Any]) -> bool:
    """Whether the episode's successful calls used two or more of the offered tools (the reward's bonus, when the
    answer is also right)."""
    return len(set(sample["tools_ok"]) & set(TOOLS)) > 1


def toolstar_section(out: Path, results: dict[str, tuple[Path, dict[str, Any]]], start: str, cfg: Any) -> list[str]:
    """The report's Tool-Star section: each variant and its SFT start ``start`` on the test rows (F1 with its
    interval, the paired change from the start, EM, calls, episodes with two kinds of tool, Tool-Star's format
    violations), self-critic against plain, and each variant's training."""
    names = [start, *(n for n in VARIANTS if n in results)]
    if len(names) == 1:
        return []
    samples = {name: read_samples(results[name][0] / "samples.jsonl") for name in names}
    c = GRPOSelfCriticConfig()  # the runs' settings: the library's defaults
    critic = f"{c.loss_type} loss, beta {c.beta:g}, coef {c.coef:g}, every {c.every} step"
    lines = [
        "## Tool-Star's reward, plain and with self-critic (no target)",
        "",
        f"Both from `{start}`, {cfg.toolstar_steps} GRPO steps each with the main GRPO's seed and settings (dynamic "
        "sampling included, so their prompts agree at the first step and then drift apart), rewarded by Tool-Star's "
        "reward alone: -1 for a format violation, 0 for a wrong answer, else the F1, plus 0.1 for a right answer "
        "reached with two kinds of tool (no row here needs two, so that bonus pays for an extra call). The "
        f"self-critic is a DPO term inside each GRPO update ({critic}) on the best against the worst episode of "
        "each group, not Tool-Star's separate offline DPO stage. Each run's last step, greedy on the test rows. F1's "
        "interval is the evaluation's own (`metrics.json`); a change is paired by row, its interval a bootstrap "
        "over the test rows. Both cover which test rows were drawn, not the spread between training runs: that "
        "needs the other seeds.",
        "",
        "| policy | F1 [95% CI] | change in F1, points [95% CI] | EM | tool calls / episode | episodes using 2+ "
        "tools | right with 2+ tools | format violations |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        rows, metrics = samples[name], results[name][1]
        low, high = metrics["intervals"]["f1"]
        change = "-" if name == start else _change(samples[name], samples[start])
        calls = sum(len(s["tool_calls"]) for s in rows) / len(rows)
        several = [s for s in rows if several_kinds(s)]
        right = sum(s["f1"] > 0 for s in several) / len(rows)
        lines.append(f"| {name} | {metrics['f1']:.3f} [{low:.3f}, {high:.3f}] | {change} | {metrics['em']:.3f} | "
                     f"{calls:.2f} | {len(several) / len(rows):.1%} | {right:.1%} | "
                     f"{sum(map(violated, rows)) / len(rows):.1%} |")  # fmt: skip
    plain, with_critic = VARIANTS
    if plain in samples and with_critic in samples:
        lines += ["", f"Self-critic against plain: {_change(samples[with_critic], samples[plain])} points of F1."]
    trained = [n for n in VARIANTS if n in results]
    lines += ["", *_training(out, trained), "", "![Tool-Star runs](toolstar.png)" if _plot(out, trained) else "", ""]
    return lines


def _change(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    """The paired change of F1 from ``base`` to ``rows`` in points, with its interval."""
    before = {s["id"]: s["f1"] for s in base}
    delta, low, high = paired_interval([s["f1"] - before[s["id"]] for s in rows])
    return f"{delta * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}]"


def _training(out: Path, names: list[str]) -> list[str]:
    """Per variant: its mean reward over its first and last steps (a third of them each, at most 3), and (with the
    self-critic) its pairs and the task reward's gap within them."""
    lines = []
    for name in names:
        records = [r for r in read_metrics(out / _slug(name) / "metrics.jsonl") if "reward" in r]
        if not records:
            continue
        k = max(1, min(3, len(records) // 3))
        first, last = (sum(r["reward"] for r in part) / k for part in (records[:k], records[-k:]))
        line = f"- {name}: mean Tool-Star reward {first:+.3f} over its first {k} steps, {last:+.3f} over its last {k}"
        critic = [r for r in records if "dpo/pairs" in r]
        if critic:
            pairs = sum(r["dpo/pairs"] for r in critic)
            gaps = [r["dpo/reward_gap"] for r in critic if "dpo/reward_gap" in r]
            gap = f", the reward {sum(gaps) / len(gaps):.2f} apart within a pair on average" if gaps else ""
            line += f"; the self-critic made {pairs:g} pairs over {len(critic)} steps{gap}"
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

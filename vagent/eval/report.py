"""``metrics.md``: what a person reads of an eval run, the protocol card first.

Sections: the protocol (the card's fields that decide the score), the scores (one table, as ``eval-report`` puts
runs side by side), each metric with its 95% interval, avg@j and pass@j for every j up to k read off the same run,
the spread across samples, the benchmark's own groups, and what failed (answers no rule could read, requests that
never got a reply).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vagent.eval.card import read_card

__all__ = ["card_table", "metrics_markdown", "write_report", "write_table"]

PROFILE_OWN = "the profile's own cap"


def write_table(runs: Sequence[dict[str, Any]], path: Path | None, names: Sequence[str]) -> str:
    """A markdown table of one or more runs' metrics (one row per run), written to ``path`` if given."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k not in ("n", "samples")]
    lines = ["| run | n | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for name, m in zip(names, runs, strict=True):
        cells = [f"{m.get(k, float('nan')):.3f}" if isinstance(m.get(k), float) else str(m.get(k, "")) for k in keys]
        lines.append(f"| {name} | {m.get('n', '')} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    if path is not None:
        path.write_text(table)
    return table


def card_table(card: dict[str, Any]) -> str:
    """The card's fields that decide a score, as a two-column markdown table."""
    limits, judge = card.get("limits") or {}, card.get("judge")
    preset = card.get("protocol")
    overridden = ", ".join(f"{k} ({v['preset']} -> {v['used']})" for k, v in (card.get("overrides") or {}).items())
    commit = (card.get("vagent") or {}).get("commit") or "not a git checkout"
    rows = [
        ("protocol", (preset or "none (flags only)") + (f"; overridden: {overridden}" if overridden else "")),
        (
            "benchmark",
            f"{card['benchmark']} ({Path(card['data']).name}, sha256 {card['data_sha256'][:12]}, loader "
            f"{card['loader_sha256'][:12]})",
        ),
        (
            "model",
            f"{card['model']}"
            + (f" (config sha256 {card['model_config_sha256'][:12]})" if card.get("model_config_sha256") else ""),
        ),
        (
            "backend",
            f"{card.get('backend')}" + (f", model {card['endpoint_model']}" if card.get("endpoint_model") else ""),
        ),
        (
            "agent, tools",
            f"{card.get('agent')}, {'none' if card.get('tools') == [] else card.get('tools') or 'default'}",
        ),
        (
            "sampling",
            f"k = {card.get('samples')}, temperature {limits.get('temperature')}, top_p "
            f"{limits.get('top_p')}, seed {card.get('seed')}",
        ),
        (
            "budgets",
            f"{limits.get('max_turns')} turns, {limits.get('max_images')} images, "
            f"{limits.get('max_new_tokens')} tokens a turn, {limits.get('max_total_tokens')} an episode, "
            f"tool calls {limits.get('max_tool_calls') or PROFILE_OWN}",
        ),
        ("pixels", "the endpoint's" if card.get("pixels") is None else f"{card['pixels'][0]} to {card['pixels'][1]}"),
        (
            "answers read by",
            f"{card.get('extract')}"
            + (", a random option on a parse failure" if card.get("parse_fallback") == "random" else ""),
        ),
        (
            "judge",
            "none"
            if not judge
            else f"{judge.get('model')} ({judge.get('mode')}, prompt sha256 {(judge.get('prompt_sha256') or '')[:12]})",
        ),
        ("vagent", f"{(card.get('vagent') or {}).get('version')} at {commit}"),
    ]
    if card.get("option_order"):
        rows.insert(6, ("option order", card["option_order"]))
    return "| protocol card | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def metrics_markdown(metrics: dict[str, Any], name: str, card: dict[str, Any] | None) -> str:
    """The whole ``metrics.md`` of one run."""
    parts = [f"# {metrics.get('benchmark', '')}: {name}\n"]
    if card:
        parts.append(card_table(card) + f"\nRerun exactly: `vagent eval --rerun {name} --out {name}-rerun`\n")
    parts.append("## Scores\n\n" + write_table([metrics], None, [name]))
    intervals = metrics.get("intervals") or {}
    if intervals:
        lines = ["| metric | value | 95% interval |", "|---|---:|---|"]
        method = "Wilson's for a 0/1 metric with one sample a record and one record an image or video; else a "
        method += "bootstrap over the images or videos asked about, each with all its records and samples"
        lines += [
            f"| {k} | {metrics.get(k, float('nan')):.3f} | [{lo:.3f}, {hi:.3f}] |" for k, (lo, hi) in intervals.items()
        ]
        parts.append(f"## Intervals ({method})\n\n" + "\n".join(lines) + "\n")
    at_k = metrics.get("at_k") or {}
    if len(at_k) > 1:
        keys = list(next(iter(at_k.values())))
        names = [k.split("/", 1)[0].split("@")[0] + "@j/" + k.split("/", 1)[1] for k in keys]
        lines = ["| j | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(keys)]
        lines += [f"| {j} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |" for j, row in at_k.items()]
        parts.append("## avg@j and pass@j, read off each record's first j samples\n\n" + "\n".join(lines) + "\n")
    spread = metrics.get("spread") or {}
    if spread:
        lines = ["| metric | std across samples | lowest sample | highest sample |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['std']:.3f} | {v['min']:.3f} | {v['max']:.3f} |" for k, v in spread.items()]
        parts.append("## Spread: each sample index's mean over the records\n\n" + "\n".join(lines) + "\n")
    for key in sorted(k for k in metrics if k.startswith("by_")):
        groups = metrics[key]
        cols = [c for c in next(iter(groups.values())) if c != "n"]
        lines = [f"| {key[3:]} | n | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        lines += [f"| {g} | {v['n']} | " + " | ".join(f"{v[c]:.3f}" for c in cols) + " |" for g, v in groups.items()]
        parts.append(f"## By {key[3:]}\n\n" + "\n".join(lines) + "\n")
    failures = [f"{metrics[k]} {what}" for k, what in (("parse_failures", "answers no rule could read (scored 0)"),
                                                       ("endpoint_failures", "episodes whose requests failed (scored 0; "
                                                        "the same command again retries them)"))
                if metrics.get(k)]  # fmt: skip
    if failures or metrics.get("skipped"):
        failures += [f"{len(metrics['skipped'])} records skipped by the loader"] if metrics.get("skipped") else []
        parts.append("## Failures\n\n" + "\n".join(f"- {f}" for f in failures) + "\n")
    return "\n".join(parts)


def write_report(out_dir: Path, metrics: dict[str, Any]) -> None:
    """Write ``metrics.json`` and ``metrics.md`` of the run in ``out_dir`` (its card read from ``protocol.json``)."""
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, ensure_ascii=False))
    (out_dir / "metrics.md").write_text(metrics_markdown(metrics, out_dir.name, read_card(out_dir)))

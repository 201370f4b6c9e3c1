"""Evaluation entry points: ``vagent eval`` (one benchmark, one policy) and ``vagent eval-report`` (compare runs).

vagent eval --model DIR --benchmark mat-coding --data FILE [--image-root DIR] [--tools crop,zoom_in|none] --out DIR
vagent eval --endpoint URL --benchmark judge-pairs --data FILE --out DIR   (a judge behind an OpenAI-compatible API)
torchrun --nproc_per_node N -m vagent.cli eval ...      (rows split over ranks; rank 0 merges)
vagent eval-report RUN_DIR [RUN_DIR ...] --out DIR       (side-by-side table + bar chart PNG, and accuracy and
                                                         turns against the turn budget, read off each run)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from vagent.agents import get_profile
from vagent.eval import BENCHMARKS, BenchmarkError
from vagent.eval.runner import evaluate, read_samples, write_table
from vagent.eval.turns import budgets, exactness, turn_scaling
from vagent.model import load_policy
from vagent.rollout import RolloutLimits
from vagent.training.distributed import init_distributed, shutdown


def run_eval(args: argparse.Namespace) -> int:
    benchmark = BENCHMARKS[args.benchmark]
    rows, errors = benchmark.load(Path(args.data), Path(args.image_root) if args.image_root else None)
    for record, why in errors:
        print(f"bad record {record}: {why}", file=sys.stderr)
    if errors and not args.skip_bad:
        raise BenchmarkError(f"{len(errors)} bad record(s) in {args.data} (listed above); fix them or pass --skip-bad")
    rows = rows[: args.limit] if args.limit else rows
    if not rows:
        raise BenchmarkError(f"no records to evaluate in {args.data}")
    if args.endpoint:
        return _eval_endpoint(args, benchmark, rows, errors)
    env = init_distributed(args.device)
    try:
        policy = load_policy(args.model, device=env.device, dtype=args.dtype, attn_implementation=args.attn)
        limits = episode_limits(args)
        _check_context(policy, limits, get_profile(args.agent).limits.max_turns, quiet=not env.is_main)
        import torch

        torch.manual_seed(args.seed + env.rank)
        from vagent.config import ToolboxConfig
        from vagent.recipes.common import tool_services

        services = tool_services(ToolboxConfig(search_corpus=args.search_corpus, search_url=args.search_url,
                                               allow_unsandboxed_code=args.unsandboxed))  # fmt: skip
        backend = episode_backend(args, policy, limits)
        try:
            metrics = evaluate(policy, benchmark, rows, Path(args.out), tools=args.tools, limits=limits,
                               n_samples=args.samples, batch_size=args.batch_size, services=services, env=env,
                               skipped=errors, progress=env.is_main, agent=args.agent,
                               tool_workers=args.tool_workers, backend=backend)  # fmt: skip
        finally:
            if backend is not None:
                backend.close()
    finally:
        shutdown()
    if metrics and args.judge:
        metrics = _judge(args, rows)
    if metrics:
        print((Path(args.out) / "metrics.md").read_text())
        print(f"wrote {args.out}/samples.jsonl, metrics.json, trajectories.html")
    return 0


def episode_backend(args: argparse.Namespace, policy: Any, limits: RolloutLimits) -> Any:
    """The generation backend of ``vagent eval`` and ``vagent rollout`` (``--backend``): None for vagent's own HF
    engine (``run`` makes one), or a vLLM engine over the checkpoint, which the caller closes.

    Raises:
        BenchmarkError: vLLM cannot run this checkpoint here (one line, with the remedy).
    """
    if args.backend != "vllm":
        return None
    from vagent.rollout.vllm_backend import VLLMBackend

    try:
        return VLLMBackend.for_policy(policy, max_model_len=limits.max_total_tokens, max_num_seqs=args.batch_size,
                                      max_images=limits.max_images, seed=args.seed,
                                      gpu_memory_utilization=args.gpu_memory_utilization, sleep=False)  # fmt: skip
    except ValueError as e:
        raise BenchmarkError(f"--backend vllm: {e}") from None


def episode_limits(args: argparse.Namespace) -> RolloutLimits:
    """The episode limits of ``vagent eval`` and ``vagent rollout`` (``--max-turns`` ... ``--top-p``): the agent
    profile's own turn and image limits unless given."""
    profile = get_profile(args.agent).limits
    return RolloutLimits(max_turns=args.max_turns or profile.max_turns, max_new_tokens=args.max_new_tokens,
                         max_total_tokens=args.max_total_tokens, max_images=args.max_images or profile.max_images,
                         max_tool_calls=args.max_tool_calls, temperature=args.temperature,
                         top_p=args.top_p)  # fmt: skip


def _check_context(policy, limits: RolloutLimits, own_turns: int, quiet: bool = False) -> None:
    """An episode must fit the model's positions (an error); a turn budget past the profile's own (test-time turn
    scaling) with too few images for a tool output every turn is worth a note."""
    positions = policy.model.config.get_text_config().max_position_embeddings
    if limits.max_total_tokens > positions:
        raise BenchmarkError(f"--max-total-tokens {limits.max_total_tokens} is past the model's context of {positions} "
                             "positions; lower it (an episode stops at max_tokens when it reaches it)")  # fmt: skip
    if not quiet and limits.max_turns > own_turns and limits.max_images <= limits.max_turns:
        print(f"note: --max-turns {limits.max_turns} with --max-images {limits.max_images}: an episode whose every "
              f"turn returns an image stops at max_images before its last turns; for turn scaling give --max-images "
              f"{limits.max_turns + 1} or more (prompt images count too) and --max-total-tokens to hold them",
              file=sys.stderr)  # fmt: skip


def _eval_endpoint(args: argparse.Namespace, benchmark, rows, errors) -> int:
    """``--endpoint URL``: a judge behind an OpenAI-compatible API answers the rows in one turn (no tool loop)."""
    import os

    from vagent.eval.judges import evaluate_endpoint
    from vagent.judge import JudgeClient
    from vagent.recipes.judged import first_model

    if benchmark.name != "judge-pairs":
        raise BenchmarkError(f"--endpoint evaluates judges (--benchmark judge-pairs); {benchmark.name} needs the "
                             "tool loop of a checkpoint (--model)")  # fmt: skip
    api_key = os.environ.get(args.judge_api_key_env) if args.judge_api_key_env else None
    out = Path(args.out)
    client = JudgeClient(args.endpoint, args.endpoint_model or first_model(args.endpoint), api_key=api_key,
                         concurrency=args.judge_concurrency, cache_path=out / "judge_cache.jsonl")  # fmt: skip
    try:
        evaluate_endpoint(client, benchmark, rows, out, max_tokens=args.max_new_tokens, temperature=args.temperature,
                          skipped=errors)  # fmt: skip
    finally:
        client.close()
    print((out / "metrics.md").read_text())
    print(f"wrote {out}/samples.jsonl, metrics.json")
    return 0


def _judge(args: argparse.Namespace, rows) -> dict[str, Any]:
    """``--judge URL``: grade the run's predictions with a model judge (``vagent.eval.judged``)."""
    import os

    from vagent.eval.judged import judge_run
    from vagent.judge import JudgeClient
    from vagent.recipes.judged import first_model

    api_key = os.environ.get(args.judge_api_key_env) if args.judge_api_key_env else None
    client = JudgeClient(args.judge, args.judge_model or first_model(args.judge), api_key=api_key,
                         concurrency=args.judge_concurrency, cache_path=Path(args.out) / "judge_cache.jsonl")  # fmt: skip
    metrics = judge_run(Path(args.out), rows, client, mode=args.judge_mode)
    print(f"judged accuracy {metrics['judged_accuracy']:.3f} ({metrics['judge_failures']} judge failures)")
    return metrics


def compare(run_dirs: list[str], out: Path | None) -> str:
    """Side-by-side table of several eval runs (their metrics.json) and, with ``out``, a bar chart PNG."""
    runs: list[dict[str, Any]] = []
    for d in run_dirs:
        path = Path(d) / "metrics.json"
        if not path.is_file():
            raise BenchmarkError(f"{d} holds no metrics.json (not an eval run dir, or the run has not finished)")
        runs.append(json.loads(path.read_text()))
    names = [Path(d).name for d in run_dirs]
    table = write_table(runs, None, names)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(table)
        bar_chart(runs, names, out / "comparison.png")
    return table


def bar_chart(runs: list[dict[str, Any]], names: list[str], path: Path, title: str = "") -> Path:
    """Grouped bars of each run's primary metrics (those in [0, 1])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, v in runs[0].items() if isinstance(v, float) and 0 <= v <= 1 and not k.startswith("tool_error")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(keys) * max(1, len(runs)) / 2), 4))
    width = 0.8 / len(runs)
    for i, (name, run) in enumerate(zip(names, runs, strict=True)):
        xs = [j + i * width for j in range(len(keys))]
        bars = ax.bar(xs, [run.get(k, 0.0) for k in keys], width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))], keys, rotation=20, ha="right")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: inside, it hid bar labels
    ax.set_title(title or "eval comparison")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def turn_report(run_dirs: list[str], out: Path | None) -> tuple[str, Path | None]:
    """Accuracy (each run's primary metric), answers, turns and images against the turn budget, read off each run's
    samples at the budgets up to its own (``vagent.eval.turns``); with ``out``, ``turns.md`` and ``turns.png``.
    Runs made before turn records are listed as skipped. Returns the markdown and the figure's path (None if none)."""
    sections, curves = [], []
    for d in run_dirs:
        metrics = json.loads((Path(d) / "metrics.json").read_text())
        samples = read_samples(Path(d) / "samples.jsonl")
        name, limits = Path(d).name, metrics.get("limits") or {}
        if not limits or not samples or any("answer_turn" not in s for s in samples):
            sections.append(f"### {name}\n\nskipped: no per-turn records (a run made before them); rerun it\n")
            continue
        metric = BENCHMARKS[metrics["benchmark"]].metrics[0]  # read from the answer alone, 0 without one
        table = turn_scaling(samples, metric, budgets(limits["max_turns"]))
        stops = Counter(s["stop_reason"] for s in samples)  # what cut the episodes that did not answer
        lines = [f"### {name}", "",
                 f"{metrics['benchmark']}, {metrics['n']} records, {len(samples)} samples, one rollout at "
                 f"{limits['max_turns']} turns (at most {limits['max_images']} images, {limits['max_total_tokens']} "
                 f"tokens); the smaller budgets are read off it: {exactness(limits['temperature'])}. This holds as no "
                 "vagent agent profile tells the model its turn budget. Only the answer's metric is read off.", "",
                 "stops at the largest budget: " + ", ".join(f"{k} {v}" for k, v in stops.most_common()), "",
                 f"| turn budget | {metric} | answered | mean turns | mean images |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['budget']} | {r[metric]:.3f} | {r['answered']:.3f} | {r['turns']:.2f} | "
                  f"{r.get('images', float('nan')):.2f} |" for r in table]  # fmt: skip
        sections.append("\n".join(lines) + "\n")
        curves.append((name, table, metric))
    text = "## Turn scaling\n\n" + "\n".join(sections)
    if out is None:
        return text, None
    out.mkdir(parents=True, exist_ok=True)
    (out / "turns.md").write_text(text)
    return text, turns_chart(curves, out / "turns.png") if curves else None


def turns_chart(curves: list[tuple[str, list[dict[str, Any]], str]], path: Path) -> Path:
    """Two panels against the turn budget (log 2 axis): each run's primary metric, and the mean turns it used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ticks = sorted({r["budget"] for _, table, _ in curves for r in table})
    metrics = sorted({metric for _, _, metric in curves})  # one name for the axis, or each run's in its label
    for name, table, metric in curves:
        xs = [r["budget"] for r in table]
        left.plot(xs, [r[metric] for r in table], marker="o", label=name if len(metrics) == 1 else f"{name} ({metric})")
        right.plot(xs, [r["turns"] for r in table], marker="o", label=name)
    right.plot(ticks, ticks, color="grey", linestyle=":", linewidth=1, label="every turn used")
    for ax, ylabel in ((left, metrics[0] if len(metrics) == 1 else "primary metric"), (right, "mean turns")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("turn budget")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    left.set_ylim(0, 1.05)
    fig.suptitle("test-time turn scaling: each run read off at the budgets up to its own")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def run_report(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    print(compare(args.runs, out))
    text, figure = turn_report(args.runs, out)
    print(text)
    if out is not None:
        print(f"wrote {out}/comparison.md, comparison.png, turns.md" + (", turns.png" if figure else ""))
    return 0

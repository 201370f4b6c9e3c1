"""Evaluation entry points: ``vagent eval`` (one benchmark, one policy) and ``vagent eval-report`` (compare runs).

vagent eval --model DIR --benchmark mat-coding --data FILE [--image-root DIR] [--tools crop,zoom_in|none] --out DIR
vagent eval --endpoint URL --benchmark judge-pairs --data FILE --out DIR   (a judge behind an OpenAI-compatible API)
torchrun --nproc_per_node N -m vagent.cli eval ...      (rows split over ranks; rank 0 merges)
vagent eval-report RUN_DIR [RUN_DIR ...] --out DIR       (side-by-side table + bar chart PNG)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vagent.agents import get_profile
from vagent.eval import BENCHMARKS, BenchmarkError
from vagent.eval.runner import evaluate, write_table
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
        import torch

        torch.manual_seed(args.seed + env.rank)
        from vagent.config import ToolboxConfig
        from vagent.recipes.common import tool_services

        services = tool_services(ToolboxConfig(search_corpus=args.search_corpus, search_url=args.search_url,
                                               allow_unsandboxed_code=args.unsandboxed))  # fmt: skip
        own = get_profile(args.agent).limits  # the agent's own turn and image limits, unless given
        limits = RolloutLimits(max_turns=args.max_turns or own.max_turns, max_new_tokens=args.max_new_tokens,
                               max_total_tokens=args.max_total_tokens, max_images=args.max_images or own.max_images,
                               temperature=args.temperature, top_p=args.top_p)  # fmt: skip
        metrics = evaluate(policy, benchmark, rows, Path(args.out), tools=args.tools, limits=limits,
                           n_samples=args.samples, batch_size=args.batch_size, services=services, env=env,
                           skipped=errors, progress=env.is_main, agent=args.agent)  # fmt: skip
    finally:
        shutdown()
    if metrics and args.judge:
        metrics = _judge(args, rows)
    if metrics:
        print((Path(args.out) / "metrics.md").read_text())
        print(f"wrote {args.out}/samples.jsonl, metrics.json, trajectories.html")
    return 0


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


def run_report(args: argparse.Namespace) -> int:
    print(compare(args.runs, Path(args.out) if args.out else None))
    if args.out:
        print(f"wrote {args.out}/comparison.md and comparison.png")
    return 0

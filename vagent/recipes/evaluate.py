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
from vagent.eval.card import (
    CARD_NAME,
    card_differences,
    file_sha256,
    protocol_card,
    read_card,
    weights_fingerprint,
    write_card,
)
from vagent.eval.protocols import FIELDS, PROTOCOLS, resolve
from vagent.eval.report import write_table
from vagent.eval.runner import evaluate, read_samples
from vagent.eval.turns import budgets, exactness, turn_scaling
from vagent.model import load_policy
from vagent.rollout import RolloutLimits
from vagent.training.distributed import init_distributed, shutdown


def run_eval(args: argparse.Namespace) -> int:
    if args.rerun:
        args = rerun_args(args)
    for flag, value in (("--benchmark", args.benchmark), ("--data", args.data), ("--out", args.out),
                        ("--model or --endpoint", args.model or args.endpoint)):  # fmt: skip
        if not value:
            raise BenchmarkError(f"{flag} is required (or --rerun RUN_DIR)")
    values, overrides = resolve({k: getattr(args, k, None) for k in FIELDS}, args.protocol)
    for key, value in values.items():
        setattr(args, key, value)
    args.data, args.image_root = (
        str(Path(args.data).resolve()),
        args.image_root and str(Path(args.image_root).resolve()),
    )
    args.model = args.model and str(Path(args.model).resolve())
    benchmark = BENCHMARKS[args.benchmark]
    rows, errors = benchmark.load(Path(args.data), Path(args.image_root) if args.image_root else None)
    for record, why in errors:
        print(f"bad record {record}: {why}", file=sys.stderr)
    if errors and not args.skip_bad:
        raise BenchmarkError(f"{len(errors)} bad record(s) in {args.data} (listed above); fix them or pass --skip-bad")
    rows = order_options(rows[: args.limit] if args.limit else rows, args.option_order)
    if not rows:
        raise BenchmarkError(f"no records to evaluate in {args.data}")
    if args.protocol and PROTOCOLS[args.protocol].judge and not args.judge:
        print(f"note: the {args.protocol} protocol grades with a model judge; without --judge URL only the "
              f"rule-based score ({args.extract}) is reported", file=sys.stderr)  # fmt: skip
    if args.endpoint and benchmark.name == "judge-pairs":
        return _eval_judge_endpoint(args, benchmark, rows, errors)
    if args.endpoint:
        return _eval_endpoint_policy(args, benchmark, rows, errors, overrides)
    env = init_distributed(args.device)
    try:
        # with vLLM on a GPU the engine holds the weights (sharded, with --tensor-parallel-size): the policy (its
        # processor, its config) stays on the CPU, no second copy on the device
        from vagent.rollout.vllm_backend import policy_placement

        _, placement = policy_placement(args.backend, str(env.device), args.dtype, args.attn)
        policy = load_policy(args.model, **placement)
        set_pixel_budget(policy, args.min_pixels, args.max_pixels)
        limits = episode_limits(args)
        _check_context(policy, limits, get_profile(args.agent).limits.max_turns, quiet=not env.is_main)
        _start_card(args, benchmark, limits, policy.pixel_budget, overrides, write=env.is_main)
        import torch

        torch.manual_seed(args.seed + env.rank)
        from vagent.config import ToolboxConfig
        from vagent.recipes.common import tool_services

        services = tool_services(ToolboxConfig(search_corpus=args.search_corpus, search_url=args.search_url,
                                               allow_unsandboxed_code=args.unsandboxed))  # fmt: skip
        group = env.rank // getattr(args, "tensor_parallel_size", 1)  # a card written before the flag has none
        backend = episode_backend(args, policy, limits, device=env.device.type, group=group)
        try:
            metrics = evaluate(policy, benchmark, rows, Path(args.out), tools=args.tools, limits=limits,
                               n_samples=args.samples, batch_size=args.batch_size, services=services, env=env,
                               skipped=errors, progress=env.is_main, agent=args.agent,
                               tool_workers=args.tool_workers, backend=backend, extract=args.extract,
                               parse_fallback=args.parse_fallback)  # fmt: skip
        finally:
            if backend is not None:
                backend.close()
    finally:
        shutdown()
    return _finish(args, rows, metrics)


def _finish(args: argparse.Namespace, rows, metrics: dict[str, Any]) -> int:
    if metrics and args.judge:
        metrics = _judge(args, rows)
    if metrics:
        print((Path(args.out) / "metrics.md").read_text())
        print(f"wrote {args.out}/protocol.json, samples.jsonl, metrics.json, metrics.md, trajectories.html")
    return 0


def rerun_args(args: argparse.Namespace) -> argparse.Namespace:
    """The command line of the run in ``args.rerun`` (its ``protocol.json``), into ``args.out`` (default
    ``RUN_DIR-rerun``). The data file and the model's config must be the ones the card names (same SHA-256).

    Raises:
        BenchmarkError: no card in the run dir, or the file or model changed since.
    """
    run_dir = Path(args.rerun)
    card = read_card(run_dir)
    if card is None:
        raise BenchmarkError(f"{run_dir} holds no {CARD_NAME} (not an eval run dir, or one made before cards)")
    given = {k: v for k, v in vars(args).items() if k in ("out", "func", "command", "usage_check")}
    replay = argparse.Namespace(**{**card["args"], **given, "rerun": None})
    replay.out = args.out or str(run_dir.resolve()) + "-rerun"
    if Path(replay.out).resolve() == run_dir.resolve():
        raise BenchmarkError("--out must be another dir than the run being repeated")
    data = Path(replay.data)
    if not data.exists() or file_sha256(data) != card["data_sha256"]:
        raise BenchmarkError(f"{data} is not the file {run_dir.name} was scored on (missing, or its SHA-256 changed)")
    if card.get("model_config_sha256"):
        config = Path(replay.model) / "config.json"
        same = config.is_file() and file_sha256(config) == card["model_config_sha256"]
        if not same or weights_fingerprint(Path(replay.model)) != card.get("model_weights"):
            raise BenchmarkError(f"{replay.model} is not the model {run_dir.name} scored (missing, or its "
                                 "config.json or weight files changed)")  # fmt: skip
    return replay


def _start_card(args: argparse.Namespace, benchmark, limits: RolloutLimits, pixels, overrides, write: bool) -> None:
    """Write the run's card; a resumed run (a card in ``--out`` already) must be under the same protocol."""
    import dataclasses

    from vagent.judge import TEMPLATES

    loader = sys.modules[benchmark.load.__module__]
    card = protocol_card(vars(args), benchmark=benchmark.name, loader=loader, limits=dataclasses.asdict(limits),
                         pixels=pixels, overrides=overrides,
                         protocol=args.protocol, agent_module=sys.modules[type(get_profile(args.agent)).__module__],
                         judge_prompt=TEMPLATES[args.judge_mode] if args.judge else None)  # fmt: skip
    out = Path(args.out)
    old = read_card(out)
    if old is not None:
        keep = {"vagent", "judge", "args", "command", "overrides"}  # a resume may differ in these
        changed = [k for k in card_differences([{k: v for k, v in old.items() if k not in keep},
                                                {k: v for k, v in card.items() if k not in keep}])]  # fmt: skip
        if changed:
            raise BenchmarkError(f"{out} holds a run under another protocol ({', '.join(changed)} differ); resume it "
                                 "with the same flags, or pass another --out")  # fmt: skip
    if write:
        write_card(out, card)


def set_pixel_budget(policy: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """``--min-pixels`` / ``--max-pixels``: the budget of the images the model is shown (its processor's, which
    the engine, the tools' frame and the encoder all read)."""
    if min_pixels is None and max_pixels is None:
        return
    low, high = policy.pixel_budget
    low, high = min_pixels or low, max_pixels or high
    if low > high:
        raise BenchmarkError(f"--min-pixels {low} is more than --max-pixels {high}")
    image_processor = policy.processor.image_processor
    image_processor.size["shortest_edge"], image_processor.size["longest_edge"] = low, high  # a dict or a SizeDict
    for name, value in (("min_pixels", low), ("max_pixels", high)):
        if hasattr(image_processor, name):
            setattr(image_processor, name, value)


def order_options(rows, option_order: str | None):
    """``--option-order as-listed``: leave each record's options in the file's order (a loader that would otherwise
    reorder them records the file's order in ``row.extra["listed"]``); None: the loader's order."""
    if option_order != "as-listed":
        return rows
    import dataclasses

    return [dataclasses.replace(r, choices=r.extra["listed"]["choices"], answer=r.extra["listed"]["answer"])
            if "listed" in r.extra else r for r in rows]  # fmt: skip


def episode_backend(args: argparse.Namespace, policy: Any, limits: RolloutLimits, device: str | None = None,
                    group: int = 0) -> Any:  # fmt: skip
    """The generation backend of ``vagent eval`` and ``vagent rollout`` (``--backend``): None for vagent's own HF
    engine (``run`` makes one), or a vLLM engine over the checkpoint on ``device`` (default: the policy's), which the
    caller closes; ``group`` (this rank's TP group, or its rank without one) varies the engine's seed.

    Raises:
        BenchmarkError: vLLM cannot run this checkpoint here (one line, with the remedy).
    """
    tp = getattr(args, "tensor_parallel_size", 1)
    if args.backend != "vllm":
        if tp > 1:
            raise BenchmarkError("--tensor-parallel-size shards vLLM's engine: add --backend vllm")
        return None
    import torch.distributed as dist

    from vagent.rollout.vllm_backend import VLLMBackend

    # under torchrun the group's ranks each submit their own rows to one sharded engine; in one process, vLLM's
    # worker processes hold the shards and this process submits every row
    ranks = dist.is_available() and dist.is_initialized()
    try:
        return VLLMBackend.for_policy(policy, max_model_len=limits.max_total_tokens,
                                      max_num_seqs=args.batch_size * (tp if ranks else 1),
                                      max_images=limits.max_images, seed=args.seed + 1_000_003 * group, device=device,
                                      gpu_memory_utilization=args.gpu_memory_utilization, sleep=False,
                                      tensor_parallel_size=tp, tp_ranks=ranks)  # fmt: skip
    except ValueError as e:
        raise BenchmarkError(f"--backend vllm: {e}") from None


def episode_limits(args: argparse.Namespace) -> RolloutLimits:
    """The episode limits of ``vagent eval`` and ``vagent rollout`` (``--max-turns`` ... ``--top-p``): the agent
    profile's own turn and image limits unless given. Every sampled turn is seeded from ``--seed``, the record, the
    sample's index and the turn, so a rerun draws the same samples however the episodes are batched."""
    profile = get_profile(args.agent).limits
    return RolloutLimits(max_turns=args.max_turns or profile.max_turns, max_new_tokens=args.max_new_tokens,
                         max_total_tokens=args.max_total_tokens, max_images=args.max_images or profile.max_images,
                         max_tool_calls=args.max_tool_calls, temperature=args.temperature, top_p=args.top_p,
                         sampling_seed=args.seed)  # fmt: skip


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


def _eval_endpoint_policy(args: argparse.Namespace, benchmark, rows, errors, overrides) -> int:
    """``--endpoint URL``: the model behind an OpenAI-compatible API answers, turn by turn, with vagent running the
    agent profile's tools here (``vagent.eval.endpoint``); scored by the same loaders, rules and card."""
    import os

    from vagent.config import ToolboxConfig
    from vagent.eval.endpoint import QWEN25_PIXELS, endpoint_episodes
    from vagent.recipes.common import tool_services
    from vagent.recipes.judged import first_model

    pixels = (args.min_pixels or QWEN25_PIXELS[0], args.max_pixels or QWEN25_PIXELS[1])
    args.endpoint_model = args.endpoint_model or first_model(args.endpoint)
    limits = episode_limits(args)
    _start_card(args, benchmark, limits, pixels, overrides, write=True)
    services = tool_services(ToolboxConfig(search_corpus=args.search_corpus, search_url=args.search_url,
                                           allow_unsandboxed_code=args.unsandboxed))  # fmt: skip
    api_key = os.environ.get(args.judge_api_key_env) if args.judge_api_key_env else None
    episodes = endpoint_episodes(args.endpoint, model=args.endpoint_model, limits=limits, agent=args.agent,
                                 services=services, concurrency=args.judge_concurrency, api_key=api_key,
                                 seed=args.seed, tool_workers=args.tool_workers, pixel_budget=pixels)  # fmt: skip
    metrics = evaluate(None, benchmark, rows, Path(args.out), tools=args.tools, limits=limits, n_samples=args.samples,
                       batch_size=args.batch_size, skipped=errors, agent=args.agent, extract=args.extract,
                       parse_fallback=args.parse_fallback, episodes=episodes)  # fmt: skip
    return _finish(args, rows, metrics)


def _eval_judge_endpoint(args: argparse.Namespace, benchmark, rows, errors) -> int:
    """``--endpoint URL --benchmark judge-pairs``: a judge behind an OpenAI-compatible API answers the pairs in one
    turn (no tool loop)."""
    import os

    from vagent.eval.judges import evaluate_endpoint
    from vagent.judge import JudgeClient
    from vagent.recipes.judged import first_model

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
    """Side-by-side table of several eval runs (their metrics.json), their protocol cards side by side with every
    field in which they differ named, and, with ``out``, a bar chart PNG."""
    runs: list[dict[str, Any]] = []
    for d in run_dirs:
        path = Path(d) / "metrics.json"
        if not path.is_file():
            raise BenchmarkError(f"{d} holds no metrics.json (not an eval run dir, or the run has not finished)")
        runs.append(json.loads(path.read_text()))
    names = [Path(d).name for d in run_dirs]
    table = write_table(runs, None, names) + "\n" + protocol_comparison([read_card(Path(d)) for d in run_dirs], names)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(table)
        bar_chart(runs, names, out / "comparison.png")
    return table


def protocol_comparison(cards: list[dict[str, Any] | None], names: list[str]) -> str:
    """The protocol fields in which the runs differ, one row each with every run's value; or that they agree."""
    missing = [n for n, c in zip(names, cards, strict=True) if c is None]
    lines = ["## Protocols", ""]
    if missing:
        lines += [f"No protocol card in {', '.join(missing)} (made before cards): not compared.", ""]
    present = [(n, c) for n, c in zip(names, cards, strict=True) if c is not None]
    if len(present) < 2:
        return "\n".join(lines) + "\n"
    differences = card_differences([c for _, c in present])
    if not differences:
        return "\n".join([*lines, "The runs' protocol cards agree in every field that decides a score.", ""])
    lines += [f"The runs differ in {len(differences)} protocol field(s):", "",
              "| field | " + " | ".join(n for n, _ in present) + " |", "|---|" + "---|" * len(present)]  # fmt: skip
    for field, values in differences.items():
        cells = [json.dumps(v, default=str) if not isinstance(v, str) else v for v in values]
        lines.append(f"| {field} | " + " | ".join(c if len(c) <= 40 else c[:37] + "..." for c in cells) + " |")
    return "\n".join(lines) + "\n"


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

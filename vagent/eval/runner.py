"""Run a policy over a benchmark through the rollout engine: resumable, sharded over ranks, with outputs
people read (a markdown table, the HTML trajectory viewer) and programs read (samples.jsonl, metrics.json).

Layout of ``out_dir``::

    samples.rank{r}.jsonl        one line per finished sample, appended as it finishes (the resume log)
    trajectories.rank{r}.jsonl   the matching trajectories (export.JsonlWriter: images saved as PNG)
    samples.jsonl                all ranks' samples in benchmark order (rank 0 writes it at the end)
    metrics.json, metrics.md     overall / pass@k / per-type metrics, tool use, what was skipped, the limits
    limits.json                  the episode limits and sampling the samples were made under
    trajectories.html            the viewer of the first trajectories with their crops and frames inline

A rerun with the same ``out_dir`` reads the samples logs and runs only what is missing, so an
interrupted evaluation finishes without repeating finished samples; it must ask for the same limits (a run
mixing two turn budgets could not be read off per budget, see ``vagent.eval.turns``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vagent.data import Row
from vagent.eval.benchmarks import Benchmark, BenchmarkError
from vagent.eval.extract import extract_choice
from vagent.eval.metrics import summarize
from vagent.eval.report import write_report, write_table
from vagent.eval.turns import turn_record
from vagent.model import Policy
from vagent.rewards.answer import choice_match, gold_answers
from vagent.rollout import GenerationBackend, RolloutLimits, Task, run
from vagent.rollout.export import JsonlWriter, read_jsonl, write_html
from vagent.toolbox import ToolServices
from vagent.training.distributed import DistEnv, all_gather_object, barrier
from vagent.training.metrics import read_metrics
from vagent.types import Trajectory

__all__ = ["evaluate", "read_samples", "write_table"]


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Records of a samples log; a line torn by a kill is skipped (that sample runs again)."""
    return read_metrics(path)


Episodes = Callable[[list[Task], int, Callable[[Trajectory], None]], object]


def evaluate(policy: Policy | None, benchmark: Benchmark, rows: Sequence[Row], out_dir: Path, *, tools: list[str] | None,
             limits: RolloutLimits, n_samples: int = 1, batch_size: int = 8, services: ToolServices | None = None,
             env: DistEnv | None = None, skipped: Sequence[tuple[str, str]] = (), label: str = "",
             progress: bool = True, agent: str = "vagent", tool_workers: int = 8,
             backend: GenerationBackend | None = None, extract: str = "vagent", parse_fallback: str = "none",
             episodes: Episodes | None = None) -> dict[str, Any]:  # fmt: skip
    """Evaluate ``rows``; returns the metrics dict (also written to ``out_dir/metrics.json`` by rank 0).

    Args:
        tools: Tools offered to every row (``[]`` = the no-tool baseline); None = each row's own list, else
            the benchmark's defaults.
        n_samples: Samples per row (pass@k); greedy decoding needs ``limits.temperature = 0``.
        env: This process's place among ranks (rows are split round-robin); None = a single process.
        skipped: Records the loader could not read, reported in the metrics.
        agent: The agent profile the policy speaks (``vagent.agents.PROFILES``): its prompt, tools and answers.
        tool_workers: Threads running tool calls (``vagent.rollout.run``).
        backend: What generates (``vagent.rollout.run``'s; default: a new HF backend per chunk).
        extract: How answers are read off the replies (``vagent.eval.extract.EXTRACTORS``).
        parse_fallback: ``random``: a multiple-choice reply the rule cannot read scores a random option, drawn from
            the record's id and the sample's index (lmms-eval's LongVideoBench); ``none``: it scores 0. Either way
            it is counted in ``parse_failures``.
        episodes: ``(tasks, n_samples, progress)``: runs the episodes another way than vagent's engine over
            ``policy`` (a model behind an OpenAI-compatible endpoint, ``vagent.eval.endpoint``), calling
            ``progress(trajectory)`` as each finishes; ``policy`` may then be None.

    Raises:
        BenchmarkError: ``out_dir`` holds samples made under other limits (a resume must ask for the same).
    """
    rank, world = (env.rank, env.world_size) if env else (0, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    _same_limits(out_dir, limits, write=rank == 0)
    log = out_dir / f"samples.rank{rank}.jsonl"
    # a sample whose requests failed (--endpoint) is asked again: a resume retries it, its new line replaces the old
    done = {(s["id"], s["sample"]) for s in read_samples(log) if "endpoint_error" not in s}
    mine = [row for i, row in enumerate(rows) if i % world == rank]
    todo = [row for row in mine if any((row.id, k) not in done for k in range(n_samples))]
    by_id = {row.id: row for row in rows}
    default_tools = list(benchmark.tools)

    def task(row: Row) -> Task:
        t = Task.from_row(row, default_tools)
        if tools is not None:
            t.tools = list(tools)
        return t

    bar = tqdm(total=len(mine) * n_samples, initial=len(done), desc=label or benchmark.name, disable=not progress,
               dynamic_ncols=True)  # fmt: skip
    with JsonlWriter(out_dir / f"trajectories.rank{rank}.jsonl") as tw, open(log, "a") as samples_log:
        seen: dict[str, int] = {}

        def finished(trajectory) -> None:
            # the sample's own index (its seeds), not the order samples finish in: a short episode finishes first
            k = trajectory.sample if trajectory.sample is not None else seen.get(trajectory.task_id, 0)
            seen[trajectory.task_id] = seen.get(trajectory.task_id, 0) + 1
            if (trajectory.task_id, k) in done:  # a finished sample of a partially done row
                return
            row = by_id[trajectory.task_id]
            trajectory.sample = k
            tw.write(trajectory)
            record = sample_record(benchmark, row, trajectory, k, extract, parse_fallback)
            samples_log.write(json.dumps(record, ensure_ascii=False) + "\n")
            samples_log.flush()
            bar.update(1)

        for rows_of_chunk in _chunks(todo, batch_size, backend):
            tasks = [task(r) for r in rows_of_chunk]
            if episodes is not None:
                episodes(tasks, n_samples, finished)
                continue
            run(policy, tasks, n_samples, limits, batch_size=batch_size, progress=finished, agent=agent,
                services=services, tool_workers=tool_workers, backend=backend)  # fmt: skip
    bar.close()
    barrier()
    if rank != 0:
        return {}
    return _merge(benchmark, rows, out_dir, world, skipped, tools, agent, limits)


def _tools_label(tools: list[str] | None, benchmark: Benchmark, rows: Sequence[Row]) -> str:
    """What the metrics say was offered: ``tools``, or (None) each row's own list where it has one, else the
    benchmark's defaults."""
    if tools is not None:
        return ",".join(tools) or "none"
    default = (",".join(benchmark.tools) or "none") + " (default)"
    own = sorted({",".join(row.tools) or "none" for row in rows if row.tools is not None})
    every = all(row.tools is not None for row in rows)
    if not own:
        return default
    if own == ["none"] and every:  # the loader's rows offer none (judge-pairs)
        return "none"
    return "the rows' own: " + " | ".join(own) + ("" if every else f"; else {default}")


def _chunks(todo: list[Row], batch_size: int, backend: GenerationBackend | None) -> list[list[Row]]:
    """The rows in chunks of ``batch_size``, so finished samples reach the log while the run goes on. The ranks of a
    vLLM TP group roll out together: each gets as many chunks (empty ones where it has fewer rows left)."""
    chunk = max(1, batch_size)
    chunks = [todo[start : start + chunk] for start in range(0, len(todo), chunk)]
    if getattr(backend, "tensor_parallel_size", 1) > 1:
        chunks += [[]] * (max(all_gather_object(len(chunks))) - len(chunks))
    return chunks


def sample_record(benchmark: Benchmark, row: Row, trajectory: Trajectory, sample: int, extract: str,
                  parse_fallback: str) -> dict[str, Any]:  # fmt: skip
    """One line of ``samples.jsonl``: the sample's scores under ``extract`` (with ``parse_fallback``), its prediction
    and gold, tool use, its parse errors by kind (``vagent.chat``) and whether its answer's turn had one, turns,
    stop reason, the record's types and groups, and why its requests failed if they did."""
    scores = benchmark.score(row, trajectory, rule=extract)
    guess = None
    if parse_fallback == "random" and scores.get("parsed") == 0.0 and row.choices:
        guess = fallback_option(row, trajectory, sample, extract)
        scores = {**scores, "accuracy": choice_match(guess, str(row.answer), row.choices) if guess else 0.0}
    record = {"id": row.id, "sample": sample, "prediction": trajectory.answer,
              "gold": gold_answers(row.answer, row.answer_type), **scores,
              "tool_calls": [r.name for r in trajectory.tool_results],
              "tool_errors": sum(1 for r in trajectory.tool_results if r.error),
              "tools_ok": [r.name for r in trajectory.tool_results if r.ok],  # the calls that succeeded
              "parse_errors": {k.removeprefix("parse_error/"): int(v) for k, v in trajectory.metrics.items()
                               if k.startswith("parse_error/") and v},  # malformed tags and calls, by kind
              "malformed_answer": bool(trajectory.metrics.get("malformed_answer")),  # its turn broke the grammar
              "turns": trajectory.metrics.get("turns", 0), "stop_reason": trajectory.stop_reason,
              "type": row.extra.get("type") or [], "groups": row.extra.get("groups") or {},
              "cluster": (row.videos or row.images or [row.id])[0],  # what the record asks about (its interval)
              **turn_record(trajectory)}  # fmt: skip
    if guess is not None:
        record["guessed"] = guess
    if "endpoint_error" in trajectory.metrics:  # a request that never got a reply: not a wrong answer
        record["endpoint_error"] = trajectory.metrics["endpoint_error"]
    if clash := [key for key in scores if record[key] != scores[key]]:
        raise ValueError(f"{benchmark.name} metric names {clash} clash with sample fields")
    return record


def well_formed_share(samples: Sequence[dict[str, Any]]) -> float:
    """The share of ``samples`` that answered in a turn that kept the grammar (``vagent.chat``): an ``<answer>`` left
    open around a call, closed around a tag, or written beside a call, is answered (``answered``) but not well
    formed."""
    good = sum(1 for s in samples if s["prediction"] is not None and not s.get("malformed_answer"))
    return good / len(samples) if samples else 0.0


def fallback_option(row: Row, trajectory: Trajectory, sample: int, extract: str) -> str | None:
    """The option a reply the rule could not read scores under ``--parse-fallback random``, from a generator seeded
    with the record's id and the sample's index (a rerun draws the same), as lmms-eval's LongVideoBench task guesses.
    None for a letter that is no option (scored wrong, as lmms-eval does)."""
    import random

    rng = random.Random(f"{row.id}/{sample}")
    return extract_choice(trajectory.last_reply, trajectory.answer, row.choices or [], extract, task=row.source,
                          fallback=rng)  # fmt: skip


def _same_limits(out_dir: Path, limits: RolloutLimits, write: bool) -> None:
    """Refuse to resume a run under other limits (its samples would mix two budgets); record them for a new run."""
    path, asked = out_dir / "limits.json", json.loads(json.dumps(dataclasses.asdict(limits)))  # as read back
    if path.is_file():
        made = json.loads(path.read_text())
        if changed := {k: (made.get(k), v) for k, v in asked.items() if made.get(k) != v}:
            said = ", ".join(f"{k} {was} (now {now})" for k, (was, now) in changed.items())
            raise BenchmarkError(f"{out_dir} holds samples made under other limits: {said}; pass the same limits to "
                                 "resume it, or another --out")  # fmt: skip
    elif write:  # whole or not at all: another rank may read it while this one writes
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asked, indent=1))
        os.replace(tmp, path)


def _merge(benchmark: Benchmark, rows: Sequence[Row], out_dir: Path, world: int, skipped, tools,
           agent: str = "vagent", limits: RolloutLimits | None = None) -> dict[str, Any]:  # fmt: skip
    samples = {
        (s["id"], s["sample"]): s for r in range(world) for s in read_samples(out_dir / f"samples.rank{r}.jsonl")
    }
    order = {row.id: i for i, row in enumerate(rows)}
    merged = sorted((s for s in samples.values() if s["id"] in order), key=lambda s: (order[s["id"]], s["sample"]))
    with open(out_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in merged)
    metrics = summarize(merged, benchmark.metrics)
    if benchmark.report is not None:
        metrics.update(benchmark.report(rows, merged))
    calls = [len(s["tool_calls"]) for s in merged]
    metrics["tool_calls_per_sample"] = sum(calls) / len(calls) if calls else 0.0
    metrics["tool_use_rate"] = sum(1 for c in calls if c) / len(calls) if calls else 0.0
    metrics["tool_error_rate"] = sum(s["tool_errors"] for s in merged) / sum(calls) if sum(calls) else 0.0
    metrics["answered"] = sum(1 for s in merged if s["prediction"] is not None) / len(merged) if merged else 0.0
    metrics["well_formed"] = well_formed_share(merged)
    metrics["benchmark"] = benchmark.name
    metrics["tools"] = _tools_label(tools, benchmark, rows)
    metrics["agent"] = agent
    metrics["limits"] = dataclasses.asdict(limits) if limits is not None else {}
    metrics["skipped"] = [{"record": r, "reason": why} for r, why in skipped]
    if "parsed" in benchmark.metrics:
        metrics["parse_failures"] = sum(1 for s in merged if not s["parsed"] and "endpoint_error" not in s)
    metrics["endpoint_failures"] = sum(1 for s in merged if "endpoint_error" in s)
    write_report(out_dir, metrics)
    trajectories = [t for r in range(world) for t in read_jsonl(out_dir / f"trajectories.rank{r}.jsonl")]
    rewards = {(s["id"], s["sample"]): s.get(benchmark.metrics[0]) for s in merged}
    counts: dict[str, int] = {}
    for t in trajectories:  # show the primary metric as the trajectory's score in the viewer
        k = t.sample if t.sample is not None else counts.get(t.task_id, 0)
        counts[t.task_id] = counts.get(t.task_id, 0) + 1
        t.reward = rewards.get((t.task_id, k))
    write_html(trajectories, out_dir / "trajectories.html", title=f"{benchmark.name}: {out_dir.name}")
    return metrics

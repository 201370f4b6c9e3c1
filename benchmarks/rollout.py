"""Rollout engine efficiency, measured side by side in one run on one tiny random checkpoint.

    python benchmarks/rollout.py [--size small] [--rows 8] [--new-tokens 48] [--device cpu|cuda]

Workload: ``--rows`` rows, row i scripted as (i % 4) sampled turns, then (tool call, sampled turn) x 2,
then an answer: sampled turns sit between tool calls, and rows call tools in different turns. Decoding is greedy,
so every configuration generates exactly the same tokens. The tool sleeps ``--tool-s`` seconds
(0 for the generation-only runs).

Reported:
* engine overhead = wall time of the generation-only rollout / time spent in model forwards during
  it (the same token schedule, the bare forwards: sampling, cache bookkeeping, tokenization, tool
  dispatch and Python are the overhead);
* prefill ratio = tokens run through prefill / unique tokens of the trajectories, with KV-cache
  reuse and without it (every turn re-prefills its whole prefix), and with reuse but without the shared
  prefix (each row prefills the system prompt the rows share on its own), with its generation time;
* async overlap with the sleeping tool: T_async (rows run their tools while others generate),
  T_sync (turn-synchronous: every row waits for every tool before the next turn), and the bound
  T_bound = max(generation-only time, the longest row's critical path = the row's generation time
  when it runs alone + its tool sleeps); overlap efficiency = (T_sync - T_async) / (T_sync - T_bound).
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
import types
from pathlib import Path

import torch
from PIL import Image

from vagent import toolbox
from vagent.model import load_policy
from vagent.rollout import RolloutLimits, Task, run
from vagent.tiny_model import PRESETS, build_tiny_checkpoint
from vagent.types import Observation

SLEEP_CALL = '<tool_call>{"name": "sleep", "arguments": {}}</tool_call>'


def sleep_tool(seconds: float) -> types.ModuleType:
    tool = types.ModuleType("sleep")
    tool.NAME = "sleep"
    tool.SCHEMA = {"name": "sleep", "description": "Waits.", "parameters": {"type": "object", "properties": {}}}
    tool.call = lambda arguments, context: time.sleep(seconds) or Observation(text="done")
    return tool


def tasks(rows: int) -> list[Task]:
    image = Image.new("RGB", (448, 336), (120, 160, 200))
    out = []
    for i in range(rows):
        # Rows start 0-3 sampled turns late, so their tool calls fall in different turns: a turn-synchronous
        # engine then waits for some row's tool at nearly every turn, an asynchronous one overlaps them.
        script: list[str | None] = [None] * (i % 4)
        for _ in range(2):
            script += [SLEEP_CALL, None]
        out.append(Task(id=f"r{i}", question=f"Question {i}?", images=[image], tools=["sleep"],
                        scripted_turns=[*script, "<answer>x</answer>"]))  # fmt: skip
    return out


def timed_run(policy, work, limits, **kwargs):
    stats: dict[str, float] = {}
    finish: dict[str, float] = {}
    start = time.perf_counter()
    out = run(policy, work, limits=limits, batch_size=len(work), stats=stats,
              progress=lambda t: finish.__setitem__(t.task_id, time.perf_counter() - start), **kwargs)  # fmt: skip
    return time.perf_counter() - start, out, stats, finish


def median_run(policy, work, limits, repeat, **kwargs):
    """The run with the median wall time of ``repeat`` (CPU timings on shared machines are noisy)."""
    runs = sorted((timed_run(policy, work, limits, **kwargs) for _ in range(repeat)), key=lambda r: r[0])
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=sorted(PRESETS))
    parser.add_argument("--model", help="A checkpoint dir instead of a tiny random one.")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--tool-s", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=3, help="Runs per configuration; the median is reported.")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    if args.model:
        path = args.model
    else:
        scratch = Path(tempfile.mkdtemp(prefix="vagent-bench-rollout-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        path = build_tiny_checkpoint(scratch / "ckpt", size=args.size)
    policy = load_policy(path, device=args.device, dtype=args.dtype)
    limits = RolloutLimits(max_turns=16, max_new_tokens=args.new_tokens, max_total_tokens=8192, temperature=0.0)
    work = tasks(args.rows)
    toolbox.TOOLS["sleep"] = sleep_tool(0.0)
    timed_run(policy, work[:2], limits)  # warm-up (allocator, kernels)
    t_gen, gen_out, gen_stats, gen_finish = median_run(policy, work, limits, args.repeat)
    _, noreuse_out, noreuse_stats, _ = timed_run(policy, work, limits, reuse_cache=False)
    t_unshared, unshared_out, unshared_stats, _ = median_run(policy, work, limits, args.repeat, share_prefix=False)
    solo = {
        task.id: median_run(policy, [task], limits, args.repeat)[0] for task in work
    }  # each row's generation, alone
    toolbox.TOOLS["sleep"] = sleep_tool(args.tool_s)
    t_async, async_out, _, _ = median_run(policy, work, limits, args.repeat)
    t_sync, sync_out, _, _ = median_run(policy, work, limits, args.repeat, turn_barrier=True)
    del toolbox.TOOLS["sleep"]

    same = [t.token_ids for t in gen_out] == [t.token_ids for t in async_out] == [t.token_ids for t in sync_out]
    same = same and [t.token_ids for t in gen_out] == [t.token_ids for t in noreuse_out]
    same = same and [t.token_ids for t in gen_out] == [t.token_ids for t in unshared_out]
    unique = sum(len(t.token_ids) for t in gen_out)
    sampled = sum(sum(t.loss_mask) for t in gen_out)
    calls = {t.task_id: t.metrics.get("tool_calls", 0) for t in gen_out}
    t_bound = max(t_gen, max(solo[k] + args.tool_s * calls[k] for k in calls))
    efficiency = (t_sync - t_async) / (t_sync - t_bound) if t_sync > t_bound else float("nan")
    # A second reading of "a row's critical path": its finish time in the batched generation-only run + its tools.
    t_bound_batched = max(t_gen, max(gen_finish[k] + args.tool_s * calls[k] for k in calls))
    efficiency_batched = (t_sync - t_async) / (t_sync - t_bound_batched) if t_sync > t_bound_batched else float("nan")

    print(f"# {policy.family} {args.size if not args.model else args.model} on {policy.device} ({policy.dtype}), "
          f"{args.rows} rows, {sum(calls.values())} tool calls, {sampled} sampled / {unique} unique tokens, "
          f"identical tokens in all runs: {same}")  # fmt: skip
    print("| metric | value | target |\n|---|---:|---:|")
    print(
        f"| engine overhead (wall / forward time, generation-only run) | {t_gen / gen_stats['forward_s']:.2f} | <= 1.2 |"
    )
    print(f"| prefill ratio with cache reuse | {gen_stats['prefill_tokens'] / unique:.3f} | <= 1.1 |")
    print(f"| prefill ratio without reuse | {noreuse_stats['prefill_tokens'] / unique:.3f} | |")
    print(f"| prefill ratio with reuse, shared prefix per row | {unshared_stats['prefill_tokens'] / unique:.3f} | |")
    print(
        f"| forward passes (reuse / no reuse) | {gen_stats['forward_passes']} / {noreuse_stats['forward_passes']} | |"
    )
    print(f"| T_gen (tools instant) | {t_gen:.2f} s | |")
    print(f"| T_gen, shared prefix per row | {t_unshared:.2f} s ({t_unshared / t_gen:.2f}x) | |")
    print(f"| T_async ({args.tool_s:g} s tool, concurrent) | {t_async:.2f} s | |")
    print(f"| T_sync (turn-synchronous) | {t_sync:.2f} s | |")
    print(f"| T_bound | {t_bound:.2f} s | |")
    print(f"| overlap efficiency (T_sync - T_async) / (T_sync - T_bound) | {efficiency:.2f} | >= 0.8 |")
    print(f"| T_bound, critical path from the batched run | {t_bound_batched:.2f} s | |")
    print(f"| overlap efficiency with that bound | {efficiency_batched:.2f} | |")
    print(f"| speed-up T_sync / T_async | {t_sync / t_async:.2f}x | |")
    if torch.cuda.is_available() and policy.device.type == "cuda":
        print(f"| decode throughput (generation-only run) | {sampled / t_gen:.0f} tok/s | |")


if __name__ == "__main__":
    main()

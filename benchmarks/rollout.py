"""Rollout engine efficiency, measured side by side in one run on one tiny random checkpoint.

    python benchmarks/rollout.py [--size small] [--vocab trained|qwen] [--rows 8] [--new-tokens 48] [--device cpu|cuda]
                                 [--decode-rows 16 64] [--baseline DIR]

Workload: ``--rows`` rows, row i scripted as (i % 4) sampled turns, then (tool call, sampled turn) x 2,
then an answer: sampled turns sit between tool calls, and rows call tools in different turns. Decoding is greedy,
so every configuration generates exactly the same tokens. The tool sleeps ``--tool-s`` seconds
(0 for the generation-only runs).

Reported:
* engine overhead = wall time of the generation-only rollout / time spent in model forwards during
  it (the same token schedule, the bare forwards: sampling, cache bookkeeping, tokenization, tool
  dispatch and Python are the overhead);
* prefill ratio = tokens run through prefill / unique tokens of the trajectories, with KV-cache
  reuse and without it (every turn re-prefills its whole prefix: ``HFBackend(reuse_cache=False)``), and
  with reuse but without the shared prefix (``HFBackend(share_prefix=False)``), with its generation time;
* async overlap with the sleeping tool: T_async (rows run their tools while others generate),
  T_sync (turn-synchronous: ``TurnBarrier``, every row waits for every tool before the next turn), and the
  bound T_bound = max(generation-only time, the longest row's critical path = the row's generation time
  when it runs alone + its tool sleeps); overlap efficiency = (T_sync - T_async) / (T_sync - T_bound);
* decode time per step at ``--decode-rows`` rows: every row gets the same kind of prompt (system prompt with
  the tool schemas, an image, its own question) and one sampled turn of ``--decode-tokens`` tokens with EOS
  off and stop strings no row reaches, so every decode step runs the full batch; the mean wall time of a decode
  ``step()`` (forward, sampling, stop checks, cache bookkeeping). With ``--baseline DIR`` (a checkout of
  an older vagent, e.g. ``git worktree add /tmp/base afb217c``) the same measurement runs on that code in a
  subprocess, on the same checkpoint, and both columns are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from checkpoint_args import add_checkpoint_arguments, checkpoint_path
from PIL import Image

from vagent import toolbox
from vagent.model import load_policy
from vagent.rollout import RolloutLimits, Task, run
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


def timed_run(policy, work, limits, make_backend=None):
    """One rollout with a fresh backend (``make_backend(policy)``; default ``HFBackend``): wall time, trajectories,
    the backend's counters and each row's finish time."""
    from vagent.rollout import HFBackend

    backend = (make_backend or HFBackend)(policy)
    finish: dict[str, float] = {}
    start = time.perf_counter()
    out = run(policy, work, limits=limits, batch_size=len(work), backend=backend,
              progress=lambda t: finish.__setitem__(t.task_id, time.perf_counter() - start))  # fmt: skip
    return time.perf_counter() - start, out, backend.stats(), finish


def median_run(policy, work, limits, repeat, make_backend=None):
    """The run with the median wall time of ``repeat`` (CPU timings on shared machines are noisy)."""
    runs = sorted((timed_run(policy, work, limits, make_backend) for _ in range(repeat)), key=lambda r: r[0])
    return runs[len(runs) // 2]


def decode_step_ms(policy, rows: int, new_tokens: int, repeat: int = 1, warm_up: bool = True) -> dict[str, float]:
    """Mean wall time of a decode ``step()`` at ``rows`` rows, the median over ``repeat`` rollouts (see the module
    docstring). Uses only what old and
    new vagent share (``run``, ``HFBackend.step`` and its ``_pending`` queue), so ``--baseline`` can run it."""
    from vagent.rollout import hf_backend

    image = Image.new("RGB", (448, 336), (120, 160, 200))
    work = [Task(id=f"d{i}", question=f"Question number {i}: what is in the picture?", images=[image])
            for i in range(rows)]  # fmt: skip
    policy.model.generation_config.eos_token_id = None  # no EOS: every row decodes exactly new_tokens tokens
    # Stop strings no row reaches, shaped like the real ones: their check costs what it costs every step (the old
    # code decoded every row's tail), and the batch stays full. The engine reads them when it starts.
    sys.modules["vagent.rollout.engine"].STOP_STRINGS = ("</never_a_tool_call>", "</never_an_answer>")
    limits = RolloutLimits(max_turns=1, max_new_tokens=new_tokens, max_total_tokens=8192, temperature=0.0)
    times: list[float] = []
    original = hf_backend.HFBackend.step

    def timed_step(self):
        decoding = not self._pending
        start = time.perf_counter()
        out = original(self)
        if decoding:
            times.append(time.perf_counter() - start)
        return out

    hf_backend.HFBackend.step = timed_step
    means = []
    try:
        if warm_up:
            run(policy, work[:2], limits=limits, batch_size=2)
        for _ in range(repeat):
            times.clear()
            run(policy, work, limits=limits, batch_size=rows)
            means.append(1000 * sum(times) / len(times))
    finally:
        hf_backend.HFBackend.step = original
    return {"rows": rows, "steps": len(times), "step_ms": sorted(means)[len(means) // 2], "runs_ms": means}


def decode_table(path: str, args: argparse.Namespace) -> list[dict[str, float]]:
    policy = load_policy(path, device=args.device, dtype=args.dtype)
    return [decode_step_ms(policy, rows, args.decode_tokens, args.repeat) for rows in args.decode_rows]


def baseline_table(path: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """``decode_table`` run by the vagent at ``args.baseline`` (a subprocess with that checkout first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))
    command = [sys.executable, __file__, "--decode-only", "--model", path, "--decode-tokens", str(args.decode_tokens),
               "--decode-rows", *map(str, args.decode_rows), "--repeat", str(args.repeat), "--dtype", args.dtype, "--threads", str(torch.get_num_threads())]  # fmt: skip
    if args.device:
        command += ["--device", args.device]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--tool-s", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=3, help="Runs per configuration; the median is reported.")
    parser.add_argument(
        "--decode-rows", type=int, nargs="*", default=[16, 64], help="Batch sizes of the decode timing."
    )
    parser.add_argument("--decode-tokens", type=int, default=32, help="Tokens each row decodes in the decode timing.")
    parser.add_argument("--baseline", help="A checkout of another vagent to time decode steps on, side by side.")
    parser.add_argument("--decode-only", action="store_true", help="Only the decode timing, as JSON (baseline runs).")
    args = parser.parse_args()
    path = checkpoint_path(args)
    if args.decode_only:
        print(json.dumps(decode_table(path, args)))
        return
    policy = load_policy(path, device=args.device, dtype=args.dtype)
    engine_table(policy, args)
    before = baseline_table(path, args) if args.baseline else None
    after = decode_table(path, args)  # last: it turns EOS off and swaps the stop strings in this process
    print(f"\n| decode step ({args.decode_tokens} tokens per row, full batch) | this code | "
          f"{'baseline ' + args.baseline if before else ''} |\n|---|---:|---:|")  # fmt: skip
    for i, now in enumerate(after):
        old = f"{before[i]['step_ms']:.1f} ms ({before[i]['step_ms'] / now['step_ms']:.2f}x)" if before else ""
        print(f"| {now['rows']} rows, ms per decode step | {now['step_ms']:.1f} ms | {old} |")


def engine_table(policy, args: argparse.Namespace) -> None:
    """Engine overhead, prefill ratios and tool/generation overlap (the first table)."""
    from vagent.rollout import HFBackend, TurnBarrier

    limits = RolloutLimits(max_turns=16, max_new_tokens=args.new_tokens, max_total_tokens=8192, temperature=0.0)
    work = tasks(args.rows)
    toolbox.TOOLS["sleep"] = sleep_tool(0.0)
    timed_run(policy, work[:2], limits)  # warm-up (allocator, kernels)
    t_gen, gen_out, gen_stats, gen_finish = median_run(policy, work, limits, args.repeat)
    _, noreuse_out, noreuse_stats, _ = timed_run(policy, work, limits, lambda p: HFBackend(p, reuse_cache=False))
    unshared = lambda p: HFBackend(p, share_prefix=False)  # noqa: E731
    t_unshared, unshared_out, unshared_stats, _ = median_run(policy, work, limits, args.repeat, unshared)
    solo = {task.id: median_run(policy, [task], limits, args.repeat)[0] for task in work}  # each row alone
    toolbox.TOOLS["sleep"] = sleep_tool(args.tool_s)
    t_async, async_out, _, _ = median_run(policy, work, limits, args.repeat)
    t_sync, sync_out, _, _ = median_run(policy, work, limits, args.repeat, lambda p: TurnBarrier(HFBackend(p)))
    del toolbox.TOOLS["sleep"]

    ids = [t.token_ids for t in gen_out]
    same = all([t.token_ids for t in other] == ids for other in (async_out, sync_out, noreuse_out, unshared_out))
    unique = sum(len(t.token_ids) for t in gen_out)
    sampled = sum(sum(t.loss_mask) for t in gen_out)
    calls = {t.task_id: t.metrics.get("tool_calls", 0) for t in gen_out}
    t_bound = max(t_gen, max(solo[k] + args.tool_s * calls[k] for k in calls))
    efficiency = (t_sync - t_async) / (t_sync - t_bound) if t_sync > t_bound else float("nan")
    # A second reading of "a row's critical path": its finish time in the batched generation-only run + its tools.
    t_bound_batched = max(t_gen, max(gen_finish[k] + args.tool_s * calls[k] for k in calls))
    efficiency_batched = (t_sync - t_async) / (t_sync - t_bound_batched) if t_sync > t_bound_batched else float("nan")

    print(f"# {policy.family} {args.model or args.size} on {policy.device} ({policy.dtype}), "
          f"{args.rows} rows, {sum(calls.values())} tool calls, {sampled} sampled / {unique} unique tokens, "
          f"identical tokens in all runs: {same}")  # fmt: skip
    print("| metric | value | target |\n|---|---:|---:|")
    print(
        f"| engine overhead (wall / forward time, generation-only run) | {t_gen / gen_stats.forward_s:.2f} | <= 1.15 |"
    )
    print(f"| prefill ratio with cache reuse | {gen_stats.prefill_tokens / unique:.3f} | <= 1.1 |")
    print(f"| prefill ratio without reuse | {noreuse_stats.prefill_tokens / unique:.3f} | |")
    print(f"| prefill ratio with reuse, shared prefix per row | {unshared_stats.prefill_tokens / unique:.3f} | |")
    print(f"| forward passes (reuse / no reuse) | {gen_stats.forward_passes} / {noreuse_stats.forward_passes} | |")
    print(f"| stop-string tail decodes / decode steps | {gen_stats.stop_decodes} / {gen_stats.decode_steps} | |")
    print(f"| KV storage growths (generation-only run) | {gen_stats.cache_growths} | |")
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

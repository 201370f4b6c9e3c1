"""Rollout engine efficiency, measured side by side in one run on one tiny random checkpoint.

    python benchmarks/rollout.py [--size small] [--vocab trained|qwen] [--rows 8] [--new-tokens 48] [--device cpu|cuda]
                                 [--decode-rows 16 64] [--baseline DIR] [--doc]

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
  the tool schemas, an image, its own question) and one turn of ``--decode-tokens`` tokens, greedy or sampled at
  each of ``--decode-temperatures``, with EOS off and stop strings no row reaches, so every decode step runs the
  full batch; the mean wall time of a decode ``step()`` (forward, sampling, stop checks, cache bookkeeping), the
  sampled tokens/s it gives (rows / step time), and the read bound: the time to read once what a decode step must
  read (the language model's weights the step multiplies by, not the vision tower or the input embedding's unused
  rows, plus every row's KV cache at the mean context of the decode) at the bandwidth of a large copy on the
  device, measured in the same run. On CUDA, where decode steps replay CUDA graphs, the same steps are also timed
  run eagerly (``HFBackend(policy, cuda_graphs=False)``). Each configuration first runs once untimed on the backend
  it is timed on (graphs captured, kernels chosen). With ``--baseline DIR`` (a checkout of an older vagent,
  e.g. ``git worktree add /tmp/base afb217c``) the same measurement runs on that code in a subprocess, on the
  same checkpoint, before this process loads it, and its column is printed too.

``--doc`` also writes both tables into docs/benchmarks.md, in the section ``rollout-<device>-<vocab>`` (e.g.
``rollout-cpu-qwen``; ``-tool<ms>ms`` appended when ``--tool-s`` is not 0.2), with the command, the commit and the
machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types

import torch
from checkpoint_args import add_checkpoint_arguments, baseline_env, checkout_name, checkpoint_label, checkpoint_path
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


def full_batch_decoding(policy) -> None:
    """No EOS (every row decodes exactly its tokens; a backend reads the EOS ids when it is made) and stop strings
    no row reaches, shaped like the real ones: their check costs what it costs every step (the old code decoded
    every row's tail), and the batch stays full. The engine reads the stop strings when it starts."""
    policy.model.generation_config.eos_token_id = None
    sys.modules["vagent.rollout.engine"].STOP_STRINGS = ("</never_a_tool_call>", "</never_an_answer>")


def decode_step_ms(
    policy,
    rows: int,
    new_tokens: int,
    repeat: int = 1,
    warm_up: bool = True,
    temperature: float = 0.0,
    backend=None,
) -> dict[str, float]:
    """Mean wall time of a decode ``step()`` at ``rows`` rows, the median over ``repeat`` rollouts (see the module
    docstring). Uses only what old and new vagent share (``run``, ``HFBackend.step`` and its ``_pending`` queue), so
    ``--baseline`` can run it. ``backend``: one backend for the warm-up and every timed rollout (its CUDA graphs
    are captured in the warm-up); default a new one per rollout. Call ``full_batch_decoding`` first."""
    from vagent.rollout import hf_backend

    image = Image.new("RGB", (448, 336), (120, 160, 200))
    work = [Task(id=f"d{i}", question=f"Question number {i}: what is in the picture?", images=[image])
            for i in range(rows)]  # fmt: skip
    limits = RolloutLimits(max_turns=1, max_new_tokens=new_tokens, max_total_tokens=8192, temperature=temperature)
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
    reuse = {"backend": backend} if backend is not None else {}  # old checkouts' run() takes no backend
    try:
        if warm_up:  # the full batch: every shape the timed runs use
            run(policy, work, limits=limits, batch_size=rows, **reuse)
        for _ in range(repeat):
            times.clear()
            out = run(policy, work, limits=limits, batch_size=rows, **reuse)
            means.append(1000 * sum(times) / len(times))
    finally:
        hf_backend.HFBackend.step = original
    prompt = sum(len(t.token_ids) - sum(t.loss_mask) for t in out) / len(out)
    return {"rows": rows, "steps": len(times), "step_ms": sorted(means)[len(means) // 2], "runs_ms": means,
            "context": prompt + new_tokens / 2}  # fmt: skip


def copy_bandwidth(device: torch.device, mib: int = 1024, repeat: int = 20) -> float:
    """Bytes per second read and written by a large on-device copy: the best of ``repeat`` timed copies."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeat + 2):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def decode_read_bytes(policy, rows: int, context: float) -> float:
    """Bytes a decode step must read at least once: the weights it multiplies by (the language model and its head;
    not the vision tower, nor the input embedding, of which it reads one row per row) and ``rows`` KV caches of
    ``context`` tokens."""
    model = policy.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    skip = {id(p) for n, p in model.named_parameters() if "visual" in n}
    if embed is not head:
        skip.add(id(embed))
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    config = model.config
    text = getattr(config, "text_config", None) or config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * head.element_size()
    return weights + rows * context * per_token


def decode_table(policy, args: argparse.Namespace, make_backend=None) -> list[dict[str, float]]:
    """``decode_step_ms`` at each temperature and row count; ``make_backend(policy)`` makes each one's backend
    (default: ``run``'s own, as an old checkout has it)."""
    full_batch_decoding(policy)
    return [{**decode_step_ms(policy, rows, args.decode_tokens, args.repeat, temperature=t,
                              backend=make_backend(policy) if make_backend else None), "temperature": t}
            for t in args.decode_temperatures for rows in args.decode_rows]  # fmt: skip


def baseline_table(path: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """``decode_table`` run by the vagent at ``args.baseline`` (a subprocess with that checkout first on the path)."""
    env = baseline_env(args.baseline)
    command = [sys.executable, __file__, "--decode-only", "--model", path, "--decode-tokens", str(args.decode_tokens),
               "--decode-rows", *map(str, args.decode_rows), "--decode-temperatures", *map(str, args.decode_temperatures),
               "--repeat", str(args.repeat), "--dtype", args.dtype, "--threads", str(torch.get_num_threads())]  # fmt: skip
    if args.device:
        command += ["--device", args.device]
    out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr shows
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
    parser.add_argument("--decode-temperatures", type=float, nargs="*", default=[0.0, 1.0],
                        help="Sampling temperatures of the decode timing (0: greedy).")  # fmt: skip
    parser.add_argument("--baseline", help="A checkout of another vagent to time decode steps on, side by side.")
    parser.add_argument("--decode-only", action="store_true", help="Only the decode timing, as JSON (baseline runs).")
    parser.add_argument("--doc", action="store_true", help="Also write the tables into docs/benchmarks.md.")
    args = parser.parse_args()
    path = checkpoint_path(args)
    # the baseline's subprocess first: one model in the device's memory at a time
    before = baseline_table(path, args) if args.baseline and args.decode_rows and not args.decode_only else None
    policy = load_policy(path, device=args.device, dtype=args.dtype)
    if args.decode_only:
        print(json.dumps(decode_table(policy, args)))
        return
    engine = engine_table(policy, args)
    decode = decode_lines(policy, args, before) if args.decode_rows else []
    if args.doc:
        from doc_table import write_section

        key = f"rollout-{policy.device.type}-{checkpoint_label(args)}"
        if args.tool_s != 0.2:
            key += f"-tool{round(args.tool_s * 1000)}ms"
        body = "\n\n".join(filter(None, ("\n".join(engine), "\n".join(decode))))
        write_section(key, body, device=str(policy.device))


def decode_lines(policy, args: argparse.Namespace, before: list[dict[str, float]] | None) -> list[str]:
    """The decode table (this code, its eager steps on CUDA, and ``before``, the baseline's ``decode_table``):
    its lines, also printed."""
    from vagent.rollout import HFBackend

    # last: they turn EOS off and swap the stop strings in this process
    graphs = policy.device.type == "cuda"
    eager = decode_table(policy, args, lambda p: HFBackend(p, cuda_graphs=False)) if graphs else None
    after = decode_table(policy, args, HFBackend)
    bandwidth = copy_bandwidth(policy.device)
    columns = [
        *(["eager steps, ms"] if eager else []),
        *([f"baseline {checkout_name(args.baseline)}, ms"] if before else []),
    ]
    decode = [f"Decode step: {args.decode_tokens} tokens per row, full batch; read bound at {bandwidth / 1e9:,.0f} GB/s "
              f"(a {policy.device.type} copy, measured in this run)" + ("; steps replayed from CUDA graphs, against "
              "the same steps run eagerly" if graphs else "") + ".", "",
              f"| rows | sampling | ms per decode step | sampled tokens/s | read bound | step / bound | {' | '.join(columns)} |",
              "|---:|---|---:|---:|---:|---:|" + "---:|" * len(columns)]  # fmt: skip
    for i, now in enumerate(after):
        bound_ms = 1000 * decode_read_bytes(policy, now["rows"], now["context"]) / bandwidth
        others = [f"{t[i]['step_ms']:.1f} ({t[i]['step_ms'] / now['step_ms']:.2f}x)" for t in (eager, before) if t]
        sampling = f"temperature {now['temperature']:g}" if now["temperature"] > 0 else "greedy"
        decode.append(f"| {now['rows']} | {sampling} | {now['step_ms']:.1f} | {1000 * now['rows'] / now['step_ms']:,.0f} | "
                      f"{bound_ms:.2f} ms | {now['step_ms'] / bound_ms:.1f}x | {' | '.join(others)} |")  # fmt: skip
    print("\n" + "\n".join(decode))
    return decode


def engine_table(policy, args: argparse.Namespace) -> list[str]:
    """Engine overhead, prefill ratios and tool/generation overlap (the first table): its lines, also printed."""
    from vagent.rollout import HFBackend, TurnBarrier

    limits = RolloutLimits(max_turns=16, max_new_tokens=args.new_tokens, max_total_tokens=8192, temperature=0.0)
    work = tasks(args.rows)
    toolbox.TOOLS["sleep"] = sleep_tool(0.0)
    timed_run(policy, work, limits)  # warm-up (allocator, kernels)
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

    rows = [
        ("engine overhead (wall / forward time, generation-only run)", f"{t_gen / gen_stats.forward_s:.2f}", "<= 1.15"),
        ("prefill ratio with cache reuse", f"{gen_stats.prefill_tokens / unique:.3f}", "<= 1.1"),
        ("prefill ratio without reuse", f"{noreuse_stats.prefill_tokens / unique:.3f}", ""),
        ("prefill ratio with reuse, shared prefix per row", f"{unshared_stats.prefill_tokens / unique:.3f}", ""),
        ("forward passes (reuse / no reuse)", f"{gen_stats.forward_passes} / {noreuse_stats.forward_passes}", ""),
        ("stop-string tail decodes / decode steps", f"{gen_stats.stop_decodes} / {gen_stats.decode_steps}", ""),
        ("KV storage growths (generation-only run)", f"{gen_stats.cache_growths}", ""),
        (
            "CUDA graph captures (generation-only run)",
            f"{gen_stats.graph_captures}, {gen_stats.graph_capture_s:.2f} s",
            "",
        ),
        ("T_gen (tools instant)", f"{t_gen:.2f} s", ""),
        ("T_gen, shared prefix per row", f"{t_unshared:.2f} s ({t_unshared / t_gen:.2f}x)", ""),
        (f"T_async ({args.tool_s:g} s tool, concurrent)", f"{t_async:.2f} s", ""),
        ("T_sync (turn-synchronous)", f"{t_sync:.2f} s", ""),
        ("T_bound", f"{t_bound:.2f} s", ""),
        ("overlap efficiency (T_sync - T_async) / (T_sync - T_bound)", f"{efficiency:.2f}", ">= 0.8"),
        ("T_bound, critical path from the batched run", f"{t_bound_batched:.2f} s", ""),
        ("overlap efficiency with that bound", f"{efficiency_batched:.2f}", ""),
        ("speed-up T_sync / T_async", f"{t_sync / t_async:.2f}x", ""),
        ("sampled tokens/s (generation-only run)", f"{sampled / t_gen:,.0f}", ""),
    ]
    if policy.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(policy.device) / 2**30
        rows.append(("peak GPU memory allocated (model included)", f"{peak:.1f} GiB", ""))
    lines = [f"{policy.family} {args.model or args.size} ({policy.model.get_input_embeddings().num_embeddings:,}-row vocabulary) on "
             f"{policy.device} ({policy.dtype}), {args.rows} rows, {sum(calls.values())} tool calls, {sampled} sampled / "
             f"{unique} unique tokens, identical tokens in all runs: {same}.", "",
             "| metric | value | target |", "|---|---:|---:|", *(f"| {m} | {v} | {t} |" for m, v, t in rows)]  # fmt: skip
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

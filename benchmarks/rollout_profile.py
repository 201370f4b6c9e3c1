"""Where a rollout decode step's time goes: a ``torch.profiler`` breakdown, this code and (optionally) an older one.

    python benchmarks/rollout_profile.py [--workload decode|multiturn] [--size small] [--vocab trained|qwen] [--rows 16]
                                         [--decode-tokens 32] [--baseline DIR] [--doc]

Workloads: ``decode`` is ``benchmarks/rollout.py``'s decode timing (every row one sampled turn, EOS off, stop
strings that no row reaches, so every decode step runs the full batch) and only its decode steps are profiled;
``multiturn`` is that script's generation-only rollout (rows sample, call an instant tool, rejoin the batch) and
every backend step is profiled, prefills (where rows join) included. Labels are put on the backend's parts from
outside (the methods both the old and the new ``HFBackend`` have, plus each one's cache and stop-string code),
and the steps' time is split into:

* forward: the model forward (``HFBackend._forward``), of which attention (``aten::scaled_dot_product_attention``)
  and the KV cache update inside the layers (``DynamicLayer.update``'s ``torch.cat`` before,
  ``SlotCache.update``'s in-place write and read after) are shown apart;
* cache management outside the forward (before: ``_join``/``_leave`` compaction; after: ``SlotCache.plan``);
* sampling (``HFBackend._sample``); stop strings (before: ``tokenizer.decode`` of every row's tail; after:
  ``StopMatcher.matches``);
* Python and the rest: the step's time outside all of these (bookkeeping, building inputs, masks).

The parts are host (CPU) times. On CUDA, where kernels run asynchronously, a part's time is its launches plus any
wait for the GPU (sampling waits for the logits), and one more row gives the kernels the steps launched, on the
GPU's clock: a step far longer than its kernels is bound by the host, not the GPU. (The profiler does not attribute
the kernels of a CUDA graph's replay to the step: with graphs that row reads "not traced".)

With ``--baseline DIR`` the same profile runs in a subprocess on the vagent at DIR (e.g. a
``git worktree add /tmp/base afb217c``), on the same checkpoint; both tables are printed. ``--doc`` also writes the
table into docs/benchmarks.md, section ``profile-<device>-<vocab>-<workload>``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from checkpoint_args import add_checkpoint_arguments, baseline_env, checkout_name, checkpoint_label, checkpoint_path
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from vagent.model import load_policy

PARTS = ("forward", "attention", "cache (in forward)", "cache (outside)", "sampling", "stop strings", "python/rest")


def _label(owner: object, name: str, label: str, gate: list[bool]) -> None:
    """Wrap ``owner.name`` so that, inside a decode step (``gate[0]``), it runs under ``record_function(label)``."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if not gate[0]:
            return original(*args, **kwargs)
        with record_function(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def _instrument(policy, all_steps: bool) -> list[bool]:
    from transformers.cache_utils import DynamicLayer

    from vagent.rollout import hf_backend

    gate = [False]
    backend = hf_backend.HFBackend
    _label(backend, "_forward", "forward", gate)
    _label(backend, "_graph_decode", "forward", gate)  # a decode step replayed from a CUDA graph
    _label(backend, "_sample", "sampling", gate)
    for name in ("_join", "_leave"):  # the old backend's batch compaction
        _label(backend, name, "cache (outside)", gate)
    _label(DynamicLayer, "update", "cache (in forward)", gate)
    _label(policy.tokenizer, "decode", "stop strings", gate)  # the old backend decoded every row's tail
    if importlib.util.find_spec("vagent.rollout.kv_cache"):
        from vagent.rollout.kv_cache import SlotCache
        from vagent.rollout.stops import StopMatcher

        _label(SlotCache, "update", "cache (in forward)", gate)
        for name in ("plan", "reserve", "copy_slot"):
            _label(SlotCache, name, "cache (outside)", gate)
        _label(StopMatcher, "matches", "stop strings", gate)
    step = backend.step

    def decode_step(self):
        if self._pending and not all_steps:  # a prefill step: not profiled in the decode workload
            return step(self)
        gate[0] = True
        try:
            with record_function("decode_step"):
                return step(self)
        finally:
            gate[0] = False

    backend.step = decode_step
    return gate


def _breakdown(events) -> dict[str, float]:
    """Sum each part over the decode steps (ms per step); nested labels are counted once, at the outermost."""
    totals = dict.fromkeys(PARTS, 0.0)
    steps = [e for e in events if e.name == "decode_step" and e.device_type == DeviceType.CPU]

    def walk(event, inside_forward: bool) -> float:
        """Adds the labelled parts under ``event``; returns the time of labelled parts directly under it."""
        covered = 0.0
        for child in event.cpu_children:
            name = child.name
            ms = child.cpu_time_total / 1000
            if name == "aten::scaled_dot_product_attention":
                totals["attention"] += ms
                covered += ms
            elif name in totals:
                totals[name] += ms
                covered += ms
                walk(child, inside_forward or name == "forward")
            else:
                covered += walk(child, inside_forward)
        return covered

    for step in steps:
        walk(step, False)
    step_ms = sum(e.cpu_time_total for e in steps) / 1000
    outside = totals["forward"] + totals["cache (outside)"] + totals["sampling"] + totals["stop strings"]
    totals["python/rest"] = step_ms - outside
    per_step = {k: v / len(steps) for k, v in totals.items()}
    per_step["step"] = step_ms / len(steps)
    # The kernels the steps launched, summed on the GPU's clock: far under the step's wall time means the GPU
    # waits for the host (launches, Python, syncs), not the other way round.
    per_step["GPU kernels"] = sum(e.device_time_total for e in steps) / 1000 / len(steps)
    per_step["steps"] = len(steps)
    return per_step


def _replays_graphs(backend) -> bool:
    """Whether the backend's decode steps replayed CUDA graphs: the profiler does not attribute a replay's kernels
    to the step that launched it, so their GPU time is not in the profile."""
    graphs = getattr(backend, "graphs", None)
    return bool(graphs is not None and graphs.captures)


def profile_decode(policy, args: argparse.Namespace) -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("bench_rollout", Path(__file__).with_name("rollout.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if policy.device.type == "cuda" else [])
    # This code: one backend for the warm-up and the profiled run, so its CUDA graphs are captured before the
    # profile (the baseline, --json, makes a backend per run as its run() does).
    if args.workload == "decode":
        bench.full_batch_decoding(policy)  # before a backend reads the EOS ids
    backend = None
    if not args.json:
        from vagent.rollout import HFBackend

        backend = HFBackend(policy, cuda_graphs=False if args.eager else None)
    if args.workload == "decode":
        # warm-up at the profiled shapes
        bench.decode_step_ms(policy, args.rows, args.decode_tokens, warm_up=False, backend=backend)
        _instrument(policy, all_steps=False)
        with profile(activities=activities) as prof:
            bench.decode_step_ms(policy, args.rows, args.decode_tokens, warm_up=False, backend=backend)
        return {**_breakdown(prof.events()), "graphs": _replays_graphs(backend)}
    from vagent import toolbox
    from vagent.rollout import RolloutLimits, run

    toolbox.TOOLS["sleep"] = bench.sleep_tool(0.0)
    limits = RolloutLimits(max_turns=16, max_new_tokens=args.decode_tokens, max_total_tokens=8192, temperature=0.0)
    work = bench.tasks(args.rows)
    reuse = {"backend": backend} if backend is not None else {}
    run(policy, work, limits=limits, batch_size=len(work), **reuse)  # warm-up
    _instrument(policy, all_steps=True)
    with profile(activities=activities) as prof:
        with record_function("rollout"):
            run(policy, work, limits=limits, batch_size=len(work), **reuse)
    out = {**_breakdown(prof.events()), "graphs": _replays_graphs(backend)}
    total = next(e for e in prof.events() if e.name == "rollout").cpu_time_total / 1000
    out["engine outside steps (ms per run)"] = total - out["step"] * out["steps"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--workload", default="decode", choices=["decode", "multiturn"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--baseline", help="A checkout of another vagent to profile too, side by side.")
    parser.add_argument("--json", action="store_true", help="Print this code's breakdown as JSON (baseline runs).")
    parser.add_argument(
        "--eager", action="store_true", help="Decode eagerly on CUDA too (HFBackend(cuda_graphs=False))."
    )
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args()
    path = checkpoint_path(args)
    if args.json:
        print(json.dumps(profile_decode(load_policy(path, device=args.device, dtype=args.dtype), args)))
        return
    before = None
    if args.baseline:
        env = baseline_env(args.baseline)
        command = [sys.executable, __file__, "--json", "--model", path, "--rows", str(args.rows),
                   "--decode-tokens", str(args.decode_tokens), "--workload", args.workload, "--dtype", args.dtype, "--threads", str(torch.get_num_threads())]  # fmt: skip
        out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr shows
        before = json.loads(out.strip().splitlines()[-1])
    policy = load_policy(path, device=args.device, dtype=args.dtype)  # after the baseline: one model in memory
    after = profile_decode(policy, args)
    kind = "decode steps" if args.workload == "decode" else "every backend step of a multi-turn rollout"
    lines = [f"{kind.capitalize()}, {args.rows} rows, {args.decode_tokens} tokens per turn, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; ms per step (share of the step).", "",
             f"| part | this code | {'baseline ' + checkout_name(args.baseline) if before else ''} |", "|---|---:|---:|"]  # fmt: skip
    for part in ("step", *PARTS):
        cells = [f"{t[part]:.2f} ({t[part] / t['step']:.0%})" if t else "" for t in (after, before)]
        lines.append(f"| {part} | {cells[0]} | {cells[1]} |")
    if policy.device.type == "cuda":
        cells = ["not traced (graph replays)" if t and t.get("graphs") else
                 f"{t['GPU kernels']:.2f} ({t['GPU kernels'] / t['step']:.0%})" if t else "" for t in (after, before)]  # fmt: skip
        lines.append(f"| GPU kernels (device clock) | {cells[0]} | {cells[1]} |")
    lines.append(f"| steps | {after['steps']} | {before['steps'] if before else ''} |")
    if args.workload == "multiturn":
        key = "engine outside steps (ms per run)"
        lines.append(f"| {key} | {after[key]:.0f} | {f'{before[key]:.0f}' if before else ''} |")
    print("\n".join(lines))
    if args.doc:
        from doc_table import write_section

        key = f"profile-{policy.device.type}-{checkpoint_label(args)}-{args.workload}" + (
            "-eager" if args.eager else ""
        )
        write_section(key, "\n".join(lines), device=str(policy.device))


if __name__ == "__main__":
    main()

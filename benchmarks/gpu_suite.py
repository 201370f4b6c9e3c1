"""The GPU proof in one command: the rollout, one whole GRPO step and SFT steps of the 3B configs, on one device.

    python benchmarks/gpu_suite.py --out DIR [--parts env rollout grpo_step sft gpu_tests vllm] [--doc]
    python benchmarks/gpu_suite.py --device cpu --size tiny --out DIR            (every part, tiny, under a minute)

On CUDA the checkpoint is Qwen2.5-VL-3B's shape (text 2048 x 36, GQA 16/2, vision 1280 x 32, tied head) with Qwen's
151,936-row vocabulary and random bf16 weights, made on the device in seconds (``--checkpoint-dir`` keeps it for the
next call). ``--device cpu --size tiny`` runs the same parts on a tiny tied checkpoint, so a bug a CPU can find costs
no GPU minute (a default test runs it).

Each part runs in a process of its own (a part that fails or runs out of memory records its traceback or its exit
status, and the suite goes on; each part starts with the device empty) and writes ``DIR/<part>.log``; the numbers go
to ``DIR/results.json`` and, with ``--doc``, to docs/benchmarks.md (section ``gpu-suite``). ``--parts`` picks parts.
``--budget S`` fits the whole call into S seconds (a lent GPU comes for minutes): each part gets a share of what is
left, a part that runs out of its time is killed with its process group, and what it measured by then (each decode
setting, each SFT run as it ends) is kept with the status ``timeout``. ``benchmarks/gpu_suite.sh`` runs it on a
machine without a registry (its wheels come from ``benchmarks/gpu_wheels.sh``).

* ``env``: device, driver, torch and transformers, the copy bandwidth and the dense matmul TFLOP/s measured here.
* ``rollout``: the decode step at 16, 64 and 256 rows with each attention kernel side by side (``rollout.attention``:
  SDPA over the gathered slots, FlexAttention over the whole storage; CUDA graphs and eager on CUDA), against the time
  to read the weights and the KV cache once at the measured bandwidth, and flex's step over SDPA's (a "graphs" row
  whose captures failed says so); a rollout whose tool sleeps 200 ms, run with rows overlapping their tools and
  turn-synchronously (graph captures left out); the image prefill (vision tower + prefill) of 1000 x 750 images,
  wall time and the forwards alone. Flex is skipped, with the reason, where Triton has no C compiler or Python.h.
* ``grpo_step``: ``configs/grpo/qwen2_5_vl_3b.yaml`` under FSDP on one process, sizes scaled to one device: episodes
  of two scripted crop turns (random weights call no tools) and a sampled answer, a reward that spreads within every
  group; the second step's stage times, sampled and trained tokens/s, the update's MFU, and the peak device memory
  against ``vagent memory``'s plan for the same config at the longest episode's length. 8 GiB of KV storage keeps
  the plan inside an 80 GB device. No checkpoint is written (``train.save_final=false``).
* ``sft``: steps of ``configs/sft/qwen2_5_vl_3b_fsdp.yaml`` with the chunked LM head and with whole logits, and of the
  ZeRO-2 config where DeepSpeed imports: tokens/s, MFU, peak memory against the plan at the rows' own length.
* ``gpu_tests``: ``pytest -m gpu``.
* ``vllm`` (where vLLM is installed; skipped, saying so, elsewhere): ``benchmarks/vllm_rollout.py``'s single-turn
  workload on the suite's checkpoint (64 rows with an image, 128 sampled tokens each, EOS off): bare vLLM
  (``LLM.generate``), vagent's rollout over ``VLLMBackend`` (target: at least 0.9 of bare vLLM's tokens/s) and over
  ``HFBackend``; then the update's round trip on the engine (level-2 sleep, the weights streamed back by
  ``load_weights``, the caches reset) with its seconds, and how many rows' greedy tokens after it equal those before
  it (stale or garbled weights after a wake-up show here: trl#5312, vllm#29341). On CPU it runs the ``small`` preset
  (vLLM's CPU attention takes no head size below 32).

MFU = 6 x the language model's parameters x tokens/s / the device's dense bf16 peak (``--peak-tflops``; by default
read off the device's name: 989 for an H100 SXM or an H200, 756 for an H100 PCIe). An estimate: the frozen vision
tower (forward only, on patches) and attention's own FLOPs are left out, and the head is counted at every position
(the chunked head runs at the trained ones only). On CPU it is not reported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARTS = ("env", "rollout", "grpo_step", "sft", "gpu_tests", "vllm")
# Under --budget: each part's share of the time left when it starts, against the shares of the parts still to run.
SHARES = {"env": 0.04, "rollout": 0.4, "grpo_step": 0.26, "sft": 0.22, "gpu_tests": 0.08, "vllm": 0.2}
GRPO_CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_3b.yaml"
SFT_CONFIGS = {"fsdp": ROOT / "configs" / "sft" / "qwen2_5_vl_3b_fsdp.yaml",
               "zero2": ROOT / "configs" / "sft" / "qwen2_5_vl_3b_zero2.yaml"}  # fmt: skip
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # Qwen2.5-VL's processor defaults
CROPS = ['<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 224, 168]}}</tool_call>',
         '<tool_call>{"name": "crop", "arguments": {"bbox": [112, 84, 336, 252]}}</tool_call>']  # fmt: skip

# Per scale: decode rows, decode tokens, GRPO prompts x group, tokens per turn, SFT rows and steps, matmul size.
SCALES = {
    "gpu": {"decode_rows": [16, 64, 256], "decode_tokens": 32, "prompts": 16, "group": 8, "turn_tokens": 128,
            "sft_rows": 64, "sft_steps": 6, "micro": 4, "matmul": 8192, "image": (1000, 750), "prefill_rows": 16,
            "vllm_rows": 64},
    "cpu": {"decode_rows": [2, 4], "decode_tokens": 4, "prompts": 2, "group": 2, "turn_tokens": 8,
            "sft_rows": 4, "sft_steps": 2, "micro": 2, "matmul": 512, "image": (448, 336), "prefill_rows": 2,
            "vllm_rows": 4},
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Results, one log per part.")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="3b", choices=["3b", "tiny"], help="3b: Qwen2.5-VL-3B's shapes.")
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    parser.add_argument("--checkpoint-dir", help="Build the checkpoint here and keep it (default: under --out).")
    parser.add_argument("--peak-tflops", type=float, help="Dense bf16 peak TFLOP/s, for MFU (default: by the device).")
    parser.add_argument("--build-checkpoint", action="store_true", help=argparse.SUPPRESS)  # in a process of its own
    parser.add_argument("--part-timeout", type=float, default=540.0, help="Seconds a part may run.")
    parser.add_argument("--budget", type=float, help="Seconds the whole call may take; parts share what is left.")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's, as time.time()
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.build_checkpoint:
        print(checkpoint(args, out))
        return
    if args.child:
        run_child(args, out)
        return
    start = time.perf_counter()
    # a `timeout` around the suite sends SIGTERM: end as Ctrl-C does, through run_part's cleanup of the running part
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {"device": args.device, "size": args.size, "parts": {}}
    previous = out / "results.json"
    results["parts"] = (_read_json(previous) or {}).get("parts", {})  # a second call adds its parts to the first's
    # built in a process of its own: this one never holds device memory while the parts run (its errors show here)
    build = [sys.executable, __file__, "--build-checkpoint", "--out", str(out), "--device", args.device, "--size",
             args.size, *(["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else [])]  # fmt: skip
    built = subprocess.run(build, stdout=subprocess.PIPE, text=True)
    if built.returncode != 0:
        raise SystemExit(f"building the checkpoint failed (exit {built.returncode}): see its traceback above")
    results["checkpoint"] = built.stdout.strip().splitlines()[-1]
    # a part that will only say it is skipped takes no share of the budget from the others
    shares = {**SHARES, "vllm": SHARES["vllm"] if importlib.util.find_spec("vllm") else 0.0}
    for i, part in enumerate(args.parts):
        timeout = args.part_timeout
        if args.budget is not None:
            left = args.budget - (time.perf_counter() - start)
            if left < 30:  # too little to start one: an earlier call's result for it stays
                print(f"{part}: not run, {left:.0f} s of the budget left", flush=True)
                continue
            share = left * shares[part] / sum(shares[p] for p in args.parts[i:])
            timeout = min(timeout, left, max(share, 30.0))  # no part gets less than its start-up needs
        results["parts"][part] = run_part(part, args, out, timeout)
        status = results["parts"][part]["status"]
        print(f"{part}: {status} ({results['parts'][part]['seconds']:.0f} s)", flush=True)
        _write_json(previous, results)
    print(f"suite: {time.perf_counter() - start:.0f} s; results in {previous}")
    print(table(results))
    if args.doc:
        from benchmarks.doc_table import write_section

        write_section("gpu-suite", table(results), device=args.device)


def checkpoint(args: argparse.Namespace, out: Path) -> Path:
    """The suite's checkpoint: Qwen2.5-VL-3B's shapes, Qwen's vocabulary and pixel budget (an image of 1000 x 750
    is its 972 tokens), tied head, bf16 on CUDA; tiny (trained vocabulary, a small pixel budget, tied head, fp32) on
    CPU. Built once into ``--checkpoint-dir`` (or ``out``)."""
    from vagent.tiny_model import build_tiny_checkpoint

    root = Path(args.checkpoint_dir) if args.checkpoint_dir else out
    big = args.size == "3b"
    # the pixel budget in the name: a checkpoint an older suite built at another budget is not taken for this one
    path = root / f"ckpt-{args.size}-{args.device}{'-qwen-pixels' if big else ''}"
    if not (path / "config.json").is_file():
        pixels = {"min_pixels": QWEN_MIN_PIXELS, "max_pixels": QWEN_MAX_PIXELS} if big else {}
        build_tiny_checkpoint(path, size=args.size, vocab="qwen" if big else "trained", tie_embeddings=True,
                              device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                              **pixels)  # fmt: skip
    return path


def run_part(part: str, args: argparse.Namespace, out: Path, timeout: float) -> dict:
    """Run one part in its own process group, killed whole (its own subprocesses too) after ``timeout`` seconds; its
    status, its numbers (those it had saved, if it ran out of time or crashed) or what went wrong, and its time."""
    cmd = [sys.executable, __file__, "--child", part, "--out", str(out), "--device", args.device, "--size", args.size,
           "--deadline", str(time.time() + timeout)]  # fmt: skip
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    if args.checkpoint_dir:
        cmd += ["--checkpoint-dir", args.checkpoint_dir]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    start = time.perf_counter()
    result_file, partial_file = out / f"{part}.json", out / f"{part}.partial.json"
    result_file.unlink(missing_ok=True)
    partial_file.unlink(missing_ok=True)
    with open(out / f"{part}.log", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            code = child.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            _stop_group(child)
            code = "timeout"
        except BaseException:  # Ctrl-C, or SIGTERM from a timeout around the suite: the part does not run on
            _stop_group(child)
            raise
    seconds = time.perf_counter() - start
    if (result := _read_json(result_file)) is not None:
        return {**result, "seconds": seconds}
    tail = (out / f"{part}.log").read_text()[-3000:]
    saved = _read_json(partial_file) or {}
    status = "timeout" if code == "timeout" else "failed"
    error = f"ran out of its {timeout:.0f} s" if code == "timeout" else f"exit {code}"
    return {**saved, "status": status, "error": error, "log_tail": tail, "seconds": seconds}


def _stop_group(child: subprocess.Popen) -> None:
    """End a part's process group: SIGTERM first, so that torchrun (the ZeRO-2 run's launcher) ends its workers,
    which it starts in sessions of their own; SIGKILL after 15 s. The next part then finds the device empty."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a file cut by a kill would break the next reader."""
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=2, default=float))
    path.with_suffix(".tmp").replace(path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_child(args: argparse.Namespace, out: Path) -> None:
    """One part, in this process: ``out/<part>.json`` gets {"status": "ok", ...numbers} or the traceback."""
    scale = SCALES["gpu" if args.device == "cuda" else "cpu"]
    try:
        numbers = globals()[f"part_{args.child}"](args, scale, checkpoint(args, out), out)
        result = {"status": numbers.pop("status", "ok"), **numbers}
    except Exception:  # a part that fails records why; the suite goes on
        saved = _read_json(out / f"{args.child}.partial.json") or {}
        result = {**saved, "status": "failed", "error": traceback.format_exc()}
        traceback.print_exc()
    _write_json(out / f"{args.child}.json", result)


def _save(args: argparse.Namespace, out: Path, numbers: dict) -> None:
    """What the part has measured so far: kept if it runs out of time (``run_part``) or crashes later."""
    _write_json(out / f"{args.child}.partial.json", numbers)


def _left(args: argparse.Namespace) -> float:
    """Seconds until the part's deadline (inf without a budget)."""
    return args.deadline - time.time() if args.deadline else math.inf


# -- parts ------------------------------------------------------------------------------------------------------


def part_env(args, scale, ckpt: Path, out: Path) -> dict:
    import torch
    import transformers

    from benchmarks.rollout import copy_bandwidth

    device = torch.device(args.device)
    numbers = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if device.type == "cuda":
        numbers["device_name"] = torch.cuda.get_device_name(device)
        numbers["device_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        numbers["driver"] = smi.stdout.strip() or "unknown"
        numbers["peak_tflops"] = peak_tflops(args)
    numbers["copy_gb_s"] = copy_bandwidth(device, mib=1024 if device.type == "cuda" else 64, repeat=10) / 1e9
    numbers["matmul_tflops"] = matmul_tflops(device, scale["matmul"])
    numbers["compiler"] = compiler_missing() or "ok"
    return numbers


# Dense bf16 TFLOP/s by device name (the vendors' spec sheets, without sparsity); the first match wins.
PEAKS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("GH200", 989.0), ("H100", 989.0),
         ("H200", 989.0), ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0))  # fmt: skip


def peak_tflops(args: argparse.Namespace) -> float:
    """``--peak-tflops``, else the peak of the device's model (an H100 SXM's 989 when the name is not known)."""
    import torch

    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((peak for key, peak in PEAKS if key in name), 989.0)


def compiler_missing() -> str | None:
    """Why a compiled kernel cannot be built here (None: it can): Triton builds a small C module with the system's
    compiler and Python's headers the first time it runs, and a slim image may lack either."""
    import shutil
    import sysconfig

    if not any(shutil.which(cc) for cc in (os.environ.get("CC", ""), "cc", "gcc", "clang") if cc):
        return "no C compiler (cc, gcc or clang) for Triton's launcher"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return f"no Python.h under {sysconfig.get_paths()['include']} for Triton's launcher"
    return None


def matmul_tflops(device, n: int) -> float:
    """Dense n x n x n matmul TFLOP/s: bf16 on CUDA, fp32 on CPU; the best of a few timed runs."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = math.inf
    for _ in range(5):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def part_rollout(args, scale, ckpt: Path, out: Path) -> dict:
    import torch
    from PIL import Image

    from benchmarks.rollout import (
        copy_bandwidth,
        decode_read_bytes,
        decode_step_ms,
        full_batch_decoding,
        sleep_tool,
        tasks,
        timed_run,
    )
    from vagent.model import load_policy
    from vagent.rollout import HFBackend, RolloutLimits, Task, TurnBarrier, run

    device = torch.device(args.device)
    policy = load_policy(ckpt, device=args.device)
    bandwidth = copy_bandwidth(device, mib=1024 if device.type == "cuda" else 64, repeat=10)
    numbers: dict = {"copy_gb_s": bandwidth / 1e9, "decode": []}
    # the tool overlap first: it needs EOS and the real stop strings
    sys.modules["vagent.toolbox"].TOOLS["sleep"] = sleep_tool(0.2)  # the workload's rows call it
    work = tasks(max(scale["decode_rows"][0], 4))
    limits = RolloutLimits(max_turns=8, max_new_tokens=scale["decode_tokens"], temperature=0.0)
    timed_run(policy, work, limits)  # untimed: first forwards, allocator

    def timed(make_backend=None) -> float:  # each run's new backend captures its graphs: not the tools' overlap
        seconds, _, stats, _ = timed_run(policy, work, limits, make_backend)
        return seconds - stats.graph_capture_s

    t_async, t_sync = timed(), timed(lambda p: TurnBarrier(HFBackend(p)))
    numbers["tool_overlap"] = {
        "rows": len(work),
        "async_s": t_async,
        "sync_s": t_sync,
        "sync_over_async": t_sync / t_async,
    }
    _save(args, out, numbers)
    # image prefill: the vision tower and the prefill of 1000 x 750 images, one answer token each
    image = Image.new("RGB", scale["image"], (90, 140, 200))
    prefill = [
        Task(id=f"p{i}", question=f"Image {i}: what is it?", images=[image]) for i in range(scale["prefill_rows"])
    ]
    one_token = RolloutLimits(max_turns=1, max_new_tokens=1)
    run(policy, prefill, limits=one_token, batch_size=len(prefill), backend=HFBackend(policy))  # warm-up, same shapes
    backend = HFBackend(policy)
    start = time.perf_counter()
    run(policy, prefill, limits=one_token, batch_size=len(prefill), backend=backend)
    elapsed, stats = time.perf_counter() - start, backend.stats()
    # wall: the processor's host work included; forwards: the vision tower and the prefill on the device alone
    numbers["image_prefill"] = {"rows": len(prefill), "image": list(scale["image"]), "tokens": stats.prefill_tokens,
                                "tokens_per_s": stats.prefill_tokens / elapsed,
                                "forward_tokens_per_s": stats.prefill_tokens / max(stats.forward_s, 1e-9)}  # fmt: skip
    _save(args, out, numbers)
    full_batch_decoding(policy)
    kinds = {"graphs": None, "eager": False} if device.type == "cuda" else {"eager": None}  # HFBackend's cuda_graphs
    no_compile = compiler_missing() if device.type == "cuda" else None  # flex compiles on CUDA only
    # the default path (SDPA, graphs) at every size first, then flex beside it (the measurement
    # docs/decisions/decode-attention.md waits on), then eager: what a short budget cuts is the least needed
    for kind, cuda_graphs in kinds.items():
        for attention in ("sdpa", "flex"):
            for rows in scale["decode_rows"]:
                entry = {"rows": rows, "attention": attention, "kind": kind}
                if attention == "flex" and no_compile:
                    numbers["decode"].append({**entry, "skipped": no_compile})
                    continue
                if _left(args) < 30:  # a setting's warm-up (graph capture, a compile) and timing take longer
                    numbers["decode"].append({**entry, "skipped": "out of the part's time"})
                    numbers["status"] = numbers.get("status", "timeout")  # a failure stays the status
                    numbers.setdefault("error", "decode settings skipped: out of the part's time")
                    continue
                try:
                    backend = HFBackend(policy, attention=attention, cuda_graphs=cuda_graphs)
                    # untimed first on CUDA (graphs captured, kernels compiled); the CPU's run is a smoke test
                    timing = decode_step_ms(policy, rows, scale["decode_tokens"], repeat=1, backend=backend,
                                            warm_up=device.type == "cuda")  # fmt: skip
                except Exception:  # one kernel failing (a compile on a new GPU) keeps the other's numbers
                    numbers["status"] = "failed"
                    numbers["decode"].append({**entry, "error": traceback.format_exc()[-1500:]})
                    traceback.print_exc()
                    backend = None
                    continue
                graphs = {
                    "graph_captures": backend.stats().graph_captures,
                    "graphs_failed": backend.graphs.failed if backend.graphs is not None else None,
                }
                backend = None  # its slot cache goes before the next setting's
                if kind == "graphs" and not graphs["graph_captures"]:  # a capture failed: the steps ran eagerly
                    entry["kind"] = "graphs (none captured: eager)"
                bound_ms = 1000 * decode_read_bytes(policy, rows, timing["context"]) / bandwidth
                numbers["decode"].append({**entry, **graphs, "step_ms": timing["step_ms"], "bound_ms": bound_ms,
                                          "step_over_bound": timing["step_ms"] / bound_ms,
                                          "tokens_per_s": rows * 1000 / timing["step_ms"]})  # fmt: skip
                _save(args, out, numbers)
    return numbers


ZOOM_IMAGE = (672, 504)  # the GRPO step's prompt images, as given (the episodes keep each one's original)


def _zoom_rows(ckpt: Path, out: Path, n: int) -> Path:
    """Synthetic zoom rows in the checkpoint's frame (from its processor alone: no model load)."""
    from transformers import AutoProcessor

    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.data import write_rows

    image = AutoProcessor.from_pretrained(ckpt).image_processor
    frame = {"min_pixels": image.size["shortest_edge"], "max_pixels": image.size["longest_edge"],
             "factor": image.patch_size * image.merge_size}  # fmt: skip
    rows = out / "rows"
    return write_rows(zoom_rows(rows, n, seed=0, size=ZOOM_IMAGE, **frame), rows / "train.jsonl")


def _plan_gib(config: Path, overrides: list[str], device: str, prompt_size: tuple[int, int] | None = None) -> float:
    """``vagent memory``'s peak per rank for one process running ``config`` with ``overrides``."""
    import argparse as _argparse

    from vagent.config import CONFIGS, load_config
    from vagent.recipes.memory import model_shape, setup_from_config
    from vagent.training.memory import GiB, plan

    stage = config.parent.name
    cfg = load_config(CONFIGS[stage], config, overrides)
    args = _argparse.Namespace(
        world_size=1,
        sharding=None,
        device=device,
        trained_fraction=0.5,
        images=None,
        image_tokens=None,
        prompt_size=prompt_size,
    )
    return plan(model_shape(cfg, None), setup_from_config(cfg, args, stage)).peak / GiB


def part_grpo_step(args, scale, ckpt: Path, out: Path) -> dict:
    """Two GRPO steps (the first warms up: CUDA graphs, allocator); the second's stages."""
    import torch

    import vagent.rewards as rewards
    from vagent.config import GRPOConfig, load_config
    from vagent.recipes import grpo
    from vagent.rollout import Task
    from vagent.rollout.export import read_jsonl
    from vagent.training.metrics import read_metrics

    rows = _zoom_rows(ckpt, out, scale["prompts"] * 2)

    def spread(trajectories, rows):  # the share of even sampled ids: spreads within every group of a random model
        return [sum(i % 2 == 0 for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m) / max(1, sum(t.loss_mask))
                for t in trajectories]  # fmt: skip

    rewards.REWARDS["spread"] = spread
    from_row = Task.from_row
    Task.from_row = classmethod(lambda cls, row, tools: _scripted(from_row(row, tools)))  # two crops, then sampled
    run_dir = out / "grpo-run"
    sizes = [f"grpo.prompts_per_step={scale['prompts']}", f"grpo.group_size={scale['group']}",
             f"grpo.rollout_batch_size={scale['prompts'] * scale['group']}", "grpo.dynamic_sampling=false",
             "rollout.max_turns=3", f"rollout.max_new_tokens={scale['turn_tokens']}", "rollout.max_total_tokens=3072",
             f"model.device={args.device}", f"model.path={ckpt}",
             # the config rolls out on vLLM, whose CUDA wheel a lent machine cannot be given (over the carry limit):
             # this part measures vagent's HF backend, the one the decode part measures too
             "rollout.backend=hf"]  # fmt: skip
    if args.device == "cpu":  # fp32, and KV storage grown on demand (the config's budget is a GPU's)
        sizes += ["train.precision=fp32", "rollout.kv_cache_gb=null"]
    else:  # one 80 GB device holds the update and the rollout: 8 GiB of KV (75 rows of 3,072) keeps the plan at 73 GiB
        sizes += ["rollout.kv_cache_gb=8"]
    # no checkpoint (a 3B's final save writes ~55 GB) and no resume (a second call on the same machine trains anew)
    overrides = [*sizes, f"out_dir={run_dir}", f"data.train={rows}", "train.max_steps=2", "train.save_every=0",
                 "train.save_final=false", "train.resume=none", "train.tensorboard=false", "val.rows=null",
                 "rewards.weights={crop_iou: 0.5, spread: 1.0}", "rewards.options={}",
                 "grpo.max_sampler_gap=0"]  # fmt: skip
    if torch.cuda.is_available() and args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    grpo.train(load_config(GRPOConfig, GRPO_CONFIG, overrides))
    record = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r][-1]
    trajectories = read_jsonl(sorted((run_dir / "rollouts").glob("step-*.jsonl"))[-1])  # the second step's
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    tokens = sum(len(t.token_ids) for t in trajectories)
    params = _text_parameters(ckpt)
    numbers = {
        "episodes": scale["prompts"] * scale["group"],
        "stages_s": {k.removeprefix("time/"): v for k, v in record.items() if k.startswith("time/")},
        "tool_calls_per_episode": record.get("tool_calls_per_traj"),
        "sampled_tokens": sampled, "tokens": tokens,
        "sampled_tokens_per_s_gen": sampled / max(record["time/gen"], 1e-9),
        "sampled_tokens_per_s_step": sampled / max(record["time/step"], 1e-9),
        "trained_tokens_per_s": tokens / max(record["time/update"], 1e-9),
        "sampler_logprob_gap": record.get("sampler_logprob_gap"),
    }  # fmt: skip
    # planned at the longest episode's length, the sequence the update's micro-batches padded to at most
    longest = max(len(t.token_ids) for t in trajectories)
    numbers["longest_episode"] = longest
    plan = [*sizes, f"rollout.max_total_tokens={longest}"]
    numbers.update(_memory_and_mfu(args, params, tokens, record["time/update"], GRPO_CONFIG, plan))
    return numbers


def _scripted(task):
    """``task`` with two crop turns forced before a sampled one (random weights do not call tools on their own)."""
    import dataclasses

    return dataclasses.replace(task, scripted_turns=[*CROPS, None])


def _text_parameters(ckpt: Path) -> int:
    """The language model's parameters (the embedding once: it is the tied head), MFU's N."""
    from vagent.training.memory import shape_from_config_json

    return shape_from_config_json(ckpt).text_params()


def _mfu(args: argparse.Namespace, params: int, tokens_per_s: float) -> float:
    """6 x N x tokens/s over the device's dense bf16 peak (see the module docstring)."""
    return 6 * params * tokens_per_s / (peak_tflops(args) * 1e12)


def _memory_and_mfu(args, params: int, tokens: float, seconds: float, config: Path, sizes: list[str]) -> dict:
    import torch

    numbers: dict = {
        "params": params,
        "plan_peak_gib": _plan_gib(config, [*sizes, "data.train=x"], args.device, ZOOM_IMAGE),
    }
    if args.device == "cuda":
        numbers["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        numbers["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30  # what fragmentation adds
        numbers["mfu"] = _mfu(args, params, tokens / max(seconds, 1e-9))
        if numbers["plan_peak_gib"]:
            numbers["peak_over_plan"] = numbers["peak_gib"] / numbers["plan_peak_gib"]
    else:
        import resource

        numbers["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return numbers


def part_sft(args, scale, ckpt: Path, out: Path) -> dict:
    """SFT steps of the 3B FSDP config, chunked head and whole logits, and of ZeRO-2 where DeepSpeed is installed;
    each in a process of its own (peak memory is per process)."""
    import importlib.util

    rows = _zoom_rows(ckpt, out, scale["sft_rows"])
    runs = {"fsdp, chunked head": ("fsdp", []), "fsdp, whole logits": ("fsdp", ["train.lm_head_chunk=0"])}
    numbers: dict = {"runs": {}}
    if args.device == "cuda" and importlib.util.find_spec("deepspeed"):
        # imported in a process of its own first: a missing need of DeepSpeed's is said, not a failed run's traceback
        check = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True)
        if check.returncode == 0:
            runs["zero2, chunked head"] = ("zero2", [])
        else:
            numbers["runs"]["zero2, chunked head"] = {"status": "skipped", "error": check.stderr.strip()[-500:]}
    last_run_s = 30.0  # a run's load, sharding and steps: the next one starts only with at least as much left
    for name, (config, extra) in runs.items():
        if _left(args) < last_run_s:
            numbers["runs"][name] = {"status": "skipped", "error": "out of the part's time"}
            continue
        run_start = time.perf_counter()
        run_dir = out / f"sft-{config}-{len(extra)}"
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # an earlier call's numbers are not this run's
        sizes = [f"model.path={ckpt}", f"model.device={args.device}", f"data.micro_batch_size={scale['micro']}",
                 "optim.grad_accum=1", "data.max_length=4096", *extra]  # fmt: skip
        cmd = [sys.executable, "-m", "vagent.cli", "sft", "--config", str(SFT_CONFIGS[config]), *sizes,
               f"out_dir={run_dir}", f"data.train={rows}", "data.val=null", f"train.max_steps={scale['sft_steps']}",
               "train.save_every=0", "train.save_final=false", "train.resume=none", "train.eval_every=0",
               "train.tensorboard=false"]  # fmt: skip
        if args.device == "cpu":
            cmd.append("train.precision=fp32")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        cmd = [*launcher, *cmd[1:]] if config == "zero2" else cmd  # DeepSpeed wants a launched process
        log = out / f"sft-{config}-{len(extra)}.log"
        with open(log, "w") as sink:  # straight to the file: a run killed at the part's deadline keeps its log
            code = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ}).returncode
        last_run_s = time.perf_counter() - run_start
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        steps = [r for r in records if "tokens_per_s" in r][scale["sft_steps"] // 2 :]
        if code != 0 or not steps:  # the steps it logged before failing still count, marked
            numbers["runs"][name] = {"status": "failed", "error": f"exit {code}: " + log.read_text()[-1500:]}
            if not steps:
                _save(args, out, numbers)
                continue
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in steps)
        # planned at the steps' own padded length (the plan takes every row as data.max_length long; these rows are
        # shorter): ``tokens`` counts the real ones, ``padding_waste`` the padding's share of the batch
        length = math.ceil(max(r["tokens"] / (1 - r.get("padding_waste", 0.0)) for r in steps) / scale["micro"])
        entry = {**numbers["runs"].get(name, {}), "tokens_per_s": tokens_per_s,
                 "step_s": statistics.median(r["step_s"] for r in steps),
                 "peak_gib": max(r["peak_mem_gb"] for r in steps), "row_tokens": length,
                 "plan_peak_gib": _plan_gib(SFT_CONFIGS[config], [*sizes, f"data.max_length={length}", "data.train=x"],
                                            args.device)}  # fmt: skip
        if args.device == "cuda":
            entry["mfu"] = _mfu(args, _text_parameters(ckpt), tokens_per_s)
            if entry["plan_peak_gib"]:
                entry["peak_over_plan"] = entry["peak_gib"] / entry["plan_peak_gib"]
        numbers["runs"][name] = entry
        _save(args, out, numbers)
    if any(r.get("status") == "failed" for r in numbers["runs"].values()):
        numbers["status"] = "failed"
    elif any(r.get("status") == "skipped" for r in numbers["runs"].values()):
        numbers["status"], numbers["error"] = "timeout", "runs skipped: out of the part's time"
    return numbers


def part_gpu_tests(args, scale, ckpt: Path, out: Path) -> dict:
    # a test module that cannot be imported here (a package missing on the GPU machine) must not stop the GPU tests
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
           "--continue-on-collection-errors", "tests"]  # fmt: skip
    print("running:", " ".join(cmd), flush=True)
    log = out / "gpu_tests.pytest.log"
    with open(log, "w") as sink:  # straight to the file: kept if the part runs out of time
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    text = log.read_text()
    summary = _last_line(text)
    print(text[-5000:])
    if args.device != "cuda":
        return {"status": "skipped", "summary": summary}
    # errors are allowed only where a test module could not be imported here (a package the GPU machine lacks)
    uncollected = text.count("ERROR collecting")
    errors = int(next(iter(re.findall(r"(\d+) errors?\b", summary)), 0))
    ran = done.returncode == 0 or (" passed" in summary and " failed" not in summary and errors == uncollected)
    note = f" ({uncollected} test modules not imported)" if uncollected else ""
    return {"status": "ok" if ran else "failed", "summary": summary + note}


def part_vllm(args, scale, ckpt: Path, out: Path) -> dict:
    """The single-turn workload on three generators (``benchmarks/vllm_rollout.single_turn``), then the update's
    round trip on the engine, twice: other weights in (every greedy row should change), the checkpoint's back (every
    row should be as before). Each trip sleeps the engine first (level 2 on a GPU; a no-op on a CPU)."""
    if importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "error": "vLLM is not installed here (pip install 'vagent[vllm]')"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as GRPO runs it
    from benchmarks.vllm_rollout import _tasks, single_turn
    from vagent.model import load_policy
    from vagent.rollout import RolloutLimits, run
    from vagent.rollout.vllm_backend import VLLMBackend
    from vagent.tiny_model import build_tiny_checkpoint
    from vagent.training.weight_sync import generation_weights

    if args.device == "cpu":  # vLLM's CPU attention takes head sizes from 32 only: the small preset, not the tiny one
        ckpt = out / "ckpt-small-cpu"
        if not (ckpt / "config.json").is_file():
            build_tiny_checkpoint(ckpt, size="small")
    policy = load_policy(ckpt, device=args.device)
    rows, tokens = scale["vllm_rows"], scale["turn_tokens"]
    engine = VLLMBackend.for_policy(policy, max_model_len=4096, max_num_seqs=rows, max_images=4,
                                    gpu_memory_utilization=0.35, sleep=args.device == "cuda")  # fmt: skip
    numbers: dict = {"rows": rows, "new_tokens": tokens, "single_turn": {}}
    try:
        for name, seconds, sampled, vs_bare in single_turn(policy, engine, rows, tokens):
            numbers["single_turn"][name] = {"seconds": seconds, "tokens": sampled, "tokens_per_s": sampled / seconds,
                                            "vs_bare": vs_bare}  # fmt: skip
        _save(args, out, numbers)
        greedy, work = RolloutLimits(max_turns=1, max_new_tokens=tokens, temperature=0.0), _tasks(rows)

        def trip(weights) -> tuple[float, float, list]:  # (sleep s, sync s, greedy ids after it)
            start = time.perf_counter()
            engine.sleep()
            slept = time.perf_counter() - start
            synced = engine.load_weights(weights)
            return (
                slept,
                synced,
                [t.token_ids for t in run(policy, work, limits=greedy, batch_size=rows, backend=engine)],
            )

        engine.llm.reset_prefix_cache()  # "before" runs cold, as every run after a sync does
        before = [t.token_ids for t in run(policy, work, limits=greedy, batch_size=rows, backend=engine)]
        other = (
            (name, tensor * 1.5 if tensor.dim() > 1 else tensor) for name, tensor in generation_weights(policy.model)
        )
        _, _, perturbed = trip(other)
        numbers["sleep_s"], numbers["sync_s"], again = trip(generation_weights(policy.model))
        numbers["changed_rows"] = sum(a != b for a, b in zip(perturbed, before, strict=True))
        numbers["same_greedy_rows"] = sum(a == b for a, b in zip(again, before, strict=True))
    finally:
        engine.close()
    return numbers


# -- the table ----------------------------------------------------------------------------------------------------


def table(results: dict) -> str:
    """The suite's numbers as markdown: one line per measurement, each part's status."""
    parts = results["parts"]
    lines = ["| part | measurement | value |", "|---|---|---|"]

    def add(part: str, what: str, value) -> None:
        lines.append(f"| {part} | {what} | {value} |")

    for name in PARTS:
        part = parts.get(name)
        if part is None:
            continue
        if part["status"] != "ok":
            add(name, "status", f"{part['status']} ({_last_line(part.get('error') or part.get('summary'))[:100]})")
        if name == "env" and part["status"] == "ok":
            add(name, "device", part.get("device_name", "cpu"))
            add(name, "copy bandwidth", f"{part['copy_gb_s']:.0f} GB/s")
            add(name, "dense matmul", f"{part['matmul_tflops']:.3g} TFLOP/s")
            if "peak_tflops" in part:
                add(name, "dense bf16 peak (for MFU)", f"{part['peak_tflops']:.0f} TFLOP/s")
            if part.get("compiler", "ok") != "ok":
                add(name, "compiled kernels", part["compiler"])
        if name == "rollout" and "decode" in part:
            steps = {(d["rows"], d["attention"], d["kind"]): d.get("step_ms") for d in part["decode"]}
            for d in part["decode"]:
                what = f"decode, {d['rows']} rows, {d['attention']}, {d['kind']}"
                if "error" in d:
                    add(name, what, f"failed ({_last_line(d['error'])[:80]})")
                    continue
                if "skipped" in d:
                    add(name, what, f"skipped ({d['skipped']})")
                    continue
                sdpa = steps.get((d["rows"], "sdpa", d["kind"]))
                versus = f"; {d['step_ms'] / sdpa:.2f}x sdpa's step" if d["attention"] == "flex" and sdpa else ""
                add(
                    name,
                    what,
                    f"{d['step_ms']:.2f} ms a step ({d['step_over_bound']:.1f}x its read bound), "
                    f"{d['tokens_per_s']:,.0f} tokens/s{versus}",
                )
        if name == "rollout" and "tool_overlap" in part:
            overlap = part["tool_overlap"]
            add(name, f"200 ms tool, {overlap['rows']} rows", f"{overlap['async_s']:.2f} s overlapped, "
                f"{overlap['sync_s']:.2f} s turn-synchronous")  # fmt: skip
        if name == "rollout" and "image_prefill" in part:
            prefill = part["image_prefill"]
            add(
                name,
                f"image prefill, {prefill['image'][0]}x{prefill['image'][1]}, {prefill['rows']} rows",
                f"{prefill['tokens_per_s']:,.0f} tokens/s (wall), "
                f"{prefill.get('forward_tokens_per_s', float('nan')):,.0f} tokens/s (forwards)",
            )
        if name == "grpo_step" and part["status"] == "ok":
            stages = ", ".join(f"{k} {v:.1f}" for k, v in part["stages_s"].items() if v)
            add(name, f"stages (s), {part['episodes']} episodes", stages)
            add(name, "sampled tokens/s (whole step)", f"{part['sampled_tokens_per_s_step']:,.0f}")
            add(name, "trained tokens/s (update)", f"{part['trained_tokens_per_s']:,.0f}")
            if "mfu" in part:
                add(name, "update MFU", f"{100 * part['mfu']:.1f}%")
            if "peak_gib" in part:
                add(
                    name,
                    "peak memory / plan",
                    f"{part['peak_gib']:.1f} / {part['plan_peak_gib'] or float('nan'):.1f} GiB",
                )
        if name == "sft":
            for run_name, run in part.get("runs", {}).items():
                if run.get("status") in ("failed", "skipped"):
                    add(name, run_name, f"{run['status']} ({_last_line(run.get('error'))[:80]})")
                if "tokens_per_s" in run:
                    mfu = f", MFU {100 * run['mfu']:.1f}%" if "mfu" in run else ""
                    add(name, run_name, f"{run['tokens_per_s']:,.0f} tokens/s{mfu}, peak {run['peak_gib']:.1f} GiB")
        if name == "gpu_tests":
            add(name, "pytest -m gpu", part.get("summary", ""))
        if name == "vllm":
            lines += _vllm_rows(part)
    return "\n".join(lines)


def _vllm_rows(part: dict) -> list[str]:
    """The ``vllm`` part's table rows: tokens/s of each generator against bare vLLM's, and the weight round trips."""
    rows = []
    if part.get("single_turn"):
        bare = part["single_turn"]["bare vLLM (LLM.generate)"]["tokens_per_s"]
        # vagent + vLLM's ratio: the median of its alternated pairs with bare vLLM (single_turn), not of the medians
        runs = "; ".join(f"{gen}: {r['tokens_per_s']:,.0f} tokens/s "
                         f"({r.get('vs_bare') or r['tokens_per_s'] / bare:.2f} of bare vLLM)"
                         for gen, r in part["single_turn"].items())  # fmt: skip
        rows.append(f"| vllm | single turn, {part['rows']} rows x {part['new_tokens']} tokens (target 0.9) | {runs} |")
    if "sync_s" in part:
        rows.append(f"| vllm | update round trip (sleep, weights, caches) | sleep {part['sleep_s']:.2f} s, weight sync "
                    f"{part['sync_s']:.2f} s; greedy rows changed by other weights: {part['changed_rows']} of "
                    f"{part['rows']}, as before once the weights are back: {part['same_greedy_rows']} of "
                    f"{part['rows']} |")  # fmt: skip
    return rows


def _last_line(text: str | None) -> str:
    """A traceback's or a log's last line (what went wrong), "" for none."""
    return ((text or "").strip().splitlines() or [""])[-1]


if __name__ == "__main__":
    main()

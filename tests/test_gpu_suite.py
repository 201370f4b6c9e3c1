"""benchmarks/gpu_suite.py on CPU: every part runs on a tiny checkpoint and reports its numbers, so that a GPU minute
measures instead of finding a bug a CPU could have found."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_suite_runs_every_part_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu", "--size",
                           "tiny", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads((tmp_path / "results.json").read_text())["parts"]
    for name in ("env", "rollout", "grpo_step", "sft"):
        assert parts[name]["status"] == "ok", (name, parts[name].get("error", "")[-2000:])
        assert (tmp_path / f"{name}.log").is_file()
    assert parts["env"]["copy_gb_s"] > 0 and parts["env"]["matmul_tflops"] > 0
    decode = [(d["rows"], d["attention"]) for d in parts["rollout"]["decode"]]
    assert decode == [(2, "sdpa"), (4, "sdpa"), (2, "flex"), (4, "flex")]  # both kernels side by side
    assert "| rollout | decode, 4 rows, flex, eager |" in done.stdout and "x sdpa's step" in done.stdout
    assert all(d["step_ms"] > 0 and d["step_over_bound"] > 0 for d in parts["rollout"]["decode"])
    assert parts["rollout"]["tool_overlap"]["async_s"] > 0 and parts["rollout"]["tool_overlap"]["sync_s"] > 0
    assert (
        parts["rollout"]["image_prefill"]["forward_tokens_per_s"] >= parts["rollout"]["image_prefill"]["tokens_per_s"]
    )
    # no training run writes a checkpoint or resumes (train.save_final=false, train.resume=none): metrics only
    assert not list(tmp_path.glob("*/checkpoints/step-*")) and not list(tmp_path.glob("*/model"))
    grpo = parts["grpo_step"]
    assert grpo["tool_calls_per_episode"] >= 2  # the scripted crops ran
    assert grpo["sampled_tokens"] > 0 and grpo["stages_s"]["update"] > 0 and grpo["sampler_logprob_gap"] < 1e-3
    assert 0 < grpo["plan_peak_gib"] < 16  # planned for this config on CPU, without the GPU config's 16 GiB KV budget
    assert set(parts["sft"]["runs"]) == {"fsdp, chunked head", "fsdp, whole logits"}
    assert all(run["tokens_per_s"] > 0 for run in parts["sft"]["runs"].values())
    assert parts["gpu_tests"]["status"] == "skipped"  # no CUDA here
    assert "| grpo_step | trained tokens/s (update) |" in done.stdout


def test_under_a_short_budget_the_rollout_keeps_what_it_measured_and_says_what_it_skipped(tmp_path):
    """--budget leaves the part too little time for a decode setting: the tool overlap and the prefill are measured,
    every decode setting is skipped by name, and the part's status says it ran out of time."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu", "--size",
                           "tiny", "--out", str(tmp_path), "--parts", "rollout", "--budget", "28"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rollout = json.loads((tmp_path / "results.json").read_text())["parts"]["rollout"]
    assert rollout["status"] == "timeout" and rollout["tool_overlap"]["async_s"] > 0
    assert rollout["image_prefill"]["tokens_per_s"] > 0
    assert [d.get("skipped") for d in rollout["decode"]] == ["out of the part's time"] * 4
    assert "| rollout | decode, 2 rows, sdpa, eager | skipped (out of the part's time) |" in done.stdout


def test_a_part_past_its_time_is_killed_with_its_subprocesses_and_keeps_its_saved_numbers(tmp_path):
    sys.path.insert(0, str(ROOT))
    import argparse

    from benchmarks import gpu_suite

    args = argparse.Namespace(device="cpu", size="tiny", peak_tflops=1.0, checkpoint_dir=None)
    (tmp_path / "gpu_tests.partial.json").write_text('{"kept": 1}')  # as a part saves its numbers
    start = time.perf_counter()
    # the part builds its checkpoint (seconds), then starts pytest -m gpu, which takes longer than what is left
    result = gpu_suite.run_part("gpu_tests", args, tmp_path, timeout=8.0)
    assert time.perf_counter() - start < 15
    # run_part clears a stale partial file first: what comes back is only what this run saved (nothing)
    assert result["status"] == "timeout" and result["error"] == "ran out of its 8 s" and "kept" not in result
    assert "running: " in (tmp_path / "gpu_tests.log").read_text()  # its pytest had started when it was killed
    time.sleep(0.5)
    for pattern in (f"--out {tmp_path}", "-m gpu --continue-on-collection-errors"):  # the part, and its pytest
        survivors = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        assert not survivors.strip(), (pattern, survivors)

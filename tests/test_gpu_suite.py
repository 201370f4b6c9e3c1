"""benchmarks/gpu_suite.py on CPU: every part runs on a tiny checkpoint and reports its numbers, so that a GPU minute
measures instead of finding a bug a CPU could have found."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
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
    if importlib.util.find_spec("vllm") is None:  # its own venv runs it: tests/test_vllm_gpu_suite.py
        assert parts["vllm"]["status"] == "skipped" and "vLLM is not installed" in parts["vllm"]["error"]
    assert "| grpo_step | trained tokens/s (update) |" in done.stdout


def test_near_its_deadline_the_rollout_keeps_what_it_measured_and_says_what_it_skipped(tmp_path):
    """A part started with too little time for a decode setting (its --deadline, as --budget sets it): the tool
    overlap and the prefill are measured, every decode setting is skipped by name, and the status says it ran out of
    time. A budget too short to start a part runs none, and says so."""
    suite = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu", "--size", "tiny", "--out",
             str(tmp_path)]  # fmt: skip
    deadline = time.time() + 25  # under the 30 s a decode setting is started with, whatever the machine's speed
    done = subprocess.run([*suite, "--child", "rollout", "--deadline", str(deadline)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rollout = json.loads((tmp_path / "rollout.json").read_text())
    assert rollout["status"] == "timeout" and rollout["tool_overlap"]["async_s"] > 0
    assert rollout["image_prefill"]["tokens_per_s"] > 0
    assert [d.get("skipped") for d in rollout["decode"]] == ["out of the part's time"] * 4
    table = gpu_suite_table({"parts": {"rollout": rollout}})
    assert "| rollout | decode, 2 rows, sdpa, eager | skipped (out of the part's time) |" in table
    done = subprocess.run([*suite, "--parts", "env", "rollout", "--budget", "1"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "env: not run" in done.stdout and "rollout: not run" in done.stdout


def gpu_suite_table(results: dict) -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_suite import table

    return table(results)


def test_a_part_past_its_time_is_killed_with_its_subprocesses_and_keeps_its_saved_numbers(tmp_path):
    sys.path.insert(0, str(ROOT))
    import argparse

    from benchmarks import gpu_suite

    args = argparse.Namespace(device="cpu", size="tiny", peak_tflops=1.0, checkpoint_dir=None)
    gpu_suite.checkpoint(args, tmp_path)  # built before: the part's 8 s go to starting pytest -m gpu, which needs more
    (tmp_path / "gpu_tests.partial.json").write_text('{"kept": 1}')  # as a part saves its numbers
    start = time.perf_counter()
    result = gpu_suite.run_part("gpu_tests", args, tmp_path, timeout=8.0)
    assert time.perf_counter() - start < 25  # SIGTERM, then SIGKILL 15 s later at the latest
    # run_part clears a stale partial file first: what comes back is only what this run saved (nothing)
    assert result["status"] == "timeout" and result["error"] == "ran out of its 8 s" and "kept" not in result
    assert "running: " in (tmp_path / "gpu_tests.log").read_text()  # its pytest had started when it was killed
    time.sleep(0.5)
    for pattern in (f"--out {tmp_path}", "-m gpu --continue-on-collection-errors"):  # the part, and its pytest
        found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
        assert found.returncode == 1, (pattern, found.stdout, found.stderr)  # 1: no process matches


def test_stopping_a_part_ends_the_workers_torchrun_started_in_sessions_of_their_own(tmp_path):
    """The ZeRO-2 run is launched by torchrun, whose workers leave the part's process group: a SIGKILL of the group
    would leave them holding the device. SIGTERM first lets torchrun end them."""
    sys.path.insert(0, str(ROOT))
    import os

    from benchmarks.gpu_suite import _stop_group

    worker_pid = tmp_path / "worker.pid"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(sleeper),
              str(worker_pid)]  # fmt: skip
    part = subprocess.Popen(launch, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        if worker_pid.is_file() and worker_pid.read_text():
            break
        time.sleep(0.1)
    worker = int(worker_pid.read_text())
    assert os.getpgid(worker) != os.getpgid(part.pid)  # out of the part's group
    _stop_group(part)
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)

"""benchmarks/gpu_suite.py on CPU: every part runs on a tiny checkpoint and reports its numbers, so that a GPU minute
measures instead of finding a bug a CPU could have found."""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert decode == [(2, "sdpa"), (2, "flex"), (4, "sdpa"), (4, "flex")]  # both kernels side by side
    assert "| rollout | decode, 4 rows, flex, eager |" in done.stdout and "x sdpa's step" in done.stdout
    assert all(d["step_ms"] > 0 and d["step_over_bound"] > 0 for d in parts["rollout"]["decode"])
    assert parts["rollout"]["tool_overlap"]["async_s"] > 0 and parts["rollout"]["tool_overlap"]["sync_s"] > 0
    grpo = parts["grpo_step"]
    assert grpo["tool_calls_per_episode"] >= 2  # the scripted crops ran
    assert grpo["sampled_tokens"] > 0 and grpo["stages_s"]["update"] > 0 and grpo["sampler_logprob_gap"] < 1e-3
    assert 0 < grpo["plan_peak_gib"] < 16  # planned for this config on CPU, without the GPU config's 16 GiB KV budget
    assert set(parts["sft"]["runs"]) == {"fsdp, chunked head", "fsdp, whole logits"}
    assert all(run["tokens_per_s"] > 0 for run in parts["sft"]["runs"].values())
    assert parts["gpu_tests"]["status"] == "skipped"  # no CUDA here
    assert "| grpo_step | trained tokens/s (update) |" in done.stdout

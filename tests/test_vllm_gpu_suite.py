"""The GPU suite's ``vllm`` part on CPU, in the vLLM environment (see ``tests/test_vllm_backend.py``): the part a GPU
machine with vLLM runs measures here too, so its first GPU minute measures instead of finding a bug."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tests.vllm_required  # noqa: F401  (fails, or skips, this module without vLLM)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # 30 s; slow as the suite's other CPU run (tests/test_gpu_suite.py)
ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_suites_vllm_part_runs_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu", "--size",
                           "tiny", "--out", str(tmp_path), "--parts", "vllm"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    part = json.loads((tmp_path / "results.json").read_text())["parts"]["vllm"]
    assert part["status"] == "ok", part.get("error", "")[-2000:]
    assert set(part["single_turn"]) == {"bare vLLM (LLM.generate)", "vagent + vLLM", "vagent + HF"}
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in part["single_turn"].values())
    assert part["sync_s"] > 0 and part["rows"] == 4
    assert part["changed_rows"] == 4  # the engine took the other weights (a sync that did nothing would fail here)
    assert part["same_greedy_rows"] == 4  # and the checkpoint's back: fp32 on a CPU, the same tokens
    assert "| vllm | single turn, 4 rows x 8 tokens (target 0.9) | bare vLLM (LLM.generate): " in done.stdout
    assert "greedy rows changed by other weights: 4 of 4, as before once the weights are back: 4 of 4 |" in done.stdout

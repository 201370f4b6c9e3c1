"""GRPO with the ``judge`` reward, the judge being a second ``vagent serve`` process that is killed mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve_helpers import start_server, stop_server
from vagent.config import GRPOConfig, load_config
from vagent.recipes import grpo
from vagent.training.metrics import read_metrics

pytest.importorskip("fastapi")
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"


@pytest.mark.slow
def test_grpo_with_a_judge_that_dies_mid_run(tmp_path, tiny_qwen25, zoom_rows_file):
    process, url = start_server(tiny_qwen25, "--served-model-name", "judge", log=tmp_path / "judge.log")
    killed_at = []

    def before_step(step: int, total: int) -> None:
        if step == 1:  # the first step was judged by a live server; the rest by a dead one
            stop_server(process)
            killed_at.append(step)

    try:
        cfg = load_config(GRPOConfig, CONFIG, [
            f"out_dir={tmp_path / 'run'}", f"model.path={tiny_qwen25}", "train.max_steps=3", "train.save_every=0",
            "train.tensorboard=false", f"data.train={zoom_rows_file(8, 1000)}", "grpo.dynamic_sampling=false",
            "rewards.weights={accuracy: 1.0, format: 0.2, judge: 1.0}", f"judge.url={url}", "judge.max_tokens=8",
            "judge.retries=1", "judge.backoff_s=0.05", "judge.timeout_s=60",
        ])  # fmt: skip
        grpo.train(cfg, before_step=before_step)
    finally:
        stop_server(process)
    assert killed_at == [1]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["reward/judge"] <= 1.0 and 0.0 <= r["reward/judge_failures"] <= 1.0
    # The live judge answered (the replies it sent are cached, with their finish_reason): its random text runs to
    # judge.max_tokens (cut: finish_reason length) or reads as no verdict, a failure either way, so those samples got
    # the neutral score; after the kill every judged sample failed to connect and was counted.
    cache = [json.loads(line) for line in (tmp_path / "run" / "judge_cache.jsonl").read_text().splitlines()]
    assert cache, "the live judge answered nothing"
    assert all(entry["finish_reason"] in ("stop", "length") for entry in cache), cache
    assert records[1]["reward/judge_failures"] > 0 and records[2]["reward/judge_failures"] > 0
    final = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts").glob("*.jsonl").__next__().read_text().splitlines()
    ]
    errors = {t["metrics"]["judge"]["error"] for t in final if t["metrics"]["judge"]["error"]}
    assert errors and all(e.startswith("connection") for e in errors), errors

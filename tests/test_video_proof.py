"""The video proof (``python -m quickstart --config configs/quickstart/video_cpu.yaml``): every stage on a toy budget,
and (slow) the default run's targets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vagent.data import load_rows
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
VAGENT = str(Path(sys.executable).parent / "vagent")
CONFIG = str(ROOT / "configs/quickstart/video_cpu.yaml")


def _run(*args, timeout=900):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


def _samples(out: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (out / "eval" / run / "samples.jsonl").read_text().splitlines()]


def test_a_video_config_that_cannot_work_is_refused_before_anything_runs():
    from quickstart.config import VideoConfig, config_class
    from vagent.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="no room for 3 flash frames"):
        load_config(VideoConfig, CONFIG, ["clip.fps=1"])
    with pytest.raises(ConfigError, match="flash_frames >= 1"):
        load_config(VideoConfig, CONFIG, ["clip.flash_frames=0"])
    with pytest.raises(ConfigError, match=r"max_images \(10\) must hold the first view \(6\) and the gold clip \(8"):
        load_config(VideoConfig, CONFIG, ["rollout.max_images=10"])
    with pytest.raises(ConfigError, match="task must be one of crop, video, tools, got 'vidoe'"):
        config_class(None, ["task=vidoe"])


def test_the_video_proof_runs_every_stage(tmp_path):
    """Data, both warm-up phases with their checks, both SFTs, GRPO on crop_clip with temporal IoU, five
    evaluations and the report, on a toy budget."""
    done = _run(VAGENT, "quickstart", "--config", CONFIG, f"out_dir={tmp_path}", "tiny.size=tiny", "train_rows=6",
                "test_rows=3", "val_rows=2", "warmup_rows=6", "warmup_epochs=1", "sft_epochs=1", "grpo_steps=1",
                "group_size=2", "prompts_per_step=2", "rollout.max_new_tokens=8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (state,) = (tmp_path / "grpo" / "checkpoints").glob("step-*/trainer_state.json")
    grpo = json.loads(state.read_text())["config"]
    assert grpo["data"]["tools"] == ["crop_clip"] and grpo["rollout"]["frame_budget"] == [6, 6]
    assert grpo["rewards"]["weights"]["temporal_iou"] == 0.5 and "crop_iou" not in grpo["rewards"]["weights"]
    for run in ("sft", "sft-notool", "sft-warmup-perception", "sft-warmup-both"):  # every SFT sees the first view
        (state,) = (tmp_path / run / "checkpoints").glob("step-*/trainer_state.json")
        assert json.loads(state.read_text())["config"]["data"]["frame_budget"] == [6, 6], run
    # the warm-up rows: the color from the gold clip's frames alone (4 frames where the video ends first), the marked
    # frame's time as the prompt prints it
    see = load_rows(tmp_path / "data" / "warmup_perception.jsonl")
    when = load_rows(tmp_path / "data" / "warmup_grounding.jsonl")
    assert all(len(r.images) in (4, 8) and not r.videos and r.answer in ("red", "green", "blue", "yellow") for r in see)
    assert all(r.videos and r.answer.startswith("t=") and r.answer.endswith("s") for r in when)
    train = {r.id: r for r in load_rows(tmp_path / "data" / "train.jsonl")}
    assert all(f'"start": {r.extra["marked"]}' in r.messages[0].plain_text for r in train.values())
    tool_samples = _samples(tmp_path, "sft-with-clip")
    assert len(tool_samples) == 3 and all("temporal_iou" in s for s in tool_samples)
    assert not any(s["tool_calls"] for s in _samples(tmp_path, "no-tool-baseline"))
    mixes = {name: load_rows(tmp_path / "data" / f"{name}.jsonl") for name in ("sft_mix", "sft_mix_notool")}
    assert len(mixes["sft_mix"]) == len(mixes["sft_mix_notool"])  # as many rows: the baseline takes as many steps
    checks = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in checks] == [0, 1]
    report = (tmp_path / "report.md").read_text()
    for needed in ("## Targets", "median temporal IoU of the clip cut", "at least 2x the no-tool baseline",
                   "GRPO keeps its SFT start's greedy accuracy", "## Where does the policy cut?",
                   "sft-warmup-both (grounding): the marked frame's time on 2 val clips",
                   "sft-warmup-both (perception): the color read", "trajectories.html"):  # fmt: skip
        assert needed in report, needed
    viewer = (tmp_path / "eval" / "sft-with-clip" / "trajectories.html").read_text()
    assert all(f"t={t:.2f}s" in viewer for t in (1, 3, 5, 7, 9, 11))  # the first view's frames, captioned by time
    assert (tmp_path / "results.png").is_file() and (tmp_path / "sft_loss.png").is_file()


@pytest.mark.slow
def test_the_default_video_proof_meets_its_targets(tmp_path):
    """The video proof at its default config and seed 0 (about 18 minutes alone on 2 cores): with crop_clip the
    policy answers at least twice as often as the no-tool baseline, cutting clips on the marked moment, and GRPO
    keeps its greedy policy (docs/quickstart.md)."""
    done = _run(VAGENT, "quickstart", "--config", CONFIG, f"out_dir={tmp_path}", timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    targets = report.split("## Targets")[1].split("\n## ")[0]
    # Known misses: the time target depends on what else the machine runs (the report states it); GRPO's gain and
    # its rising reward have no room above an SFT start that answers every test clip greedily and 0.93 sampled
    # (docs/decisions/video-glimpse-task.md). Every other target must hold.
    known = ("minutes", "GRPO at least 5 points above", "GRPO's rollout reward rises")
    missed = [
        line for line in targets.splitlines() if line.endswith("| **no** |") and not any(k in line for k in known)
    ]
    assert not missed, missed
    assert "| GRPO keeps its SFT start's greedy accuracy" in targets

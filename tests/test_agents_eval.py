"""``vagent eval --agent NAME``: a benchmark runs end to end under every profile on a tiny checkpoint (V* for the
image profiles, a video multiple-choice file for LongVT), and the run records which protocol it spoke."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.videos import write_video
from vagent.agents import PROFILES
from vagent.cli import main


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    Image.new("RGB", (320, 240), (120, 40, 40)).save(root / "a.png")
    write_video(root / "clip.mp4", frames=24, fps=8.0, size=(96, 64))
    (root / "vstar.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"id": "v1", "image": "a.png", "question": "What color is the cup?", "options": ["red", "blue"], "answer": "A"},
        {"id": "v2", "image": "a.png", "question": "Left or right?", "options": ["left", "right"], "answer": "B"}]))  # fmt: skip
    (root / "video_mc.jsonl").write_text(json.dumps(
        {"id": "m1", "video": "clip.mp4", "question": "Does it get brighter?", "options": ["yes", "no"], "answer": "A"}))  # fmt: skip
    return root


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_eval_runs_a_benchmark_under_each_profile(bench, tiny_qwen25, name):
    benchmark, data = ("video-mc", "video_mc.jsonl") if name == "longvt" else ("vstar", "vstar.jsonl")
    out = bench / f"run-{name}"
    args = ["eval", "--model", str(tiny_qwen25), "--benchmark", benchmark, "--data", str(bench / data),
            "--out", str(out), "--agent", name, "--max-new-tokens", "8", "--max-turns", "2", "--max-images", "16"]  # fmt: skip
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert metrics["agent"] == name and len(samples) == (1 if name == "longvt" else 2)
    assert "accuracy" in metrics and (out / "trajectories.html").is_file()
    first = json.loads((out / "trajectories.rank0.jsonl").read_text().splitlines()[0])
    opening = first["messages"][0]["content"][0]
    expected = {"deepeyes": "You are a helpful assistant.\n\n# Tools", "pixel-reasoner": "You are a helpful assistant.",
                "longvt": "You are a helpful assistant.\n# Tools", "deepeyesv2": "You are an agent",
                "tool-star": "You are a helpful assistant that can solve", "openthinkimg": "You are a visual assistant",
                "visual-arft": None, "vagent": "You are a helpful assistant that answers",
                "mini-o3": "You are a helpful assistant. Answer the user's question",
                "chain-of-focus": "You are a helpful assistant.\n\n# Tools\nYou may call",
                "thyme": "You are a helpful assistant.\n\nSolve the following"}[name]  # fmt: skip
    if expected is None:  # Visual-ARFT's prompt is one user message that starts with the image
        assert opening["type"] == "image"
    else:
        assert opening["text"].startswith(expected)


def test_unknown_agent_is_a_usage_error(bench, tiny_qwen25, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(tiny_qwen25), "--benchmark", "vstar", "--data", str(bench / "vstar.jsonl"),
              "--out", str(bench / "x"), "--agent", "deepeyes3"])  # fmt: skip
    assert "unknown agent 'deepeyes3'" in capsys.readouterr().err


def test_training_configs_name_the_agent_profile():
    from vagent.config import GRPOConfig, SFTConfig, load_config

    paths = ["model.path=m", "data.train=rows.jsonl"]  # required by the recipes; nothing is loaded here
    assert load_config(GRPOConfig, None, [*paths, "rollout.agent=deepeyes"]).rollout.agent == "deepeyes"
    assert load_config(SFTConfig, None, [*paths, "data.agent=pixel-reasoner"]).data.agent == "pixel-reasoner"
    assert load_config(GRPOConfig, None, paths).rollout.agent == "vagent"  # today's protocol unless asked


def test_demo_streams_an_episode_under_a_profile(tiny_qwen25):
    """`vagent demo --agent NAME`: the flag reaches the rollout, and native turns render with the profile's parser."""
    from demo.app import parse_args
    from demo.episode import render_turn, stream_episode
    from vagent.model import load_policy
    from vagent.rollout import RolloutLimits, Task

    assert parse_args(["--agent", "deepeyes"]).agent == "deepeyes"
    call = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 10, 200, 150]}}</tool_call>'
    task = Task(
        id="demo", question="What?", images=[Image.new("RGB", (320, 240))], scripted_turns=[call, "<answer>x</answer>"]
    )
    events = list(stream_episode(load_policy(tiny_qwen25), task, RolloutLimits(max_turns=3), agent="deepeyes"))
    assert events[-1].kind == "done" and events[-1].trajectory.answer == "x"
    shown = render_turn(events[0], 1, "deepeyes")
    assert any("image_zoom_in_tool" in m["content"] for m in shown if isinstance(m["content"], str))

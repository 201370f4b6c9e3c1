import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from videos import write_video

from vagent.cli import build_parser, main
from vagent.data import load_rows
from vagent.training.data import gold_conversation
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
VAGENT = str(Path(sys.executable).parent / "vagent")  # the console script of the environment running the tests


def _run(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_only_working_subcommands_are_listed():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == [
        "demo",
        "dpo",
        "eval",
        "eval-report",
        "generate",
        "grpo",
        "make-tiny-model",
        "memory",
        "merge-lora",
        "quickstart",
        "rollout",
        "serve",
        "sft",
        "tools",
    ]


def test_help_and_usage_errors_do_not_import_torch():
    # torch, torchvision (through qwen-vl-utils) and transformers cost about 3 s; `vagent --help` should not.
    code = (
        "import sys\n"
        "from vagent.cli import main\n"
        "for argv in (['--help'], ['eval', '--help'], ['eval']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'transformers') if m in sys.modules)\n"
        "print('heavy modules:', heavy)\n"
    )
    result = _run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "heavy modules: []"


@pytest.mark.slow  # 20 s; the README's runnable block (tests/test_doc_examples.py) makes a model and generates by default
def test_make_tiny_model_script_then_plain_transformers_then_vagent_generate(tmp_path):
    out = tmp_path / "tiny"
    done = _run(sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--family", "qwen2_5_vl", "--out", str(out))
    assert done.returncode == 0, done.stderr
    check = _run(
        sys.executable,
        "-c",
        "import sys; from transformers import AutoModelForImageTextToText as M, AutoProcessor as P; "
        f"m = M.from_pretrained({str(out)!r}); p = P.from_pretrained({str(out)!r}); print(type(m).__name__)",
    )
    assert check.returncode == 0 and "Qwen2_5_VLForConditionalGeneration" in check.stdout, check.stderr
    image = tmp_path / "img.png"
    Image.new("RGB", (200, 120), (0, 90, 0)).save(image)
    gen = _run(VAGENT, "generate", "--model", str(out), "--image", str(image), "--prompt", "Describe.",
               "--max-new-tokens", "8")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert "tokens, stop=" in gen.stderr and gen.stdout.strip() != ""


def test_errors_are_one_clear_line_and_exit_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "checkpoint dir not found" in capsys.readouterr().err
    assert main(["quickstart", "rollout.max_turns=zero"]) == 2
    assert "'rollout.max_turns' expects an integer" in capsys.readouterr().err
    assert main(["quickstart", f"out_dir={tmp_path / 'q'}", "grpo_negative_scale=2"]) == 2  # before any training
    assert "grpo.negative_scale must be in [0, 1], got 2.0 (from the quickstart's" in capsys.readouterr().err
    assert main(["quickstart", f"out_dir={tmp_path / 'q'}", "group_size=1"]) == 2
    assert "grpo.group_size must be >= 2" in capsys.readouterr().err
    assert main(["quickstart", f"out_dir={tmp_path / 'q'}", "val_rows=-1"]) == 2
    assert "need val_rows, grpo_val_every, grpo_val_samples and sampled_test_samples >= 0" in capsys.readouterr().err
    assert main(["quickstart", f"out_dir={tmp_path / 'q'}", "rollout.temperature=0"]) == 2
    assert "sample at rollout.temperature, which is 0" in capsys.readouterr().err


def test_quickstart_runs_end_to_end(tmp_path):
    """Every stage on a toy budget (the real run's numbers are in the README): data, the warm-up and both SFTs,
    GRPO, six evaluations (four greedy, two sampled) and the report with its pictures."""
    done = _run(VAGENT, "quickstart", "--config", str(ROOT / "configs/quickstart/tiny_cpu.yaml"), f"out_dir={tmp_path}",
                "tiny.size=tiny", "train_rows=8", "test_rows=4", "warmup_rows=8", "warmup_epochs=1", "sft_epochs=1",
                "grpo_steps=1", "group_size=2", "prompts_per_step=2", "rollout.max_new_tokens=8",
                "grpo_negative_scale=0.5", "val_rows=3")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (state,) = (tmp_path / "grpo" / "checkpoints").glob("step-*/trainer_state.json")
    grpo_config = json.loads(state.read_text())["config"]
    assert grpo_config["grpo"]["negative_scale"] == 0.5  # the quickstart's knobs reach GRPO
    assert grpo_config["grpo"]["kl_coef"] == 0.05  # the KL to the SFT start that keeps its greedy answers
    assert grpo_config["val"]["keep_best"] and grpo_config["val"]["rows"] == str(tmp_path / "data" / "val.jsonl")
    assert grpo_config["val"]["temperature"] == 0.7 and grpo_config["val"]["samples"] == 1  # GRPO's own sampling
    val = load_rows(tmp_path / "data" / "val.jsonl")
    assert len(val) == 3 and not {r.images[0] for r in val} & {
        r.images[0] for r in load_rows(tmp_path / "data" / "test.jsonl")
    }
    checks = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in checks] == [0, 1]  # before the first step and after the last
    report = (tmp_path / "report.md").read_text()
    assert "GRPO policy = " in report and "val rows, 1 sample a row at temperature 0.7: step 0 " in report
    for name in (
        "grpo + crop",
        "sft + crop",
        "no-tool baseline",
        "sft, blind crop",
        "grpo + crop, sampled",
        "sft + crop, sampled",
    ):
        assert f"| {name} |" in report
    assert "GRPO at least 5 points above its SFT start (sampled" in report
    assert "95% interval" in report and "GRPO against its SFT start on the same rows" in report
    targets = report.split("## Targets")[1].split("##")[0]  # each target, measured: met or not on this toy budget
    assert targets.count("| yes |") + targets.count("| **no** |") == 9 and "targets met at seed 0" in targets
    assert "| GRPO keeps its SFT start's greedy accuracy (at most 2 points below) | " in targets
    assert f"| within 20 minutes | {report.split('Total time **')[1].split(' ')[0]} min |" in targets
    for phase in ("grounding", "perception"):  # each warm-up phase checked on every val image with a small tile
        check = (tmp_path / "eval" / f"sft-warmup-{phase}" / "samples.jsonl").read_text().splitlines()
        assert check and len(check) == len(load_rows(tmp_path / "data" / f"check_{phase}.jsonl"))
    learned = report.split("## What the warm-up learned")[1].split("##")[0]
    assert "- sft-warmup-grounding: the tile's box on " in learned and "- sft-warmup-perception: the stripes" in learned
    per_answer = report.split("## Which answers does each policy get right?")[1].split("##")[0]
    assert per_answer.count("| sft + crop |") == 1 and "most given answer" in per_answer
    for picture in ("results.png", "sft_loss.png", "grpo.png"):
        assert Image.open(tmp_path / picture).size[0] > 300
    assert "done:" in (tmp_path / "sft-notool" / "log.txt").read_text()  # the baseline trained in its own process
    assert (tmp_path / "eval" / "no-tool-baseline" / "metrics.json").is_file()
    kept_start = "GRPO policy = its SFT start" in report  # a random tiny policy answers no val row: it ties
    assert (tmp_path / "eval" / "grpo-with-crop").exists() != kept_start  # a kept start is not evaluated twice
    html = (tmp_path / report.split("- grpo + crop: [")[1].split("]")[0]).read_text()  # the viewer the report links
    assert html.count("data:image/") >= 4  # each test image, inline
    train = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    crop_rows = [r for r in train if len(r["messages"]) == 3]
    assert crop_rows, "gold trajectories crop before answering"
    crop = Image.open(tmp_path / "data" / crop_rows[0]["messages"][1]["content"][0]["path"])
    rgb = np.asarray(crop.convert("RGB"), dtype=np.int16)
    colored = int((rgb.max(axis=2) - rgb.min(axis=2) > 80).sum())  # the tile, not the grey clutter
    assert colored > 0.2 * crop.width * crop.height  # the gold crop is mostly the colored tile
    mix, notool = (load_rows(tmp_path / "data" / f"{name}.jsonl") for name in ("sft_mix", "sft_mix_notool"))
    assert len(mix) == len(notool)  # the same budget: as many rows, so as many steps
    reading = [row for row in mix if row.source.endswith("reading")]  # the crop read in context, the call not trained
    assert reading and [m.trained for m in gold_conversation(reading[0], [])][-3:] == [False, True, True]


@pytest.mark.slow
def test_a_job_beside_the_quickstart_returns_its_result_or_a_clear_error(tmp_path):
    import torch

    from quickstart.parallel import Beside

    torch.set_num_threads(2)
    job = Beside.start(True, "cpu", tmp_path / "ok.txt", "the job", json.loads, "[1, 2]")
    assert torch.get_num_threads() == 1  # the other thread is the job's
    assert job.result() == [1, 2] and torch.get_num_threads() == 2
    job.stop()
    job = Beside.start(True, "cpu", tmp_path / "slow.txt", "the job", time.sleep, 1.0)
    before_step = job.hand_over(0.6)  # the crop-tool SFT's hook: all threads from 60% of its steps on
    before_step(5, 10)
    assert not job.done and torch.get_num_threads() == 1  # before that step it neither waits nor takes a thread
    before_step(6, 10)
    assert job.done and torch.get_num_threads() == 2  # at it: waits for the job, then has both threads
    assert job.result() is None  # the result is kept, not read from the pipe twice
    job.stop()
    with pytest.raises(RuntimeError, match=r"(?s)the job failed; its log is .*bad.txt.*JSONDecodeError"):
        Beside.start(True, "cpu", tmp_path / "bad.txt", "the job", json.loads, "{bad").result()
    with pytest.raises(RuntimeError, match="ended without a result \\(exit code 3\\)"):
        Beside.start(True, "cpu", tmp_path / "died.txt", "the job", os._exit, 3).result()  # killed, OOM: no hang
    assert Beside.start(False, "cpu", tmp_path / "x.txt", "the job", json.loads, "1") is None  # parallel_* off
    assert Beside.start(True, "cuda", tmp_path / "x.txt", "the job", json.loads, "1") is None  # CPU only


def test_the_warm_up_checks_say_when_a_phase_has_not_learned_its_skill():
    from quickstart.report import check_line

    stuck = check_line({"phase": "grounding", "scores": {"box": [1.0, 0.0, 0.0, 0.0]}, "answers": 1})  # one box
    assert "mean IoU 0.25, IoU >= 0.5 for 25%, 1 distinct box " in stuck and "not learned where the tile is" in stuck
    learned = check_line({"phase": "grounding", "scores": {"box": [0.98, 1.0]}, "answers": 2})
    assert "mean IoU 0.99" in learned and "2 distinct boxes" in learned and "plateau" not in learned
    diagonals = {"falling": [0.0, 0.0], "horizontal": [1.0], "rising": [1.0, 0.0, 1.0], "vertical": [1.0]}
    stuck = check_line({"phase": "perception", "what": "stripes", "scores": diagonals, "answers": 3})
    assert "the stripes read from the gold crop on 7 val images" in stuck
    assert "accuracy 0.57 (falling 0/2, horizontal 1/1, rising 2/3, vertical 1/1)" in stuck
    assert "it does not read falling (" in stuck
    digits = check_line({"phase": "perception", "what": "digit", "scores": {"3": [1.0, 0.0]}, "answers": 2})
    assert digits.startswith("the digit read from the gold crop") and "plateau" not in digits


def test_the_greedy_targets_count_slips_the_answered_share_does_not_show():
    """GRPO's greedy targets: accuracy at most 2 points below SFT's; episodes with a tool error, and without a
    well-formed answer (none, or one whose turn broke the grammar), each at most 2 points above SFT's share."""
    from quickstart.report import greedy_kept, slips

    def sample(accuracy=1.0, prediction="rising", tool_errors=0, malformed_answer=False):
        return {"accuracy": accuracy, "prediction": prediction, "tool_errors": tool_errors,
                "malformed_answer": malformed_answer}  # fmt: skip

    sft = [sample() for _ in range(100)]
    swallowed = sample(0.0, "rising</think>\n<tool_call>", malformed_answer=True)  # an <answer> left open
    assert slips([sample(tool_errors=1), sample(), sample(prediction=None), swallowed]) == (0.25, 0.5)
    (_, measured, ok), (_, slipped, kept) = greedy_kept([*[sample()] * 98, *[swallowed] * 2], sft)
    assert ok and kept and "-2.0 points" in measured  # 2 points: within the slack
    assert "without a well-formed answer 2.0% (SFT 0.0%)" in slipped and "with a tool error 0.0%" in slipped
    (_, measured, ok), (_, slipped, kept) = greedy_kept([*[sample()] * 97, *[swallowed] * 3], sft)
    assert not ok and not kept and "-3.0 points" in measured  # 3 points: beyond it
    assert not greedy_kept([*[sample()] * 97, *[sample(tool_errors=1)] * 3], sft)[1][2]


def test_grpo_against_its_sft_start_names_the_best_of_k_its_sharpening_can_reach():
    """Sampled k times a row, the SFT start's best sample of each row (pass@k, the evaluation's own ``at_k``) beside
    its mean; once a row, no line."""
    from quickstart.report import SAMPLED, best_of, grpo_vs_sft
    from vagent.eval.metrics import summarize

    def metrics(scores):  # [[row 0's samples], [row 1's samples], ...] -> the evaluation's metrics
        return summarize([{"id": str(i), "sample": n, "accuracy": a} for i, row in enumerate(scores)
                          for n, a in enumerate(row)], ["accuracy"])  # fmt: skip

    sampled = metrics([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.0]])
    assert best_of(sampled) == ["Picking its best of 4 samples on every row, the SFT start would score 0.625 "
                                "(pass@4): the room GRPO's sharpening has, at least."]  # fmt: skip
    assert best_of(metrics([[1.0], [0.0]])) == [] and best_of({}) == []
    uneven = metrics([[0.0, 0.0, 1.0], [0.0, 1.0]])
    assert "best of 2 samples on every row, the SFT start would score 0.500" in best_of(uneven)[0]  # first 2 of each
    greedy = [{"id": str(i), "accuracy": a} for i, a in enumerate([1.0, 0.0, 1.0, 0.0])]
    samples = {"grpo + tools": greedy, "sft + tools": greedy}
    results = {n: (None, {**sampled, "accuracy": 0.344}) for n in ("grpo + tools" + SAMPLED, "sft + tools" + SAMPLED)}
    line = grpo_vs_sft(samples, results, "tools")[0]
    assert "(+0.0 points)" in line and line.endswith("would score 0.625 (pass@4): the room GRPO's sharpening has, "
                                                     "at least.")  # fmt: skip
    from quickstart.tools import _f1_as_accuracy  # the tools proof's F1 read as accuracy, at every k too

    at_k = {j: {name.replace("/accuracy", "/f1"): v for name, v in m.items()} for j, m in sampled["at_k"].items()}
    f1 = {**{k: v for k, v in sampled.items() if k != "at_k"}, "f1": 0.344, "at_k": at_k}
    assert best_of(_f1_as_accuracy(f1)) == best_of(sampled)


def test_wilson_interval_matches_the_textbook_values():
    from quickstart.report import wilson_interval

    low, high = wilson_interval(5, 10)  # p = 0.5, n = 10: (0.237, 0.763)
    assert (round(low, 3), round(high, 3)) == (0.237, 0.763)
    assert wilson_interval(0, 20)[0] == 0.0 and 0 < wilson_interval(0, 20)[1] < 0.2  # never below 0, not 0-wide
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.slow
def test_the_default_quickstart_learns_to_look_closer(tmp_path):
    """The README's main job at its default config (15-30 minutes by CPU): the numbers in its report come from
    real rollouts, and on the fixed seed the agent with the crop tool beats the no-tool baseline trained on
    the same budget, with crops that land on the tile."""
    import statistics

    done = _run(VAGENT, "quickstart", "--config", str(ROOT / "configs/quickstart/tiny_cpu.yaml"), f"out_dir={tmp_path}",
                timeout=2400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    def samples(run):
        return [json.loads(line) for line in (tmp_path / "eval" / run / "samples.jsonl").read_text().splitlines()]

    with_tool, baseline = samples("sft-with-crop"), samples("no-tool-baseline")
    accuracy = {name: sum(s["accuracy"] for s in rows) / len(rows) for name, rows in
                (("tool", with_tool), ("baseline", baseline))}  # fmt: skip
    assert accuracy["tool"] > accuracy["baseline"], accuracy
    assert statistics.median(s["crop_iou"] for s in with_tool) >= 0.3
    assert not any(s["tool_calls"] for s in baseline)  # a list of calls per sample
    report = (tmp_path / "report.md").read_text()
    assert f"| sft + crop | 192 | {accuracy['tool']:.3f} |" in report
    targets = report.split("## Targets")[1].split("##")[0]
    assert f"/ {accuracy['baseline']:.3f})" in targets  # the ratio's baseline is the baseline's real accuracy
    for kept in ("GRPO keeps its SFT start's greedy accuracy", "GRPO adds no greedy slips"):
        assert next(line for line in targets.splitlines() if kept in line).endswith("| yes |")  # issue #55, item 0


def test_tools_list_names_every_tool(capsys):
    from vagent.toolbox import TOOLS

    assert main(["tools", "list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}(" in out for name in TOOLS) and "bbox: array" in out
    assert main(["tools", "list", "--json"]) == 0
    schemas = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["name"] for s in schemas] == list(TOOLS)


def test_tools_call_prints_the_observation_and_writes_images(tmp_path, capsys):
    image = tmp_path / "img.png"
    Image.new("RGB", (1000, 750), (0, 128, 255)).save(image)
    args = ["tools", "call", "crop", "--args", '{"bbox": [10, 10, 200, 200]}', "--image", str(image)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "cropped region" in captured.out and "boxes are in" in captured.err
    assert Image.open(tmp_path / "out" / "crop_0.png").getpixel((5, 5)) == (0, 128, 255)
    # a failing call is an observation (exit 0); a usage mistake exits 2
    assert main(["tools", "call", "crop", "--args", '{"bbox": [1, 2]}', "--image", str(image)]) == 0
    assert "error (bad_arguments)" in capsys.readouterr().out
    assert main(["tools", "call", "crop", "--args", "{bbox: 1}", "--image", str(image)]) == 2
    assert "--args is not valid JSON" in capsys.readouterr().err
    assert main(["tools", "call", "crop", "--args", "{}", "--image", str(tmp_path / "missing.png")]) == 2


def test_tools_call_video_prints_frame_times(tmp_path, capsys):
    path = write_video(tmp_path / "clip.mp4", frames=30, fps=10.0, step=8)
    args = ["tools", "call", "sample_frames", "--args", '{"num_frames": 3}', "--video", str(path)]
    assert main([*args, "--out", str(tmp_path / "frames")]) == 0
    out = capsys.readouterr().out
    assert "t = 0.50, 1.50, 2.50 s" in out and out.count("wrote ") == 3 and "t=1.500s" in out


def test_tools_parse_reads_jsonl_and_reports_error_kinds(monkeypatch, capsys):
    import io

    lines = [
        {"text": '<tool_call>{"name": "crop", "arguments": {"bbox": [1, 2, 3, 4],}}</tool_call>'},
        {"text": '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'},
        {"text": "<think>easy</think><answer>7</answer>"},
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(json.dumps(x) for x in lines) + "\n"))
    assert main(["tools", "parse"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[0]["tool_calls"] == [{"name": "crop", "arguments": {"bbox": [1, 2, 3, 4]}}]
    assert out[0]["error_kinds"] == ["repaired_json"] and out[1]["error_kinds"] == ["unknown_tool"]
    assert out[2]["answer"] == "7" and out[2]["think"] == "easy" and out[2]["error_kinds"] == []
    monkeypatch.setattr("sys.stdin", io.StringIO('not json\n{"text": "<answer>1</answer>"}\n'))
    assert main(["tools", "parse"]) == 2  # malformed input is a usage error, but every line still gets an answer
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_rollout_arguments_parse(capsys):
    base = ["rollout", "--model", "m", "--data", "rows.jsonl", "--out", "t.jsonl"]
    args = build_parser().parse_args(base)
    assert (args.tools, args.samples, args.batch_size, args.html, args.limit) == (None, 1, 8, None, None)
    assert args.tool_workers == 8 and build_parser().parse_args([*base, "--tool-workers", "32"]).tool_workers == 32
    args = build_parser().parse_args([*base, "--tools", "none", "--samples", "4", "--max-turns", "3", "--top-p", "0.9"])
    assert args.tools == [] and args.samples == 4 and args.max_turns == 3 and args.top_p == 0.9
    assert build_parser().parse_args([*base, "--tools", "crop, zoom_in"]).tools == ["crop", "zoom_in"]
    # the episode limits eval and rollout share: the profile's own budgets unless given
    from vagent.recipes.evaluate import episode_limits

    limits = episode_limits(build_parser().parse_args([*base, "--max-tool-calls", "2", "--max-images", "12"]))
    assert (limits.max_tool_calls, limits.max_images, limits.max_turns) == (2, 12, 4)
    limits = episode_limits(build_parser().parse_args([*base, "--agent", "pixel-reasoner"]))
    assert (limits.max_tool_calls, limits.max_turns) == (None, 5)  # its own call budget (4) applies in the engine
    for bad in (["--tools", "crop,zoom"], ["--samples", "0"], ["--max-tool-calls", "0"], ["--tool-workers", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([*base, *bad])
        assert exit_info.value.code == 2
    assert "unknown tool(s) ['zoom']" in capsys.readouterr().err


def test_rollout_tools_flag_wins_over_the_rows_own_and_says_so(capsys):
    """`vagent rollout --tools` offers its tools to every row, as `vagent eval --tools` does, with one note counting
    the rows whose own `tools` it replaced; without it a row keeps its own list and a row without one gets crop."""
    from vagent.cli import _rollout_tasks
    from vagent.data import Row

    rows = [Row(id="own", question="q", answer="1", answer_type="exact", tools=["crop"]),
            Row(id="none", question="q", answer="1", answer_type="exact")]  # fmt: skip
    assert [t.tools for t in _rollout_tasks(rows, None)] == [["crop"], ["crop"]]
    assert capsys.readouterr().err == ""
    assert [t.tools for t in _rollout_tasks(rows, ["crop", "zoom_in"])] == [["crop", "zoom_in"]] * 2
    assert capsys.readouterr().err == "note: --tools crop,zoom_in replaces the tools of 1 of 2 rows\n"
    assert [t.tools for t in _rollout_tasks(rows, [])] == [[], []]  # --tools none: the no-tool baseline
    assert "--tools none replaces" in capsys.readouterr().err
    _rollout_tasks(rows, ["crop"])  # the same list as the row's own: nothing replaced, nothing said
    assert capsys.readouterr().err == ""


def _rows_file(tmp_path):
    Image.new("RGB", (120, 90), (200, 30, 30)).save(tmp_path / "red.png")
    rows = [
        {"id": "a", "images": ["red.png"], "question": "What colour is the image?", "answer": "red",
         "answer_type": "exact"},
        {"id": "b", "images": ["red.png"], "question": "Which colour?", "answer": "A", "answer_type": "choice",
         "choices": ["red", "blue"], "tools": ["crop", "zoom_in"]},
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rollout_runs_rows_end_to_end(tiny_qwen25, tmp_path, capsys):
    rows = _rows_file(tmp_path)
    out, html = tmp_path / "out" / "trajectories.jsonl", tmp_path / "out" / "view.html"
    argv = ["rollout", "--model", str(tiny_qwen25), "--data", str(rows), "--out", str(out), "--html", str(html),
            "--samples", "2", "--max-turns", "2", "--max-new-tokens", "8", "--batch-size", "3", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "4 trajectories (2 rows x 2 samples)" in captured.out and "stop reasons:" in captured.out
    assert f"wrote {out}" in captured.out and str(html) in captured.out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["task_id"], r["sample"]) for r in records) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert {r["task_id"]: r["gold"] for r in records} == {"a": "red", "b": "A"}
    user = next(m for m in records[-1]["messages"] if m["role"] == "user")
    assert "A. red\nB. blue" in "".join(p.get("text", "") for p in user["content"])  # choices shown as lettered options
    assert html.is_file() and html.stat().st_size > 0
    # a bad row is a usage error naming the line, before any model is loaded
    rows.write_text(rows.read_text() + json.dumps({"id": "c", "question": "q", "answer": "x", "answer_type": "exakt"}))
    assert main([*argv[:2], str(tmp_path / "no-model"), *argv[3:]]) == 2
    assert "rows.jsonl:3 (id 'c'): field 'answer_type' must be one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stage", "config"),
    [
        ("sft", "configs/sft/qwen2_5_vl_7b_zero2.yaml"),
        ("grpo", "configs/grpo/qwen2_5_vl_7b.yaml"),
        ("dpo", "configs/dpo/qwen2_5_vl_3b_fsdp.yaml"),
    ],
)
@pytest.mark.parametrize("key", ["model.path", "data.train"])
def test_a_production_recipe_without_its_model_or_data_stops_before_loading_anything(stage, config, key, capsys):
    # A 7B run with a forgotten override must not train the toy: one line naming the key, exit 2, nothing loaded
    # (the configs point at paths that do not exist here, so reaching a load would fail differently).
    assert main([stage, "--config", str(ROOT / config), f"{key}=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{key} is required" in err[0], err


def test_eval_without_a_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--benchmark", "vstar", "--data", "x.jsonl", "--out", "o"])
    assert exit_.value.code == 2 and "--model" in capsys.readouterr().err


def test_blind_crop_keeps_the_call_and_its_answer_but_shows_the_whole_image():
    from quickstart.run import blind_crop
    from vagent.toolbox import ToolContext, call_tool
    from vagent.types import ToolCall

    image = Image.new("RGB", (400, 300), "white")
    image.paste((200, 30, 30), (300, 200, 400, 300))  # red only in the bottom-right corner
    context = ToolContext(images=[image], model_sizes=[(400, 300)], convention="absolute", min_pixels=3136,
                          max_pixels=50176, image_factor=28)  # fmt: skip
    call = ToolCall("crop", {"bbox": [300, 200, 400, 300]})
    seen = call_tool(call, context)
    with blind_crop():
        blind = call_tool(call, context)
        bad = call_tool(ToolCall("crop", {"bbox": [500, 500, 600, 600]}), context)
    assert call_tool(call, context).images[0].tobytes() == seen.images[0].tobytes()  # crop is itself again after
    assert blind.text == seen.text and blind.metadata == seen.metadata and blind.images[0].size == seen.images[0].size
    assert np.asarray(seen.images[0])[..., 1].max() < 100  # the crop: all red
    assert np.asarray(blind.images[0])[..., 1].mean() > 150  # the blind crop: mostly the white image around it
    assert bad.error == "bad_box"  # calls the crop tool refuses are refused the same way


def test_with_vllm_on_a_gpu_the_policy_stays_on_the_cpu_in_the_engines_dtype(monkeypatch):
    """``vagent serve/rollout/eval`` and the demo load the HF policy where ``policy_placement`` says: as asked for the
    HF backend or vLLM on a CPU; with vLLM on a GPU on the CPU (the engine holds the weights), with sdpa (it runs no
    forward; flash-attn would refuse the CPU) and in the dtype the engine takes from it (bf16 under auto)."""
    import torch

    from vagent.rollout.vllm_backend import policy_placement

    asked = {"device": None, "dtype": "auto", "attn_implementation": "flash_attention_2"}
    assert policy_placement("hf", None, "auto", "flash_attention_2") == (None, asked)
    assert policy_placement("vllm", "cpu", "float32", None) == ("cpu", {**asked, "device": "cpu", "dtype": "float32",
                                                                         "attn_implementation": None})  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpu = ("cuda", {"device": "cpu", "dtype": torch.bfloat16, "attn_implementation": "sdpa"})
    assert policy_placement("vllm", None, "auto", "flash_attention_2") == gpu
    assert policy_placement("vllm", "cuda:0", None, None) == gpu
    assert policy_placement("vllm", "cuda", "float16", None)[1]["dtype"] == torch.float16
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=1 and device cuda"):  # vLLM would run on GPU 0
        policy_placement("vllm", "cuda:1", None, None)
    from vagent.rollout.vllm_backend import engine_device

    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=1"):  # GRPO's engine beside a policy on GPU 1
        engine_device(torch.device("cuda", 1))
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second process: its engine's own GPU
    assert policy_placement("vllm", "cuda:1", None, None) == gpu
    assert engine_device(torch.device("cuda", 1)) == "cuda" and engine_device("cpu") == "cpu"


def test_a_single_process_runs_on_the_gpu_it_is_given_and_torchrun_ranks_on_their_own(monkeypatch):
    """``init_distributed("cuda:1")`` outside torchrun sets and returns GPU 1 (it took LOCAL_RANK's 0, silently);
    under torchrun each process takes cuda:LOCAL_RANK whatever index was given."""
    import torch

    from vagent.training.distributed import init_distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed("cuda:1").device == torch.device("cuda", 1)
    assert init_distributed("cuda").device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun --nproc-per-node 1
    assert init_distributed("cuda:1").device == torch.device("cuda", 0)
    assert chosen == [1, 0, 0]
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="sees 2 GPU"):  # not torch's "invalid device ordinal" at the first kernel
        init_distributed("cuda:2")

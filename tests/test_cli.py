import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from vagent.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
VAGENT = str(Path(sys.executable).parent / "vagent")  # the console script of the environment running the tests


def _run(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_only_working_subcommands_are_listed():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == ["generate", "make-tiny-model", "quickstart"]


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


def test_quickstart_runs_end_to_end(tmp_path):
    done = _run(VAGENT, "quickstart", "--config", str(ROOT / "configs/quickstart/tiny_cpu.yaml"),
                f"out_dir={tmp_path}", "rollout.max_new_tokens=8")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[tool] images:" in done.stdout and "-> tool call crop" in done.stdout
    record = json.loads((tmp_path / "trajectory.jsonl").read_text())
    roles = [m["role"] for m in record["messages"]]
    assert roles[:4] == ["system", "user", "assistant", "tool"]
    assert len(record["token_ids"]) == len(record["loss_mask"]) and sum(record["loss_mask"]) > 0
    crop = Image.open(record["messages"][3]["content"][0]["path"])
    assert crop.getpixel((crop.width // 2, crop.height // 2))[0] > 150  # the red tile is in the middle of the crop

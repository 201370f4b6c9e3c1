"""The search-and-code proof (``python -m quickstart --config configs/quickstart/tools_cpu.yaml``): every stage on a toy
budget, and (slow) the default run's targets."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data_pipelines.synthetic.tools import CODE_THINK, TOOLS, output_think, split_of
from vagent.chat import observation_content, parse_turn
from vagent.data import load_rows
from vagent.toolbox.sandbox import Sandbox
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
VAGENT = str(Path(sys.executable).parent / "vagent")
CONFIG = str(ROOT / "configs/quickstart/tools_cpu.yaml")
# the code rows' gold calls run in bubblewrap, as tests/test_tool_choice_rows.py's do
pytestmark = pytest.mark.skipif(not Sandbox().available(), reason="bubblewrap (bwrap) is missing or does not work here")


def _run(*args, timeout=900):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


def _metrics(out: Path, run: str) -> dict:
    return json.loads((out / "eval" / run / "metrics.json").read_text())


def test_a_tools_config_that_cannot_work_is_refused_before_anything_runs():
    from quickstart.config import ToolsConfig
    from vagent.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="toolstar_steps must be >= 0"):
        load_config(ToolsConfig, CONFIG, ["toolstar_steps=-1"])
    with pytest.raises(ConfigError, match="leave toolbox.search_corpus and toolbox.search_url null"):
        load_config(ToolsConfig, CONFIG, ["toolbox.search_corpus=corpus.jsonl"])


def test_the_tool_star_section_counts_what_the_reward_counts():
    """A format violation is what ``tool_star_format_ok`` scores -1 (a parse error in any turn included); two kinds
    of tool count only calls that succeeded; a paired change's interval holds its mean and is 0-wide when every row
    moved alike."""
    from quickstart.toolstar import paired_interval, several_kinds, violated

    good = {"stop_reason": "answered", "prediction": "fema", "malformed_answer": False, "parse_errors": {}}
    assert not violated(good)
    assert violated({**good, "parse_errors": {"bad_json": 1}}) and violated({**good, "prediction": " "})
    assert violated({**good, "stop_reason": "max_turns"}) and violated({**good, "malformed_answer": True})
    assert several_kinds({"tools_ok": ["search", "code"]})
    assert not several_kinds({"tools_ok": ["search", "search"]}) and not several_kinds(
        {"tools_ok": ["search", "serach"]}
    )
    mean, low, high = paired_interval([0.0, 1.0, 0.0, 1.0, 1.0])
    assert low < mean == 0.6 < high
    assert paired_interval([0.5] * 4) == (0.5, 0.5, 0.5)


def test_the_copy_warm_up_copies_as_the_gold_trajectories_do():
    """Each copy skill's gold holds the words a gold trajectory writes at that point, the copy made at the same
    distance: the search call's JSON after its think (from the question's object and property), the value after the
    hit's sentence, and for code (half the rows) a whole code trajectory without its picture or the tools' schemas:
    the program copied from the question's expression, the tool's turn the sandbox prints for it (run here), and the
    printed number quoted, then answered."""
    import random

    from quickstart.tools import _copied
    from vagent.toolbox import ToolContext, call_tool

    rows = [_copied(f"c{i}", random.Random(i)) for i in range(200)]
    skills = Counter(r.extra["groups"]["skill"] for r in rows)
    assert set(skills) == {"query", "value", "code"} and 0.4 < skills["code"] / len(rows) < 0.6
    assert all(row.tools == [] and not row.images for row in rows)
    for row in rows:
        text, skill = row.messages[-1].plain_text, row.extra["groups"]["skill"]
        assert text.endswith(f"</think>\n<answer>{row.answer}</answer>")
        if skill == "query":
            call = json.loads(row.answer)
            assert call["name"] == "search" and call["arguments"]["k"] == 1
            assert all(word in row.question for word in call["arguments"]["query"].split())
        if skill == "value":
            assert len(row.messages) == 1 and f"is {row.answer}." in row.question
        if skill != "code":
            continue
        [call], tool, answer = parse_turn(row.messages[0].plain_text).tool_calls, row.messages[1], row.messages[2]
        expression = row.question.removeprefix("What is ").removesuffix("?")
        assert row.messages[0].plain_text.startswith(f"<think>{CODE_THINK}</think>")
        assert (call.name, call.arguments) == ("code", {"code": f"print({expression})"})
        assert tool.role == "tool" and answer.plain_text.startswith(f"<think>{output_think(row.answer)}</think>")
    sandboxed = next(row for row in rows if row.extra["groups"]["skill"] == "code")
    [call] = parse_turn(sandboxed.messages[0].plain_text).tool_calls
    observation = call_tool(call, ToolContext(), offered=["code"])
    assert [part["text"] for part in observation_content(observation)] == [sandboxed.messages[1].plain_text]


def test_the_tools_proof_runs_every_stage(tmp_path):
    """Data and corpus, the four warm-up phases with their checks, both SFTs, GRPO offering every tool with the
    corpus, five evaluations scored with MAT's F1 and EM and the report, on a toy budget; the viewer shows a search's
    query and hits and a program and its output."""
    done = _run(VAGENT, "quickstart", "--config", CONFIG, f"out_dir={tmp_path}", "tiny.size=tiny", "train_rows=8",
                "test_rows=4", "val_rows=2", "grpo_rows=4", "warmup_rows=4", "warmup_epochs=1", "sft_epochs=1",
                "grpo_steps=1", "group_size=2", "prompts_per_step=2", "rollout.max_new_tokens=8",
                "toolstar_steps=1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = tmp_path / "data"
    corpus = data / "corpus-0.jsonl"
    (state,) = (tmp_path / "grpo" / "checkpoints").glob("step-*/trainer_state.json")
    grpo = json.loads(state.read_text())["config"]
    assert grpo["data"]["tools"] == TOOLS and grpo["rewards"]["weights"]["accuracy"] == 1.0
    assert grpo["toolbox"]["search_corpus"] == str(corpus.resolve())  # GRPO searches the rows' world
    train, test = load_rows(data / "train.jsonl"), load_rows(data / "test.jsonl")
    assert all(r.tools == TOOLS and r.answer_type == "f1" for r in train + test)
    for split, rows in (("train", train), ("test", test), ("val", load_rows(data / "val.jsonl"))):
        assert all(
            split_of(r.extra["entity"], r.extra["property"]) == split for r in rows if r.extra["kind"] == "search"
        )
    # the baseline's mix: as many rows as the tool mix (as many steps), none offering or calling a tool
    mix, notool = load_rows(data / "sft_mix.jsonl"), load_rows(data / "sft_mix_notool.jsonl")
    assert len(mix) == len(notool) and all(r.tools == [] and len(r.messages) == 1 for r in notool)
    queries = [r for r in mix if r.source == "synthetic/tools-query"]  # every pair's call, held-out ones too
    assert len(queries) == len({(r.extra["entity"], r.extra["property"]) for r in queries}) == 64
    assert all(len(r.messages) == 1 for r in queries)  # the call alone: no hit, no value
    named = {r.images[0] for r in notool if r.id.startswith("tools-query-")}  # the baseline: the same pictures named
    assert named == {r.images[0] for r in queries}
    for phase in ("perception", "grounding", "entity", "copy"):  # tool-free warm-up rows, checked after each phase
        rows = load_rows(data / f"warmup_{phase}.jsonl")
        assert len(rows) == 4 and all(r.tools == [] for r in rows), phase
        verdicts = "reproduced.jsonl" if phase == "copy" else "samples.jsonl"  # copy: teacher-forced, no rollout
        assert (tmp_path / "eval" / f"sft-warmup-{phase}" / verdicts).is_file(), phase
    # GRPO's prompts are drawn apart from train: none is a row SFT trained on (a code row's numbers are its own)
    prompts = load_rows(data / "grpo.jsonl")
    assert grpo["data"]["train"] == str(data / "grpo.jsonl") and len(prompts) == 4
    asked = {r.question for r in train + prompts if r.extra["kind"] == "code"}
    assert len(asked) == sum(r.extra["kind"] == "code" for r in train + prompts) > 0
    tools, baseline = _metrics(tmp_path, "sft-with-tools"), _metrics(tmp_path, "no-tool-baseline")
    assert tools["benchmark"] == "synthetic-tools" and tools["tools"] == "search,code,crop"
    assert {"f1", "em", "crop_iou"} <= set(tools) and set(tools["by_kind"]) <= {"search", "code", "crop", "direct"}
    assert baseline["tools"] == "none" and baseline["tool_calls_per_sample"] == 0
    checks = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in checks] == [0, 1]
    report = (tmp_path / "report.md").read_text()
    for needed in ("## Targets", "search rows: F1 at least 2x the no-tool baseline's and at least 0.5",
                   "code rows: F1 at least 2x the no-tool baseline's and at least 0.5",
                   "the right tool called first on at least 70%",
                   "GRPO keeps its SFT start's greedy accuracy", "## F1 and EM by row kind", "| search F1 | search EM |",
                   "row kind x first tool called", "| sft + tools | search |", "sft-warmup-copy: a query, a value, or a program and its printed number",
                   "trajectories.html"):  # fmt: skip
        assert needed in report, needed
    assert (tmp_path / "results.png").is_file() and (tmp_path / "sft_loss.png").is_file()
    _the_tool_star_runs_start_from_sft_and_differ_only_by_the_self_critic(tmp_path, report)
    _the_corpus_is_served_and_the_viewer_shows_calls_and_observations(tmp_path, train)


def _the_tool_star_runs_start_from_sft_and_differ_only_by_the_self_critic(out: Path, report: str) -> None:
    """Both Tool-Star runs start from the tool SFT's model with the reward tool_star alone and the main GRPO's seed
    and tools, keep their last step, and differ in grpo.self_critic alone; both are evaluated and reported."""
    configs = {}
    for run in ("grpo-tool-star", "grpo-tool-star-self-critic"):  # the GRPO run's dir and its evaluation's
        (state,) = (out / run / "checkpoints").glob("step-*/trainer_state.json")
        configs[run] = json.loads(state.read_text())["config"]
        assert (out / "eval" / run / "metrics.json").is_file(), run
    plain, critic = configs["grpo-tool-star"], configs["grpo-tool-star-self-critic"]
    assert plain["rewards"]["weights"] == {"tool_star": 1.0} and plain["model"]["path"] == str(out / "sft" / "model")
    assert plain["train"]["max_steps"] == 1 and plain["val"]["rows"] is None  # the last step, no val step picked
    assert not plain["grpo"]["self_critic"]["enabled"] and critic["grpo"]["self_critic"]["enabled"]
    critic["grpo"]["self_critic"]["enabled"] = False
    critic["out_dir"] = plain["out_dir"]
    assert critic == plain
    for needed in ("## Tool-Star's reward, plain and with self-critic (no target)", "| grpo tool-star, self-critic |",
                   "episodes using 2+ tools", "Self-critic against plain:", "mean Tool-Star reward"):  # fmt: skip
        assert needed in report, needed


def _the_corpus_is_served_and_the_viewer_shows_calls_and_observations(out: Path, train) -> None:
    """The data stage points the run's toolbox (which GRPO and the evaluations are given) at the rows' corpus; the
    trajectory viewer shows a search's query and hits, and a program and its output (gold episodes here: the toy
    policy calls nothing sensible)."""
    from quickstart.config import ToolsConfig
    from quickstart.tools import build_tools_data
    from vagent.config import load_config
    from vagent.recipes.common import tool_services
    from vagent.rollout.export import write_html
    from vagent.types import Trajectory

    cfg = load_config(ToolsConfig, CONFIG, [f"out_dir={out}"])
    from vagent.model import load_policy

    policy = load_policy(out / "tiny-qwen2_5_vl-tiny")  # its frame is part of the data's recipe
    build_tools_data(cfg, out / "data", policy)  # the files are there: it only points the toolbox at the corpus
    search = next(r for r in train if r.extra["kind"] == "search")
    (hit,) = tool_services(cfg.toolbox).search.search(search.extra["query"], 1)  # the gold's one hit
    assert hit.snippet.endswith(f" is {search.answer[0]}.")
    code = next(r for r in train if r.extra["kind"] == "code")
    episodes = [Trajectory(task_id=r.id, messages=list(r.messages), answer=r.answer[0]) for r in (search, code)]
    page = write_html(episodes, out / "gold.html").read_text()
    assert "search(query=" in page and search.extra["query"] in page and hit.snippet in page
    assert "code(code=" in page and code.extra["program"] in page and f"stdout:\n{code.answer[0]}" in page


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="search and code F1 meet their targets, but GRPO gains nothing on its SFT start: no step's greedy val "
    "accuracy beats the start's, so the start is kept; sampled, that policy already answers as greedily, and most "
    "of what its best of 4 samples adds is on crop rows, where a right sample is a guess, and on search rows, where "
    "it names another object (docs/decisions/tool-choice-task.md); remove once it is met",
)
def test_the_default_tools_proof_meets_its_targets(tmp_path):
    """The search-and-code proof at its default config and seed 0 (meant to take under 20 minutes alone on 2 cores,
    the Tool-Star runs apart): with its tools the policy's F1 is at least twice the no-tool baseline's and at least
    0.5 on the search and on the code rows, it calls the right tool first on at least 70% of the rows that need one,
    and GRPO gains on its SFT start while keeping its greedy policy."""
    done = _run(VAGENT, "quickstart", "--config", CONFIG, f"out_dir={tmp_path}", timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    targets = report.split("## Targets")[1].split("\n## ")[0]
    missed = [line for line in targets.splitlines() if line.endswith("| **no** |") and "minutes" not in line]
    assert not missed, missed  # the time target depends on what else the machine runs: the report states it

"""Evaluation protocols: each preset's values against the agents' own code, flags over presets, the protocol card,
--rerun reproducing a sampled run, eval-report naming the fields in which runs differ, avg@k with intervals."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vagent.agents import PROFILES
from vagent.cli import main
from vagent.eval import BENCHMARKS
from vagent.eval.card import card_differences
from vagent.eval.extract import EXTRACTORS
from vagent.eval.metrics import summarize, wilson
from vagent.eval.protocols import BUILTIN, PROTOCOLS, resolve

# (protocol, field, value, where the agent's own evaluation code sets it). Read from the repositories' files at the
# commits named: DeepEyes a7a337a (Visual-Agent/DeepEyes), Mini-o3 8654dbf, Pixel-Reasoner a3a6c3a, Chain-of-Focus
# 431ff0d, Thyme b9285b7, LongVT 08d755b (+ lmms-eval's async_openai), DeepEyesV2 0373e6e.
PUBLISHED = [
    ("deepeyes", "samples", 1, "Visual-Agent/DeepEyes eval/eval_vstar.py process(): one trajectory per image"),
    ("deepeyes", "temperature", 0.0, 'eval/eval_vstar.py params: "temperature": 0.0'),
    ("deepeyes", "max_turns", 11, "eval/eval_vstar.py: `if try_count > 10: break`, try_count from 0"),
    ("deepeyes", "max_new_tokens", 10240, 'eval/eval_vstar.py params: "max_tokens": 10240'),
    ("deepeyes", "max_pixels", 16384 * 28 * 28, "eval/eval_vstar.py: MAX_PIXELS = 16384 * 28 * 28 (smart_resize)"),
    ("deepeyes", "min_pixels", 4 * 28 * 28, "eval/eval_vstar.py: MIN_PIXELS = 4 * 28 * 28"),
    ("deepeyes", "option_order", "as-listed", "eval/eval_vstar.py: options in JSON order, answer = options[0]"),
    ("deepeyes", "judge", True, "eval/EVALUATION.md: Qwen2.5 72B deployed by vLLM as judge; eval/judge_result.py"),
    ("mini-o3", "samples", 32, "Mini-o3/Mini-o3 README: val_n=32, the k in Avg@k"),
    ("mini-o3", "temperature", 1.0, "verl/trainer/config/ppo_trainer.yaml rollout.temperature: 1.0 (val_do_sample)"),
    ("mini-o3", "top_p", 1.0, "verl/trainer/config/ppo_trainer.yaml rollout.top_p: 1.0"),
    ("mini-o3", "max_turns", 12, "README: val_max_generation_round=12"),
    ("mini-o3", "max_images", 12, "README: val_limit_mm_per_prompt={'image': 12}"),
    ("mini-o3", "max_new_tokens", 8192, "README: data.max_response_length=8192 (rollout.response_length)"),
    ("mini-o3", "max_total_tokens", 30768, "vllm_async_engine.py: stops at max_total_response_length 32768 - 2000"),
    ("mini-o3", "max_pixels", 2_000_000, "README: data.max_pixels=2000000"),
    ("mini-o3", "min_pixels", 40_000, "README: data.min_pixels=40000"),
    ("mini-o3", "extract", "strict", 'README: extract_answer_tags="strict" (general_qa_tool.py: <answer>...</answer>)'),
    ("mini-o3", "judge", True, "verl/utils/reward_score/general_qa_tool.py: gpt-4o-2024-11-20 judge"),
    (
        "pixel-reasoner",
        "temperature",
        0.0,
        "curiosity_driven_rl/.../experience_maker.py: if is_eval: temperature = 0.0",
    ),
    ("pixel-reasoner", "max_tool_calls", 4, "experience_maker.py: force_terminate = num_toolcalls > 3"),
    ("pixel-reasoner", "max_images", 16, "experience_maker.py: max_imgnum = 16"),
    ("pixel-reasoner", "max_new_tokens", 2048, 'experience_maker.py: getattr(args, "max_out_tokens", 2048)'),
    ("pixel-reasoner", "max_total_tokens", 12088, "experience_maker.py: terminate past 12 * 1024 - 200 tokens"),
    ("pixel-reasoner", "max_pixels", 5120 * 28 * 28, "the engine's MAX_PIXELS 5120*28*28 (eval_vlm_new.sh env)"),
    ("pixel-reasoner", "judge", False, "experience_maker.py rule_reward: math_verify on the last boxed, no judge"),
    ("chain-of-focus", "temperature", 0.0, "xtong-zhang/Chain-of-Focus eval/vstar/vllm_inference.py SamplingParams"),
    ("chain-of-focus", "max_turns", 6, "eval/vstar/vllm_inference.py: max_iterations = 6"),
    ("chain-of-focus", "max_new_tokens", 512, "eval/vstar/vllm_inference.py: --max_new_tokens default 512"),
    ("chain-of-focus", "max_images", 6, 'eval/vstar/vllm_inference.py: limit_mm_per_prompt={"image": 6}'),
    ("chain-of-focus", "max_pixels", 3840 * 3840, "eval/vstar/vllm_inference.py: max_pixels = 3840 * 3840"),
    ("chain-of-focus", "min_pixels", 112 * 112, "slurm_jobs/eval/inference_vstar.sh: --min_resolution 112"),
    ("thyme", "temperature", 0.01, "yfzhang114/Thyme eval/VLMEvalKit/vlmeval/vlm/thyme/model.py: temperature=0.01"),
    ("thyme", "top_p", 0.001, "vlm/thyme/model.py: top_p=0.001"),
    ("thyme", "max_turns", 5, "vlmeval/config.py: max_iterations=5"),
    ("thyme", "max_new_tokens", 2048, "vlm/thyme/model.py: max_new_tokens=2048"),
    ("thyme", "extract", "vlmevalkit", "vlmeval/dataset/utils/multiple_choice.py: can_infer before the judge"),
    ("longvt", "temperature", 0.0, "lmms-eval models/chat/async_openai.py: temperature 0 unless the task sets it"),
    ("longvt", "max_new_tokens", 49152, "LongVT lmms_eval_tasks videomme_w_subtitle_tool.yaml: max_new_tokens 49152"),
    ("longvt", "extract", "lmms-eval", "lmms-eval harness (examples/eval/run_eval.sh --model async_openai)"),
    (
        "deepeyesv2",
        "temperature",
        0.0,
        "Visual-Agent/DeepEyesV2 evaluation/VLMEvalKit/vlmeval/config.py: temperature=0.",
    ),
    ("deepeyesv2", "max_turns", 11, "vlmeval/api/vllm_api.py: agent_try=10, `if agent_try_times > 10: break`"),
    ("deepeyesv2", "max_new_tokens", 20480, 'evaluation/VLMEvalKit/eval.sh MODEL_CONFIGS "max_tokens": 20480'),
    ("deepeyesv2", "max_pixels", 16384 * 28 * 28, "vlmeval/.../agent_utils.py smart_resize max 16384*28*28"),
    ("deepeyesv2", "extract", "vlmevalkit", "VLMEvalKit extract_answer_from_item: can_infer, then the judge"),
]


@pytest.mark.parametrize(("name", "field", "value", "source"), PUBLISHED, ids=[f"{p}.{f}" for p, f, *_ in PUBLISHED])
def test_each_preset_sets_what_the_agents_own_evaluation_code_sets(name, field, value, source):
    assert getattr(PROTOCOLS[name], field) == value, source


def test_every_preset_names_a_profile_benchmarks_and_a_rule_vagent_has():
    assert sorted(PROTOCOLS) == ["chain-of-focus", "deepeyes", "deepeyesv2", "longvt", "mini-o3", "pixel-reasoner",
                                 "thyme"]  # fmt: skip
    for protocol in PROTOCOLS.values():
        assert protocol.agent in PROFILES and protocol.extract in EXTRACTORS, protocol.name
        assert set(protocol.benchmarks) <= set(BENCHMARKS), protocol.name
        assert protocol.notes, protocol.name  # what is not reproduced is said


def test_a_flag_overrides_its_field_and_the_override_is_named():
    values, overrides = resolve({"temperature": 0.7, "samples": None}, "deepeyes")
    assert values["temperature"] == 0.7 and values["samples"] == 1 and values["max_turns"] == 11
    assert overrides == {"temperature": {"preset": 0.0, "used": 0.7}}
    assert resolve({"temperature": 0.0}, "deepeyes")[1] == {}  # the preset's own value is no override
    assert resolve({}, None) == (BUILTIN, {})


def test_intervals_and_smaller_k_by_hand():
    # 3 records x 2 samples: a = [1, 1], b = [1, 0], c = [0, 0] -> avg@2 = 0.5, pass@2 = 2/3; the first sample of
    # each alone (avg@1 = pass@1 = 2/3) is the run at k = 1; by sample index: sample 0 scores 2/3, sample 1 1/3
    samples = [{"id": i, "sample": k, "acc": v} for i, vs in (("a", [1, 1]), ("b", [1, 0]), ("c", [0, 0]))
               for k, v in enumerate(vs)]  # fmt: skip
    m = summarize(samples, ["acc"])
    assert m["acc"] == 0.5 and m["pass@2/acc"] == pytest.approx(2 / 3)
    assert m["at_k"][1] == {"avg@1/acc": pytest.approx(2 / 3), "pass@1/acc": pytest.approx(2 / 3)}
    assert m["at_k"][2]["avg@2/acc"] == 0.5
    assert m["spread"]["acc"]["min"] == pytest.approx(1 / 3) and m["spread"]["acc"]["max"] == pytest.approx(2 / 3)
    lo, hi = m["intervals"]["acc"]  # bootstrap over the three records' means (1, 0.5, 0)
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    one = summarize([{"id": str(i), "sample": 0, "acc": float(i < 8)} for i in range(10)], ["acc"])
    assert one["intervals"]["acc"] == wilson(8, 10) and one["intervals"]["acc"][1] < 1.0
    # ten questions about two videos, all right on one and all wrong on the other: they are two draws, not ten
    # (Wilson would say [0.24, 0.76]); resampling the videos gives means 0, 0.5 or 1
    clustered = [
        {"id": str(i), "sample": 0, "acc": float(i < 5), "cluster": "v1" if i < 5 else "v2"} for i in range(10)
    ]
    assert summarize(clustered, ["acc"])["intervals"]["acc"] == [0.0, 1.0]


def test_card_differences_name_each_field_that_differs():
    a = {"benchmark": "vstar", "limits": {"temperature": 0.0, "max_turns": 4}, "args": {"out": "a"}, "command": "x"}
    b = {"benchmark": "vstar", "limits": {"temperature": 1.0, "max_turns": 4}, "args": {"out": "b"}, "command": "y"}
    assert card_differences([a, b]) == {"limits.temperature": [0.0, 1.0]}
    assert card_differences([a, None]) != {}


@pytest.fixture
def vstar_file(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name, color in (("a.png", (200, 30, 30)), ("b.png", (30, 30, 200))):
        Image.new("RGB", (96, 64), color).save(images / name)
    rows = [{"id": "v1", "image": "images/a.png", "question": "What color?", "options": ["red", "blue"], "answer": "A"},
            {"id": "v2", "image": "images/b.png", "question": "What color?", "options": ["red", "blue"], "answer": "B"},
            {"id": "v3", "image": "images/a.png", "question": "Which side?", "options": ["left", "right"], "answer": "A"}]  # fmt: skip
    (tmp_path / "vstar.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path


def test_mini_o3_protocol_avg_at_4_with_intervals_and_an_exact_rerun(vstar_file, tiny_qwen25, capsys):
    out = vstar_file / "mini-o3"
    # the tiny model's context and speed need smaller budgets: each override is named on the card
    small = ["--max-new-tokens", "6", "--max-turns", "2", "--max-total-tokens", "2048", "--max-pixels", str(128 * 128),
             "--min-pixels", str(56 * 56)]  # fmt: skip
    args = ["eval", "--model", str(tiny_qwen25), "--benchmark", "vstar", "--data", str(vstar_file / "vstar.jsonl"),
            "--protocol", "mini-o3", "--samples", "4", "--out", str(out), *small]  # fmt: skip
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 3 and metrics["samples"] == 12
    assert {"accuracy", "pass@4/accuracy"} <= set(metrics) and set(metrics["intervals"]) >= {
        "accuracy",
        "pass@4/accuracy",
    }
    assert set(metrics["at_k"]) == {"1", "2", "4"} and "accuracy" in metrics["spread"]
    card = json.loads((out / "protocol.json").read_text())
    assert card["protocol"] == "mini-o3" and card["agent"] == "mini-o3" and card["extract"] == "strict"
    assert card["model_weights"] and card["scoring_sha256"] and card["dtype"] == "auto"
    assert card["limits"]["temperature"] == 1.0 and card["samples"] == 4
    assert set(card["overrides"]) == {"samples", "max_new_tokens", "max_turns", "max_total_tokens", "max_pixels",
                                      "min_pixels"}  # fmt: skip
    assert card["pixels"] == [56 * 56, 128 * 128] and len(card["data_sha256"]) == 64
    text = (out / "metrics.md").read_text()
    assert text.index("| protocol card |") < text.index("## Scores") < text.index("## Intervals")
    assert "mini-o3; overridden: samples (32 -> 4)" in text and "## avg@j and pass@j" in text

    assert main(["eval", "--rerun", str(out)]) == 0  # into mini-o3-rerun: same records, seeds, protocol
    again = vstar_file / "mini-o3-rerun"
    first, second = (out / "samples.jsonl").read_text(), (again / "samples.jsonl").read_text()
    assert first == second and len({json.loads(line)["prediction"] for line in first.splitlines()}) >= 1
    capsys.readouterr()
    assert main(["eval-report", str(out), str(again)]) == 0
    assert "agree in every field" in capsys.readouterr().out

    other = vstar_file / "greedy"
    assert main([*args[: -len(small) - 2], "--out", str(other), *small, "--temperature", "0"]) == 0
    capsys.readouterr()
    assert main(["eval-report", str(out), str(other)]) == 0
    report = capsys.readouterr().out
    assert "| limits.temperature | 1.0 | 0.0 |" in report and "| overrides.temperature.used | null | 0.0 |" in report


def test_a_rerun_refuses_a_changed_file_and_a_resume_another_protocol(vstar_file, tiny_qwen25, capsys):
    out = vstar_file / "run"
    args = ["eval", "--model", str(tiny_qwen25), "--benchmark", "vstar", "--data", str(vstar_file / "vstar.jsonl"),
            "--out", str(out), "--max-new-tokens", "4", "--max-turns", "1", "--limit", "1"]  # fmt: skip
    assert main(args) == 0
    assert main([*args, "--extract", "strict"]) == 2  # same --out, another protocol
    assert "another protocol (extract differ)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a rerun is the run as it was: a usage error
        main(["eval", "--rerun", str(out), "--limit", "2"])
    assert "it takes only --out (also given: --limit)" in capsys.readouterr().err
    with open(vstar_file / "vstar.jsonl", "a") as f:
        f.write("\n")
    assert main(["eval", "--rerun", str(out)]) == 2
    assert "is not the file run was scored on" in capsys.readouterr().err


def test_a_run_at_k_holds_the_run_at_a_smaller_k_sample_for_sample(vstar_file, policy):
    """Samples are numbered by their seeds, not by the order they finish (a short episode finishes first): the first
    j samples of a run at k are the samples a run at j draws, so at_k[j] is that run's score."""
    from vagent.eval.runner import evaluate
    from vagent.rollout import RolloutLimits
    from vagent.rollout.export import read_jsonl

    rows, _ = BENCHMARKS["vstar"].load(vstar_file / "vstar.jsonl", None)
    limits = RolloutLimits(max_turns=2, max_new_tokens=10, temperature=1.0, sampling_seed=3)

    def ids(out):
        return {(t.task_id, t.sample): t.token_ids for t in read_jsonl(out / "trajectories.rank0.jsonl")}

    evaluate(policy, BENCHMARKS["vstar"], rows, vstar_file / "k4", tools=None, limits=limits, n_samples=4,
             batch_size=2, progress=False)  # fmt: skip
    evaluate(policy, BENCHMARKS["vstar"], rows, vstar_file / "k2", tools=None, limits=limits, n_samples=2,
             batch_size=3, progress=False)  # fmt: skip
    four, two = ids(vstar_file / "k4"), ids(vstar_file / "k2")
    assert len(four) == 12 and len(two) == 6
    assert {key: four[key] for key in two} == two
    assert (
        len({len(v) for v in four.values()}) > 1
    )  # the episodes differ in length: finishing order is not sample order
    samples = [json.loads(line) for line in (vstar_file / "k4" / "samples.jsonl").read_text().splitlines()]
    assert [(s["id"], s["sample"]) for s in samples] == [(r.id, k) for r in rows for k in range(4)]

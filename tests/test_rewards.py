"""Rewards against hand-computed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from vagent.config import ConfigError
from vagent.data import Evidence, Row
from vagent.rewards import REWARDS, check_rewards, combine
from vagent.rewards.answer import answer_score, choice_match, f1_em, number_match, token_f1
from vagent.types import Frame, ToolResult, Trajectory

ROOT = Path(__file__).resolve().parent.parent

# The policy saw a 448x336 frame of an 896x672 original: model boxes are half the original's.
FRAMES = [Frame((896, 672), (448, 336), "absolute")]


def traj(answer=None, stop="answered", tool_results=(), metrics=None, sampled=10):
    return Trajectory("t", [], [0] * sampled, [1] * sampled, answer=answer, stop_reason=stop,
                      metrics=dict(metrics or {}), tool_results=list(tool_results), frames=FRAMES)  # fmt: skip


def row(answer="7", answer_type="exact", choices=None, boxes=(), spans=()):
    evidence = Evidence(boxes=[list(b) for b in boxes], spans=[list(s) for s in spans]) if boxes or spans else None
    return Row(id="r", question="q", answer=answer, answer_type=answer_type, choices=choices, evidence=evidence)


def crop(box, error=None, image_index=0):
    return ToolResult("crop", {}, error, {"box_original": box, "image_index": image_index})


def test_token_f1_and_em_by_hand():
    # "red car" vs "a red sports car": pred tokens {red, car}, gold {red, sports, car}; P = 1, R = 2/3 -> F1 = 0.8
    assert token_f1("red car", "a red sports car") == pytest.approx(0.8)
    assert token_f1("blue", "red") == 0.0
    assert f1_em("The Red Car!", ["red car", "a red sports car"]) == (1.0, 1.0)  # normalized EM wins, F1 counts 1
    f1, em = f1_em("red car", ["a red sports car", "blue bus"])
    assert (f1, em) == (pytest.approx(0.8), 0.0)  # max over golds


def test_chinese_f1_is_character_level():
    # "北京大学" vs "北京": 4 predicted chars, 2 gold, 2 common: P = 1/2, R = 1 -> F1 = 2/3
    assert token_f1("北京大学", "北京") == pytest.approx(2 / 3)
    assert f1_em("北京。", ["北京"]) == (1.0, 1.0)


def test_choice_number_and_exact():
    choices = ["red", "blue", "green"]
    assert (
        choice_match("B", "B", choices)
        == choice_match("(b)", "B", choices)
        == choice_match("blue", "B", choices)
        == 1.0
    )
    assert choice_match("B. blue", "blue", choices) == 1.0 and choice_match("D", "D", choices) == 0.0
    assert choice_match("A or B", "B", choices) == 0.0
    assert number_match("it is 3.14", 3.1416, rel_tol=0.01) == 1.0 and number_match("3", 3.1416, rel_tol=0.01) == 0.0
    assert answer_score("  Seven ", ["7", "seven"], "exact") == 1.0
    assert answer_score(None, "7", "exact") == 0.0


def test_box_iou_maps_the_answer_to_original_pixels():
    gold = [100, 100, 300, 300]  # original pixels
    # the model answers in its 448x336 frame: [50, 50, 150, 150] -> original [100, 100, 300, 300]
    exact = traj(answer="[50, 50, 150, 150]")
    # half-overlapping: original [200, 100, 400, 300]: intersection 100x200, union 2 * 40000 - 20000 -> 1/3
    half = traj(answer="[100, 50, 200, 150]")
    rows = [row(gold, "box")] * 2
    assert REWARDS["box_iou"]([exact, half], rows) == pytest.approx([1.0, 1 / 3])
    assert REWARDS["box_iou"]([exact, half], rows, threshold=0.5) == [1.0, 0.0]
    # GIoU of the half-overlapping box: enclosing 300x200 = union, so GIoU = IoU = 1/3 -> (1/3 + 1) / 2
    assert REWARDS["box_iou"]([half], rows[:1], use_giou=True) == pytest.approx([2 / 3])
    assert REWARDS["accuracy"]([exact, half], rows) == [1.0, 0.0]  # IoU >= 0.5
    assert REWARDS["box_iou"]([traj(answer="no box")], rows[:1]) == [0.0]


def test_crop_grounding_uses_iou_so_a_whole_image_crop_scores_near_zero():
    tile = [400, 300, 428, 328]  # a 28x28 evidence tile in an 896x672 image
    r = [row(boxes=[tile])]
    tight = traj(tool_results=[crop([390, 290, 438, 338])])  # 48x48 around the tile: IoU = 784 / 2304
    whole = traj(tool_results=[crop([0, 0, 896, 672])])  # contains the tile, IoU = 784 / 602112
    assert REWARDS["crop_iou"]([tight], r) == pytest.approx([784 / 2304])
    assert (
        REWARDS["crop_iou"]([whole], r)[0] == pytest.approx(784 / (896 * 672))
        and REWARDS["crop_iou"]([whole], r)[0] < 0.01
    )
    # the best crop counts; failed crops and crops of tool outputs (image 1 = a crop) do not
    several = traj(tool_results=[crop([0, 0, 896, 672]), crop(tile, error="bad_box"), crop(tile, image_index=1),
                                 crop([390, 290, 438, 338])])  # fmt: skip
    assert REWARDS["crop_iou"]([several], r) == pytest.approx([784 / 2304])
    assert REWARDS["crop_iou"]([traj()], r) == [0.0] and REWARDS["crop_iou"]([tight], [row()]) == [0.0]


def test_temporal_iou_of_sampled_spans_and_span_answers():
    r = [row(answer=[2.0, 6.0], answer_type="span", spans=[[2.0, 6.0]])]
    sampled = ToolResult("sample_frames", {}, None, {"span": [4.0, 8.0]})
    # [4, 8] vs [2, 6]: intersection 2, union 6 -> 1/3
    assert REWARDS["temporal_iou"]([traj(tool_results=[sampled])], r) == pytest.approx([1 / 3])
    # an answered span [3, 6] vs [2, 6]: 3 / 4
    assert answer_score("from 3 to 6 seconds", [2.0, 6.0], "span") == pytest.approx(0.75)
    assert REWARDS["accuracy"]([traj(answer="[3, 6]")], r) == [1.0]  # tIoU 0.75 >= 0.5


def test_tool_bonus_only_when_right_and_penalties():
    ok = crop([0, 0, 10, 10])
    bad = crop([0, 0, 10, 10], error="bad_box")
    r = [row("7")] * 4
    trajs = [traj("7", tool_results=[ok]), traj("8", tool_results=[ok]), traj("7"), traj("7", tool_results=[bad])]
    assert REWARDS["tool_bonus"](trajs, r) == [1.0, 0.0, 0.0, 0.0]
    assert REWARDS["invalid_calls"]([traj(tool_results=[ok, bad, bad, ok])], r[:1]) == [-0.5]
    assert REWARDS["call_budget"]([traj(tool_results=[ok] * 5)], r[:1], budget=3, per_call=0.1) == [pytest.approx(-0.2)]


def test_format_and_overlong():
    r = [row()] * 4
    trajs = [traj("7"), traj("7", metrics={"parse_error/repaired_json": 1}), traj(None, stop="max_turns"), traj(" ")]
    assert REWARDS["format"](trajs, r) == [1.0, 0.5, 0.0, 0.0]
    # DAPO: L_max 100, buffer 20: 80 tokens free, 90 -> -0.5, 120 -> -1
    lengths = [traj(sampled=n) for n in (80, 90, 120)]
    assert REWARDS["overlong"](lengths, r[:3], max_tokens=100, buffer=20) == [0.0, -0.5, -1.0]


def test_combine_weights_components_and_rejects_unknown_names():
    r = [row("7", boxes=[[0, 0, 10, 10]])] * 2
    trajs = [traj("7", tool_results=[crop([0, 0, 10, 10])]), traj("8")]
    totals, parts = combine(trajs, r, {"accuracy": 1.0, "crop_iou": 0.5, "format": 0.2})
    assert parts == {"accuracy": [1.0, 0.0], "crop_iou": [1.0, 0.0], "format": [1.0, 1.0]}
    assert totals == pytest.approx([1.7, 0.2])
    with pytest.raises(KeyError, match="containment"):
        combine(trajs, r, {"containment": 1.0})


def test_reward_options_are_checked_before_any_rollout(tmp_path):
    """A keyword a weighted reward does not take fails at once, naming the ones it does (GRPO's config check and
    distill's --reward-options, before the model loads); options of an unweighted reward are not read by combine, so
    GRPO leaves them (a config's defaults) and distill's flag, which has none, refuses them."""
    from data_pipelines import distill
    from vagent.config import GRPOConfig, load_config
    from vagent.recipes import grpo

    check_rewards({"overlong": 1.0}, {"overlong": {"max_tokens": 10, "buffer": 2}, "judgment": {"x": 1}})
    with pytest.raises(TypeError, match="'max_token'.*it takes \\['max_tokens', 'buffer'\\]"):
        check_rewards({"overlong": 1.0}, {"overlong": {"max_token": 10}})
    config = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
    cfg = load_config(GRPOConfig, config, [f"out_dir={tmp_path}", "rewards.options={overlong: {max_token: 10}}"])
    with pytest.raises(ConfigError, match="options of reward 'overlong'"):
        grpo.train(cfg)
    common = ["--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="names \\['judgement'\\], not in --rewards \\['judgment'\\]"):
        distill.main([*common, "--rewards", "judgment=1.0", "--reward-options", "judgement.format_weight=0"])
    with pytest.raises(SystemExit, match="options of reward 'judgment'"):
        distill.main([*common, "--rewards", "judgment=1.0", "--reward-options", "judgment.format_weigth=0"])


def test_reward_options_keep_the_commas_of_a_json_value():
    """``--reward-options`` items are split at the commas outside brackets and quotes: a JSON list keeps its commas,
    a malformed item is named, and unbalanced brackets or quotes are refused rather than merging two options."""
    from data_pipelines.distill import reward_options

    assert reward_options('accuracy.choices=["A", "B", "C"], overlong.max_tokens=10,overlong.buffer=2') == {
        "accuracy": {"choices": ["A", "B", "C"]},
        "overlong": {"max_tokens": 10, "buffer": 2},
    }
    assert reward_options("judgment.format_weight=0") == {"judgment": {"format_weight": 0}}
    with pytest.raises(SystemExit, match="'format_weight=0' is not name.key=value"):
        reward_options("judgment.x=1,format_weight=0")
    for unbalanced in ("x.k=a],y.k=1", 'x.k=["a",y.k=1', 'x.k="a,y.k=1'):  # never an option merged into another
        with pytest.raises(SystemExit, match="never closed|no opening one"):
            reward_options(unbalanced)

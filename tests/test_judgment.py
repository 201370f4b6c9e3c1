"""Judgment rows (a judge's training data): the row kind and its checks, the ``judgment`` reward on well-formed,
malformed and position-swapped verdicts, the converters, the accuracy filter, and the teacher's cold start."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from PIL import Image

from data_pipelines.convert import pairs, unifiedreward
from data_pipelines.hard_rows import hard_rows
from data_pipelines.judgments import balanced, judgment_row, position_report, teach
from tests.test_judge import fake  # noqa: F401 (the scripted OpenAI-compatible endpoint fixture)
from vagent.data import Judgment, Row, RowError, load_rows, write_rows
from vagent.data.judgment import _NOUN, render, swapped, verdict_text
from vagent.judge import JudgeClient
from vagent.rewards import REWARDS
from vagent.rewards.judgment import NOUNS, read_verdict
from vagent.types import Message, Trajectory

PAIR = Judgment("pairwise", "answers", "What digit is on the tile?", ["It is 3.", "It is 7."], "3", 1)


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "tile.png"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(path)
    return str(path)


# -- the row kind ---------------------------------------------------------------------------------------------------


def test_a_judgment_row_is_its_rendered_prompt_and_verdict_and_survives_a_round_trip(tmp_path, image):
    row = judgment_row("j1", PAIR, images=[image])
    assert row.question == render(PAIR) and row.answer == "Answer 1 is better" and row.answer_type == "exact"
    assert row.tools == [] and "Reference answer: 3\nAnswer 1: It is 3.\nAnswer 2: It is 7." in row.question
    again = load_rows(write_rows([row], tmp_path / "rows.jsonl"))[0]
    assert again.judgment == PAIR and again.question == row.question


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answer": "Answer 2 is better"}, "verdict 'Answer 1 is better'"),
        ({"question": "something else"}, "rendered by its template"),
        ({"judgment": {**PAIR.to_dict(), "preferred": 3}}, "'judgment.preferred' must be 1 or 2"),
        ({"judgment": {**PAIR.to_dict(), "kind": "ranking"}}, "'judgment.kind' must be one of"),
        ({"judgment": {**PAIR.to_dict(), "responses": ["only one"]}}, "'judgment.responses' must hold 2"),
        ({"judgment": {**PAIR.to_dict(), "prefered": 1}}, "unknown key(s) ['prefered']"),
        ({"tools": ["crop"]}, "field 'tools' must be [] (or absent) for a judgment row"),
    ],
)
def test_a_bad_judgment_row_is_refused_naming_the_field(change, message, tmp_path):
    data = {**judgment_row("j1", PAIR).to_dict(), **change}
    (tmp_path / "rows.jsonl").write_text(json.dumps(data) + "\n")
    with pytest.raises(RowError, match="rows.jsonl:1 \\(id 'j1'\\)") as error:
        load_rows(tmp_path / "rows.jsonl")
    assert message in str(error.value)


def test_a_judgment_row_offers_no_tools_whatever_the_runs_default(tmp_path, image):
    """Without a ``tools`` key a judgment row still offers none, so SFT and GRPO (whose ``data.tools`` default is
    ["crop"]) show it the system prompt a served judge is asked with."""
    from vagent.eval.judges import row_request
    from vagent.training.data import gold_conversation

    data = judgment_row("j1", PAIR, images=[image], messages=[{"role": "assistant", "content": RIGHT}]).to_dict()
    del data["tools"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(data) + "\n")
    row = load_rows(tmp_path / "rows.jsonl")[0]
    assert row.tools == []
    system = gold_conversation(row, ["crop"])[0]  # what SFT trains on with data.tools: [crop]
    assert system.plain_text == row_request(row)[0]["content"] and "crop" not in system.plain_text
    with pytest.raises(RowError, match="'tools' must be \\[\\]"):
        Row(id="j", question=row.question, answer=row.answer, answer_type="exact", judgment=PAIR, tools=["crop"])


def test_image_candidates_need_two_images_and_a_pointwise_row_scores(image):
    with pytest.raises(RowError, match="needs exactly 2 image"):
        judgment_row("g", Judgment("pairwise", "images", "a red cube", preferred=2), images=[image])
    row = judgment_row("g", Judgment("pairwise", "images", "a red cube", preferred=2), images=[image, image])
    assert row.answer == "Image 2 is better"
    point = judgment_row("p", Judgment("pointwise", "answers", "Q?", ["A."], score=7, scale=(1, 10)))
    assert (point.answer, point.answer_type) == (7, "number") and "from 1 to 10" in point.question


def test_swapping_moves_the_label_with_its_candidate():
    other = swapped(PAIR)
    assert other.responses == ["It is 7.", "It is 3."] and verdict_text(other) == "Answer 2 is better"
    assert swapped(other) == PAIR


# -- the judgment reward --------------------------------------------------------------------------------------------


def _said(text: str, stop: str = "answered", **metrics) -> Trajectory:
    answer = text.split("<answer>")[-1].split("</answer>")[0] if "<answer>" in text else None
    return Trajectory("j", [Message.text("assistant", text)], answer=answer, stop_reason=stop, metrics=metrics)


RIGHT = "<think>Answer 1 says 3, the reference.</think>\n<answer>Answer 1 is better</answer>"


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        (RIGHT, 1.0),  # right and well-formed
        ("<think>2 names it.</think><answer>Answer 2 is better</answer>", 0.5),  # well-formed, wrong verdict
        ("<answer>Answer 1 is better</answer>", 0.5),  # right, no CoT
        ("<think>  </think><answer>Answer 1 is better</answer>", 0.5),  # right, empty CoT
        ("Let me see. " + RIGHT, 0.5),  # right, text outside the tags
        (RIGHT + "\n<answer>Answer 2 is better</answer>", 0.0),  # two answers: not well-formed, verdict unread
        ("<think>both</think><answer>Answer 1 is better or Answer 2 is better</answer>", 0.5),  # unreadable verdict
        ("<think>hmm</think><answer>the first one</answer>", 0.5),  # unparseable verdict, well-formed
        ("Answer 1 is better", 0.5),  # right, no tags: the whole reply is the verdict
        ("<think>1 says 3</think> Answer 1 is better.", 0.5),  # right, after closed reasoning (one period allowed)
        # strict, as UnifiedReward-Think's accuracy reward: the verdict is the whole answer, the row's noun, as written
        ("I think Answer 1 is better.", 0.0),  # a sentence around it: no verdict
        ("<think>x</think><answer>Answer 1 is better than Answer 2</answer>", 0.5),
        ("<think>x</think><answer>answer 1 is better</answer>", 0.5),
        ("<think>x</think><answer>Image 1 is better</answer>", 0.5),  # another noun than the row's
        ("<think>x</think><answer>Response 1 is better</answer>", 0.5),
    ],
)
def test_judgment_reward_on_well_formed_and_malformed_verdicts(text, reward):
    row = judgment_row("j1", PAIR)
    assert REWARDS["judgment"]([_said(text)], [row]) == [reward]


def test_judgment_reward_reads_the_label_of_the_row_not_the_position():
    given, flipped = judgment_row("j1", PAIR), judgment_row("j1s", swapped(PAIR))
    first = _said(RIGHT)
    second = _said("<think>Answer 2 says 3, the reference.</think>\n<answer>Answer 2 is better</answer>")
    # the same verdict text is right for one presentation of the pair and wrong for the other
    assert REWARDS["judgment"]([first, first, second, second], [given, flipped, given, flipped]) == [1.0, 0.5, 0.5, 1.0]


def test_judgment_reward_edge_cases():
    row = judgment_row("j1", PAIR)
    plain = Row(id="q", question="Q?", answer="3", answer_type="exact")
    assert REWARDS["judgment"]([_said(RIGHT), _said(RIGHT, stop="max_turns")], [plain, row]) == [0.0, 0.0]
    assert REWARDS["judgment"]([_said(RIGHT, **{"parse_error/stray_tag": 1})], [row]) == [0.5]  # the engine repaired it
    assert REWARDS["judgment"]([_said(RIGHT)], [row], format_weight=0.0) == [1.0]
    point = judgment_row("p", Judgment("pointwise", "answers", "Q?", ["A."], score=7, scale=(1, 10)))
    scored = [_said(f"<think>ok</think><answer>{s}</answer>") for s in ("7", "8", "x")]
    assert REWARDS["judgment"](scored, [point] * 3) == [1.0, 0.5, 0.5]
    assert REWARDS["judgment"](scored, [point] * 3, tolerance=1.0) == [1.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="format_weight"):
        REWARDS["judgment"]([_said(RIGHT)], [row], format_weight=2.0)


def test_read_verdict():
    assert read_verdict("<think>x</think><answer>Image 2 is better</answer>").choice == 2
    assert read_verdict("<think>x</think><answer>Image 2 is better</answer>", "answers").choice is None
    assert read_verdict("<think>x</think><answer> 8 </answer>").score == 8.0
    assert read_verdict("<think>x</think><answer>8/10</answer>").score is None  # only the score
    assert read_verdict(None).choice is None and not read_verdict(None).well_formed
    # a verdict the engine cut at its stop string still reads (the reply of a served judge ends there too)
    assert read_verdict("<think>x</think><answer>Answer 1 is better").choice == 1
    # a CoT judge cut at its token limit mid-reasoning has no verdict, whatever its reasoning says
    for cut in ("<think>1. Semantic accuracy: Answer 2 is better grounded in the image", "<think>Step 1: the score"):
        reading = read_verdict(cut)
        assert (reading.choice, reading.score, reading.well_formed) == (None, None, False), cut


def test_the_reward_and_the_rows_name_candidates_with_the_same_nouns():
    assert NOUNS == _NOUN  # vagent.rewards cannot import vagent.data (siblings): the two tables must agree


# -- converters -----------------------------------------------------------------------------------------------------

UR_PROMPT = ("Given a question and a reference image, please analyze in detail the two provided answers (Answer 1 and "
             "Answer 2). ... Your task is provided as follows:\nQuestion: [What is on the sign?]\nAnswer 1: [STOP]\n"
             "Answer 2: [YIELD]")  # fmt: skip


def test_unifiedreward_records_become_judgment_rows(tmp_path, image):
    records = [
        {"conversations": [{"from": "human", "value": "<image>\n" + UR_PROMPT},
                           {"from": "gpt", "value": "<think>The sign reads YIELD.</think>\n<answer>Answer 2 is better</answer>"}],
         "image": "tile.png"},
        {"problem": "<image><image>Given a caption and two images ... Text Caption: [a red cube]",
         "solution": "Image 1 is better", "images": ["tile.png", "tile.png"]},
        {"problem": "Judge these answers freely.", "solution": "Answer 1 is better", "images": ["tile.png"]},
        {"problem": "...", "solution": "Video 1 is better", "video": "v.mp4"},
        {"problem": "...", "solution": "Both are fine", "images": ["tile.png"]},
        {"conversations": [{"from": "human", "value": "<image>\n<image>\nGiven a caption ... Text Caption: [a cube]"},
                           {"from": "gpt", "value": "<think>2 is red</think>\n<answer>Image 2 is better</answer>"}],
         "image": ["tile.png", "tile.png"]},  # LLaVA's "image" may be a list
    ]  # fmt: skip
    rows, skipped = unifiedreward.convert(records, tmp_path, tmp_path / "images")
    assert [r.id for r in rows] == ["0", "1", "2", "5"] and len(skipped) == 2
    assert rows[3].images == [str(tmp_path / "tile.png")] * 2 and rows[3].answer == "Image 2 is better"
    rows = rows[:3]
    assert "video" in skipped[0] and "no verdict 'Answer N is better'" in skipped[1]
    answers, caption, opaque = rows
    assert answers.question == UR_PROMPT and answers.answer == "Answer 2 is better"
    assert answers.judgment.responses == ["STOP", "YIELD"] and answers.judgment.question == "What is on the sign?"
    assert render(swapped(answers.judgment)).endswith("Answer 1: [YIELD]\nAnswer 2: [STOP]")  # its own template
    assert answers.messages[0].plain_text.startswith("<think>The sign reads YIELD.")  # a cold-start SFT row
    assert caption.judgment.candidates == "images" and caption.judgment.question == "a red cube"
    assert caption.question.startswith("Given a caption") and caption.messages is None  # a GRPO row
    assert opaque.judgment.question is None and opaque.question == "Judge these answers freely."
    load_rows(write_rows(rows, tmp_path / "out" / "rows.jsonl"))  # valid canonical rows


def test_generic_pairs_become_judgment_rows(tmp_path, image):
    records = [
        {
            "question": "Digit?",
            "image": "tile.png",
            "response_a": "3",
            "response_b": "7",
            "preferred": "b",
            "reference": "7",
            "cot": "<think>b is 7</think><answer>Answer 2 is better</answer>",
        },
        {"question": "a red cube", "image_a": "tile.png", "image_b": "tile.png", "preferred": 1, "id": "gen"},
        {"question": "Digit?", "images": ["tile.png"], "response": "3", "score": 2, "scale": [1, 5]},
        {"question": "Digit?", "image": "tile.png", "response_a": "3", "response_b": "7", "preferred": "c"},
        {"question": "Digit?", "image": ["tile.png", "tile.png"], "response_a": "3", "response_b": "7", "preferred": 1},
    ]
    rows, skipped = pairs.convert(records, tmp_path, tmp_path / "images", template=None)
    assert [r.answer for r in rows] == ["Answer 2 is better", "Image 1 is better", 2, "Answer 1 is better"]
    assert len(skipped) == 1 and "'preferred' must be" in skipped[0] and rows[1].id == "gen"
    assert rows[3].images == [str(tmp_path / "tile.png")] * 2  # "image" given as a list
    assert rows[0].messages is not None and rows[2].judgment.scale == (1.0, 5.0)
    custom, _ = pairs.convert(records[:1], tmp_path, tmp_path / "images", template="Q {question} | {response1} | "
                              "{response2} -> <answer>Answer N is better</answer>")  # fmt: skip
    assert custom[0].question == "Q Digit? | 3 | 7 -> <answer>Answer N is better</answer>"
    assert load_rows(write_rows(custom, tmp_path / "c.jsonl"))[0].judgment.template.startswith("Q {question}")


def test_balance_swaps_about_half_of_a_chosen_rejected_dump_and_warns_when_it_is_not(tmp_path, image, capsys):
    """A (chosen, rejected) dump written as response_a/response_b labels every row 1: the converter says so, and
    --balance shows about half the other way round (by a hash of the id: the same rows every run). (``image``
    writes tile.png beside the data.)"""
    records = [{"id": f"r{i}", "question": f"Digit {i}?", "image": "tile.png", "response_a": f"It is {i}.",
                "response_b": "It is 9.", "preferred": "a", "reference": str(i),
                "cot": "<think>a names it</think><answer>Answer 1 is better</answer>"} for i in range(40)]  # fmt: skip
    data = tmp_path / "dump.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert pairs.main(["--data", str(data), "--out", str(tmp_path / "asis")]) == 0
    assert "preferred == 1 in 100.0% of 40 pairwise rows\nwarning:" in capsys.readouterr().out
    assert pairs.main(["--data", str(data), "--out", str(tmp_path / "balanced"), "--balance"]) == 0
    out = capsys.readouterr().out
    # the rows are balanced; the gold CoTs SFT trains on are not (a swapped row drops its own), and it says so
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "--balance cannot fix these" in warnings[0]
    assert "of 40 pairwise rows\npreferred == 1 in 100.0% of" in out
    rows = load_rows(tmp_path / "balanced" / "rows.jsonl")  # valid rows: each prompt its rendered judgment
    flipped = [r for r in rows if r.judgment.preferred == 2]
    assert 0.4 <= 1 - len(flipped) / len(rows) <= 0.6 and f"swapped {len(flipped)} of 40" in out
    for row in flipped:  # the label follows its candidate; the gold CoT, which names positions, is dropped
        assert row.judgment.responses[1] == f"It is {row.judgment.reference}." and row.messages is None
    assert all(r.messages is not None for r in rows if r.judgment.preferred == 1)
    again, _ = balanced(pairs.convert(records, tmp_path, tmp_path / "images")[0])
    assert [r.judgment.preferred for r in again] == [r.judgment.preferred for r in rows]  # deterministic


def test_a_position_report_warns_outside_its_band():
    def rows(ones, n):
        return [judgment_row(f"j{i}", PAIR if i < ones else swapped(PAIR)) for i in range(n)]

    assert position_report(rows(5, 10)) == ["preferred == 1 in 50.0% of 10 pairwise rows"]
    assert position_report(rows(3, 10))[1].startswith("warning: 30.0% of the labels name position 1")
    assert position_report([]) == []
    # rows with a gold judgment are reported apart: balancing swaps rows without theirs, so their share stays skewed
    gold = [dataclasses.replace(r, messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
            for r in rows(10, 10)]  # fmt: skip
    shown, swapped_n = balanced(gold)
    assert 0 < swapped_n < 10 and all((r.messages is None) == (r.judgment.preferred == 2) for r in shown)
    report = position_report(shown)
    assert report[0] == f"preferred == 1 in {(10 - swapped_n) * 10:.1f}% of 10 pairwise rows"
    assert (
        report[-2] == f"preferred == 1 in 100.0% of {10 - swapped_n} pairwise rows with a gold judgment (the SFT set)"
    )
    assert report[-1].startswith("warning: 100.0%") and "--balance cannot fix these" in report[-1]


# -- the accuracy filter and the teacher ----------------------------------------------------------------------------


def test_hard_rows_keeps_what_the_model_still_gets_wrong():
    rows = [judgment_row(f"j{i}", PAIR) for i in range(3)]
    rewards = [1, 1, 1, 1, 1, 0.5, 0, 1, 0, 0, 0.5, 0]  # 4 samples per row: accuracy 1, 0.5, 0
    kept, accuracy = hard_rows(rows, rewards, 4, correct_at=1.0, below=1.0)
    assert accuracy == [1.0, 0.5, 0.0] and [r.id for r in kept] == ["j1", "j2"]
    assert kept[0].extra["accuracy_at_k"] == 0.5
    kept, _ = hard_rows(rows, rewards, 4, correct_at=1.0, below=1.0, min_accuracy=0.25)
    assert [r.id for r in kept] == ["j1"]


def test_hard_rows_can_select_on_the_verdicts_alone():
    """With the judgment reward's format weight, a right verdict badly formed and a wrong one well formed both
    score 0.5; ``--reward-options judgment.format_weight=0`` scores the verdict alone."""
    from data_pipelines.distill import add_rollout_arguments, reward_options
    from vagent.rewards import combine

    parser = argparse.ArgumentParser()
    add_rollout_arguments(parser)
    args = parser.parse_args(["--model", "m", "--data", "d", "--rewards", "judgment=1.0",
                              "--reward-options", "judgment.format_weight=0"])  # fmt: skip
    options = reward_options(args.reward_options)
    assert options == {"judgment": {"format_weight": 0}}
    rows = [judgment_row("right-malformed", PAIR), judgment_row("wrong-well-formed", PAIR)]
    samples = [
        _said("<answer>Answer 1 is better</answer>"),
        _said("<think>x</think><answer>Answer 2 is better</answer>"),
    ]
    default, _ = combine(samples, rows, {"judgment": 1.0})
    verdicts, _ = combine(samples, rows, {"judgment": 1.0}, options)
    assert default == [0.5, 0.5] and verdicts == [1.0, 0.0]
    kept, _ = hard_rows(rows, verdicts, 1, correct_at=1.0, below=1.0)
    assert [r.id for r in kept] == ["wrong-well-formed"]
    with pytest.raises(SystemExit, match="name.key=value"):
        reward_options("format_weight=0")


def test_the_teacher_cold_start_keeps_well_formed_judgments_that_match_the_label(fake, image):  # noqa: F811
    server, url = fake
    other = Judgment("pairwise", "answers", "And this one?", ["It is 3.", "It is 7."], "3", 1)
    rows = [judgment_row("a", PAIR, images=[image]), judgment_row("b", swapped(PAIR), images=[image]),
            judgment_row("c", other, images=[image]), judgment_row("d", swapped(other), images=[image])]  # fmt: skip
    server.script = [(200, RIGHT, 0), (200, RIGHT, 0), (200, "Answer 1 is better", 0), (500, "", 0)]
    kept, counts = teach(rows, JudgeClient(url, "teacher", concurrency=1, retries=0))
    assert [r.id for r in kept] == ["a-t0"] and kept[0].messages[0].plain_text == RIGHT
    assert counts == {"asked": 4, "kept": 1, "disagreed": 1, "malformed": 1, "failed": 1}
    sent = server.seen[0]["messages"]  # the prompt the judge will be trained on
    assert sent[0]["role"] == "system" and sent[1]["content"][0]["type"] == "image_url"
    assert sent[1]["content"][-1]["text"] == rows[0].question


def test_synthetic_judgments_name_the_tile_digit_in_one_of_the_two_answers(tmp_path):
    from data_pipelines.synthetic.judgments import judgment_rows, question_rows

    rows = load_rows(write_rows(judgment_rows(tmp_path, 40, seed=3, digits=(3, 4, 5)), tmp_path / "j.jsonl"))
    for row in rows:
        j = row.judgment
        named = [int(next(c for c in r if c.isdigit())) for r in j.responses]
        assert named[j.preferred - 1] == row.extra["digit"] == int(j.reference) != named[2 - j.preferred]
        assert set(named) <= {3, 4, 5} and row.tools == [] and len(row.images) == 1
    assert 10 < sum(r.judgment.preferred == 1 for r in rows) < 30  # the right answer's position is random
    questions = question_rows(tmp_path, 5, seed=4)
    assert all(q.answer_type == "exact" and q.answer.isdigit() and q.judgment is None for q in questions)

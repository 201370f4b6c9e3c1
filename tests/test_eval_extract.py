"""Option extraction under each harness's rule (vagent.eval.extract): one table of model outputs, the letter each rule
reads. Expected values follow the harnesses' code (VLMEvalKit vlmeval/utils/matching_util.py ``can_infer``; lmms-eval
lmms_eval/tasks/_task_utils/mcq_extract.py ``extract_mcq_answer`` as Video-MME uses it, and
lmms_eval/tasks/longvideobench/utils.py ``parse_multi_choice_response``), worked out by hand and checked against
those functions run on the same rows."""

from __future__ import annotations

import random

import pytest

from vagent.eval.extract import EXTRACTORS, extract_choice, extract_text

CARS = ["red car", "blue truck", "green bus", "yellow bike"]
NESTED = ["car", "red car", "blue truck", "green bus"]  # "car" is inside "red car"
CHINESE = ["红色汽车", "蓝色卡车"]

# (reply, answer the profile read (None: no <answer> tag), choices, {rule: expected letter})
V, S, K, L = "vagent", "strict", "vlmevalkit", "lmms-eval"
TABLE = [
    # Plain tagged letters: every rule agrees.
    ("<think>Blue is on the left.</think><answer>B</answer>", "B", CARS, {V: "B", S: "B", K: "B", L: "B"}),
    ("<answer>(B)</answer>", "(B)", CARS, {V: "B", S: "B", K: "B", L: "B"}),
    ("<answer>B. Blue truck</answer>", "B. Blue truck", CARS, {V: "B", S: "B", K: "B", L: "B"}),
    # No tag: vagent and strict read nothing; both harnesses read the whole reply.
    ("The answer is (B).", None, CARS, {V: None, S: None, K: "B", L: "B"}),
    ("Answer: B. red", None, CARS, {V: None, S: None, K: "B", L: "B"}),
    ("Answer: (C) green bus", None, CARS, {V: None, S: None, K: "C", L: "C"}),
    ("The correct answer is **B**.", None, CARS, {V: None, S: None, K: "B", L: "B"}),
    ("The final answer is \\boxed{B}", None, CARS, {V: None, S: None, K: "B", L: "B"}),
    # Several letters: VLMEvalKit infers none; lmms-eval's top-ranked format is the reply's first character.
    ("<answer>B or C</answer>", "B or C", CARS, {V: None, S: None, K: None, L: "B"}),
    # A letter then other text: choice_match reads "(B" + ") is wrong ..." as the letter B; strict wants the rest to be
    # B's text; VLMEvalKit counts two letters, then its "answer is X" pattern reads A; lmms-eval: A ends the reply.
    (
        "<answer>(B) is wrong; the answer is A</answer>",
        "(B) is wrong; the answer is A",
        CARS,
        {V: "B", S: None, K: "A", L: "A"},
    ),
    # "B. red" names B and a text that is not B's: strict rejects the contradiction, the others read the letter.
    ("<answer>B. red</answer>", "B. red", CARS, {V: "B", S: None, K: "B", L: "B"}),
    # "Option B": no letter form for vagent/strict; VLMEvalKit: the lone B token; lmms-eval: B ends the reply.
    ("<answer>Option B</answer>", "Option B", CARS, {V: None, S: None, K: "B", L: "B"}),
    # Lowercase: choice_match ignores case; strict takes capitals only; both harnesses match capital letters only.
    ("<answer>b</answer>", "b", CARS, {V: "B", S: None, K: None, L: None}),
    # An option's text: lmms-eval reads letters only; VLMEvalKit's text rule finds "red car" once.
    ("I think it's the red car", None, CARS, {V: None, S: None, K: "A", L: None}),
    ("<answer>the red car</answer>", "the red car", CARS, {V: "A", S: "A", K: "A", L: None}),
    # The article "A": vagent/strict read the text "blue truck" (articles dropped); VLMEvalKit sees one letter token A
    # among the last four; lmms-eval's first-character format reads A.
    ("<answer>A blue truck</answer>", "A blue truck", CARS, {V: "B", S: "B", K: "A", L: "A"}),
    # Nested option texts: "car" and "red car" are both inside the reply, so VLMEvalKit's text rule finds two.
    ("<answer>red car</answer>", "red car", NESTED, {V: "B", S: "B", K: None, L: None}),
    ("<answer>None of the above</answer>", "None of the above", CARS, {V: None, S: None, K: None, L: None}),
    ("<answer></answer>", "", CARS, {V: None, S: None, K: None, L: None}),
    ("<answer>E</answer>", "E", CARS, {V: None, S: None, K: None, L: None}),  # past the last option
    # Long reasoning: VLMEvalKit sees A, B and C as tokens (no single letter) and falls back to "answer is C".
    (
        "Let me compare the options. A red car is parked on the left and the blue truck is further away. The green bus "
        "is partly hidden, so it cannot be B. So the answer is C.",
        None,
        CARS,
        {V: None, S: None, K: "C", L: "C"},
    ),
    # lmms-eval: every capital after "the answer is" is a candidate; the C of "Clearly" is the later one and wins.
    # VLMEvalKit: the lone B is not among the last four tokens, so its "answer is B" pattern decides.
    ("The answer is B. Clearly, the truck is blue.", None, CARS, {V: None, S: None, K: "B", L: "C"}),
    # VLMEvalKit's "answer is X" pattern is case-insensitive and has no word boundary: the b of "based" is B.
    ("The answer is based on the color, which is red.", None, CARS, {V: None, S: None, K: "B", L: None}),
    # A letter first in a long reply: VLMEvalKit wants it among the last four tokens (and the reply is too long for
    # its text rule); lmms-eval's first-character format reads it.
    (
        "B is what I would pick, although I could not see the image clearly enough to be sure.",
        None,
        CARS,
        {V: None, S: None, K: None, L: "B"},
    ),
    # VLMEvalKit's refusal ('Z', no answer); lmms-eval finds no format and falls back to the last capital anywhere.
    ("Cannot determine the answer from the image.", None, CARS, {V: None, S: None, K: None, L: "C"}),
    # <think>: lmms-eval strips it by default (its --reasoning_tags); VLMEvalKit reads the reasoning too (its
    # SPLIT_THINK is off by default), where the lone A token is among the last four ("</think>B" is one token).
    ("<think>The car is red, so not A.</think>B", None, CARS, {V: None, S: None, K: "A", L: "B"}),
    # A prefilled <think> leaves only its closing tag: lmms-eval keeps the text after it.
    ("The car is red.</think>B", None, CARS, {V: None, S: None, K: None, L: "B"}),
    # Chinese: lmms-eval knows the phrase 答案是 and reads the letter after it; VLMEvalKit sees one token "答案是B".
    ("答案是B", None, CARS, {V: None, S: None, K: None, L: "B"}),
    ("我认为是蓝色卡车。", None, CHINESE, {V: None, S: None, K: "B", L: None}),
    ("<answer>蓝色卡车</answer>", "蓝色卡车", CHINESE, {V: "B", S: "B", K: "B", L: None}),
]


@pytest.mark.parametrize("rule", EXTRACTORS)
@pytest.mark.parametrize(("reply", "answer", "choices", "expected"), TABLE, ids=[row[0][:40] for row in TABLE])
def test_each_rule_reads_the_table(reply, answer, choices, expected, rule):
    assert extract_choice(reply, answer, choices, rule) == expected[rule]


def test_the_rules_disagree_on_most_rows():
    disagreeing = [row for row in TABLE if len(set(row[3].values())) > 1]
    assert len(TABLE) >= 20 and len(disagreeing) >= 20
    for a in EXTRACTORS:  # every pair of rules reads some row differently
        for b in EXTRACTORS:
            assert a == b or any(row[3][a] != row[3][b] for row in TABLE), (a, b)


def test_vagent_rule_is_choice_match_of_the_profile_answer():
    """Today's behaviour: letter or option text of the profile's answer, nothing without one."""
    assert extract_choice("<answer>B. whatever</answer>", "B. whatever", CARS) == "B"
    assert extract_choice("<answer>(c)</answer>", "(c)", CARS) == "C"
    assert extract_choice("The answer is B.", None, CARS) is None


def test_strict_reads_letter_forms_and_exact_texts():
    for answer in ("B", "(B)", "B.", "B)", "B:", "(B).", "B. blue truck", "B) The blue truck.", "Blue Truck"):
        assert extract_choice("", answer, CARS, "strict") == "B", answer
    for answer in ("B blue truck", "B or C", "The answer is B", "B. green bus", "blue", "(B", "BB", " "):
        assert extract_choice("", answer, CARS, "strict") is None, answer
    # the letter form wins over an option whose text is that letter: "C" is the third option, not the first ("C")
    assert extract_choice("", "C", ["C", "A", "B"], "strict") == "C"


# LongVideoBench's rule: prefixes dropped, then the first capital A-E anywhere.
LONGVIDEOBENCH = [
    ("B or C", "B"),
    ("The answer is B. Clearly, the truck is blue.", "B"),  # the default lmms-eval rule reads C
    ("Cannot determine the answer from the image.", "C"),
    ("D. A book", "D"),
    ("<think>Maybe A.</think>D", "D"),  # reasoning stripped first, as lmms-eval does for every task
    ("E", None),  # a letter, but not one of four options: lmms-eval scores it wrong, no guess
]


@pytest.mark.parametrize(("reply", "expected"), LONGVIDEOBENCH)
def test_longvideobench_rule_with_a_fallback(reply, expected):
    rng = random.Random(0)
    state = rng.getstate()
    assert extract_choice(reply, None, CARS, "lmms-eval", task="longvideobench", fallback=rng) == expected
    assert rng.getstate() == state  # a reply it reads draws nothing
    assert extract_choice(reply, None, CARS, "lmms-eval", task="longvideobench") == expected  # its primary rule


def test_random_fallback_is_seeded_and_only_on_a_parse_failure():
    failures = ["I think it's the red car", "The answer is based on the color.", "", "none of them"]
    picks = [extract_choice(r, None, CARS, "lmms-eval", task="longvideobench", fallback=random.Random(7))
             for r in failures]  # fmt: skip
    again = [extract_choice(r, None, CARS, "lmms-eval", task="longvideobench", fallback=random.Random(7))
             for r in failures]  # fmt: skip
    assert picks == again == [random.Random(7).choice("ABCD")] * len(failures)
    rng, twin = random.Random(3), random.Random(3)
    drawn = [extract_choice("no letter here", None, CARS, "lmms-eval", task="longvideobench", fallback=rng)
             for _ in range(40)]  # fmt: skip
    assert drawn == [twin.choice("ABCD") for _ in range(40)] and set(drawn) == set("ABCD")
    # without a fallback the same replies are parse failures
    assert all(extract_choice(r, None, CARS, "lmms-eval", task="longvideobench") is None for r in failures)


@pytest.mark.parametrize("rule", ["vagent", "strict", "vlmevalkit", "lmms-eval"])
def test_a_random_fallback_guesses_only_where_the_rule_reads_nothing(rule):
    assert extract_choice("no letter", None, CARS, rule, fallback=random.Random(0)) == random.Random(0).choice("ABCD")
    assert extract_choice("<answer>B</answer>", "B", CARS, rule, fallback=random.Random(0)) == "B"


def test_unknown_rule_is_an_error():
    with pytest.raises(ValueError, match="unknown extraction rule"):
        extract_choice("B", "B", CARS, "mmmu")
    with pytest.raises(ValueError, match="unknown extraction rule"):
        extract_text("B", "B", "mmmu")


def test_extract_text():
    reply = "<think>It is in France.</think> Paris"
    assert extract_text(reply, "Paris, France", "lmms-eval") == "Paris, France"  # the profile's answer first
    assert extract_text(reply, None, "vagent") is None and extract_text(reply, None, "strict") is None
    assert extract_text(reply, None, "vlmevalkit") == reply  # VLMEvalKit reads the prediction whole
    assert extract_text(reply, None, "lmms-eval") == "Paris"  # lmms-eval strips <think> blocks by default
    assert (
        extract_text("  ", None, "vlmevalkit") is None and extract_text("<think>x</think>", None, "lmms-eval") is None
    )


@pytest.mark.parametrize(
    ("answer", "rule", "expected"),
    [
        ("[24.3, 30.4]", "vagent", [24.3, 30.4]),
        ("from 00:24 to 00:30", "vagent", [0.0, 24.0]),  # the first two numbers: vagent's own rule
        ("from 00:24 to 00:30", "lmms-eval", [24.0, 30.0]),  # lmms-eval reads mm:ss
        ("1:02:03.5 - 1:02:10", "lmms-eval", [3723.5, 3730.0]),
        ("[30.4, 24.3]", "lmms-eval", [24.3, 30.4]),  # a reversed span put in order
        (None, "strict", None),
    ],
)
def test_a_span_is_read_as_each_rule_reads_times(answer, rule, expected):
    from vagent.eval.extract import extract_span

    assert extract_span("The event happens in 5 - 9 s", answer, rule) == expected

from hypothesis import given, settings
from hypothesis import strategies as st

from vagent.chat import observation_content, parse_turn, system_prompt
from vagent.toolbox import tool_schemas
from vagent.types import Observation


def kinds(turn):
    return [e.kind for e in turn.errors]


def test_well_formed_turn():
    turn = parse_turn(
        '<think>small</think>\n<tool_call>\n{"name": "crop", "arguments": {"bbox": [1, 2, 3, 4]}}\n</tool_call>'
    )
    assert turn.think == "small" and turn.answer is None and not turn.errors
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("crop", {"bbox": [1, 2, 3, 4]})]
    assert parse_turn("<answer> 7 </answer>").answer == "7"


def test_policy_for_imperfect_output():
    two = parse_turn('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in two.tool_calls] == ["a", "b"] and not two.errors
    both = parse_turn('<tool_call>{"name": "a", "arguments": {}}</tool_call><answer>3</answer>')
    assert both.answer == "3" and both.tool_calls == [] and kinds(both) == ["call_with_answer"]
    unclosed = parse_turn('<tool_call>{"name": "a", "arguments": {"x": 1}}')
    assert unclosed.tool_calls[0].arguments == {"x": 1} and kinds(unclosed) == ["unclosed_tag"]
    trailing = parse_turn('<tool_call>{"name": "a", "arguments": {"x": [1, 2,],},}</tool_call>')
    assert trailing.tool_calls[0].arguments == {"x": [1, 2]} and kinds(trailing) == ["repaired_json"]
    quotes = parse_turn("<tool_call>{'name': 'a', 'arguments': {'ok': true}}</tool_call>")
    assert quotes.tool_calls[0].arguments == {"ok": True} and kinds(quotes) == ["repaired_json"]
    double = parse_turn('<tool_call>{"name": "a", "arguments": "{\\"bbox\\": [1, 2, 3, 4]}"}</tool_call>')
    assert double.tool_calls[0].arguments == {"bbox": [1, 2, 3, 4]} and kinds(double) == ["repaired_json"]
    assert kinds(parse_turn("<tool_call>crop the top left</tool_call>")) == ["bad_json"]
    assert kinds(parse_turn('<tool_call>{"arguments": {}}</tool_call>')) == ["bad_call"]
    assert kinds(parse_turn('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')) == ["bad_call"]
    assert parse_turn("just words").tool_calls == [] and parse_turn("just words").answer is None


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("<>/{}[]\"':,tool_call answer think name arguments 0123 \n")), max_size=200)
)
def test_parser_never_raises(text):
    turn = parse_turn(text)
    assert all(e.kind for e in turn.errors)


def test_system_prompt_lists_tool_schemas_and_observation_content():
    prompt = system_prompt(tool_schemas(["crop"]))
    assert "<tools>" in prompt and '"name": "crop"' in prompt and "<tool_call>" in prompt
    assert system_prompt([]).endswith("<answer></answer>.")
    content = observation_content(Observation(text="done", images=[object(), object()]))
    assert content == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "done"}]

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


def test_more_imperfect_output():
    stray = parse_turn('{"name": "crop", "arguments": {}}</tool_call>')
    assert stray.tool_calls == [] and kinds(stray) == ["stray_tag"]
    two = parse_turn("<answer>1</answer> or <answer>2</answer>")
    assert two.answer == "1" and kinds(two) == ["multiple_answers"]
    assert kinds(parse_turn("<answer> </answer>")) == ["empty_answer"]
    # answers that swallowed the grammar, as the crop proof's GRPO policies wrote them (seed 3 greedy, seed 0 sampled):
    # the block closes, so without a check they parsed clean and earned the format reward in full. Tag-counting checks
    # reject them (open-r1's tag_count_reward, DeepEyes' compute_score, Tool-Star's validate_template_format)
    swallowed = parse_turn("<answer>falling. The blue tile shows</think>\n<tool_call>\n<think>horizontal</answer>")
    assert swallowed.answer.endswith("horizontal") and kinds(swallowed) == ["tag_in_answer"]
    assert kinds(parse_turn("<answer>ris. rising. rising.</think>\n<answer>rising</answer>")) == ["tag_in_answer"]
    # left open, the body runs to the end of the turn: that is the one error, not two
    assert kinds(parse_turn('<answer>falling.</think>\n<tool_call>\n{"name": {"bbox": [1105, 65')) == ["unclosed_tag"]
    assert kinds(parse_turn("<answer>up <answer>down</answer>")) == ["tag_in_answer"]
    # a call written inside <think> is reasoning about a call, not a call; its closing tag is not stray
    musing = parse_turn('<think>maybe <tool_call>{"name": "crop", "arguments": {}}</tool_call></think>')
    assert musing.actions == [] and not musing.errors and "maybe" in musing.think
    # Python literals are read on the syntax tree: JSON-ish words inside strings survive intact
    literal = parse_turn(
        "<tool_call>{'name': 'search', 'arguments': {'query': 'true construe', 'x': None}}</tool_call>"
    )
    assert literal.tool_calls[0].arguments == {"query": "true construe", "x": None}
    # only literals: a function call in the "JSON" is not evaluated
    assert kinds(parse_turn("<tool_call>{'name': __import__('os').getcwd()}</tool_call>")) == ["bad_json"]
    assert kinds(parse_turn("<tool_call>" + "[" * 100_000 + "</tool_call>")) == ["bad_json"]


def test_actions_keep_failed_calls_in_order():
    turn = parse_turn(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert [getattr(a, "name", None) or a.kind for a in turn.actions] == ["a", "bad_json", "b"]
    assert [c.name for c in turn.tool_calls] == ["a", "b"]


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(
    st.text(alphabet=st.sampled_from(list("<>/{}[]\"':,tool_call answer think name arguments 0123 \n")), max_size=200)
)
def test_parser_never_raises(text):
    turn = parse_turn(text)
    assert all(e.kind for e in turn.errors)


def test_system_prompt_lists_tool_schemas_and_observation_content():
    prompt = system_prompt(tool_schemas(["crop"]))
    assert "<tools>" in prompt and '"name": "crop"' in prompt and "<tool_call>" in prompt
    assert system_prompt([]).endswith("<answer></answer>.") and "tool" not in system_prompt([])
    content = observation_content(Observation(text="done", images=[object(), object()]))
    assert content == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "done"}]
    frames = observation_content(Observation(text="2 frames", images=[object(), object()], timestamps=[0.5, 1.25]))
    assert [c.get("text") for c in frames] == ["t=0.50s", None, "t=1.25s", None, "2 frames"]
    failed = observation_content(Observation(text="box outside the image.", error="bad_box"))
    assert failed == [{"type": "text", "text": "Error: box outside the image."}]

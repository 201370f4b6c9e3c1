"""Agent profiles, continued: DeepEyesV2 (code and search, pre-filled <think>), Tool-Star (results inside the
assistant turn), OpenThinkIMG (JSON actions, 0-100 percent lines, Terminate) and Visual-ARFT (search/coding
chain). Model outputs are written in each agent's own format (see the profile modules for the sources)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.test_agents import ORIGINAL, _between_turns, _context, _decode
from vagent.agents import deepeyesv2 as dv2
from vagent.agents import get_profile
from vagent.agents import tool_star as ts
from vagent.agents import visual_arft as va
from vagent.data.encode import encode_messages
from vagent.rollout import RolloutLimits, Task, rollout
from vagent.toolbox import ToolServices
from vagent.toolbox.sandbox import Sandbox
from vagent.toolbox.search import SearchResult


class FakeSearch:
    """A search backend with fixed hits (no corpus, no network)."""

    def search(self, query: str, k: int) -> list[SearchResult]:
        return [SearchResult("Eiffel Tower", "Built in 1889 by Gustave Eiffel.", "https://x.org/eiffel"),
                SearchResult("Paris", "Capital of France.", "https://x.org/paris")][:k]  # fmt: skip


def _services_context(images=(ORIGINAL,)):
    context = _context(images=images)
    context.search = FakeSearch()
    # trusted test code; bubblewrap may be missing on CI machines
    context.sandbox = Sandbox(timeout_s=20.0, bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    return context


# -- DeepEyesV2 ------------------------------------------------------------------------------------------------

DV2_CODE = (
    "<think>The text is tiny; crop the top-left quarter and print its size.</think>\n<code>\n```python\n"
    "crop = image_1.crop((0, 0, 500, 400))\nprint(crop.size)\nimport matplotlib.pyplot as plt\n"
    "plt.imshow(crop)\nplt.show()\n```\n</code>"
)


def test_deepeyesv2_code_sees_image_1_and_returns_plots_in_its_format():
    profile = get_profile("deepeyesv2")
    turn = profile.parse(DV2_CODE)
    assert [(c.name, profile.tool_for(c)) for c in turn.tool_calls] == [("python", "code")]
    [obs] = profile.act(turn, _services_context(), [])
    assert obs.ok, obs.text
    assert (
        obs.text == "Code execution result:\nstdout:\n```\n(500, 400)\n\n```\n\nstderr:\n```\n\n```\n\nImages:\n<image>"
    )
    message = profile.observation_message(obs)
    assert [p.type for p in message.content] == ["text", "image"] and message.role == "user"
    assert message.content[0].text.endswith("Images:\n")


def test_deepeyesv2_search_calls_and_errors():
    profile = get_profile("deepeyesv2")
    call = '<think>Who built it?</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "tower builder"}}\n</tool_call>'
    [obs] = profile.act(profile.parse(call), _services_context(), [])
    assert obs.text == (
        "<tool_response>\nA Google search for 'tower builder' found 2 results:\n\n## Web Results\n"
        "1. [Eiffel Tower](https://x.org/eiffel)\n\nBuilt in 1889 by Gustave Eiffel.\n\n"
        "2. [Paris](https://x.org/paris)\n\nCapital of France.\n</tool_response>"
    )
    lens = profile.act(profile.parse('<tool_call>\n{"name": "image_search"}\n</tool_call>'), _services_context(), [])
    assert lens[0].error == "unavailable"
    bad = profile.parse('<tool_call>{"name": "image_search", "arguments": {"q": 1}}</tool_call>')
    assert profile.act(bad, _services_context(), [])[0].text.startswith("Error: Invalid tool call parameters for image")
    wrong = profile.parse('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert profile.act(wrong, _services_context(), [])[0].text.startswith("Error: Invalid tool call name:")
    assert profile.parse("<code>print(1)</code>").actions == []  # no fenced python block: its env ends the episode
    assert profile.parse("<think>done</think> <answer> 1889 </answer>").answer == "1889"


def test_deepeyesv2_prefills_think_after_each_tool_turn(policy):
    task = Task(id="d", question="Who built it?", images=[ORIGINAL],
                scripted_turns=['<tool_call>{"name": "search", "arguments": {"query": "tower"}}</tool_call>', None])  # fmt: skip
    limits = RolloutLimits(max_turns=2, max_new_tokens=6, temperature=1.0)
    traj = rollout(policy, task, limits, services=ToolServices(search=FakeSearch()), agent="deepeyesv2")
    between = _between_turns(policy, traj)
    assert between.startswith("\n<|im_start|>user\n<tool_response>\nA Google search for 'tower' found 2 results")
    assert between.endswith("</tool_response><|im_end|>\n")
    second = traj.messages[4]
    n = len(policy.tokenizer.encode("<think>"))
    assert second.plain_text.startswith("<think>") and second.sampled[:n] == [0] * n and second.sampled[n] == 1
    enc = encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                          max_pixels=policy.pixel_budget[1], forced_spans=dv2.PROFILE.forced_spans)  # fmt: skip
    assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
    # a gold (SFT) text turn: its pre-filled <think> is not trained on, the rest is
    gold = [*traj.messages[:4], type(second).text("assistant", "<think>It is Eiffel.</think><answer>Eiffel</answer>")]
    enc = encode_messages(gold, policy.processor, min_pixels=policy.pixel_budget[0], max_pixels=policy.pixel_budget[1],
                          forced_spans=dv2.PROFILE.forced_spans)  # fmt: skip
    trained = _decode(policy, enc.input_ids[enc.loss_mask.bool()].tolist())
    assert trained == "It is Eiffel.</think><answer>Eiffel</answer><|im_end|>"


# -- Tool-Star -------------------------------------------------------------------------------------------------


def test_tool_star_results_continue_the_same_assistant_turn(policy):
    search = "<think> I need the year. </think> <search> Eiffel Tower completion year </search>"
    final = " <think> It was 1889. </think> <answer> The final answer is \\[ \\boxed{1889} \\] </answer>"
    task = Task(id="t", question="When was it finished?", images=[ORIGINAL], scripted_turns=[search, final])
    traj = rollout(
        policy, task, RolloutLimits(max_turns=3), services=ToolServices(search=FakeSearch()), agent="tool-star"
    )
    assert traj.answer == "1889" and traj.stop_reason == "answered"
    assert [m.role for m in traj.messages] == ["system", "user", "assistant"]  # one assistant turn
    turn = _decode(policy, traj.messages[2].token_ids)
    result = " <result>\nEiffel Tower\nBuilt in 1889 by Gustave Eiffel.\n\nParis\nCapital of France.\n</result>"
    assert turn == search + result + final + "<|im_end|>\n"
    # exactly the result's tokens are forced, tokenized the way its rollout does: tokenizer.encode(result)
    ids = policy.tokenizer.encode(result)
    start = len(policy.tokenizer.encode(search))
    assert traj.messages[2].token_ids[start : start + len(ids)] == ids
    enc = encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                          max_pixels=policy.pixel_budget[1], forced_spans=ts.PROFILE.forced_spans)  # fmt: skip
    assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
    # the same turn as gold text: the <result> block is masked out of the loss
    gold = [*traj.messages[:2], type(traj.messages[2]).text("assistant", search + result + final)]
    enc = encode_messages(gold, policy.processor, min_pixels=policy.pixel_budget[0], max_pixels=policy.pixel_budget[1],
                          forced_spans=ts.PROFILE.forced_spans)  # fmt: skip
    assert "<result>" not in _decode(policy, enc.input_ids[enc.loss_mask.bool()].tolist())


def test_tool_star_python_and_the_call_budget(policy):
    profile = get_profile("tool-star")
    [obs] = profile.act(profile.parse("<python> print(6 * 7) </python>"), _services_context(), [])
    assert obs.text == " <result>\n42\n</result>"
    [err] = profile.act(profile.parse("<python> 1 / 0 </python>"), _services_context(), [])
    assert err.error and "ZeroDivisionError" in err.text
    call = "<search> q </search>"
    task = Task(id="t", question="Q?", scripted_turns=[call] * 5)
    traj = rollout(
        policy, task, RolloutLimits(max_turns=8), services=ToolServices(search=FakeSearch()), agent="tool-star"
    )
    assert traj.metrics["tool_calls"] == ts.MAX_CALLS and traj.stop_reason == "max_calls"
    assert [m.role for m in traj.messages] == ["system", "user", "assistant"]
    assert _decode(policy, traj.token_ids).endswith("<|im_end|>\n")


# -- OpenThinkIMG ----------------------------------------------------------------------------------------------


def _otk(name: str, arguments: dict, more: str = "") -> str:
    return (
        json.dumps({"thought": "I will locate the value first.", "actions": [{"name": name, "arguments": arguments}]})
        + more
    )


def test_openthinkimg_lines_are_percent_of_the_image_and_only_the_first_action_runs():
    profile = get_profile("openthinkimg")
    text = _otk("DrawHorizontalLineByY", {"image": "img_1", "param": 'x="21.5" y="25"'})
    turn = profile.parse(text)
    assert [profile.tool_for(c) for c in turn.tool_calls] == ["draw"]
    [obs] = profile.act(turn, _context(), [])
    assert obs.ok and obs.metadata["drawn"]["line"] == 1
    line_row = 200  # 25% of 800 pixels
    drawn = obs.images[0].resize(ORIGINAL.size)
    assert drawn.getpixel((500, line_row))[0] > 200 and drawn.getpixel((500, 600)) == ORIGINAL.getpixel((500, 600))
    assert obs.text == ("OBSERVATION:\nDrawHorizontalLineByY model outputs: Line drawn successfully.\n"
                        "Please summarize the model outputs and answer my first question.")  # fmt: skip
    two = json.dumps({"thought": "", "actions": [{"name": "crop", "arguments": {"image": "img_1", "param": "[0, 0, 500, 400]"}},
                                                  {"name": "OCR", "arguments": {"image": "img_1"}}]})  # fmt: skip
    parsed = profile.parse(two)
    assert [c.name for c in parsed.tool_calls] == ["crop"] and parsed.error_kinds == ["ignored_calls"]
    [crop] = profile.act(parsed, _context(), [])
    assert crop.metadata["box_original"] == [0, 0, 500, 400] and "Image cropped successfully." in crop.text


def test_openthinkimg_model_tools_are_not_available_and_terminate_answers():
    profile = get_profile("openthinkimg")
    [ocr] = profile.act(profile.parse(_otk("OCR", {"image": "img_1"})), _context(), [])
    assert ocr.error == "unavailable" and "OCR is not available in vagent: it needs an OCR model." in ocr.text
    assert len(ocr.images) == 1  # its loop sends the newest image back with every observation
    [none] = profile.act(
        profile.parse(_otk("DrawVerticalLineByX", {"image": "img_1", "param": "x=140"})), _context(), []
    )
    assert "No valid points extracted." in none.text  # 140 > 100 percent: dropped, as its worker does
    assert profile.parse(_otk("Terminate", {"ans": "1985"})).answer == "1985"
    assert (
        profile.parse('{"thought": "x", "actions": [{"name": "Terminate", "arguments": {"answer": "Top"}}]}').answer
        == "Top"
    )
    broken = profile.parse('{"thought": "x", "actions": [{"name": "crop", "arguments": {"param": }]}')
    assert broken.actions == [] and broken.error_kinds == ["bad_json"]


def test_openthinkimg_renders_image_then_observation_text(policy):
    task = Task(id="o", question="Which year is highest?", images=[ORIGINAL],
                scripted_turns=[_otk("crop", {"image": "img_1", "param": "[0, 0, 500, 400]"}), _otk("Terminate", {"ans": "1985"})])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="openthinkimg")
    assert traj.answer == "1985" and traj.tool_results[0].metadata["box_original"] == [0, 0, 500, 400]
    between = _between_turns(policy, traj)
    assert between.startswith("\n<|im_start|>user\n<|vision_start|>")
    assert between.endswith("<|vision_end|>OBSERVATION:\ncrop model outputs: Image cropped successfully.\n"
                            "Please summarize the model outputs and answer my first question.<|im_end|>\n")  # fmt: skip
    text = _decode(policy, traj.token_ids)
    assert "<|im_start|>user\nYou are a visual assistant capable of generating and solving steps" in text


# -- Visual-ARFT -----------------------------------------------------------------------------------------------


def test_visual_arft_search_chain():
    profile = get_profile("visual-arft")
    prompt = profile.prompt("Who designed it?", [ORIGINAL], [], ["search"])
    assert len(prompt) == 1 and prompt[0].plain_text == va.SEARCH_PROMPT + "\n<query> Who designed it? </query>"
    turn = profile.parse("<think> I need the architect. </think>\n<search> Eiffel Tower designer </search>")
    [obs] = profile.act(turn, _services_context(), [])
    assert obs.text == ("<information> 1. Content:Built in 1889 by Gustave Eiffel.2. Content:Capital of France. "
                        "</information> ")  # fmt: skip
    assert profile.parse("<think> done </think>\n<answer> Gustave Eiffel </answer>").answer == "Gustave Eiffel"


def test_visual_arft_coding_chain_replaces_the_image():
    profile = get_profile("visual-arft")
    assert profile.prompt("What is written?", [ORIGINAL], [], [])[0].plain_text.endswith(
        "<query> What is written? <query>"
    )
    problem = profile.parse("<think> The image is upside down. </think>\n<problem> {'rotation180'} </problem>")
    [tips] = profile.act(problem, _services_context(), [])
    assert tips.text == va.TIPS_OTHER.format(problems=["rotation180"])
    code = (
        "<think> Rotate it back. </think>\n<code>\n```python\nfrom PIL import Image\n"
        "img = Image.open('path_to_input_image.jpg')\nimg.rotate(180).save('path_to_output_image.jpg')\n```\n</code>"
    )
    [obs] = profile.act(profile.parse(code), _services_context(images=(Image.new("RGB", (64, 48), (9, 9, 9)),)), [])
    assert obs.ok and len(obs.images) == 1 and obs.text == ""
    assert profile.observation_message(obs).content[0].type == "image"
    [bad] = profile.act(profile.parse("<code> no fenced block </code>"), _services_context(), [])
    assert bad.error == "bad_call" and bad.text == "Code is not extracted successfully"


@pytest.mark.parametrize("name", ["deepeyesv2", "tool-star", "openthinkimg", "visual-arft"])
def test_tools_parse_lists_each_profiles_native_calls(name, monkeypatch, capsys):
    import io

    from vagent.cli import main

    text = {"deepeyesv2": DV2_CODE, "tool-star": "<search> q </search>",
            "openthinkimg": _otk("OCR", {"image": "img_1"}), "visual-arft": "<search> q </search>"}[name]  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"text": text})))
    assert main(["tools", "parse", "--agent", name]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = {"deepeyesv2": "code", "tool-star": "search", "openthinkimg": None, "visual-arft": "search"}[name]
    assert [c["name"] for c in out["tool_calls"]] == [expected]
    assert ("unknown_tool" in out["error_kinds"]) == (expected is None)  # OCR has no vagent equivalent


def test_malformed_native_outputs_become_error_observations():
    star = get_profile("tool-star")
    [obs] = star.act(star.parse("I will look it up </search>"), _services_context(), [])
    assert obs.error == "unclosed_tag" and obs.text == " <result>\n</search> has no <search>\n</result>"
    [empty] = star.act(star.parse("<search>   </search>"), _services_context(), [])
    assert empty.text == " <result>\ninvalid query\n</result>"  # its search() answers an empty query so
    arft = get_profile("visual-arft")
    [unclosed] = arft.act(arft.parse("<think> hm </think> <search> the tower"), _services_context(), [])
    assert unclosed.error == "unclosed_tag"
    [bad] = arft.act(arft.parse("<think> hm </think> <problem> rotation </problem>"), _services_context(), [])
    assert bad.error == "bad_call"
    v2 = get_profile("deepeyesv2")
    [json_err] = v2.act(v2.parse("<tool_call>{'name': 'search'</tool_call>"), _services_context(), [])
    assert json_err.text.startswith("Error: Invalid tool call format: {'name': 'search'. Error: Expecting")

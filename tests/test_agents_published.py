"""Agent profiles, continued: Mini-o3 (``<grounding>`` with 0-1 boxes on a named source), Chain-of-Focus (absolute
boxes of its view, enlarged 1.5x, crop shown at 2x) and Thyme (python in ``<code>``, ``<sandbox_output>``). Model
outputs are written in each agent's own format (see the profile modules for the repository files)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from tests.test_agents import ORIGINAL, _between_turns, _context, _decode, _vision
from tests.test_agents_more import _services_context
from vagent.agents import chain_of_focus as cof
from vagent.agents import get_profile
from vagent.agents import mini_o3 as mo3
from vagent.agents import thyme as th
from vagent.data.encode import encode_messages
from vagent.rollout import RolloutLimits, Task, rollout, run
from vagent.toolbox import ToolServices
from vagent.toolbox.sandbox import Sandbox

# trusted test code; bubblewrap may be missing on CI machines
SANDBOX = Sandbox(timeout_s=20.0, bwrap="/nonexistent/bwrap", allow_unsandboxed=True)


def _encode(policy, traj, name):
    return encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                           max_pixels=policy.pixel_budget[1], factor=policy.image_factor,
                           forced_spans=get_profile(name).forced_spans)  # fmt: skip


# -- Mini-o3 ---------------------------------------------------------------------------------------------------

MO3_CALL = (
    "<think>The sign is too small to read. I will zoom in on the upper left part.</think> "
    '<grounding>{"bbox_2d": [0.1, 0.25, 0.4, 0.5], "source": "original_image"}</grounding>'
)


def _mo3(bbox, source="original_image") -> str:
    return f'<think>Zoom.</think> <grounding>{{"bbox_2d": {bbox}, "source": "{source}"}}</grounding>'


def test_mini_o3_prompt_is_its_tool_crop_system_prompt():
    system, user = get_profile("mini-o3").prompt("What does the sign say?", [ORIGINAL], [], [])
    assert system.plain_text == mo3.SYSTEM_PROMPT
    assert '<grounding>{"bbox_2d": [x0, y0, x1, y1], "source": "original_image"}</grounding>' in system.plain_text
    assert "(suppose the width and height of the image are 1.0)" in system.plain_text
    assert [p.type for p in user.content] == ["image", "text"] and user.plain_text == "\nWhat does the sign say?"


def test_mini_o3_grounding_is_fractions_of_the_named_source():
    profile = get_profile("mini-o3")
    turn = profile.parse(MO3_CALL)
    assert [(c.name, profile.tool_for(c)) for c in turn.tool_calls] == [("grounding", "crop")]
    [obs] = profile.act(turn, _context(), [])
    # [0.1, 0.25, 0.4, 0.5] of the 1000x800 original (not of the 500x400 view): 300x200, within 40000..2e6 pixels
    assert obs.ok and obs.metadata["box_original"] == [100, 200, 400, 400] and obs.images[0].size == (300, 200)
    assert obs.text == mo3.OBSERVATION.format(action=0, observation=1)
    message = profile.observation_message(obs)
    assert message.role == "user" and [p.type for p in message.content] == ["text", "image", "text"]
    assert message.content[0].text.endswith("(Observation 1):\n") and message.content[2].text.startswith(".\nContinue")
    # observation_1 is the crop: [0, 0, 0.5, 0.5] of 300x200 is 150x100, scaled up to 40000 pixels (sides truncated)
    crop = Image.new("RGB", (300, 200), (1, 2, 3))
    [again] = profile.act(profile.parse(_mo3("[0, 0, 0.5, 0.5]", "observation_1")), _context((ORIGINAL, crop)), [])
    assert again.metadata["box_original"] == [0, 0, 150, 100] and again.metadata["image_index"] == 1
    assert again.images[0].size == (244, 163) and again.text == mo3.OBSERVATION.format(action=1, observation=2)


@pytest.mark.parametrize(
    ("text", "info"),
    [
        ('<grounding>{"bbox_2d": [0.1, 0.2, 0.3, 0.4]}</grounding>', "'NoneType' object has no attribute 'group'"),
        (_mo3("[0.1, 0.2, 0.3, 0.4]", "observation_3"), 'Error in predicting the source observation: "observation_3".'),
        (_mo3("[0.1, 0.2, 0.3, 0.4]", "crop_1"),
         "The 'source' argument \"crop_1\" does not match the pattern 'observation_([0-9]*)'."),
        (_mo3("[0.5, 0.2, 0.5, 0.4]"), "The bounding box is not valid in width: [500, 160, 500, 320]"),
        # pixels where it wants fractions: 100 x 1000 lands far right of the image
        (_mo3("[100, 50, 400, 300]"), "The bounding box is not valid in width: [100000, 40000, 999, 799]"),
        (_mo3("[0.1, 0.2, 0.3]"), ""),  # its bare `assert`
        (_mo3("[0.0, 0.0, 1.0, 0.004]"),  # 999 x 3 pixels
         "The absolute aspect ratio of the bounding box exceeds 200, which is too large."),
    ],
)  # fmt: skip
def test_mini_o3_malformed_calls_become_its_error_turn(text, info):
    profile = get_profile("mini-o3")
    [obs] = profile.act(profile.parse(text), _context(), [])
    assert not obs.ok and obs.text == f"ERROR occurs during grounding. Error Information: {info}.\n" + mo3.ERROR_PROMPT
    assert profile.observation_message(obs).plain_text == obs.text


def test_mini_o3_answers_and_calls():
    profile = get_profile("mini-o3")
    assert profile.parse("<think>It reads STOP.</think> <answer> STOP </answer>").answer == "STOP"
    assert profile.parse("<answer>A</answer> no, <answer>B</answer>").answer == "A"  # its strict rule: the first
    both = profile.parse("<answer>A</answer> " + MO3_CALL)  # a turn with a call is a call
    assert both.answer is None and len(both.actions) == 1
    assert profile.parse("<think>I am not sure.</think>").actions == []  # final, without an answer
    assert mo3.mini_o3_size(4000, 3000) == (1632, 1224)  # sqrt(2e6 / 12e6) scale, truncated


def test_mini_o3_episode_renders_as_its_loop(policy):
    """vllm_async_engine.py: "...</grounding>" + "<|im_end|>\\n<|im_start|>user\\n" + observation + "<|im_end|>\\n"."""
    task = Task(id="m", question="What does the sign say?", images=[ORIGINAL],
                scripted_turns=[MO3_CALL, "<think>It reads STOP.</think> <answer>STOP</answer>"])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="mini-o3")
    assert traj.answer == "STOP" and traj.tool_results[0].metadata["box_original"] == [100, 200, 400, 400]
    assert (traj.tool_results[0].name, traj.tool_results[0].native) == ("crop", "grounding")
    enc = _encode(policy, traj, "mini-o3")
    assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
    shown = _vision(policy, enc.image_grid_thw[1])
    observation = mo3.OBSERVATION.format(action=0, observation=1).replace("<image>", shown)
    assert _between_turns(policy, traj) == "\n<|im_start|>user\n" + observation + "<|im_end|>\n"
    text = _decode(policy, traj.token_ids)
    assert "</grounding><|im_end|>" in text and text.startswith("<|im_start|>system\n" + mo3.SYSTEM_PROMPT)
    assert "<|vision_end|>\nWhat does the sign say?<|im_end|>" in text


# -- Chain-of-Focus --------------------------------------------------------------------------------------------

COF_CALL = (
    "<think>The sign is small; I need to zoom in on it.</think> <tool_call>\n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [100, 100, 200, 140], "label": "the sign"}}\n</tool_call>'
)


def test_chain_of_focus_prompt_is_its_eval_prompt():
    system, user = get_profile("chain-of-focus").prompt("What does the sign say?", [ORIGINAL], [], [])
    assert system.plain_text == cof.SYSTEM_PROMPT and system.plain_text.startswith("You are a helpful assistant.\n\n")
    assert '"name":"image_zoom_in_tool"' in system.plain_text
    assert [p.type for p in user.content] == ["image", "text"]
    assert user.plain_text == "Question: What does the sign say?" + cof.USER_PROMPT


def test_chain_of_focus_box_is_view_pixels_enlarged_then_shown_twice_as_large():
    profile = get_profile("chain-of-focus")
    turn = profile.parse(COF_CALL)
    assert [profile.tool_for(c) for c in turn.tool_calls] == ["crop"]
    [obs] = profile.act(turn, _context(), [])
    # view 500x400: [100, 100, 200, 140] enlarged 1.5x about its centre = [75, 90, 225, 150]; the original is twice
    # the view: [150, 180, 450, 300]; shown at smart_resize(2 x 60, 2 x 150) = 308x112
    assert obs.ok and obs.metadata["box_view"] == [75, 90, 225, 150]
    assert obs.metadata["box_original"] == [150, 180, 450, 300] and obs.images[0].size == (308, 112)
    assert obs.text == cof.USER_PROMPT
    message = profile.observation_message(obs)
    assert message.role == "user" and [p.type for p in message.content] == ["image", "text"]
    # only the first <tool_call> is read
    two = profile.parse(COF_CALL + COF_CALL.replace("[100, 100, 200, 140]", "[0, 0, 50, 50]"))
    assert profile.act(two, _context(), [])[0].metadata["box_view"] == [75, 90, 225, 150]


@pytest.mark.parametrize(
    ("arguments", "kind", "region", "size"),
    [
        ('{"bbox_2d": [100, 100, 600, 140]}', "bad_box", [0, 0, 1000, 800], (1008, 812)),  # past the view: whole, x2
        ('{"bbox_2d": [200, 100, 100, 140]}', "bad_box", [0, 0, 1000, 800], (1008, 812)),  # reversed
        ('{"bbox": [100, 100, 200, 140]}', "bad_call", [0, 0, 1000, 800], (500, 400)),  # KeyError: the view itself
        ('{"bbox_2d": [100, 100, 200]}', "bad_call", [0, 0, 1000, 800], (500, 400)),  # unpacking fails
        ('{"bbox_2d": [100, 100, 200, 140]', "bad_json", [0, 0, 1000, 800], (1008, 812)),  # no JSON: whole, x2
    ],
)
def test_chain_of_focus_unusable_calls_still_get_an_image(arguments, kind, region, size):
    """CoF has no error text: what it cannot read comes back as an image (Image.crop(None), or do_crop's fallback)."""
    profile = get_profile("chain-of-focus")
    text = '<tool_call>{"name": "image_zoom_in_tool", "arguments": ' + arguments + "}</tool_call>"
    [obs] = profile.act(profile.parse(text), _context(), [])
    assert obs.error == kind and obs.text == cof.USER_PROMPT
    assert obs.metadata["box_original"] == region and obs.images[0].size == size


def test_chain_of_focus_answers_are_read_on_one_line():
    profile = get_profile("chain-of-focus")
    assert profile.parse("<think>It is a sheep.</think> <answer>\nB\n</answer>").answer == "B"
    assert profile.parse("<answer>The sign\nsays B</answer>").answer is None  # judge_result.py: no DOTALL
    assert profile.parse("I will zoom <tool_call> {").error_kinds == ["unclosed_tag"]


def test_chain_of_focus_episode_renders_as_its_loop(policy):
    task = Task(id="c", question="What does the sign say?", images=[ORIGINAL],
                scripted_turns=[COF_CALL, "<think>It says STOP.</think> <answer>STOP</answer>"])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="chain-of-focus")
    assert traj.answer == "STOP"
    enc = _encode(policy, traj, "chain-of-focus")
    assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
    shown = _vision(policy, enc.image_grid_thw[1])
    assert _between_turns(policy, traj) == "\n<|im_start|>user\n" + shown + cof.USER_PROMPT + "<|im_end|>\n"
    assert "<|vision_end|>Question: What does the sign say?" + cof.USER_PROMPT in _decode(policy, traj.token_ids)


# -- Thyme -----------------------------------------------------------------------------------------------------


def _scene() -> Image.Image:
    """1000x800 blue with a red plate at x 100-400, y 200-400: a crop of exactly that region is all red."""
    image = Image.new("RGB", (1000, 800), (30, 60, 200))
    image.paste((220, 20, 20), (100, 200, 400, 400))
    return image


TH_CODE = (
    "<think>The plate is small; I will crop it and zoom in.</think>\n<code>\n```python\nimport cv2\nimport os\n\n"
    'image_path = "/mllm_hdd/data/17127.jpg"\nimage = cv2.imread(image_path)\n'
    "x1, y1, x2, y2 = 100, 200, 400, 400\ncropped = image[y1:y2, x1:x2]\n"
    'processed_path = os.path.join("/mnt/data/temp_processed_images/", "17127_crop.jpg")\n'
    "cv2.imwrite(processed_path, cropped)\nprint(processed_path)\n```\n</code>"
)


def test_thyme_prompt_names_the_image_and_its_size():
    system, user = get_profile("thyme").prompt("What is the plate number?", [ORIGINAL], [], [])
    assert system.plain_text == th.SYSTEM_PROMPT and "<code>\n    ```python\n    # your code." in system.plain_text
    assert [p.type for p in user.content] == ["image", "text"]
    assert user.plain_text == th.USER_PROMPT.format(question="What is the plate number?", path="image_0.png",
                                                    size="1000x800")  # fmt: skip
    assert user.plain_text.startswith('<image>\nWhat is the plate number?\n\n### User Image Path:** "image_0.png"')


def test_thyme_code_crops_the_user_image_and_returns_it_in_sandbox_output():
    profile = get_profile("thyme")
    turn = profile.parse(TH_CODE)
    assert [(c.name, profile.tool_for(c)) for c in turn.tool_calls] == [("python", "code")]
    assert turn.tool_calls[0].arguments["code"].startswith("import cv2\nimport os\n\nimage_path = ")
    context = _services_context(images=(_scene(),))
    [obs] = profile.act(turn, context, [])
    assert obs.ok, obs.text
    assert obs.text == "<sandbox_output><image></sandbox_output>" and len(obs.images) == 1
    crop = obs.images[0]
    assert crop.size == (308, 196)  # the 300x200 region the code cut, on the policy's 28-pixel grid
    red = [crop.getpixel((x, y)) for x in (2, crop.width // 2, crop.width - 3) for y in (2, crop.height - 3)]
    assert all(r > 180 and b < 80 for r, _, b in red)  # the red plate: image_path was pointed at the user image
    message = profile.observation_message(obs)
    assert message.role == "user" and [p.type for p in message.content] == ["text", "image", "text"]
    assert [p.text for p in message.content if p.type == "text"] == ["<sandbox_output>", "</sandbox_output>"]


@pytest.mark.parametrize(
    ("code", "expected", "kind"),
    [
        ("print(6 * 7)", "42", None),  # a computation: its printed output
        ("x = 1 / 0", "Sandbox for N/A: Code execution failed: division by zero", "code_error"),
        ("import not_a_module", "Sandbox for N/A: Code execution failed due to ImportError. Ensure all required "
         "modules are available and correctly named: No module named 'not_a_module'", "code_error"),
        ("x = 1", "Sandbox for N/A: No output captured.", "no_output"),
        ("import subprocess\nsubprocess.run(['ls'])", "Sandbox for N/A: Code contains potentially dangerous system "
         "operations such as remove. Execution denied.", "refused"),
    ],
)  # fmt: skip
def test_thyme_text_results_and_errors_in_its_words(code, expected, kind):
    profile = get_profile("thyme")
    [obs] = profile.act(profile.parse(f"<code>\n```python\n{code}\n```\n</code>"), _services_context(), [])
    assert obs.text == f"<sandbox_output>{expected}</sandbox_output>" and obs.error == kind


def test_thyme_rewrites_code_as_its_sandbox_does():
    # the first line takes the second's indentation, then the block is dedented (an indented fenced block runs)
    assert th.thyme_code("import os\n    print(os.getcwd())") == "import os\nprint(os.getcwd())"
    assert th.thyme_code("img = cv.imread(image_path)\nprint(f'{1/3:.2f}')") == (
        "img = cv2.imread(image_path)\nprint(f'{1 / 3:.8f}')"
    )
    assert th.thyme_code('p = "/mnt/data/temp_processed_images/a.png"') == 'p = "./a.png"'
    assert th.thyme_code('image_path = "/elsewhere/x.jpg"') == "image_path = 'image_0.png'"


def test_thyme_answers():
    profile = get_profile("thyme")
    assert profile.parse("<think>It is S QT 911.</think>\n<answer> **C. S QT 911** </answer>").answer == (
        "**C. S QT 911**"
    )
    assert profile.parse("<answer>The answer is \\boxed{C}</answer>").answer == "C"
    assert profile.parse("<answer>\\boxed{C</answer>").answer == "C"  # unclosed: the rest, as its extractor does
    assert profile.parse("<think>Let me look.</think>").actions == []  # neither code nor answer: the episode ends


def test_thyme_episode_renders_the_sandbox_output_turn(policy):
    task = Task(id="t", question="What is the plate number?", images=[_scene()],
                scripted_turns=[TH_CODE, "<think>It is red.</think>\n<answer>red</answer>"])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3), services=ToolServices(sandbox=SANDBOX), agent="thyme")
    assert traj.answer == "red" and not traj.tool_results[0].error
    enc = _encode(policy, traj, "thyme")
    assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
    shown = _vision(policy, enc.image_grid_thw[1])
    expected = "\n<|im_start|>user\n<sandbox_output>" + shown + "</sandbox_output><|im_end|>\n"
    assert _between_turns(policy, traj) == expected
    assert "</code><|im_end|>" in _decode(policy, traj.token_ids)


# -- all three: token-in/token-out with sampled turns, and the CLI ---------------------------------------------

_CALLS = {"mini-o3": MO3_CALL, "chain-of-focus": COF_CALL,
          "thyme": "<code>\n```python\nfrom PIL import Image\nImage.open(image_path).crop((0, 0, 200, 100))"
                   ".save('/mnt/data/temp_processed_images/c.png')\n```\n</code>"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_a_multi_turn_rollout_reencodes_to_its_ids(policy, name):
    """Scripted call, then sampled turns: the one encoder gives back the engine's ids and mask (as
    ``test_a_multi_turn_rollout_reencodes_to_its_ids_under_every_profile`` checks for the other profiles)."""
    torch.manual_seed(0)
    limits = RolloutLimits(max_turns=3, max_new_tokens=12, temperature=1.0, max_images=6)
    task = Task(id=name, question="What?", images=[ORIGINAL], scripted_turns=[_CALLS[name], None])
    for traj in run(policy, [task], n_samples=2, limits=limits, agent=name, services=ToolServices(sandbox=SANDBOX)):
        assert traj.metrics["tool_calls"] == 1 and sum(traj.loss_mask) > 0
        assert not any(r.error for r in traj.tool_results), traj.tool_results
        enc = _encode(policy, traj, name)
        assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
        assert len(enc.image_grid_thw) == len(traj.images) == 2


@pytest.mark.parametrize(("name", "native"), [("mini-o3", "grounding"), ("chain-of-focus", "image_zoom_in_tool"),
                                              ("thyme", "python")])  # fmt: skip
def test_tools_parse_names_the_vagent_tool(name, native, monkeypatch, capsys):
    from vagent.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"text": _CALLS[name]})))
    assert main(["tools", "parse", "--agent", name]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["native"]) for c in out["tool_calls"]] == [(get_profile(name).tools[0], native)]

"""Agent profiles: each published agent's own output format is parsed, the right vagent tool runs on the right
region or time span (checked in original-image pixels and seconds), the observation renders token for token
as the agent's own code renders it, answers are extracted, and malformed output becomes an error observation.

Model outputs below are written in each agent's format, taken from its prompts and examples (see the
profile modules for the repository files)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.videos import write_video
from vagent.agents import PROFILES, get_profile
from vagent.agents import deepeyes as de
from vagent.agents import longvt as lv
from vagent.agents import pixel_reasoner as pr
from vagent.data.encode import encode_messages
from vagent.media import smart_resize
from vagent.rollout import RolloutLimits, Task, rollout, run
from vagent.toolbox import ToolContext, ToolServices
from vagent.toolbox.sandbox import Sandbox

# 1000x800 original: the context's model view is half size, so a box read in the wrong frame lands elsewhere.
ORIGINAL = Image.new("RGB", (1000, 800), (90, 140, 200))


def _context(images=(ORIGINAL,), videos=()) -> ToolContext:
    images = list(images)
    return ToolContext(images=images, model_sizes=[(im.width // 2, im.height // 2) for im in images],
                       videos=list(videos), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280)  # fmt: skip


def _decode(policy, ids) -> str:
    return policy.tokenizer.decode(ids, skip_special_tokens=False)


def _vision(policy, grid) -> str:
    """The placeholder text of one image: what the processor expands '<|image_pad|>' to."""
    return "<|vision_start|>" + "<|image_pad|>" * (int(grid.prod()) // 4) + "<|vision_end|>"


def _between_turns(policy, traj, k: int = 0):
    """The ids from the end of assistant turn ``k`` to the start of the next assistant turn (exclusive of the
    header), and the grids of the images in that stretch."""
    text = _decode(policy, traj.token_ids)
    header = "<|im_start|>assistant\n"
    starts = [i for i in range(len(text)) if text.startswith(header, i)]
    end_of_turn = text.index("<|im_end|>", starts[k]) + len("<|im_end|>")
    return text[end_of_turn : starts[k + 1]]


# -- DeepEyes ------------------------------------------------------------------------------------------------

DE_CALL = (
    "<think>The sign is too small to read; I will zoom in on it.</think>  <tool_call>  \n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [100, 50, 400, 300], "label": "the sign"}}  \n</tool_call>'
)


def test_deepeyes_zoom_runs_crop_on_original_pixels_and_renders_as_its_env():
    profile = get_profile("deepeyes")
    turn = profile.parse(DE_CALL)
    assert [(c.name, profile.tool_for(c)) for c in turn.tool_calls] == [("image_zoom_in_tool", "crop")]
    [obs] = profile.act(turn, _context(), [])
    # bbox_2d is in pixels of the original 1000x800 image, not of the 500x400 view
    assert obs.ok and obs.metadata["box_original"] == [100, 50, 400, 300] and obs.metadata["image_index"] == 0
    assert obs.images[0].size[0] / obs.images[0].size[1] == pytest.approx(300 / 250, rel=0.1)
    message = profile.observation_message(obs)
    assert message.role == "user"
    assert [p.text if p.type == "text" else "<image>" for p in message.content] == [
        "<tool_response>", "<image>", de.USER_PROMPT, "</tool_response>"]  # fmt: skip


def test_deepeyes_runs_only_the_last_call_and_answers_first():
    profile = get_profile("deepeyes")
    two = DE_CALL + '\n<tool_call>{"name": "image_rotate_tool", "arguments": {"angle": 90}}</tool_call>'
    turn = profile.parse(two)
    assert [c.name for c in turn.tool_calls] == ["image_rotate_tool"] and turn.error_kinds == ["ignored_calls"]
    [obs] = profile.act(turn, _context(), [])
    # counter-clockwise like its PIL rotate; a quarter turn is vagent's exact transpose (portrait now)
    assert obs.ok and obs.metadata["angle"] == 90 and obs.images[0].size[0] < obs.images[0].size[1]
    answered = profile.parse("<think>It reads STOP.</think> <answer>B</answer>" + DE_CALL)
    assert answered.answer == "B" and answered.actions == []
    assert profile.parse("<answer></answer>").answer is None  # `if answer:` in its env: empty does not end


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 10, 30, 200]}}</tool_call>',
         "Error: ZOOM IN ARGUMENTS ARE INVALID"),  # a side of 20 <= 30
        ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [5000, 10, 6000, 300]}}</tool_call>',
         "Error: ZOOM IN ARGUMENTS ARE INVALID"),  # entirely right of the image
        ('<tool_call>{"name": "magnify", "arguments": {}}</tool_call>', "Error: Unknown tool name: magnify"),
        ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox": [1, 2, 3, 4]}}</tool_call>', "Error: 'bbox_2d'"),
        ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}</tool_call>',
         'Error: Invalid tool call format: {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}. '
         "Error: Expecting ',' delimiter: line 1 column 70 (char 69)"),
    ],
)  # fmt: skip
def test_deepeyes_malformed_calls_become_its_error_observations(text, expected):
    profile = get_profile("deepeyes")
    [obs] = profile.act(profile.parse(text), _context(), [])
    assert not obs.ok and obs.text == expected
    assert profile.observation_message(obs).plain_text == expected  # a user turn "Error: ..."


def test_deepeyes_box_validation_clips_then_checks_sides_and_aspect():
    profile = get_profile("deepeyes")
    wide = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [-50, 0, 2000, 35]}}</tool_call>'
    [obs] = profile.act(profile.parse(wide), _context(), [])
    assert obs.ok and obs.metadata["box_original"] == [0, 0, 1000, 35]  # clipped to the image, as its env does
    assert de._deepeyes_box([0, 0, 3200, 31], (4000, 100)) is None  # aspect ratio 103 > 100
    assert de._deepeyes_box([0, 0, 3000, 31], (4000, 100)) == [0, 0, 3000, 31]


def test_deepeyes_observation_is_token_for_token_its_env_string(policy):
    """visual_toolbox_v2.execute: "\\n<|im_start|>user\\n<tool_response><image>{prompt}</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n", its leading newline closing the assistant turn."""
    task = Task(
        id="d", question="What does the sign say?", images=[ORIGINAL], scripted_turns=[DE_CALL, "<answer>A</answer>"]
    )
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="deepeyes")
    assert traj.stop_reason == "answered" and traj.answer == "A"
    assert traj.tool_results[0].metadata["box_original"] == [100, 50, 400, 300]
    grid = encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                           max_pixels=policy.pixel_budget[1]).image_grid_thw[1]  # fmt: skip
    env = ("\n<|im_start|>user\n" + "<tool_response>" + "<image>" + de.USER_PROMPT + "</tool_response>"
           + "<|im_end|>\n").replace("<image>", _vision(policy, grid))  # fmt: skip
    assert _between_turns(policy, traj) == env
    prompt = _decode(policy, traj.token_ids)
    assert prompt.startswith(
        "<|im_start|>system\n" + de.SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    )
    assert "<|vision_end|>What does the sign say?" + de.USER_PROMPT + "<|im_end|>" in prompt


# -- Pixel-Reasoner -------------------------------------------------------------------------------------------

PR_CALL = (
    "The image shows a street with a sign on the left. To read it I will zoom in.\n\n<tool_call>\n"
    '{"name": "crop_image_normalized", "arguments": {"bbox_2d": [0.2, 0.3, 0.5, 0.6], "target_image":1}}\n</tool_call>'
)


def test_pixel_reasoner_crop_is_padded_fractions_of_the_raw_image():
    profile = get_profile("pixel-reasoner")
    turn = profile.parse(PR_CALL)
    assert [profile.tool_for(c) for c in turn.tool_calls] == ["crop"]
    [obs] = profile.act(turn, _context(), [])
    # [0.2-0.1, 0.3-0.1, 0.5+0.1, 0.6+0.1] of 1000x800
    assert obs.ok and obs.metadata["box_original"] == [100, 160, 600, 560]
    h, w = smart_resize(400, 500, min_pixels=pr.CROP_MIN_PIXELS, max_pixels=pr.CROP_MAX_PIXELS)
    assert obs.text == f"\nHere is the cropped image (Image Size: {w}x{h}):" and obs.images[0].size == (w, h)
    # a box with numbers >= 1 is pixels of the target image, padded the same way (and the verl-tool name)
    pixels = PR_CALL.replace("[0.2, 0.3, 0.5, 0.6]", "[200, 240, 500, 480]").replace(
        "crop_image_normalized", "crop_image"
    )
    [same] = profile.act(profile.parse(pixels), _context(), [])
    assert same.metadata["box_original"] == [100, 160, 600, 560]


def test_pixel_reasoner_target_image_counts_returned_images_and_limits():
    profile = get_profile("pixel-reasoner")
    crop = Image.new("RGB", (400, 300), (10, 10, 10))
    context = _context(images=(ORIGINAL, crop))
    second = PR_CALL.replace('"target_image":1', '"target_image":2').replace(
        "[0.2, 0.3, 0.5, 0.6]", "[0.0, 0.0, 0.4, 0.4]"
    )
    [obs] = profile.act(profile.parse(second), context, [])
    assert obs.metadata["image_index"] == 1 and obs.metadata["box_original"] == [0, 0, 200, 150]  # 0.5 x 400, 0.5 x 300
    [bad] = profile.act(profile.parse(PR_CALL.replace('"target_image":1', '"target_image":3')), context, [])
    assert bad.text == ("\nExecution error:\nExecution Error: Incorrect `target_image` argument in "
                        "`crop_image_normalized` operation. You can only pick an image within [1,2]\n")  # fmt: skip
    tiny = PR_CALL.replace("[0.2, 0.3, 0.5, 0.6]", "[0.5, 0.5, 0.5, 0.5]")  # padding alone: 200x160, fine
    assert profile.act(profile.parse(tiny), context, [])[0].ok
    [small] = profile.act(profile.parse(tiny), _context(images=(Image.new("RGB", (100, 100)),)), [])
    assert small.text == "\nExecution error:\nCropped image is too small: 20x20\n"
    [frames] = profile.act(profile.parse(PR_CALL.replace(
        '"crop_image_normalized", "arguments": {"bbox_2d": [0.2, 0.3, 0.5, 0.6], "target_image":1}',
        '"select_frames", "arguments": {"target_frames": [1, 2]}')), context, [])  # fmt: skip
    assert "`select_frames` from **image** not **video**" in frames.text and frames.error


def test_pixel_reasoner_turn_end_decides_between_call_and_answer():
    profile = get_profile("pixel-reasoner")
    final = "The sign shows a sheep, so the answer is B.\n\n\\boxed{B}"
    assert profile.parse(final).answer == "B" and not profile.parse(final).actions
    assert profile.parse(PR_CALL + " trailing words").answer is None  # a call not at the end is not run
    assert not profile.parse(PR_CALL + " trailing words").actions
    [obs] = profile.act(profile.parse('<tool_call>\n{"name": "crop_image_normalized", "arguments": }\n</tool_call>'),
                        _context(), [])  # fmt: skip
    assert obs.text == "\nExecution error:\nExpecting value: line 2 column 48 (char 48)\n" and obs.error == "bad_json"


def test_pixel_reasoner_select_frames_on_a_video(tmp_path):
    profile = get_profile("pixel-reasoner")
    video = str(write_video(tmp_path / "v.mp4", frames=32, fps=8.0))
    messages = profile.prompt("What happens?", [], [video], [])
    frames = [p.image for p in messages[1].content if p.type == "image"]
    assert len(frames) == pr.VIDEO_FRAMES
    context = _context(images=frames, videos=[video])
    call = '<tool_call>\n{"name": "select_frames", "arguments": {"target_frames": [3, 9]}}\n</tool_call>'
    [obs] = profile.act(profile.parse(call), context, [])
    assert obs.images == [frames[2], frames[8]]
    w, h = frames[0].size
    assert obs.text == f"\nHere are the selected frames (Frame Size: {w}x{h}, Numbered 1 to 2):"
    nine = call.replace("[3, 9]", str(list(range(1, 10))))
    assert "(no more than 8 frames)" in profile.act(profile.parse(nine), context, [])[0].text


def test_pixel_reasoner_observation_renders_as_its_chat_template(policy):
    """experience_maker.py appends {"role": "user", "content": [text, image]} and re-applies the chat template."""
    task = Task(id="p", question="What animal is on the sign?", images=[ORIGINAL],
                scripted_turns=[PR_CALL, "So the answer is \\boxed{B}."])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="pixel-reasoner")
    assert traj.answer == "B" and traj.tool_results[0].metadata["box_original"] == [100, 160, 600, 560]
    crop = traj.messages[3].images[0]
    text = policy.processor.apply_chat_template(
        [{"role": "system", "content": "x"}, {"role": "user", "content": [
            {"type": "text", "text": f"\nHere is the cropped image (Image Size: {crop.width}x{crop.height}):"},
            {"type": "image"}]}], tokenize=False)  # fmt: skip
    grid = encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                           max_pixels=policy.pixel_budget[1]).image_grid_thw[1]  # fmt: skip
    expected = "\n" + text.split("<|im_end|>\n", 1)[1].replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                               _vision(policy, grid))  # fmt: skip
    assert _between_turns(policy, traj) == expected
    assert "What animal is on the sign?\n\n\n\nGuidelines: Understand" in _decode(policy, traj.token_ids)


def test_pixel_reasoner_call_budget_ends_the_episode(policy):
    """The agent's own budget (4 calls) and the rollout's max_tool_calls are one budget: the smaller one holds."""
    task = Task(id="p", question="Q?", images=[ORIGINAL], scripted_turns=[PR_CALL] * 6)
    for budget, calls in ((None, 4), (9, 4), (2, 2)):
        limits = RolloutLimits(max_turns=8, max_images=16, max_tool_calls=budget)
        traj = rollout(policy, task, limits, agent="pixel-reasoner")
        assert (traj.metrics["tool_calls"], traj.stop_reason, traj.metrics["turns"]) == (calls, "max_calls", calls + 1)


# -- LongVT ---------------------------------------------------------------------------------------------------


@pytest.fixture
def clip(tmp_path):
    return str(write_video(tmp_path / "clip.mp4", frames=40, fps=8.0, size=(96, 64)))  # 5 s


def _lv_call(path, start, end):
    return ("<think>The event happens early; I will look at 1-3 s closely.</think>\n<tool_call>\n"
            + json.dumps({"name": "crop_video", "arguments": {"video_path": path, "start_time": start, "end_time": end}})
            + "\n</tool_call>")  # fmt: skip


def test_longvt_crop_video_samples_one_frame_per_second_of_its_span(clip):
    profile = get_profile("longvt")
    turn = profile.parse(_lv_call(clip, 1, 3))
    assert [profile.tool_for(c) for c in turn.tool_calls] == ["sample_frames"]
    [obs] = profile.act(turn, _context(videos=[clip]), [])
    assert obs.ok and obs.metadata["span"] == [1.0, 3.0] and len(obs.images) == 2
    assert all(1.0 <= t <= 3.0 for t in obs.timestamps)
    assert obs.text == "Cropped 1s-3s, got 2 frames."
    assert all(w * h <= lv.FRAME_MAX_PIXELS for w, h in (im.size for im in obs.images))
    # the path may be named by file name; an end past the video is clipped, as single_inference.py does
    [tail] = profile.act(profile.parse(_lv_call("clip.mp4", 3.5, 9.0)), _context(videos=[clip]), [])
    assert tail.metadata["span"] == [3.5, 5.0] and tail.text == "Cropped 3.5s-9.0s, got 2 frames."


@pytest.mark.parametrize(
    ("start", "end", "path", "expected"),
    [
        (6, 8, None, "Error: start_time (6s) exceeds video duration (5.00s)"),
        (-1, 2, None, "Error: start_time must be non-negative, got -1"),
        (3, 2, None, "Error: end_time (2) must be greater than start_time (3)"),
        (1, 2, "/elsewhere/other.mp4", "Error: Video file not found: /elsewhere/other.mp4"),
    ],
)
def test_longvt_bad_spans_are_its_error_observations(clip, start, end, path, expected):
    profile = get_profile("longvt")
    [obs] = profile.act(profile.parse(_lv_call(path or clip, start, end)), _context(videos=[clip]), [])
    assert not obs.ok and obs.text == expected


def test_longvt_unreadable_calls_end_the_turn_and_answers_are_read():
    profile = get_profile("longvt")
    broken = profile.parse('<tool_call>{"name": "crop_video", "arguments": {"start_time": 1,</tool_call>')
    assert broken.actions == [] and broken.error_kinds == ["bad_json"]  # vLLM's Hermes parser: no calls
    assert profile.parse("<think>It is a dog.</think><answer>B</answer>").answer == "B"


def test_longvt_prompt_and_tool_turn_render_as_its_template(policy, clip):
    task = Task(id="v", question="When does it get bright?", videos=[clip],
                scripted_turns=[_lv_call(clip, 1, 3), "<answer>late</answer>"])  # fmt: skip
    traj = rollout(policy, task, RolloutLimits(max_turns=3, max_images=16), agent="longvt")
    assert traj.answer == "late" and traj.tool_results[0].metadata["span"] == [1.0, 3.0]
    text = _decode(policy, traj.token_ids)
    assert text.count("<|vision_start|>") == 5 + 2  # 5 s at 1 fps in the prompt, 2 frames returned
    assert f"When does it get bright? {lv.TOOL_PROMPT} The Video path for this video is: {clip}<|im_end|>" in text
    between = _between_turns(policy, traj)
    assert between.startswith("\n<|im_start|>user\n<tool_response>\n<|vision_start|>")
    assert between.endswith("<|vision_end|>Cropped 1s-3s, got 2 frames.</tool_response><|im_end|>\n")


# -- every profile: token-in/token-out and the CLI --------------------------------------------------------------


def _profile_task(name: str, clip: str) -> Task:
    calls = {"vagent": '<tool_call>{"name": "crop", "arguments": {"bbox": [10, 20, 120, 90]}}</tool_call>',
             "deepeyes": DE_CALL, "pixel-reasoner": PR_CALL, "longvt": _lv_call(clip, 0, 2),
             "deepeyesv2": '<tool_call>{"name": "search", "arguments": {"query": "who"}}</tool_call>',
             "tool-star": "<think> look it up </think> <search> who </search>",
             "openthinkimg": json.dumps({"thought": "", "actions": [
                 {"name": "DrawVerticalLineByX", "arguments": {"image": "img_1", "param": "x=50"}}]}),
             "visual-arft": "<think> look it up </think>\n<search> who </search>",
             "mini-o3": '<grounding>{"bbox_2d": [0.1, 0.2, 0.4, 0.5], "source": "original_image"}</grounding>',
             "chain-of-focus": '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 20, 120, 90]}}'
                               "</tool_call>",
             "thyme": "<code>\n```python\nprint(6 * 7)\n```\n</code>"}  # fmt: skip
    if name == "longvt":
        return Task(id=name, question="What?", videos=[clip], scripted_turns=[calls[name], None])
    tools = ["search"] if name == "visual-arft" else ["crop"]
    return Task(id=name, question="What?", images=[ORIGINAL], tools=tools, scripted_turns=[calls[name], None])


class _Hits:
    def search(self, query, k):
        from vagent.toolbox.search import SearchResult

        return [SearchResult("A title", "A snippet.", "https://x.org")]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_multi_turn_rollout_reencodes_to_its_ids_under_every_profile(policy, clip, name):
    """Scripted call, then sampled turns: the one encoder (told the profile) gives back the engine's ids and mask."""
    torch.manual_seed(0)
    limits = RolloutLimits(max_turns=3, max_new_tokens=12, temperature=1.0, max_images=16)
    for traj in run(
        policy,
        [_profile_task(name, clip)],
        n_samples=2,
        limits=limits,
        agent=name,
        services=ToolServices(search=_Hits(), sandbox=Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)),
    ):
        assert traj.metrics["tool_calls"] == 1 and sum(traj.loss_mask) > 0
        assert not any(r.error for r in traj.tool_results), traj.tool_results
        enc = encode_messages(traj.messages, policy.processor, min_pixels=policy.pixel_budget[0],
                              max_pixels=policy.pixel_budget[1], factor=policy.image_factor,
                              forced_spans=get_profile(name).forced_spans)  # fmt: skip
        assert enc.input_ids.tolist() == traj.token_ids and enc.loss_mask.tolist() == traj.loss_mask
        assert len(enc.image_grid_thw) == len(traj.images)


def test_tools_parse_names_the_vagent_tool_of_a_native_call(monkeypatch, capsys):
    import io

    from vagent.cli import main

    lines = [{"text": DE_CALL}, {"text": "<answer>C</answer>"}]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(json.dumps(x) for x in lines)))
    assert main(["tools", "parse", "--agent", "deepeyes"]) == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["tool_calls"] == [{"name": "crop", "native": "image_zoom_in_tool",
                                    "arguments": {"bbox_2d": [100, 50, 400, 300], "label": "the sign"}}]  # fmt: skip
    assert second["answer"] == "C" and second["tool_calls"] == [] and second["error_kinds"] == []
    with pytest.raises(SystemExit):
        main(["tools", "parse", "--agent", "nope"])


def test_rewards_read_a_native_call_as_the_vagent_tool_it_ran(policy):
    """Grounding rewards look for crop/zoom and video tools by vagent's names: a DeepEyes zoom must count as a crop
    (``ToolResult.name``), with the agent's own name kept beside it (``native``)."""
    from vagent.data import Evidence, Row
    from vagent.rewards import REWARDS

    task = Task(id="d", question="q", images=[ORIGINAL], scripted_turns=[DE_CALL, "<answer>A</answer>"])
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="deepeyes")
    assert (traj.tool_results[0].name, traj.tool_results[0].native) == ("crop", "image_zoom_in_tool")
    row = Row(id="d", question="q", answer="A", answer_type="exact", evidence=Evidence(boxes=[[100, 50, 400, 300]]))
    assert REWARDS["crop_iou"]([traj], [row]) == [1.0]  # the zoom's box is the evidence box

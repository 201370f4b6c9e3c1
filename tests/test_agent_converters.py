"""DeepEyes and Pixel-Reasoner converters on hand-written records in each agent's own data layout: the rows load,
and a converted gold trajectory encodes to exactly the tokens the engine produces for the same turns under
that agent's profile (so SFT cold-starts on the protocol the policy then runs)."""

from __future__ import annotations

import io

from PIL import Image

from data_pipelines.convert import deepeyes as de_convert
from data_pipelines.convert import pixel_reasoner as pr_convert
from tests.test_agents import DE_CALL, PR_CALL
from vagent.agents import deepeyes, pixel_reasoner
from vagent.data import load_rows
from vagent.data.encode import encode_messages
from vagent.media import smart_resize
from vagent.rollout import RolloutLimits, Task, rollout
from vagent.toolbox import TOOLS
from vagent.training.data import gold_conversation

IMAGE = Image.new("RGB", (1000, 800), (90, 140, 200))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _encode(policy, messages, agent):
    from vagent.agents import get_profile

    return encode_messages(messages, policy.processor, min_pixels=policy.pixel_budget[0],
                           max_pixels=policy.pixel_budget[1], forced_spans=get_profile(agent).forced_spans)  # fmt: skip


def test_deepeyes_records_become_rows_and_gold_trajectories_in_its_protocol(tmp_path, policy):
    crop = IMAGE.crop((100, 50, 400, 300))
    question = "What does the sign say?"
    chat = [{"role": "system", "content": deepeyes.SYSTEM_PROMPT},
            {"role": "user", "content": "<image>" + question + deepeyes.USER_PROMPT}]  # fmt: skip
    response = [{"role": "assistant", "content": DE_CALL},
                {"role": "user", "content": "<tool_response><image>" + deepeyes.USER_PROMPT + "</tool_response>"},
                {"role": "assistant", "content": "<think>It says STOP.</think> <answer>STOP</answer>"}]  # fmt: skip
    records = [
        {"data_source": "vstar", "prompt": chat, "response": response, "env_name": "visual_toolbox_v2",
         "images": [{"bytes": _png(IMAGE), "path": "a.png"}, {"bytes": _png(crop), "path": "crop.png"}],
         "reward_model": {"ground_truth": "STOP", "style": "model"}, "extra_info": {"index": 7}},
        {"data_source": "vstar", "prompt": chat, "images": [{"bytes": _png(IMAGE), "path": "a.png"}],
         "reward_model": {"ground_truth": "B"}},  # an RL prompt: a row without a trajectory
        {"prompt": chat, "images": [], "reward_model": {"ground_truth": "x"}},  # a marker without its image
        {"prompt": chat, "images": [{"bytes": _png(IMAGE)}]},  # no answer
    ]  # fmt: skip
    rows, skipped = de_convert.convert(records, tmp_path, tmp_path / "out" / "images")
    assert [r.id for r in rows] == ["7", "1"] and len(skipped) == 2
    assert "more <image> markers than images" in skipped[0] and "ground_truth" in skipped[1]
    written = load_rows(de_convert.write_rows(rows, tmp_path / "out" / "rows.jsonl"), known_tools=TOOLS)
    row = written[0]
    assert row.question == question and row.answer == "STOP" and row.messages[3].content[1].type == "image"
    assert written[1].messages is None and written[1].source == "deepeyes:vstar"
    # the gold trajectory is token for token what the engine makes of the same turns under --agent deepeyes
    gold = _encode(policy, gold_conversation(row, [], "deepeyes"), "deepeyes")
    task = Task(id="7", question=question, images=[IMAGE], scripted_turns=[r["content"] for r in response[::2]])
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="deepeyes")
    assert gold.input_ids.tolist() == traj.token_ids
    assert gold.image_grid_thw.tolist() == _encode(policy, traj.messages, "deepeyes").image_grid_thw.tolist()
    assert sum(gold.loss_mask.tolist()) > 0  # the assistant turns are trained on


def test_pixel_reasoner_records_become_rows_with_their_conversation(tmp_path, policy):
    IMAGE.save(tmp_path / "a.png")
    crop_path = tmp_path / "crop.png"
    h, w = smart_resize(400, 500, min_pixels=pixel_reasoner.CROP_MIN_PIXELS, max_pixels=pixel_reasoner.CROP_MAX_PIXELS)
    IMAGE.crop((100, 160, 600, 560)).resize((w, h)).save(crop_path)
    question = "What animal is on the sign?"
    text = question + pixel_reasoner.GUIDELINES
    record = {"qid": "pr-1", "message_list": [[
        {"role": "system", "content": [{"type": "text", "text": pixel_reasoner.SYSTEM_PROMPT}]},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": text}]},
        {"role": "assistant", "content": [{"type": "text", "text": PR_CALL}]},
        {"role": "user", "content": [{"type": "text", "text": f"\nHere is the cropped image (Image Size: {w}x{h}):"},
                                     {"type": "image", "image": "crop.png"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is a sheep.\n\n\\boxed{B}"}]}]]}  # fmt: skip
    bad = {"qid": "pr-2", "message_list": [{"role": "user", "content": [{"type": "text", "text": "Q?"}]}]}
    rows, skipped = pr_convert.convert([record, bad], tmp_path)
    assert [r.id for r in rows] == ["pr-1"] and "no assistant turn" in skipped[0]
    row = load_rows(pr_convert.write_rows(rows, tmp_path / "rows.jsonl"), known_tools=TOOLS)[0]
    assert row.question == question and row.answer == "B" and len(row.images) == 1
    gold = _encode(policy, gold_conversation(row, [], "pixel-reasoner"), "pixel-reasoner")
    task = Task(id="pr-1", question=question, images=[IMAGE], scripted_turns=[PR_CALL, "It is a sheep.\n\n\\boxed{B}"])
    traj = rollout(policy, task, RolloutLimits(max_turns=3), agent="pixel-reasoner")
    assert traj.answer == "B" and gold.input_ids.tolist() == traj.token_ids

import torch
from PIL import Image

from vagent.chat import observation_content, system_prompt
from vagent.media import resize_to_budget
from vagent.rollout import RolloutLimits, Task, rollout, run
from vagent.toolbox import tool_schemas

IMAGE = Image.new("RGB", (700, 500), (200, 200, 200))
CROP = (
    '<think>look closer</think>\n<tool_call>\n{"name": "crop", "arguments": {"bbox": [10, 20, 120, 90]}}\n</tool_call>'
)


def test_scripted_episode_tokens_equal_the_chat_template_rendering(policy):
    """Segment-by-segment tokenization must give exactly what rendering the whole conversation gives."""
    task = Task(id="t", question="What is here?", images=[IMAGE], scripted_turns=[CROP, "<answer>grey</answer>"])
    traj = rollout(policy, task, RolloutLimits(max_turns=4))
    assert traj.stop_reason == "answered" and traj.answer == "grey"
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sum(traj.loss_mask) == 0  # nothing was sampled
    budget = policy.pixel_budget
    crop = traj.messages[3].images[0]
    shown = [resize_to_budget(img, min_pixels=budget[0], max_pixels=budget[1]) for img in (IMAGE, crop)]
    tool_msg = {"role": "tool", "content": observation_content(_obs_of(traj))}
    conversation = [
        {"role": "system", "content": system_prompt(tool_schemas(["crop"]))},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is here?"}]},
        {"role": "assistant", "content": CROP},
        tool_msg,
        {"role": "assistant", "content": "<answer>grey</answer>"},
    ]
    text = policy.processor.apply_chat_template(conversation, tokenize=False)
    expected = policy.processor(text=[text], images=shown, return_tensors="pt")["input_ids"][0].tolist()
    assert traj.token_ids == expected


def _obs_of(traj):
    from vagent.types import Observation

    tool = traj.messages[3]
    return Observation(text=tool.plain_text, images=[p.image for p in tool.content if p.type == "image"])


def test_sampled_tokens_are_masked_one_and_tool_images_are_tokenized(policy):
    torch.manual_seed(0)
    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP])
    traj = rollout(policy, task, RolloutLimits(max_turns=2, max_new_tokens=16))
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["sampled_tokens"] == sum(traj.loss_mask) > 0
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
    # sampled tokens have real log-probs, forced tokens 0
    assert all(lp < 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 1)
    assert all(lp == 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)
    # the sampled span is the last assistant turn's content, followed only by forced closing tokens
    first = traj.loss_mask.index(1)
    assert policy.tokenizer.decode(traj.token_ids[:first]).endswith("<|im_start|>assistant\n")
    # image placeholders for both images: prompt image and the crop the tool returned
    image_pad = policy.model.config.image_token_id
    assert traj.token_ids.count(image_pad) > 0 and len(traj.images) == 2
    assert traj.stop_reason in ("no_action", "max_tokens", "max_turns", "answered")


def test_bad_tool_calls_become_observations_and_the_episode_goes_on(policy):
    bad = '<tool_call>{"name": "crop", "arguments": {"bbox": [9999, 9999, 10000, 10000]}}</tool_call>'
    unknown = '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'
    garbled = "<tool_call>crop the top left</tool_call>"
    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[bad, unknown, garbled, "<answer>x</answer>"])
    traj = rollout(policy, task, RolloutLimits(max_turns=5))
    assert traj.stop_reason == "answered"
    assert traj.metrics["tool_error/bad_box"] == 1 and traj.metrics["tool_error/unknown_tool"] == 1
    assert traj.metrics["tool_error/bad_json"] == 1 and traj.metrics["parse_error/bad_json"] == 1
    assert traj.messages[3].plain_text.startswith("Error:") and "outside the image" in traj.messages[3].plain_text
    assert "not valid JSON" in traj.messages[7].plain_text


def test_limits_are_recorded_as_stop_reasons(policy):
    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP, CROP, CROP])
    assert rollout(policy, task, RolloutLimits(max_turns=2)).stop_reason == "max_turns"
    assert rollout(policy, task, RolloutLimits(max_turns=5, max_images=2)).stop_reason == "max_images"
    assert rollout(policy, task, RolloutLimits(max_turns=5, max_total_tokens=50)).stop_reason == "max_tokens"


def test_run_groups_samples_by_task(policy):
    tasks = [Task(id=f"t{i}", question="Q?", images=[IMAGE], scripted_turns=["<answer>a</answer>"]) for i in range(2)]
    out = run(policy, tasks, n_samples=2, limits=RolloutLimits(max_turns=1))
    assert [t.task_id for t in out] == ["t0", "t0", "t1", "t1"]


def test_turn_cut_by_its_token_budget_is_max_tokens(policy):
    torch.manual_seed(0)
    task = Task(id="t", question="Q?", images=[IMAGE])
    traj = rollout(policy, task, RolloutLimits(max_turns=1, max_new_tokens=3, temperature=1.0))
    # three random tokens cannot hold a closed tool call or answer; the turn is cut by the budget
    assert traj.metrics["sampled_tokens"] == 3 and traj.stop_reason in ("max_tokens", "max_turns")
    assert traj.stop_reason == "max_tokens" or traj.messages[-1].tool_calls


def test_rollout_with_a_qwen3_vl_policy_uses_its_32_pixel_grid(tmp_path):
    from vagent.model import load_policy
    from vagent.tiny_model import build_tiny_checkpoint

    policy = load_policy(build_tiny_checkpoint(tmp_path / "q3", family="qwen3_vl", size="nano", min_pixels=32 * 32 * 4))
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [100, 100, 400, 400]}}</tool_call>'  # 0-1000 grid
    traj = rollout(policy, Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[crop, "<answer>a</answer>"]),
                   RolloutLimits(max_turns=3))  # fmt: skip
    assert traj.stop_reason == "answered" and not any(k.startswith("tool_error") for k in traj.metrics)
    out = traj.messages[3].images[0]
    assert out.width % 32 == 0 and out.height % 32 == 0

import dataclasses
import threading
import time

import pytest
import torch
from conftest import BOTH_VOCABS
from PIL import Image
from videos import write_video

from vagent.chat import observation_content, system_prompt
from vagent.data import Row
from vagent.media import resize_to_budget
from vagent.rewards import REWARDS
from vagent.rollout import HFBackend, RolloutLimits, Task, rollout, run
from vagent.toolbox import tool_schemas

IMAGE = Image.new("RGB", (700, 500), (200, 200, 200))
CROP = (
    '<think>look closer</think>\n<tool_call>\n{"name": "crop", "arguments": {"bbox": [10, 20, 120, 90]}}\n</tool_call>'
)


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
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
    # one record per call, in order, for the rewards: the unparseable one has no name
    assert [(r.name, r.error) for r in traj.tool_results] == [
        ("crop", "bad_box"), ("teleport", "unknown_tool"), (None, "bad_json")]  # fmt: skip


def test_an_answer_that_swallowed_tags_is_malformed_and_earns_half_the_format_reward(policy):
    swallowed = "<answer>up. The blue tile shows</think>\n<tool_call>\n<think>down</answer>"  # as GRPO wrote it
    trajs = [rollout(policy, Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[turn]), RolloutLimits())
             for turn in (swallowed, "<answer>down</answer>")]  # fmt: skip
    assert [t.stop_reason for t in trajs] == ["answered", "answered"] and trajs[0].tool_results == []
    assert trajs[0].metrics["parse_error/tag_in_answer"] == 1 and trajs[0].metrics["malformed_answer"] == 1
    assert trajs[1].metrics["malformed_answer"] == 0
    rows = [Row(id="r", question="Q?", answer="down", answer_type="exact")] * 2
    assert REWARDS["format"](trajs, rows) == [0.5, 1.0]


def test_limits_are_recorded_as_stop_reasons(policy):
    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP, CROP, CROP])
    assert rollout(policy, task, RolloutLimits(max_turns=2)).stop_reason == "max_turns"
    assert rollout(policy, task, RolloutLimits(max_turns=5, max_images=2)).stop_reason == "max_images"
    assert rollout(policy, task, RolloutLimits(max_turns=5, max_total_tokens=50)).stop_reason == "max_tokens"


def test_run_groups_samples_by_task(policy):
    tasks = [Task(id=f"t{i}", question="Q?", images=[IMAGE], scripted_turns=["<answer>a</answer>"]) for i in range(2)]
    out = run(policy, tasks, n_samples=2, limits=RolloutLimits(max_turns=1))
    assert [t.task_id for t in out] == ["t0", "t0", "t1", "t1"]


def test_the_samples_of_one_task_are_prefilled_once(policy):
    """A GRPO group's identical prompts run through the model once, and the system prompt the tasks share once
    for all of them; each sample still decodes on its own."""
    tasks = [
        Task(id="a", question="Q?", images=[IMAGE], tools=[]),
        Task(id="b", question="Other?", images=[IMAGE], tools=[]),
    ]
    limits = RolloutLimits(max_turns=1, max_new_tokens=6, temperature=0.0)
    backend = HFBackend(policy)
    group = run(policy, tasks, n_samples=3, limits=limits, backend=backend)
    alone = [run(policy, [task], limits=limits)[0] for task in tasks]
    prompts = [t.token_ids[: t.loss_mask.index(1)] for t in alone]  # the tokens before the first sampled one
    vision_start = policy.model.config.vision_start_token_id
    shared = prompts[0].index(vision_start)  # the two prompts differ only after their (identical) image
    assert prompts[0][:shared] == prompts[1][:shared] and shared >= 16
    assert backend.stats().prefill_tokens == sum(map(len, prompts)) - shared
    assert [t.token_ids for t in group] == [t.token_ids for t in alone for _ in range(3)]
    unshared = HFBackend(policy, share_prefix=False)
    assert [t.token_ids for t in run(policy, tasks, n_samples=3, limits=limits, backend=unshared)] \
        == [t.token_ids for t in group]  # fmt: skip
    assert unshared.stats().prefill_tokens == sum(map(len, prompts))


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
    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[crop, "<answer>a</answer>"])
    [traj] = run(policy, [task], limits=RolloutLimits(max_turns=3), keep_patches=True)
    assert traj.stop_reason == "answered" and not any(k.startswith("tool_error") for k in traj.metrics)
    out = traj.messages[3].images[0]
    assert out.width % 32 == 0 and out.height % 32 == 0
    from vagent.data.encode import encode_messages  # its 16-px patches encode as its processor expands them

    budget = dict(zip(("min_pixels", "max_pixels"), policy.pixel_budget, strict=True), factor=policy.image_factor)
    assert len(traj.patches) == 2  # the prompt's and the crop's, each on its own part
    assert encode_messages(traj.messages, policy.processor, **budget).input_ids.tolist() == traj.token_ids


# -- the batched engine: one encoder, cache reuse, concurrency ------------------------------------------

ZOOM = '<tool_call>{"name": "zoom_in", "arguments": {"bbox": [50, 40, 300, 200], "factor": 2}}</tool_call>'
TWO_IMAGES = [IMAGE, Image.new("RGB", (320, 640), (30, 90, 160))]


def _tasks():
    # multi-turn, multi-image: two prompt images, two scripted tool turns adding two more, then sampled turns
    return [
        Task(id="a", question="Where?", images=TWO_IMAGES, tools=["crop", "zoom_in"], scripted_turns=[CROP, ZOOM]),
        Task(id="b", question="What?", images=[IMAGE], scripted_turns=[CROP]),
        Task(id="c", question="Tell me.", images=[TWO_IMAGES[1]]),
    ]


def _limits(**kw):
    return RolloutLimits(**{"max_turns": 4, "max_new_tokens": 12, "temperature": 0.0, **kw})


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_the_one_encoder_gives_back_the_engine_ids_masks_and_images(policy):
    from vagent.data.encode import encode_messages

    torch.manual_seed(0)
    for traj in run(policy, _tasks(), n_samples=2, limits=_limits(temperature=1.0), batch_size=4):
        min_pixels, max_pixels = policy.pixel_budget
        enc = encode_messages(traj.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor, logprobs=traj.logprobs)  # fmt: skip
        assert enc.input_ids.tolist() == traj.token_ids
        assert enc.loss_mask.tolist() == traj.loss_mask and sum(traj.loss_mask) > 0
        assert len(enc.image_grid_thw) == len(traj.images)  # prompt images and every tool output
        pads = int((enc.input_ids == policy.model.config.image_token_id).sum())
        assert pads * 4 == int(enc.image_grid_thw.prod(-1).sum()) == enc.pixel_values.shape[0]


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_kept_patches_are_made_once_shared_by_a_group_and_encode_as_the_processor_does(policy):
    """With keep_patches each image's patches are made once: a group's samples hold the same prompt tensors, every
    turn request of a row carries the very tensors of its earlier images, and the encoder takes them by reference and
    gives what running the processor on the images again gives."""
    from vagent.data.encode import encode_messages

    torch.manual_seed(0)
    backend, requests = HFBackend(policy), []
    submit = backend.submit
    backend.submit = lambda request: (requests.append(request), submit(request))[1]
    out = run(policy, _tasks(), n_samples=3, limits=_limits(temperature=1.0), batch_size=4, backend=backend,
              keep_patches=True)  # fmt: skip
    storage = lambda p: p.pixel_values.untyped_storage().data_ptr()  # noqa: E731
    min_pixels, max_pixels = policy.pixel_budget
    for g, images in enumerate((2, 1, 1)):  # the tasks' prompt images
        group = out[3 * g : 3 * g + 3]
        assert len({tuple(storage(p) for p in t.patches[:images]) for t in group}) == 1
        assert all(
            a.pixel_values is b.pixel_values
            for t in group
            for a, b in zip(t.patches[:images], group[0].patches[:images], strict=True)
        )
    tool_outputs = [storage(p) for t in out for p in t.patches[len(t.frames) :]]
    assert len(tool_outputs) >= 3 * 3 and len(set(tool_outputs)) == len(tool_outputs)  # tasks a (2) and b (1) x 3
    for key, t in enumerate(out):  # every turn of the row sent the row's own tensors, none a copy
        turns = [r for r in requests if r.key == key]
        assert turns and len(turns[-1].pixel_values) == len(t.patches)
        assert all(
            a is p.pixel_values
            for r in turns
            for a, p in zip(r.pixel_values, t.patches[: len(r.pixel_values)], strict=True)
        )
    kw = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    for t in out:
        carried = encode_messages(t.messages, policy.processor, **kw)
        again = encode_messages(_without_patches(t.messages), policy.processor, **kw)  # the processor run again
        assert carried.input_ids.tolist() == again.input_ids.tolist() == t.token_ids
        assert torch.equal(carried.pixel_values, again.pixel_values)
        assert torch.equal(carried.image_grid_thw, again.image_grid_thw)
        assert all(a is p.pixel_values for a, p in zip(carried.image_patches, t.patches, strict=True))
    assert "patches" not in out[0].to_dict()
    assert not run(policy, _tasks()[1:2], limits=_limits())[0].patches  # eval, serve: the rows keep none
    group = out[3:6]  # task b: one prompt image, shared by the group's samples
    group[0].release_patches()  # its parts: the prompt's, which its group shares, and its own tool outputs
    assert not group[0].patches and all(len(t.patches) == len(t.images) - 1 for t in group[1:])


def test_a_backend_that_makes_its_own_patches_is_sent_images_and_grids_and_rolls_out_the_same(policy):
    """A backend with ``needs_pixels = False`` (vLLM, whose processor makes the patches) gets no pixels from the
    engine, only the model-sized images and the grids their sizes give: the grids and the ids are those the
    processor gives, so the same greedy episodes come out, tool outputs included. Under keep_patches (GRPO) the
    engine still makes the patches a trainer takes."""

    class OwnPatches(HFBackend):
        needs_pixels = False

        def submit(self, request):
            sent.append([p is not None for p in request.pixel_values])
            made = policy.processor.image_processor(images=request.images, return_tensors="pt")
            assert torch.equal(torch.cat(request.image_grid_thw), made["image_grid_thw"])
            patches = list(made["pixel_values"].split([int(g.prod()) for g in request.image_grid_thw]))
            super().submit(dataclasses.replace(request, pixel_values=patches))

    sent = []
    reference = run(policy, _tasks(), limits=_limits(), batch_size=3)
    own = run(policy, _tasks(), limits=_limits(), batch_size=3, backend=OwnPatches(policy))
    assert [t.token_ids for t in own] == [t.token_ids for t in reference]
    assert sum(len(t.tool_results) for t in own) >= 3  # the scripted crops and zoom: tool images in later turns
    assert sent and not any(any(made) for made in sent)  # the processor's pixel work was not done for it
    sent.clear()
    kept = run(policy, _tasks()[1:2], limits=_limits(), backend=OwnPatches(policy), keep_patches=True)
    assert kept[0].patches and all(all(made) for made in sent)  # a trainer takes them: made, and sent along


def _without_patches(messages):
    """The same conversation with no part carrying patches: the encoder then runs the processor on every image."""
    return [dataclasses.replace(m, content=[dataclasses.replace(p, patches=None) for p in m.content]) for m in messages]


def test_every_image_part_carries_the_patches_of_its_own_image_among_images_of_one_size(policy):
    """The engine hands each image's patches to the very part that shows it: with two prompt images and two zooms all
    seen at 224x224 (one grid, so ids and grids alike cannot tell them apart), each part's patches are the processor's
    of that part's own image, and the episode encodes to the pixels of the processor run on its images again."""
    from vagent.data.encode import encode_messages, encode_segment

    first = Image.radial_gradient("L").resize((224, 224)).convert("RGB")  # regions of different pixels
    second = Image.linear_gradient("L").resize((224, 224)).convert("RGB")
    zooms = [f'<tool_call>{{"name": "zoom_in", "arguments": {{"bbox": {box}, "factor": 2, "image_index": {i}}}}}'
             "</tool_call>" for box, i in (([0, 0, 112, 112], 0), ([112, 112, 224, 224], 1))]  # fmt: skip
    task = Task(id="s", question="Where?", images=[first, second], tools=["zoom_in"], scripted_turns=zooms)
    torch.manual_seed(0)
    out = run(policy, [task], n_samples=2, limits=_limits(max_turns=3, max_images=4), keep_patches=True)
    min_pixels, max_pixels = policy.pixel_budget
    kw = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor)
    for t in out:
        parts = [p for m in t.messages for p in m.content if p.type == "image"]
        assert len(parts) == 4 and all(p.image.size == (224, 224) for p in parts)
        assert not any(k.startswith("tool_error") for k in t.metrics)
        own = [encode_segment(policy.processor, policy.processor.image_token, [policy.model_view(p.image)])
               for p in parts]  # fmt: skip
        assert all(torch.equal(p.patches.pixel_values, o["pixel_values"]) for p, o in zip(parts, own, strict=True))
        assert not any(torch.equal(own[i]["pixel_values"], own[j]["pixel_values"])
                       for i in range(4) for j in range(i + 1, 4))  # fmt: skip
        carried = encode_messages(t.messages, policy.processor, **kw)
        again = encode_messages(_without_patches(t.messages), policy.processor, **kw)
        assert carried.input_ids.tolist() == again.input_ids.tolist() == t.token_ids
        assert torch.equal(carried.pixel_values, again.pixel_values)


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_recorded_logprobs_match_a_full_forward_over_the_whole_sequence(policy):
    """The cache, batching and multimodal RoPE positions are right iff a fresh full forward scores the
    sampled tokens exactly as the sampler did."""
    from vagent.data.encode import encode_messages
    from vagent.model import token_logprobs

    torch.manual_seed(1)
    trajectories = run(policy, _tasks(), n_samples=2, limits=_limits(temperature=1.0), batch_size=6)
    for traj in trajectories:
        min_pixels, max_pixels = policy.pixel_budget
        enc = encode_messages(traj.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
        ids = enc.input_ids[None]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": enc.pixel_values,
                 "image_grid_thw": enc.image_grid_thw, "mm_token_type_ids": enc.mm_token_type_ids[None]}  # fmt: skip
        with torch.no_grad():
            full = token_logprobs(policy.model, batch, suppress=policy.vision_placeholder_ids)[0]
        sampled = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert torch.allclose(full[sampled], torch.tensor(traj.logprobs)[sampled], atol=1e-4)


@pytest.mark.parametrize("policy", BOTH_VOCABS, indirect=True)
def test_greedy_with_cache_reuse_and_batching_equals_recomputing_every_turn(policy):
    reused = run(policy, _tasks(), limits=_limits(), batch_size=3)
    recomputed = run(policy, _tasks(), limits=_limits(), batch_size=1, backend=HFBackend(policy, reuse_cache=False))
    assert [t.token_ids for t in reused] == [t.token_ids for t in recomputed]
    assert all(t.metrics.get("sampled_tokens", 0) > 0 for t in reused)


def test_a_hanging_tool_is_cut_off_without_stalling_other_rows(policy, monkeypatch):
    import threading
    import types

    from vagent import toolbox
    from vagent.types import Observation

    release = threading.Event()  # the tool hangs until the test lets it go, after run() returned without it
    slow = types.ModuleType("slow")
    slow.NAME = "slow"
    slow.SCHEMA = {"name": "slow", "description": "hangs", "parameters": {"type": "object", "properties": {}}}
    slow.call = lambda arguments, context: release.wait(60) and Observation(text="late")
    monkeypatch.setitem(toolbox.TOOLS, "slow", slow)
    hang = Task(id="hang", question="Q?", images=[IMAGE], tools=["slow"],
                scripted_turns=['<tool_call>{"name": "slow", "arguments": {}}</tool_call>', "<answer>x</answer>"])  # fmt: skip
    quick = [
        Task(id=f"q{i}", question="Q?", images=[IMAGE], scripted_turns=[CROP, "<answer>y</answer>"]) for i in range(2)
    ]
    finished = []
    try:
        out = run(policy, [hang, *quick], limits=_limits(), batch_size=3, tool_timeout_s=0.5,
                  progress=lambda t: finished.append(t.task_id))  # fmt: skip
        assert not release.is_set()  # run() came back while the tool still hung
    finally:
        release.set()
    assert out[0].metrics["tool_error/timeout"] == 1 and out[0].stop_reason == "answered"
    assert "did not finish within 0.5 s" in out[0].messages[3].plain_text
    assert [t.stop_reason for t in out[1:]] == ["answered", "answered"]
    assert finished[-1] == "hang"  # the quick rows did not wait for it


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_tasks_name_their_videos_and_video_tools_run(policy, tmp_path, family):
    """Videos reach the model as the frames a video tool returns, each after its time as text (Qwen3-VL's processor
    would write its own ``<t seconds>`` only for a video input, which vagent never sends): the same on both
    families, encoded as the engine ran them (Qwen3-VL on its 32-pixel grid)."""
    if family == "qwen3_vl":
        from vagent.model import load_policy
        from vagent.tiny_model import build_tiny_checkpoint

        policy = load_policy(build_tiny_checkpoint(tmp_path / "q3", family=family, size="nano",
                                                   min_pixels=32 * 32 * 4))  # fmt: skip
    path = write_video(tmp_path / "clip.mp4", frames=30, fps=10.0, step=8)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    call = '<tool_call>{"name": "sample_frames", "arguments": {"start": 1, "end": 2, "num_frames": 2}}</tool_call>'
    task = Task(id="v", question="When does it get bright?", videos=[str(path), str(broken)],
                tools=["sample_frames"], scripted_turns=[call, "<answer>late</answer>"])  # fmt: skip
    traj = rollout(policy, task, _limits())
    assert traj.messages[1].plain_text.startswith("Video 0: 3.0 s long.\nVideo 1: unreadable.\n")
    frames = traj.messages[3]
    assert len(frames.images) == 2 and [p.timestamps for p in frames.content if p.type == "image"] == [[1.2], [1.7]]
    assert traj.stop_reason == "answered" and not any(k.startswith("tool_error") for k in traj.metrics)
    assert traj.tool_results[0].name == "sample_frames" and traj.tool_results[0].metadata["span"] == [1.0, 2.0]
    from vagent.data.encode import encode_messages

    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(traj.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                          factor=policy.image_factor)  # fmt: skip
    assert enc.input_ids.tolist() == traj.token_ids  # frame times are text parts of the tool turn, encoded alike


@pytest.mark.parametrize("calls", [1, 2])
def test_an_observation_that_would_overflow_the_cap_ends_the_episode_before_it(policy, calls):
    """The crop's tool turn would carry the episode past max_total_tokens: the episode stops at its cap, before the
    observation (never with part of its image placeholders), re-encodes to its ids, and counts the call. With two
    calls in the turn, a cap one token short of the second observation keeps neither (the turn's results go in
    whole or not at all)."""
    from vagent.data import encode_messages

    min_pixels, max_pixels = policy.pixel_budget

    def ids(messages):
        return encode_messages(messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                               factor=policy.image_factor).input_ids.tolist()  # fmt: skip

    task = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP * calls, "<answer>grey</answer>"])
    whole = rollout(policy, task, RolloutLimits(max_turns=3, max_total_tokens=4096))
    tool_turns = [i for i, m in enumerate(whole.messages) if m.role == "tool"]
    assert len(tool_turns) == calls
    cap = len(ids(whole.messages[: tool_turns[-1] + 1])) - 1  # one token short of the turn's last observation
    cut = rollout(policy, task, RolloutLimits(max_turns=3, max_total_tokens=cap))
    assert cut.stop_reason == "max_tokens" and len(cut.token_ids) <= cap
    assert [m.role for m in cut.messages] == [m.role for m in whole.messages[: tool_turns[0]]]
    assert cut.metrics["tool_calls"] == calls
    assert ids(cut.messages) == cut.token_ids


@pytest.mark.parametrize("agent", ["vagent", "deepeyesv2"])  # DeepEyesV2 forces "<think>" at each later turn
def test_no_episode_passes_max_total_tokens_whatever_the_cap(policy, agent):
    """Sampled turns cut by length get "<|im_end|>\\n" added, and a profile may force an opening: the turn's budget
    leaves room for both, so at every cap the episode ends at or below it (before, one to three tokens over)."""
    task = Task(id="t", question="Where is the cat?", images=[IMAGE], scripted_turns=[None, CROP])
    prompt = len(rollout(policy, task, RolloutLimits(max_turns=1, max_new_tokens=1), agent=agent).token_ids) - 3
    for cap in range(prompt, prompt + 60, 7):
        torch.manual_seed(cap)
        out = run(policy, [task], 3, RolloutLimits(max_turns=3, max_new_tokens=64, max_total_tokens=cap), agent=agent)
        assert all(len(t.token_ids) <= max(cap, prompt + 3) for t in out), (cap, [len(t.token_ids) for t in out])


# -- the call budget, concurrent calls, the frame budget ------------------------------------------------------


def test_the_call_budget_counts_every_call_across_turns(policy):
    """max_tool_calls=3: with one call a turn the 4th call attempt ends the episode (stop reason max_calls, its call
    never runs); two calls in one turn count two, and a turn that would pass the budget runs none of its calls."""
    limits = RolloutLimits(max_turns=8, max_tool_calls=3)
    one_a_turn = rollout(policy, Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP] * 5), limits)
    assert (one_a_turn.stop_reason, one_a_turn.metrics["tool_calls"], one_a_turn.metrics["turns"]) == (
        "max_calls",
        3,
        4,
    )
    assert [m.role for m in one_a_turn.messages].count("tool") == 3 and one_a_turn.messages[-1].role == "assistant"
    two_then_one = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP * 2, CROP, CROP])
    traj = rollout(policy, two_then_one, limits)
    assert (traj.stop_reason, traj.metrics["tool_calls"], traj.metrics["turns"]) == ("max_calls", 3, 3)
    two_twice = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP * 2, CROP * 2])
    traj = rollout(policy, two_twice, limits)
    assert (traj.stop_reason, traj.metrics["tool_calls"], len(traj.tool_results)) == ("max_calls", 2, 2)
    answered = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP * 3, "<answer>a</answer>"])
    assert rollout(policy, answered, limits).stop_reason == "answered"  # spending the budget exactly is allowed


def _timed_tool(monkeypatch):
    """A test tool ``wait``: sleeps ``seconds``, then returns an image of colour ``shade`` and how many images its
    context held (what the call could see)."""
    import types

    from vagent import toolbox
    from vagent.types import Observation

    def call(arguments, context):
        time.sleep(arguments["seconds"])
        shade = arguments["shade"]
        return Observation(text=f"waited {arguments['seconds']} s", images=[Image.new("RGB", (56, 56), (shade,) * 3)],
                           metadata={"seen": len(context.images), "shade": shade})  # fmt: skip

    tool = types.ModuleType("wait")
    tool.NAME, tool.call = "wait", call
    properties = {"seconds": {"type": "number"}, "shade": {"type": "integer"}}
    tool.SCHEMA = {"name": "wait", "description": "sleeps", "parameters": {"type": "object", "properties": properties}}
    monkeypatch.setitem(toolbox.TOOLS, "wait", tool)


def _hanging_tool(monkeypatch) -> threading.Event:
    """A test tool ``hang``: its calls hang until the returned event is set (at most 60 s)."""
    import types

    from vagent import toolbox
    from vagent.types import Observation

    release = threading.Event()
    hang = types.ModuleType("hang")
    hang.NAME, hang.call = "hang", lambda arguments, context: release.wait(60) and Observation(text="late")
    hang.SCHEMA = {"name": "hang", "description": "hangs", "parameters": {"type": "object", "properties": {}}}
    monkeypatch.setitem(toolbox.TOOLS, "hang", hang)
    return release


def _wait(seconds: float, shade: int) -> str:
    return f'<tool_call>{{"name": "wait", "arguments": {{"seconds": {seconds}, "shade": {shade}}}}}</tool_call>'


def test_the_calls_of_one_turn_run_concurrently_and_come_back_in_call_order(policy, monkeypatch):
    """Two 1.0 s calls and an instant one in one turn: the turn waits about one slow call (under 1.7 s, where in
    sequence it takes 2.0 s: a wide margin on shared cores), and the results come back in call order though the
    instant one finished first, labelled with the indices their images get, every call saw only the images from
    before the turn, and the images are appended in call order (the one encoder agrees). A pool of one thread (fewer
    threads than the turn has calls) runs them one after another and does not deadlock."""
    from vagent.data import encode_messages

    _timed_tool(monkeypatch)
    turn = _wait(1.0, 10) + _wait(1.0, 20) + _wait(0, 30)
    task = Task(id="t", question="Q?", images=[IMAGE], tools=["wait"], scripted_turns=[turn, "<answer>a</answer>"])
    for workers in (8, 1):
        [traj] = run(policy, [task], limits=_limits(), tool_workers=workers)
        assert traj.stop_reason == "answered" and traj.metrics["tool_calls"] == 3
        assert [r.metadata["shade"] for r in traj.tool_results] == [10, 20, 30]
        assert [r.metadata["seen"] for r in traj.tool_results] == [1, 1, 1]
        tools = [m.plain_text for m in traj.messages if m.role == "tool"]
        assert [t.split(" s")[0] for t in tools] == ["Image 1: waited 1.0", "Image 2: waited 1.0", "Image 3: waited 0"]
        assert [img.getpixel((0, 0))[0] for img in traj.images[1:]] == [10, 20, 30]
        min_pixels, max_pixels = policy.pixel_budget
        enc = encode_messages(traj.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                              factor=policy.image_factor)  # fmt: skip
        assert enc.input_ids.tolist() == traj.token_ids
        if workers > 1:
            assert 1.0 <= traj.metrics["tool_wait_s"] < 1.7, traj.metrics["tool_wait_s"]
        else:
            assert traj.metrics["tool_wait_s"] >= 2.0 and traj.metrics["tool_queue_s"] >= 1.0 + 2.0  # 2nd 1 s, 3rd 2 s


@pytest.mark.parametrize("workers", [8, 1])
def test_a_hanging_call_times_out_alone_its_turns_other_calls_keep_their_results(policy, monkeypatch, workers):
    """A turn with a hung call and a quick one: the hung one times out and the quick one keeps its result, also with
    one worker, where the quick call waits behind the hung one and runs on the thread that takes its place."""
    _timed_tool(monkeypatch)
    release = _hanging_tool(monkeypatch)
    turn = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>' + _wait(0, 40)
    task = Task(
        id="t", question="Q?", images=[IMAGE], tools=["hang", "wait"], scripted_turns=[turn, "<answer>a</answer>"]
    )
    try:
        [traj] = run(policy, [task], limits=_limits(), tool_timeout_s=0.5, tool_workers=workers)
    finally:
        release.set()
    assert traj.stop_reason == "answered" and [r.error for r in traj.tool_results] == ["timeout", None]
    tools = [m for m in traj.messages if m.role == "tool"]
    assert "did not finish within 0.5 s" in tools[0].plain_text and tools[1].plain_text.startswith(
        "Image 1: waited 0 s"
    )
    assert len(traj.images) == 2 and traj.images[1].getpixel((0, 0))[0] == 40


def test_the_frame_budget_draw_lies_in_its_range_is_fixed_per_prompt_and_seed_and_varies_across_prompts():
    from vagent.rollout import first_view_frames

    draws = {f"row-{i}": first_view_frames(f"row-{i}", (2, 8), seed=0) for i in range(40)}
    assert all(2 <= n <= 8 for n in draws.values()) and len(set(draws.values())) >= 4
    assert all(first_view_frames(key, [2, 8], seed=0) == n for key, n in draws.items())  # a config gives a list
    assert any(first_view_frames(key, (2, 8), seed=1) != n for key, n in draws.items())
    assert first_view_frames("row-0", (5, 5), seed=3) == 5


def test_a_frame_budget_shows_the_drawn_frames_in_the_first_view_the_same_for_a_group(policy, tmp_path):
    """vagent's profile shows a video as its name only; under rollout.frame_budget its prompt shows the drawn
    number of frames (with their times), the same for both samples of a task, and prompts differ across tasks."""
    from vagent.data import encode_messages
    from vagent.rollout import first_view_frames

    path = str(write_video(tmp_path / "clip.mp4", frames=40, fps=10.0))
    budget = (2, 6)
    ids = ["v0", "v1", "v2", "v3", "v4", "v5"]
    two = [next(i for i in ids if first_view_frames(i, budget) == n) for n in sorted({first_view_frames(i, budget)
                                                                                       for i in ids})[:2]]  # fmt: skip
    tasks = [Task(id=i, question="When?", videos=[path], tools=["sample_frames"], scripted_turns=["<answer>a</answer>"])
             for i in two]  # fmt: skip
    plain = run(policy, tasks[:1], limits=_limits())[0]
    assert plain.messages[1].images == [] and "Video 0: 4.0 s long.\n" in plain.messages[1].plain_text
    out = run(policy, tasks, n_samples=2, limits=_limits(frame_budget=budget))
    shown = [len(t.messages[1].images) for t in out]
    assert shown == [first_view_frames(i, budget) for i in two for _ in range(2)] and shown[0] != shown[2]
    assert out[0].token_ids == out[1].token_ids and out[0].token_ids != out[2].token_ids
    user = out[0].messages[1].content
    stamps = [p.timestamps[0] for p in user if p.type == "image"]
    assert stamps == sorted(stamps) and 0 < stamps[0] and stamps[-1] < 4.0
    assert [p.text for p in user if p.type == "text"][1] == f"t={stamps[0]:.2f}s"
    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(out[2].messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                          factor=policy.image_factor)  # fmt: skip
    assert enc.input_ids.tolist() == out[2].token_ids


def test_the_frame_budget_sets_longvts_prompt_frames_and_is_refused_by_pixel_reasoner(tmp_path):
    from vagent.agents import get_profile

    path = str(write_video(tmp_path / "clip.mp4", frames=40, fps=10.0))
    longvt = get_profile("longvt")
    assert len(longvt.prompt("Q?", [], [path], ["sample_frames"])[-1].images) == 4  # 1 fps over 4 s
    assert len(longvt.prompt("Q?", [], [path], ["sample_frames"], frames=7)[-1].images) == 7
    pixel_reasoner = get_profile("pixel-reasoner")
    assert len(pixel_reasoner.prompt("Q?", [], [path], [])[-1].images) == 16
    with pytest.raises(ValueError, match="select_frames only re-shows"):
        pixel_reasoner.prompt("Q?", [], [path], [], frames=7)


# -- image labels, queued calls, the image cap ---------------------------------------------------------------


def _crop(bbox, image_index=0) -> str:
    return f'<tool_call>{{"name": "crop", "arguments": {{"bbox": {list(bbox)}, "image_index": {image_index}}}}}</tool_call>'


def test_two_crops_of_one_turn_are_labelled_with_the_indices_they_get_and_a_later_index_means_that_image(policy):
    """A turn crops the red left half then the blue right half (and makes a text-only call between them): the tool
    turns say "Image 1:" and "Image 2:" (each call saw one image, so each alone would have said "Image 1"), and the
    next turn's crop of image 2 cuts the blue crop, the image labelled "Image 2"; the trajectory re-encodes."""
    from vagent.data import encode_messages

    halves = Image.new("RGB", (448, 224), (200, 30, 30))
    halves.paste((30, 30, 200), (224, 0, 448, 224))
    w, h = policy.model_view(halves).size
    left, right = _crop([4, 4, w // 2 - 4, h - 4]), _crop([w // 2 + 4, 4, w - 4, h - 4])
    unknown = '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'
    task = Task(id="t", question="Q?", images=[halves], scripted_turns=[left + unknown + right, _crop([2, 2, 30, 30], 2),
                                                                        "<answer>blue</answer>"])  # fmt: skip
    traj = rollout(policy, task, _limits())
    assert traj.stop_reason == "answered" and [r.error for r in traj.tool_results] == [None, "unknown_tool", None, None]
    tools = [m for m in traj.messages if m.role == "tool"]
    labels = [m.plain_text.split(":")[0] for m in tools]
    assert labels == ["Image 1", "Error", "Image 2", "Image 3"], [m.plain_text for m in tools]
    colours = [m.images[0].getpixel((2, 2)) for m in (tools[0], tools[2], tools[3])]
    assert colours[0][0] > 150 and colours[1][2] > 150  # Image 1 red, Image 2 blue
    assert traj.tool_results[3].metadata["image_index"] == 2 and colours[2][2] > 150  # image 2 is the blue one
    assert "of image 2 " in tools[3].plain_text
    min_pixels, max_pixels = policy.pixel_budget
    enc = encode_messages(traj.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                          factor=policy.image_factor)  # fmt: skip
    assert enc.input_ids.tolist() == traj.token_ids


def test_time_queued_for_a_worker_is_not_a_timeout(policy, monkeypatch):
    """One worker, 0.5 s calls, a 1.5 s timeout: a row with two calls and three rows with one (2.5 s of calls in
    all) all get their results, though the last calls start about 2 s after their turns ended; the wait for a worker is
    counted in tool_queue_s."""
    _timed_tool(monkeypatch)
    tasks = [Task(id=f"r{i}", question="Q?", images=[IMAGE], tools=["wait"],
                  scripted_turns=[_wait(0.5, 10) * (2 if i == 0 else 1), "<answer>a</answer>"]) for i in range(4)]  # fmt: skip
    out = run(policy, tasks, limits=_limits(), batch_size=4, tool_workers=1, tool_timeout_s=1.5)
    assert [[r.error for r in t.tool_results] for t in out] == [[None, None], [None], [None], [None]]
    assert all(t.stop_reason == "answered" for t in out)
    queued = sorted(t.metrics["tool_queue_s"] for t in out)
    assert queued[-1] >= 1.0 and sum(queued) >= 2.0, queued  # calls queue one after another behind one worker


def test_a_hung_call_gives_up_its_worker_so_queued_calls_still_run(policy, monkeypatch):
    """One worker: a row's call hangs and another row's call waits behind it. The hung call is abandoned at its
    timeout and a new thread takes its place, so the queued call runs (and is no timeout) while the hung thread
    still hangs."""
    _timed_tool(monkeypatch)
    release = _hanging_tool(monkeypatch)
    stuck = Task(id="stuck", question="Q?", images=[IMAGE], tools=["hang"],
                 scripted_turns=['<tool_call>{"name": "hang", "arguments": {}}</tool_call>', "<answer>a</answer>"])  # fmt: skip
    behind = Task(id="behind", question="Q?", images=[IMAGE], tools=["wait"],
                  scripted_turns=[_wait(0, 50), "<answer>b</answer>"])  # fmt: skip
    try:
        out = run(policy, [stuck, behind], limits=_limits(), tool_workers=1, tool_timeout_s=0.5)
        assert not release.is_set()
    finally:
        release.set()
    assert [[r.error for r in t.tool_results] for t in out] == [["timeout"], [None]]
    assert [t.stop_reason for t in out] == ["answered", "answered"]


def test_the_image_cap_counts_only_returned_images_and_every_call_of_the_turn(policy):
    """A prompt already over max_images: a text-only call never trips the cap, an image call does. At the cap every
    call of the turn ran and is counted (metrics and tool_results), though only those under the cap are shown."""
    unknown = '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'
    crowded = Task(id="t", question="Q?", images=[IMAGE] * 3, scripted_turns=[unknown, "<answer>a</answer>"])
    traj = rollout(policy, crowded, _limits(max_images=2))
    assert traj.stop_reason == "answered" and traj.metrics["tool_calls"] == 1
    three = Task(id="t", question="Q?", images=[IMAGE], scripted_turns=[CROP * 3, "<answer>a</answer>"])
    traj = rollout(policy, three, _limits(max_images=2))
    assert traj.stop_reason == "max_images"
    assert traj.metrics["tool_calls"] == 3 and len(traj.tool_results) == 3
    assert [m.role for m in traj.messages].count("tool") == 1 and len(traj.images) == 2


def test_a_frame_budget_is_clamped_to_leave_room_for_a_tool_image(policy, tmp_path):
    """Two videos under a frame budget of 3 with max_images 5: 6 frames would fill the cap, so each video shows 2
    (4 images, room for one more) and a one-frame call comes back; a row whose prompt images leave no room for one
    frame per video and a tool image is refused by name."""
    path = str(write_video(tmp_path / "clip.mp4", frames=40, fps=10.0))
    call = '<tool_call>{"name": "sample_frames", "arguments": {"start": 1, "end": 2, "num_frames": 1}}</tool_call>'
    task = Task(id="two-videos", question="When?", videos=[path, path], tools=["sample_frames"],
                scripted_turns=[call, "<answer>a</answer>"])  # fmt: skip
    traj = rollout(policy, task, _limits(max_images=5, frame_budget=(3, 3)))
    assert len(traj.messages[1].images) == 4 and traj.stop_reason == "answered" and len(traj.images) == 5
    full = Task(id="crowded-row", question="When?", images=[IMAGE] * 3, videos=[path], tools=["sample_frames"])
    with pytest.raises(ValueError, match="crowded-row"):
        rollout(policy, full, _limits(max_images=4, frame_budget=(2, 2)))

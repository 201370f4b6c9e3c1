"""The training paths that search, code and video agents take and the crop task never does: text-only tool
observations (search hits, code output) and many-frame clip observations inside SFT batches (beside an image row) and
GRPO batches; and Tool-Star's hierarchical reward with self-critic DPO on groups the policy itself sampled."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from data_pipelines.gold import tool_turn
from vagent.config import GRPOConfig, SFTConfig, load_config
from vagent.data import Row, encode_messages, load_rows, write_rows
from vagent.data.batching import collate
from vagent.model import load_policy, masked_token_logprobs
from vagent.recipes import grpo, sft
from vagent.rollout import RolloutLimits, Task, run
from vagent.rollout.export import read_jsonl
from vagent.toolbox import ToolContext, ToolServices
from vagent.toolbox.sandbox import Sandbox
from vagent.toolbox.search import BM25Backend
from vagent.training.data import SFTDataset
from vagent.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
GRPO_CONFIG = ROOT / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
SFT_CONFIG = ROOT / "configs" / "sft" / "qwen2_5_vl_tiny_cpu.yaml"
# the code tool runs in bubblewrap, which `make test` installs (as tests/test_sandbox.py needs it)
pytestmark = pytest.mark.skipif(not Sandbox().available(), reason="bubblewrap (bwrap) is missing or does not work here")

# An offline corpus (BM25Backend's JSONL: title, text, url) where one entry holds the fact the question asks for
CORPUS = [
    {"title": "Veltria", "text": "Veltria is a small inland country. Its capital is Lumen, on the river Ost.",
     "url": "https://example.org/veltria"},
    {"title": "Ostmark", "text": "Ostmark is a region north of Veltria known for its salt mines.",
     "url": "https://example.org/ostmark"},
    {"title": "Lumen (band)", "text": "Lumen is a rock band formed in 1998.", "url": "https://example.org/band"},
]  # fmt: skip
QUESTION = "What is the capital of Veltria? Check the product 1234 * 5678 as well."
SEARCH = {"query": "capital of Veltria"}
CODE = {"code": "print(1234 * 5678)"}
CLIP = {"start": 0.5, "end": 1.5}  # at 8 frames/s: 8 frames


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in CORPUS) + "\n")
    return corpus, ToolServices(search=BM25Backend(corpus), sandbox=Sandbox(timeout_s=20))


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    from tests.videos import write_video

    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=24, fps=8.0, size=(96, 64))


# -- SFT -------------------------------------------------------------------------------------------------------------


def test_sft_batches_text_only_observations_and_an_eight_frame_clip_beside_an_image_row(tmp_path, tiny_qwen25, services,
                                                                                      video, zoom_rows_file):  # fmt: skip
    """A search-and-code row (no image: its observations are the search hits and the program's output, text only), a
    video row whose tool turn returned a 8-frame clip, and a crop row, in the same micro-batches: the text row's
    batch trains only the assistant's calls and answer (not a character of the hits or the output), the clip row
    holds its 8 frames, each after its time; and the shipped tiny SFT config trains on the mixture (finite loss, the
    weights move)."""
    _, svc = services
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    min_pixels, max_pixels = policy.pixel_budget
    context = ToolContext(search=svc.search, sandbox=svc.sandbox, min_pixels=min_pixels, max_pixels=max_pixels)
    search_call, hits = tool_turn("search", SEARCH, context, tmp_path / "s")
    code_call, output = tool_turn("code", CODE, context, tmp_path / "c")
    text_row = Row.from_dict({
        "id": "text0", "question": QUESTION, "answer": "Lumen", "answer_type": "f1", "tools": ["search", "code"],
        "messages": [{"role": "assistant", "content": search_call}, hits, {"role": "assistant", "content": code_call},
                     output, {"role": "assistant", "content": "<answer>Lumen</answer>"}],
    })  # fmt: skip
    clip_context = ToolContext(videos=[str(video)], min_pixels=min_pixels, max_pixels=max_pixels)
    clip_call, frames = tool_turn("crop_clip", CLIP, clip_context, tmp_path / "v")
    assert sum(part["type"] == "image" for part in frames["content"]) == 8
    clip_row = Row.from_dict({
        "id": "clip0", "question": "When does it get bright?", "answer": [1.0, 1.5], "answer_type": "span",
        "videos": [str(video)], "tools": ["crop_clip"],
        "messages": [{"role": "assistant", "content": clip_call}, frames,
                     {"role": "assistant", "content": "<answer>[1.0, 1.5]</answer>"}],
    })  # fmt: skip
    [image_row] = load_rows(zoom_rows_file(1, 3))
    rows = [text_row, clip_row, image_row]
    data = SFTDataset(rows, policy.processor, default_tools=["crop"], max_length=10**5, micro_batch_size=3, seed=0,
                      group_by_length=False, group_batches=1, min_pixels=min_pixels, max_pixels=max_pixels,
                      factor=policy.image_factor)  # fmt: skip
    assert data.skipped == [] and len(data) == 1
    batch = data[0]
    order = [i for i in range(3) if "Veltria" in policy.tokenizer.decode(batch["input_ids"][i])]
    [text] = order
    hits_text = hits["content"][0]["text"]
    assert "river Ost" in hits_text and "7006652" in output["content"][0]["text"]
    trained = policy.tokenizer.decode(batch["input_ids"][text][batch["loss_mask"][text].bool()])
    assert '"search"' in trained and '"code"' in trained and "Lumen</answer>" in trained
    assert "river Ost" not in trained and "7006652" not in trained  # observations are context, never targets
    assert batch["image_grid_thw"].shape[0] == 8 + 2  # the clip's frames, the crop row's image and crop; no text row's
    decoded = [policy.tokenizer.decode(batch["input_ids"][i]) for i in range(3)]
    [clip_text] = [d for d in decoded if "get bright" in d]
    assert len(re.findall(r"t=\d+\.\d\ds<\|vision_start\|>", clip_text)) == 8  # each frame right after its time
    # the recipe: a text-only row and image rows in one micro-batch, two steps, the weights move
    data_file = write_rows([dataclasses.replace(r, id=f"{r.id}-{k}") for k in range(2) for r in rows],
                           tmp_path / "rows.jsonl")  # fmt: skip
    out = tmp_path / "sft"
    model = sft.train(load_config(SFTConfig, SFT_CONFIG, [
        f"out_dir={out}", f"model.path={tiny_qwen25}", f"data.train={data_file}", "data.val=null",
        "data.micro_batch_size=3", "data.max_length=100000", "optim.grad_accum=1", "train.max_steps=2",
        "train.tensorboard=false",
        "train.save_every=0"]))  # fmt: skip
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    before, after = policy.model.state_dict(), load_policy(model, device="cpu", dtype="float32").model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


# -- GRPO ------------------------------------------------------------------------------------------------------------

# The scripted opening of each row kind's episodes (forced, loss mask 0), then the turn the policy samples
SCRIPTS = {"s": [_call("search", SEARCH), _call("code", CODE), None], "v": [_call("crop_clip", CLIP), None]}


def _scripted(monkeypatch) -> None:
    """GRPO's tasks, each opened by its kind's scripted tool turns: the observations are real (BM25 hits, the
    sandbox's output, the video's frames) and the policy samples the turn after them."""
    made = Task.from_row.__func__

    def from_row(cls, row, default_tools):
        task = made(cls, row, default_tools)
        task.scripted_turns = list(SCRIPTS[row.id[0]])
        return task

    monkeypatch.setattr(Task, "from_row", classmethod(from_row))


def _teach_answers(policy, services) -> None:
    """``policy``, in place, after a few steps on two gold search-and-code episodes that answer "Lumen" (right) and
    "Rome" (wrong): sampled at T = 1 after the same observations, its answers then spread over right, wrong and
    malformed, so Tool-Star's reward differs within a group as it does early in a real run."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=48, max_images=12)
    tasks = [Task(id=f"gold{i}", question=QUESTION, tools=["search", "code"],
                  scripted_turns=[_call("search", SEARCH), _call("code", CODE), f"<answer>{answer}</answer>"])
             for i, answer in enumerate(["Lumen", "Rome"])]  # fmt: skip
    gold = run(policy, tasks, limits=limits, batch_size=2, services=services)
    assert all(t.stop_reason == "answered" and len(t.tool_results) == 2 for t in gold)
    observed = " ".join(m.plain_text for m in gold[0].messages if m.role == "tool")
    assert "river Ost" in observed and "7006652" in observed
    last = []
    for t in gold:  # only the answer turn is taught: the calls stay scripted
        answer = [m for m in t.messages if m.role == "assistant"][-1]
        answer.token_ids, answer.sampled = None, None
        last.append(answer)
    min_pixels, max_pixels = policy.pixel_budget
    encoded = [encode_messages(t.messages, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels,
                               factor=policy.image_factor) for t in gold]  # fmt: skip
    batch = collate(encoded, policy.tokenizer.pad_token_id or 0)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=3e-3, weight_decay=0.0)
    policy.model.train()
    for _ in range(60):  # about where its samples spread over all three levels
        lp, _ = masked_token_logprobs(policy.model, batch, batch["loss_mask"])
        optimizer.zero_grad()
        (-lp.sum() / batch["loss_mask"].sum()).backward()
        optimizer.step()
    policy.model.eval()


def test_grpo_with_tool_star_and_self_critic_trains_on_text_and_clip_observations(tmp_path, tiny_qwen25, services,
                                                                                  video, monkeypatch):  # fmt: skip
    """Two GRPO steps of the shipped tiny config over search-and-code rows (no image: text-only observations) and
    video rows (a 8-frame clip), rewarded by Tool-Star's hierarchical reward, with self-critic DPO on. Every episode
    re-encodes to its sampled ids (the score stage checks it), the trainer's log-probs of the sampled tokens after
    those observations equal the sampler's (gap < 1e-3), the groups the policy sampled spread over Tool-Star's
    levels (a right answer with two tools: 1.1; well-formed wrong: 0; malformed: -1), the DPO term trains on their
    best-worst pairs, and the written rollouts hold the hits, the program's output and the clip's frames."""
    corpus, svc = services
    policy = load_policy(tiny_qwen25, device="cpu", dtype="float32")
    _teach_answers(policy, svc)
    start = tmp_path / "start"
    shutil.copytree(tiny_qwen25, start)  # the checkpoint's tokenizer and processor, the taught weights
    policy.model.save_pretrained(start)
    rows = [{"id": f"s{i}", "question": QUESTION, "answer": "Lumen", "answer_type": "f1", "tools": ["search", "code"]}
            for i in range(3)]  # fmt: skip
    rows.append({"id": "v0", "question": "When does it get bright?", "answer": "Lumen", "answer_type": "f1",
                 "videos": [str(video)], "tools": ["crop_clip"]})  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _scripted(monkeypatch)
    out = tmp_path / "grpo"
    model = grpo.train(load_config(GRPOConfig, GRPO_CONFIG, [
        f"out_dir={out}", f"model.path={start}", f"data.train={data}", "data.tools=[search, code, crop_clip]",
        f"toolbox.search_corpus={corpus}", "rollout.max_turns=4", "rollout.max_new_tokens=16",
        "rollout.max_images=12", "grpo.prompts_per_step=4", "grpo.rollout_batch_size=16",
        "grpo.dynamic_sampling=false", "grpo.self_critic.enabled=true", "rewards.weights={tool_star: 1.0}",
        "rewards.options={}", "train.max_steps=2", "train.save_every=2", "train.tensorboard=false"]))  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    before, after = policy.model.state_dict(), load_policy(model, device="cpu", dtype="float32").model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the groups' advantages and pairs trained it
    for r in records:
        assert r["sampler_logprob_gap"] < 1e-3, r["sampler_logprob_gap"]
        assert r["tool_failure_rate"] == 0.0 and r["tool_calls_per_traj"] >= 1
    assert sum(r["dpo/pairs"] for r in records) >= 1 and all(torch.isfinite(torch.tensor(r["dpo/loss"]))
                                                               for r in records if r["dpo/pairs"])  # fmt: skip
    trajectories = list(read_jsonl(out / "rollouts" / "step-00000002.jsonl"))
    rewards = {round(t.reward, 3) for t in trajectories}
    assert 1.1 in rewards and rewards & {0.0, -1.0}, rewards  # a right answer with two kinds of tools, and worse
    text = [t for t in trajectories if t.task_id.startswith("s")]
    clip = [t for t in trajectories if t.task_id.startswith("v")]
    assert text and clip
    for t in text:
        assert [r.name for r in t.tool_results][:2] == ["search", "code"]
        observed = " ".join(m.plain_text for m in t.messages if m.role == "tool")
        assert "river Ost" in observed and "7006652" in observed
        assert not any(part.type == "image" for m in t.messages for part in m.content)  # text only, end to end
    for t in clip:
        [frames] = [m for m in t.messages if m.role == "tool"]
        assert sum(part.type == "image" for part in frames.content) == 8

"""DPO: the losses against hand-computed values and their gradients' signs, preference rows, the pair encoding (SFT's
masks), and the recipe on a tiny checkpoint (it raises the chosen-over-rejected log-ratio of its pairs; the three ways
of scoring the reference agree; exact resume; 2 FSDP ranks give the losses of 1)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_pipelines.synthetic.pairs import wrong_answer_pairs
from data_pipelines.synthetic.zoom import zoom_rows
from vagent.algorithms import dpo_loss, length_normalized, pair_stats, sequence_logprobs
from vagent.config import ConfigError, DPOConfig, load_config
from vagent.data import Row, RowError, load_rows, write_rows
from vagent.data.batching import collate
from vagent.data.encode import encode_messages, encoded_length
from vagent.model import load_policy
from vagent.recipes import dpo
from vagent.training.data import SFTDataset
from vagent.training.metrics import read_metrics
from vagent.training.preference import PreferenceDataset, pair_logprobs, token_logprobs

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "dpo" / "qwen2_5_vl_tiny_cpu.yaml"
SIZE = (448, 336)  # small images keep a step quick; the tile stays 28 px (as in test_sft)


# -- the losses ------------------------------------------------------------------------------------------------

# policy chosen -1, rejected -3; reference chosen -2, rejected -2.5: the margin h = (-1 + 2) - (-3 + 2.5) = 1.5
POLICY, REFERENCE = (-1.0, -3.0), (-2.0, -2.5)


def _loss(loss_type="sigmoid", beta=0.5, label_smoothing=0.0):
    """The loss of the example pair and its gradients to the policy's chosen and rejected log-probs and to the
    reference's."""
    policy = [torch.tensor([v], requires_grad=True) for v in POLICY]
    reference = [torch.tensor([v], requires_grad=True) for v in REFERENCE]
    loss = dpo_loss(*policy, *reference, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    loss.sum().backward()
    return float(loss.detach()), float(policy[0].grad), float(policy[1].grad), reference[0].grad


@pytest.mark.parametrize(
    ("loss_type", "beta", "smoothing", "value", "d_chosen"),
    [
        # -log sigmoid(0.5 x 1.5) = log(1 + e^-0.75); d/d chosen = -beta sigmoid(-0.75) = -0.5 x 0.32082
        ("sigmoid", 0.5, 0.0, 0.386871, -0.160411),
        # 0.9 log(1 + e^-0.75) + 0.1 log(1 + e^0.75); d/d chosen = -0.5 (0.9 x 0.32082 - 0.1 x 0.67918)
        ("sigmoid", 0.5, 0.1, 0.461871, -0.110411),
        # the same formula as sigmoid on the log-probs it is given (the caller averages them)
        ("sigmoid_norm", 0.5, 0.0, 0.386871, -0.160411),
        # (1.5 - 1 / (2 x 0.1))^2 = (1.5 - 5)^2; d/d chosen = 2 (1.5 - 5): below IPO's target the chosen side rises
        ("ipo", 0.1, 0.0, 12.25, -7.0),
        # above the target (1.5 > 1 / (2 x 0.5) = 1) IPO pulls the margin back: (1.5 - 1)^2, d/d chosen = +1
        ("ipo", 0.5, 0.0, 0.25, 1.0),
    ],
)
def test_the_loss_and_its_gradient_match_a_hand_computed_pair(loss_type, beta, smoothing, value, d_chosen):
    loss, grad_chosen, grad_rejected, grad_reference = _loss(loss_type, beta, smoothing)
    assert loss == pytest.approx(value, abs=1e-5)
    assert grad_chosen == pytest.approx(d_chosen, abs=1e-5)
    assert grad_rejected == pytest.approx(-d_chosen, abs=1e-5)  # the margin's two sides move opposite ways
    assert grad_reference is None  # the reference is a constant


def test_the_length_normalized_losses_compare_token_means():
    """chosen: 2 trained tokens of -1 (sum -2, mean -1); rejected: 4 of -1 (sum -4, mean -1); reference chosen 2 of
    -1.5 (sum -3, mean -1.5), rejected as the policy's. Summed margin (-2 + 3) - 0 = 1, per token 0.5."""
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])  # position 0 never scores
    policy = torch.tensor([[0.0, -1, -1, 0, 0], [0, -1, -1, -1, -1]])
    reference = torch.tensor([[0.0, -1.5, -1.5, 0, 0], [0, -1, -1, -1, -1]])
    losses = {}
    for loss_type in ("sigmoid", "sigmoid_norm"):
        average = length_normalized(loss_type)
        pi, ref = sequence_logprobs(policy, mask, average=average), sequence_logprobs(reference, mask, average=average)
        losses[loss_type] = float(dpo_loss(pi[:1], pi[1:], ref[:1], ref[1:], beta=1.0, loss_type=loss_type))
    assert losses["sigmoid"] == pytest.approx(0.313262, abs=1e-5)  # log(1 + e^-1)
    assert losses["sigmoid_norm"] == pytest.approx(0.474077, abs=1e-5)  # log(1 + e^-0.5)
    assert length_normalized("ipo") and not length_normalized("sigmoid")
    with pytest.raises(ValueError, match="unknown DPO loss type"):
        length_normalized("hinge")


def test_pair_statistics_are_trls_rewards():
    stats = pair_stats(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -2.0]),
                       torch.tensor([-2.5, -2.0]), beta=0.5)  # fmt: skip
    # pair 0: chosen +1, rejected -0.5 (won); pair 1: chosen 0, rejected +1 (lost)
    assert {k: round(float(v), 4) for k, v in stats.items()} == {
        "rewards/chosen": 0.5, "rewards/rejected": 0.25, "rewards/margin": 0.25, "rewards/accuracy": 1.0,
        "logratio/chosen": 1.0, "logratio/rejected": 0.5, "logps/chosen": -3.0, "logps/rejected": -4.0,
    }  # fmt: skip


def test_bad_loss_arguments_are_errors():
    one = torch.zeros(1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(one, one, one, one, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(one, one, one, one, beta=0.1, loss_type="ipo", label_smoothing=0.1)


# -- rows ---------------------------------------------------------------------------------------------------------

GOOD = [{"role": "assistant", "content": "<think>It is red.</think>\n<answer>red</answer>"}]
BAD = [{"role": "assistant", "content": "<answer>blue</answer>"}]


def _row(**fields):
    return {"id": "p1", "question": "What colour?", "answer": "red", "answer_type": "exact", **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"chosen": GOOD}, "field 'rejected' is required with 'chosen'"),
        ({"rejected": BAD}, "field 'chosen' is required with 'rejected'"),
        ({"chosen": GOOD, "rejected": GOOD}, "field 'rejected' is the same trajectory as 'chosen'"),
        (
            {"chosen": GOOD, "rejected": [{"role": "user", "content": "Another question?"}, *BAD]},
            "field 'rejected' must start from the prompt 'chosen' starts from",
        ),
        ({"chosen": GOOD, "rejected": [{"role": "assistant", "content": 3}]}, r"field 'rejected\[0\]\.content'"),
        ({"chosen": [{"role": "tool", "content": "x"}], "rejected": BAD}, "field 'chosen' has no assistant turn"),
    ],
    ids=["no-rejected", "no-chosen", "same", "other-prompt", "bad-part", "nothing-to-train"],
)
def test_a_bad_pair_is_an_error_naming_the_field(fields, message):
    with pytest.raises(RowError, match=f"row 'p1': {message}"):
        Row.from_dict(_row(**fields))


def test_a_pair_round_trips_through_jsonl_with_its_media(tmp_path):
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.new("RGB", (32, 32), "red").save(tmp_path / "img" / "a.png")
    Image.new("RGB", (16, 16), "red").save(tmp_path / "img" / "crop.png")
    tool = {"role": "tool", "content": [{"type": "image", "path": "img/crop.png"}]}
    call = {
        "role": "assistant",
        "content": '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 8, 8]}}</tool_call>',
    }
    record = _row(images=["img/a.png"], chosen=[call, tool, *GOOD], rejected=[call, tool, *BAD])
    (tmp_path / "pairs.jsonl").write_text(json.dumps(record) + "\n")
    row = load_rows(tmp_path / "pairs.jsonl")[0]
    assert [m.role for m in row.chosen] == ["assistant", "tool", "assistant"] and row.messages is None
    assert row.rejected[1].content[0].path == str(tmp_path / "img" / "crop.png")
    again = load_rows(write_rows([row], tmp_path / "out" / "pairs.jsonl"))[0]
    assert again.chosen == row.chosen and again.rejected == row.rejected
    (tmp_path / "img" / "crop.png").unlink()
    with pytest.raises(RowError, match=r"field 'chosen\[1\]\.content\[0\]\.path' names a file that does not exist"):
        load_rows(tmp_path / "pairs.jsonl")


def test_wrong_answer_pairs_change_only_the_answer(tmp_path, policy):
    rows = zoom_rows(tmp_path, 6, seed=0, size=SIZE, clutter=5, **policy.frame)
    pairs, skipped = wrong_answer_pairs(rows, seed=0)
    assert len(pairs) == 6 and not skipped
    for row, pair in zip(rows, pairs, strict=True):
        assert pair.chosen == row.messages and pair.messages is None
        assert pair.chosen[:-1] == pair.rejected[:-1]
        assert f"<answer>{row.answer}</answer>" in pair.chosen[-1].plain_text
        wrong = pair.rejected[-1].plain_text
        assert "<answer>" in wrong and f"<answer>{row.answer}</answer>" not in wrong
        assert wrong.split("<answer>")[0] == pair.chosen[-1].plain_text.split("<answer>")[0]


# -- the pair encoding ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory, policy):
    """4 training pairs and 3 val pairs from zoom rows (crop-then-answer and direct answers) in the tiny model's frame."""
    out = tmp_path_factory.mktemp("dpo-data")
    for name, n, seed in (("train", 4, 0), ("val", 3, 1)):
        rows = zoom_rows(out, n, seed=seed, size=SIZE, clutter=20, **policy.frame)
        write_rows(rows, out / f"{name}-sft.jsonl")
        write_rows(wrong_answer_pairs(rows, seed=seed)[0], out / f"{name}.jsonl")
    return out / "train.jsonl"


# Text-only pairs (no tools offered, so a short system prompt): the recipe's mechanics at a fraction of a zoom pair's
# tokens. The rejected answer is wrong; each answer is chosen in one pair and rejected in none.
TEXT_QA = [("What is 2 + 3?", "5", "6"), ("Which is larger, 7 or 4?", "7", "4"), ("What is 6 minus 4?", "2", "3"),
           ("How many sides has a triangle?", "3", "8")]  # fmt: skip


@pytest.fixture(scope="module")
def text_pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("dpo-text") / "pairs.jsonl"
    side = lambda a: [{"role": "assistant", "content": f"<think>Plain arithmetic.</think>\n<answer>{a}</answer>"}]  # noqa: E731
    rows = [_row(id=f"t{i}", question=q, answer=a, tools=[], chosen=side(a), rejected=side(b))
            for i, (q, a, b) in enumerate(TEXT_QA)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _datasets(policy, pairs_file, micro_batch_size=1):
    min_pixels, max_pixels = policy.pixel_budget
    common = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=policy.image_factor, default_tools=["crop"],
                  max_length=4096, micro_batch_size=micro_batch_size, seed=0, group_by_length=False, group_batches=1)  # fmt: skip
    sft = SFTDataset(load_rows(pairs_file.with_name("train-sft.jsonl")), policy.processor, **common)
    return sft, PreferenceDataset(load_rows(pairs_file), policy.processor, **common)


def test_each_side_of_a_pair_encodes_as_sft_encodes_that_trajectory(policy, pairs_file):
    """The chosen side of a pair is the SFT row's gold trajectory: the same ids, the same loss mask (tool
    observations, images and the prompt forced), the same pixels; chosen rows first, then rejected."""
    sft, pairs = _datasets(policy, pairs_file)
    assert pairs.ids == sft.ids
    image_token = policy.model.config.image_token_id
    for i in range(len(pairs.pairs)):
        batch = pairs.encode([i])
        assert batch["pair_index"].tolist() == [i] and batch["input_ids"].shape[0] == 2
        gold = collate([encode_messages(sft.conversations[i], policy.processor, min_pixels=pairs.budget["min_pixels"],
                                        max_pixels=pairs.budget["max_pixels"])], sft.pad_id)  # fmt: skip
        n = int(gold["attention_mask"].sum())
        assert int(batch["attention_mask"][0].sum()) == n
        for key in ("input_ids", "loss_mask", "mm_token_type_ids"):
            assert torch.equal(batch[key][0, :n], gold[key][0]), key
        n_gold = int(gold["image_grid_thw"].shape[0])
        assert torch.equal(batch["image_grid_thw"][:n_gold], gold["image_grid_thw"])  # the chosen row's images first
        assert torch.equal(batch["pixel_values"][: gold["pixel_values"].shape[0]], gold["pixel_values"])
        images = batch["input_ids"] == image_token
        assert images[0].any() and not batch["loss_mask"][images].any()  # every image token is forced
        trained = [policy.tokenizer.decode(batch["input_ids"][r][batch["loss_mask"][r].bool()]) for r in (0, 1)]
        assert trained[0] != trained[1] and trained[1].endswith("</answer><|im_end|>")


@pytest.mark.parametrize("chunk_size", [0, 7])
def test_one_forward_of_both_sides_scores_each_sequence_as_alone(policy, pairs_file, chunk_size):
    """The concatenated forward (2 pairs = 4 rows, padded, the system prompt run once) gives every sequence the
    log-prob it gets alone; the head whole (0) or in chunks."""
    _, pairs = _datasets(policy, pairs_file)
    batch = pairs.encode([0, 1])
    with torch.no_grad():
        chosen, rejected = pair_logprobs(policy.model, batch, average=False, chunk_size=chunk_size)
        for i, side in ((0, 0), (1, 0), (0, 1), (1, 1)):
            alone = pairs.encode([i])
            rows = {k: v[side : side + 1] for k, v in alone.items() if k not in ("pixel_values", "image_grid_thw")}
            one = collate([encode_messages(pairs.pairs[i][side], policy.processor, min_pixels=pairs.budget["min_pixels"],
                                           max_pixels=pairs.budget["max_pixels"])], pairs.pad_id)  # fmt: skip
            assert torch.equal(rows["input_ids"][:, : one["input_ids"].shape[1]], one["input_ids"])
            lp = token_logprobs(policy.model, one, chunk_size=1024)
            expected = float(sequence_logprobs(lp, one["loss_mask"]))
            assert float((chosen, rejected)[side][i]) == pytest.approx(expected, rel=1e-5, abs=1e-4)
    assert chosen.shape == rejected.shape == (2,) and torch.all(chosen < 0)


# -- the recipe -----------------------------------------------------------------------------------------------------


def _args(out, model, pairs_file, *extra):
    return [f"out_dir={out}", f"model.path={model}", "model.device=cpu", f"data.train={pairs_file}",
            "data.micro_batch_size=2", "optim.lr=2e-3", "optim.grad_accum=1", "optim.warmup_steps=0",
            "train.max_steps=6", "train.tensorboard=false", *extra]  # fmt: skip


def _curve(out, key):
    return [r[key] for r in read_metrics(Path(out) / "metrics.jsonl") if key in r and "lr" in r]


def _margins(model_dir, start, pairs_file):
    """(N,) each training pair's (policy - reference) chosen-over-rejected log-ratio, scored afresh."""
    trained, reference = load_policy(model_dir, device="cpu"), load_policy(start, device="cpu")
    _, pairs = _datasets(trained, pairs_file, micro_batch_size=len(load_rows(pairs_file)))
    batch = pairs.encode(range(len(pairs.pairs)))
    with torch.no_grad():
        pi = pair_logprobs(trained.model, batch, average=False)
        ref = pair_logprobs(reference.model, batch, average=False)
    return (pi[0] - ref[0]) - (pi[1] - ref[1])


def test_a_few_dpo_steps_raise_the_chosen_over_rejected_log_ratio(tmp_path, tiny_qwen25, pairs_file):
    """4 steps on the 4 training pairs, all of them in every step. Measured margins: 1.9, 2.5, -1.9, 2.6 nats. The
    third pair's chosen answer (4) is the rejected answer of two others, and 4 steps teach the tiny model the
    answers' prior before it reads the trajectory's own reasoning: the pairs' mean rises, not every pair."""
    val = pairs_file.with_name("val.jsonl")
    args = _args(tmp_path, tiny_qwen25, pairs_file, f"data.val={val}", "data.micro_batch_size=4", "train.max_steps=4",
                 "optim.lr=3e-3")  # fmt: skip
    model_dir = dpo.train(load_config(DPOConfig, CONFIG, args))
    margins = _margins(model_dir, tiny_qwen25, pairs_file)
    # before the first step the policy is its reference: every margin is 0
    assert _curve(tmp_path, "logratio/chosen")[0] == 0.0 and _curve(tmp_path, "logratio/rejected")[0] == 0.0
    assert float(margins.mean()) > 0.5 and int((margins > 0).sum()) >= 3, margins
    losses = _curve(tmp_path, "loss")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6), losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # the whole batch every step: it only falls
    assert _curve(tmp_path, "rewards/margin")[-1] > 0 and _curve(tmp_path, "rewards/accuracy")[-1] >= 0.75
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "grad_norm"} <= set(records[0])
    final_eval = [r for r in records if "eval/loss" in r]
    assert len(final_eval) == 1 and final_eval[0]["eval/pairs"] == 3.0  # every val pair once


def test_precomputed_and_lora_references_are_the_start_policy(tmp_path, tiny_qwen25, text_pairs, capsys):
    """dpo.precompute_ref scores each pair once with the start policy, which is what the frozen copy scores at every
    step: the same losses. With LoRA the reference is the policy with its adapters off: the first step's log-ratios
    are 0, as they are against a copy."""
    copy = tmp_path / "copy"  # only its curves are read: it saves nothing (train.save_final=false)
    args = _args(copy, tiny_qwen25, text_pairs, "train.max_steps=3", "train.save_final=false")
    assert dpo.train(load_config(DPOConfig, CONFIG, args)) is None
    assert not (copy / "model").exists() and not list((copy / "checkpoints").glob("step-*"))
    pre = tmp_path / "precomputed"
    dpo.train(load_config(DPOConfig, CONFIG,
                          _args(pre, tiny_qwen25, text_pairs, "train.max_steps=3", "dpo.precompute_ref=true")))  # fmt: skip
    assert "scored 4 pairs once" in capsys.readouterr().out and (pre / "reference_logprobs.pt").is_file()
    for key in ("loss", "logratio/chosen", "rewards/margin"):
        assert _curve(pre, key) == pytest.approx(_curve(copy, key), rel=1e-4, abs=1e-5), key
    lora = tmp_path / "lora"
    dpo.train(load_config(DPOConfig, CONFIG, _args(lora, tiny_qwen25, text_pairs, "train.max_steps=2",
                                                   "train.lora.enabled=true", "train.lora.r=4")))  # fmt: skip
    assert "adapters disabled" in capsys.readouterr().out
    assert _curve(lora, "logratio/chosen")[0] == 0.0 and _curve(lora, "loss")[0] == pytest.approx(math.log(2))
    assert _curve(lora, "logratio/chosen")[1] != 0.0  # the adapters moved the policy off its base


class _Killed(Exception):
    """Raised by the test's logger after step 3 is logged: the run stops as if killed there."""


@pytest.mark.parametrize("precompute", [False, True], ids=["frozen-copy", "precomputed"])
def test_a_stopped_run_resumes_to_the_same_losses(tmp_path, tiny_qwen25, text_pairs, monkeypatch, precompute):
    """A checkpoint at step 2; the run stops after step 3 and resumes from step 2 to the uninterrupted losses.
    Precomputed, the resume reads the reference's log-probs back; with the file gone, a copy of the start scores them
    again."""
    from vagent.training.metrics import MetricsLogger

    extra = ["train.max_steps=4", "train.save_every=2", f"dpo.precompute_ref={str(precompute).lower()}"]
    full = tmp_path / "full"
    dpo.train(load_config(DPOConfig, CONFIG, _args(full, tiny_qwen25, text_pairs, *extra)))
    log = MetricsLogger.log

    def killing_log(self, step, values):
        log(self, step, values)
        if step == 3 and "loss" in values:
            raise _Killed

    stopped = tmp_path / "stopped"
    args = _args(stopped, tiny_qwen25, text_pairs, *extra)
    monkeypatch.setattr(MetricsLogger, "log", killing_log)
    with pytest.raises(_Killed):
        dpo.train(load_config(DPOConfig, CONFIG, args))
    monkeypatch.setattr(MetricsLogger, "log", log)
    if precompute:
        (stopped / "reference_logprobs.pt").unlink()
    dpo.train(load_config(DPOConfig, CONFIG, args))
    assert _curve(stopped, "loss") == pytest.approx(_curve(full, "loss"), rel=1e-6, abs=1e-7)
    assert len(_curve(stopped, "loss")) == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.deepspeed=configs/deepspeed/zero2.json"], "DeepSpeed"),
        (["train.lm_head_kernel=liger"], "chunked"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "not to ipo"),
        (["dpo.beta=0"], "dpo.beta"),
        (["dpo.loss_type=hinge"], "must be one of"),
    ],
    ids=["deepspeed", "liger", "ipo-smoothing", "beta", "loss-type"],
)
def test_an_unsupported_setting_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(DPOConfig, CONFIG, overrides)
    assert "\n" not in str(info.value)


def test_rows_without_pairs_are_skipped_with_their_reason(policy, pairs_file):
    min_pixels, max_pixels = policy.pixel_budget
    common = dict(min_pixels=min_pixels, max_pixels=max_pixels, factor=28, default_tools=["crop"], max_length=4096,
                  micro_batch_size=1, seed=0, group_by_length=False, group_batches=1)  # fmt: skip
    with pytest.raises(ValueError, match="no usable preference pairs .* has no preference pair"):
        PreferenceDataset(load_rows(pairs_file.with_name("train-sft.jsonl")), policy.processor, **common)
    whole = PreferenceDataset(load_rows(pairs_file), policy.processor, **common)
    longest = [max(encoded_length(side, policy.processor, min_pixels=min_pixels, max_pixels=max_pixels)
                   for side in pair) for pair in whole.pairs]  # fmt: skip
    limit = sorted(longest)[1]  # the shortest two pairs fit
    short = PreferenceDataset(load_rows(pairs_file), policy.processor, **{**common, "max_length": limit})
    fits = sum(n <= limit for n in longest)
    assert 2 <= fits < 4 and len(short.pairs) == fits and len(short.skipped) == 4 - fits
    assert all(f"data.max_length={limit}" in why for _, why in short.skipped)


# -- two ranks -------------------------------------------------------------------------------------------------------


def _torchrun(ranks, args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), str(ROOT / "tools" / "train.py"), "--config", str(CONFIG),
           *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["train.lora.enabled=true", "optim.lr=1e-2"]], ids=["full", "lora"])
def test_two_fsdp_ranks_give_the_dpo_losses_of_one_rank(tmp_path, tiny_qwen25, pairs_file, lora):
    """One unsharded rank with 2 micro-batches of 1 pair a step against 2 FSDP ranks with 1 each: the same pairs a
    step; the frozen reference is loaded into shards like the policy, or with LoRA is the sharded policy with its
    adapters off."""
    val = f"data.val={pairs_file.with_name('val.jsonl')}"
    common = ["data.micro_batch_size=1", "train.max_steps=4", "train.eval_every=2", *lora]
    one, two = tmp_path / "one", tmp_path / "two"
    result = _torchrun(1, [*_args(one, tiny_qwen25, pairs_file, val, *common), "optim.grad_accum=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    result = _torchrun(2, [*_args(two, tiny_qwen25, pairs_file, val, *common), "train.sharding=fsdp"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert " 2 rank(s) x 1 accum" in result.stdout
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/accuracy"):
        assert _curve(two, key) == pytest.approx(_curve(one, key), rel=1e-4, abs=1e-5), key
    # a log-ratio is the difference of two sums of about -400 nats: the sharded sums' rounding (measured 8.5e-4 at
    # step 3, 3e-6 of the sums) is all that is left of it
    for key in ("logratio/chosen", "logratio/rejected"):
        assert _curve(two, key) == pytest.approx(_curve(one, key), abs=5e-3), key
    evals = [[r["eval/loss"] for r in read_metrics(out / "metrics.jsonl") if "eval/loss" in r] for out in (one, two)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=1e-4, abs=1e-5)  # 3 val pairs over 2 ranks
    assert abs(_curve(one, "logratio/chosen")[-1]) > 0.1  # the policy moved off its reference

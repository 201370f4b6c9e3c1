"""Judges as endpoints: ``judge-pairs`` (agreement, position bias, unparseable verdicts) for a checkpoint and for an
OpenAI-compatible endpoint, and the trained judge's request matching its training prompt by construction."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from data_pipelines.judgments import judgment_row
from tests.test_judge import fake  # noqa: F401 (the scripted OpenAI-compatible endpoint fixture)
from vagent.cli import main
from vagent.config import ConfigError, GRPOConfig, JudgeConfig, load_config
from vagent.data import Judgment, Row, load_rows, write_rows
from vagent.data.encode import encode_prompt
from vagent.eval import BENCHMARKS
from vagent.eval.benchmarks.judge_pairs import SWAPPED, report
from vagent.eval.judges import evaluate_endpoint, judgment_request, row_request
from vagent.judge import JudgeClient, verdicts
from vagent.judge.verdicts import _data_url as data_url
from vagent.recipes.judged import judge_scores
from vagent.rollout import Task, prompt_messages
from vagent.serve.request import parse_chat_request
from vagent.types import Message, Trajectory

BENCH = BENCHMARKS["judge-pairs"]


def _pairs(tmp_path, n=3):
    """n answer pairs (p1's right answer second, the others' first), an image pair, and a row whose prompt was
    kept as written."""
    image, other = tmp_path / "tile.png", tmp_path / "other.png"
    Image.new("RGB", (56, 56), (30, 60, 200)).save(image)
    Image.new("RGB", (56, 56), (200, 30, 30)).save(other)
    rows = []
    for i in range(n):
        responses, preferred = ([f"It is {i}.", "It is 9."], 1) if i != 1 else (["It is 9.", "It is 1."], 2)
        rows.append(judgment_row(f"p{i}", Judgment("pairwise", "answers", f"Digit {i}?", responses, str(i), preferred),
                                 images=[str(image)]))  # fmt: skip
    rows.append(judgment_row("gen", Judgment("pairwise", "images", "a blue tile", preferred=1),
                             images=[str(image), str(other)]))  # fmt: skip
    rows.append(judgment_row("kept", Judgment("pairwise", "answers", None, [], None, 2), question="Which is better?"))
    return write_rows(rows, tmp_path / "pairs.jsonl")


def test_the_loader_shows_each_pair_both_ways(tmp_path):
    rows, errors = BENCH.load(_pairs(tmp_path), None)
    assert errors == []
    ids = [r.id for r in rows]
    assert ids == ["p0", "p0" + SWAPPED, "p1", "p1" + SWAPPED, "p2", "p2" + SWAPPED, "gen", "gen" + SWAPPED, "kept"]
    p0s = rows[1]
    assert p0s.answer == "Answer 2 is better" and "Answer 1: It is 9.\nAnswer 2: It is 0." in p0s.question
    gen, gens = rows[6], rows[7]
    assert gens.images == list(reversed(gen.images)) and gens.answer == "Image 2 is better"
    assert rows[-1].extra["order"] == "given"  # a prompt kept as written cannot be swapped


def _scored(rows, verdicts):
    """Samples as the runner logs them, for the replies ``verdicts`` (by row id)."""
    samples = []
    for row in rows:
        text = verdicts.get(row.id, "")
        scores = BENCH.score(row, Trajectory(row.id, [Message.text("assistant", text)], stop_reason="answered"))
        samples.append({"id": row.id, "sample": 0, **scores})
    return samples


def test_agreement_position_bias_and_unparseable_verdicts(tmp_path):
    rows, _ = BENCH.load(_pairs(tmp_path), None)
    first = "<think>x</think><answer>Answer 1 is better</answer>"
    # a judge that always names position 1: right on p0 and p2 as given, wrong on their swaps; p1 the other way
    samples = _scored(rows[:6], {r.id: first for r in rows[:6]})
    metrics = report(rows, samples)
    assert [s["agreement"] for s in samples] == [1, 0, 0, 1, 1, 0]
    assert metrics["first_preference"] == 1.0 and metrics["consistency"] == 0.0 and metrics["pairs"] == 3
    assert metrics["agreement_both_orders"] == 0.0
    # a judge that follows the labelled candidate in both orders is consistent and has no position preference
    right = {r.id: f"<think>x</think><answer>Answer {r.judgment.preferred} is better</answer>" for r in rows[:6]}
    right["p2" + SWAPPED] = "<think>x</think><answer>no idea</answer>"
    samples = _scored(rows[:6], right)
    metrics = report(rows, samples)
    assert [s["unparseable"] for s in samples] == [0, 0, 0, 0, 0, 1]
    assert metrics["consistency"] == pytest.approx(2 / 3) and metrics["agreement_both_orders"] == pytest.approx(2 / 3)
    assert metrics["first_preference"] == pytest.approx(3 / 5)  # p0, p1s, p2 name position 1; p0s, p1 position 2
    assert report(rows, _scored(rows[-1:], {}))["single_order"] == 1
    # first_preference counts only pairs judged both ways: the single-order row's label (position 2) is unbalanced
    right = {r.id: f"<think>x</think><answer>{r.answer}</answer>" for r in rows}
    metrics = report(rows, _scored(rows, right))
    assert metrics["first_preference"] == 0.5 and metrics["single_order"] == 1 and metrics["consistency"] == 1.0


def test_a_judge_cut_mid_reasoning_is_unparseable_not_right(fake, tmp_path):  # noqa: F811
    """A CoT judge cut at its token limit ("<think>... Answer 2 is better grounded ...") has given no verdict: as a
    checkpoint's episode (stop reason max_tokens) and as an endpoint's reply (finish_reason length)."""
    rows, _ = BENCH.load(_pairs(tmp_path), None)
    p1 = rows[2]  # labelled 2
    cut = "<think>1. Semantic accuracy: Answer 2 is better grounded in the image"
    scores = BENCH.score(p1, Trajectory(p1.id, [Message.text("assistant", cut)], stop_reason="max_tokens"))
    assert scores == {"agreement": 0.0, "unparseable": 1.0, "well_formed": 0.0}
    server, url = fake
    server.script = [(200, cut, 0, "length")]
    metrics = evaluate_endpoint(JudgeClient(url, "judge", retries=0), BENCH, [p1], tmp_path / "run")
    assert (metrics["agreement"], metrics["unparseable"], metrics["judge_failures"]) == (0.0, 1.0, 1)


def test_an_endpoint_judge_is_evaluated_from_its_replies(fake, tmp_path):  # noqa: F811
    server, url = fake
    rows, _ = BENCH.load(_pairs(tmp_path, n=1), None)
    rows = rows[:2]
    server.script = [(200, "<think>a</think><answer>Answer 1 is better</answer>", 0), (500, "", 0)]
    metrics = evaluate_endpoint(JudgeClient(url, "judge", concurrency=1, retries=0), BENCH, rows, tmp_path / "run")
    assert metrics["agreement"] == 0.5 and metrics["unparseable"] == 0.5 and metrics["judge_failures"] == 1
    assert metrics["pairs"] == 1 and metrics["consistency"] == 0.0
    assert server.seen[0]["messages"] == row_request(rows[0])  # the prompt it was trained on
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples[1]["error"].startswith("http 500")


def test_vagent_eval_endpoint_and_checkpoint(fake, tmp_path, tiny_qwen25, capsys):  # noqa: F811
    _, url = fake  # the scripted endpoint answers "Judgement: 1" to everything: no verdict
    data = _pairs(tmp_path, n=2)
    assert main(["eval", "--endpoint", url, "--benchmark", "judge-pairs", "--data", str(data),
                 "--out", str(tmp_path / "endpoint")]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "endpoint" / "metrics.json").read_text())
    assert metrics["unparseable"] == 1.0 and metrics["model"] == "judge-model" and metrics["n"] == 7
    assert main(["eval", "--model", str(tiny_qwen25), "--benchmark", "judge-pairs", "--data", str(data),
                 "--out", str(tmp_path / "ckpt"), "--max-new-tokens", "4", "--max-turns", "1"]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "ckpt" / "metrics.json").read_text())
    assert {"agreement", "unparseable", "consistency", "first_preference", "pairs"} <= set(metrics)
    assert metrics["samples"] == 7 and metrics["pairs"] == 4
    assert metrics["tools"] == "none"  # judge-pairs rows offer no tools
    with pytest.raises(SystemExit):  # neither --model nor --endpoint (nor --rerun): a usage error, named
        main(["eval", "--benchmark", "judge-pairs", "--data", str(data), "--out", str(tmp_path / "x")])
    assert "--model or --endpoint required" in capsys.readouterr().err


# -- the prompt a trained judge gets is the one it was trained on -----------------------------------------------------


def test_the_served_judge_reads_its_training_prompt(tmp_path, policy):
    """A judgment row's SFT/rollout prompt, and the request the ``judge`` reward sends for the same answers, are the
    same messages once the server parses them, and encode to the same token ids."""
    image = tmp_path / "tile.png"
    Image.new("RGB", (80, 56), (20, 140, 40)).save(image)
    judgment = Judgment("pairwise", "answers", "What digit is on the green tile?", ["It is 4.", "5"], "4", 1)
    row = load_rows(write_rows([judgment_row("j", judgment, images=[str(image)])], tmp_path / "rows.jsonl"))[0]
    trained = prompt_messages(Task.from_row(row, ["crop"]))  # what SFT, distill and GRPO show the judge
    # what the GRPO loop sends for a policy's answers to that question (judge.prompt: judgment)
    policy_row = Row(id="q", question="What digit is on the green tile?", answer="4", answer_type="exact",
                     images=[str(image)])  # fmt: skip
    captured = []

    class Client:
        def complete_many(self, requests, **params):
            captured.extend(requests)
            return [SimpleNamespace(text="", error="offline")] * len(requests)

    cfg = JudgeConfig(url="http://judge/v1", prompt="judgment", mode="pairwise")
    samples = [Trajectory("t", [], answer=a, stop_reason="answered") for a in ("5", "It is 4.")]
    judge_scores(Client(), cfg, samples, [policy_row] * 2, group_size=2)  # pair_order: sample 1 is Answer 1
    assert captured == [judgment_request(judgment, [str(image)])] == [row_request(row)]
    served = parse_chat_request(json.dumps({"model": "judge", "messages": captured[0]}).encode(), model_name="judge",
                                allowed_roots=[], max_image_pixels=10**8).messages  # fmt: skip
    assert [(m.role, m.plain_text) for m in served] == [(m.role, m.plain_text) for m in trained]
    pixels = [p.image.tobytes() for m in served for p in m.content if p.image is not None]
    assert pixels == [Image.open(image).convert("RGB").tobytes()]  # full resolution, lossless
    shown = [policy.model_view(Image.open(image).convert("RGB"))]
    assert torch.equal(encode_prompt(policy.processor, served, shown)["input_ids"],
                       encode_prompt(policy.processor, trained, shown)["input_ids"])  # fmt: skip


def test_the_judge_sees_the_question_the_policy_saw_with_its_choices(tmp_path):
    image = tmp_path / "tile.png"
    Image.new("RGB", (56, 56), (20, 140, 40)).save(image)
    row = Row(id="c", question="Which digit is on the tile?", choices=["3", "7"], answer="A", answer_type="choice",
              images=[str(image)])  # fmt: skip
    shown = Task.from_row(row, []).question  # what the policy's prompt asked
    assert shown.endswith("\nA. 3\nB. 7")
    samples = [Trajectory("t", [], answer=a, stop_reason="answered") for a in ("A", "B")]
    for cfg, expected in ((JudgeConfig(url="http://judge/v1", prompt="judgment", mode="pairwise"), f"Question: {shown}\n"),
                          (JudgeConfig(url="http://judge/v1", mode="correct"), f"[Question]: {shown}\n")):  # fmt: skip
        client = _Capture()
        judge_scores(client, cfg, samples, [row] * 2, group_size=2)
        assert expected in client.requests[0][-1]["content"][-1]["text"]


@pytest.mark.parametrize("both_orders", [False, True])
def test_a_groups_requests_share_one_encoding_of_its_image(tmp_path, monkeypatch, both_orders):
    """Every pairwise request of a group shows the row's image: it is encoded once per judge_scores call and each
    request holds the same string (a 2000x1500 PNG is 0.7 s and 11.5 MiB as a data URL)."""
    image = tmp_path / "tile.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(image)
    encodes = []

    def counted(picture, max_side=None):
        encodes.append(picture.size)
        return data_url(picture, max_side)

    monkeypatch.setattr(verdicts, "_data_url", counted)
    row = Row(id="q", question="Digit?", answer="4", answer_type="exact", images=[str(image)])
    samples = [Trajectory("t", [], answer=f"It is {k}.", stop_reason="answered") for k in range(4)]
    client = _Capture()
    judge_scores(client, JudgeConfig(url="http://judge/v1", prompt="judgment", mode="pairwise",
                                     both_orders=both_orders), samples, [row] * 4, group_size=4)  # fmt: skip
    urls = [part["image_url"]["url"] for request in client.requests for m in request if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == "image_url"]  # fmt: skip
    assert len(urls) == (12 if both_orders else 6) and encodes == [(64, 48)]
    assert all(url is urls[0] for url in urls)  # one string, not copies


class _Capture:
    """A judge client that records the requests and answers none (each fails)."""

    def __init__(self):
        self.requests = []

    def complete_many(self, requests, **params):
        self.requests.extend(requests)
        return [SimpleNamespace(text="", error="offline")] * len(requests)


def test_judge_config_checks_the_judgment_prompt():
    with pytest.raises(ConfigError, match="mode correct has no judgment rows"):
        load_config(GRPOConfig, None, ["judge.prompt=judgment", "judge.mode=correct"])
    with pytest.raises(ConfigError, match="judge.prompt must be"):
        load_config(GRPOConfig, None, ["judge.prompt=vagent"])
    with pytest.raises(ConfigError, match="judge.scale"):
        load_config(GRPOConfig, None, ["judge.scale=[5, 1]"])


def test_a_pointwise_trained_judge_scores_on_its_scale(fake):  # noqa: F811
    server, url = fake
    server.script = [(200, "<think>ok</think><answer>8</answer>", 0), (200, "<think>?</think><answer>n/a</answer>", 0)]
    cfg = JudgeConfig(url=url, prompt="judgment", mode="score", scale=[0.0, 10.0], reference=False)
    row = Row(id="q", question="Q?", answer="4", answer_type="exact")
    samples = [Trajectory("t", [], answer=a, stop_reason="answered") for a in ("four", "five")]
    scores, failed = judge_scores(JudgeClient(url, "m", concurrency=1), cfg, samples, [row] * 2, group_size=2)
    assert scores == [0.8, None] and failed == [False, True]
    assert server.seen[0]["stop"] == ["</answer>"]  # the turn ends where the engine ended the judge's training turns
    text = server.seen[0]["messages"][-1]["content"][-1]["text"]
    assert "from 0 to 10" in text and "Answer: four" in text and "Reference answer" not in text

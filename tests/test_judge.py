"""Judged rewards: the verdict parser on malformed judge text, pairwise -> win rates, Tool-Star's hierarchical
reward on hand-written trajectories, and the judge client (retries, timeouts, cache) against a fake endpoint."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vagent.config import JudgeConfig
from vagent.data import Row
from vagent.judge import JudgeClient, judge_messages, parse_verdict
from vagent.judge.client import TRUNCATED
from vagent.recipes.judged import JudgedRewards, judge_scores
from vagent.rewards import REWARDS, pairwise_win_rates
from vagent.types import Message, ToolResult, Trajectory

# -- the verdict parser -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Judgement: 1", 1.0),
        ("judgment:0", 0.0),
        ("The answers agree.\n**Judgement:** 1", 1.0),
        ("1", 1.0),
        ("Incorrect.", 0.0),
        ("Judgement: 0 ... on reflection Judgement: 1", 1.0),  # the last verdict counts
        ("", None),
        ("Judgement: maybe", None),
        ("<think>unclosed", None),
    ],
)
def test_correct_mode_parser(text, score):
    verdict = parse_verdict(text, "correct")
    assert verdict.score == score
    assert (verdict.error is None) == (score is not None)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Mostly right.\nScore: 7", 0.7),
        ("Score: 10/10", 1.0),
        ("score : **3**", 0.3),
        ("Score: 11", None),  # out of range is not a verdict
        ("Score: -2", None),
        ("seven out of ten", None),
        ("\x00\ufffd garbage", None),
    ],
)
def test_score_mode_parser(text, score):
    assert parse_verdict(text, "score").score == pytest.approx(score) if score is not None else True
    assert (parse_verdict(text, "score").score is None) == (score is None)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("<think>2 is wrong</think><answer>Answer 1 is better</answer>", 1.0),
        ("<think>x</think>\n<answer> answer 2 is the better </answer>", 0.0),
        ("<answer>Answer 2 is better", 0.0),  # unclosed tag
        ("no tags: Answer 1 is better.", 1.0),
        ("<answer>Answer 1 is better. Answer 2 is better.</answer>", None),  # contradictory
        ("<answer>Both are fine</answer>", None),
        ("<think>Answer 1 is better? no</think><answer>tie</answer>", None),  # the verdict block has none
        ("<think>1. Answer 2 is better grounded", None),  # reasoning cut short: no verdict
        ("<think>2 misreads it</think> Answer 1 is better.", 1.0),  # after closed reasoning
    ],
)
def test_pairwise_parser(text, score):
    assert parse_verdict(text, "pairwise").score == score


def test_reasoning_is_kept():
    verdict = parse_verdict("<think>the red one is left</think><answer>Answer 1 is better</answer>", "pairwise")
    assert verdict.reasoning == "the red one is left"
    assert parse_verdict("They match in meaning.\nJudgement: 1", "correct").reasoning == "They match in meaning."


def test_unknown_template_fields_stay_as_written():
    messages = judge_messages("Q: {question} / {not_a_field}", {"question": "why?"})
    assert messages[0]["content"][-1]["text"] == "Q: why? / {not_a_field}"


# -- pairwise -> scores ---------------------------------------------------------------------------------------


def test_win_rates_by_hand():
    # 0 beats 1 and 2; 2 beats 1 once and ties once; the failed comparison is left out.
    outcomes = [(0, 1, 1.0), (0, 2, 1.0), (2, 1, 1.0), (1, 2, 0.5), (1, 2, None)]
    # 1: lost twice, one tie -> 0.5 / 3; 2: lost once, won once, one tie -> 1.5 / 3.
    assert pairwise_win_rates(3, outcomes) == [1.0, pytest.approx(0.5 / 3), pytest.approx(1.5 / 3)]


def test_win_rates_when_every_comparison_failed_are_none():
    assert pairwise_win_rates(2, [(0, 1, None)]) == [None, None]
    assert pairwise_win_rates(1, []) == [None]


def test_judge_reward_maps_failures_to_neutral():
    t = [Trajectory("a", []), Trajectory("b", [])]
    assert REWARDS["judge"](t, [None, None], scores=[0.0, None], neutral=0.25) == [0.0, 0.25]
    with pytest.raises(ValueError, match="needs scores"):
        REWARDS["judge"](t, [None, None])


# -- Tool-Star --------------------------------------------------------------------------------------------------


def _row(answer="Eiffel Tower", answer_type="f1"):
    return Row(id="q", question="q", answer=answer, answer_type=answer_type)


def _traj(answer, tools=(), stop="answered", metrics=None):
    results = [ToolResult(n, {}, e) for n, e in tools]
    return Trajectory("t", [], answer=answer, stop_reason=stop, tool_results=results, metrics=metrics or {})


def test_tool_star_hierarchy():
    rows = [_row()] * 7
    trajectories = [
        _traj(None, stop="max_turns"),  # no answer: format violation
        _traj("Eiffel Tower", metrics={"parse_error/unclosed_tag": 1}),  # right, but ill-formed
        _traj("Big Ben"),  # well-formed and wrong
        _traj("the Eiffel Tower"),  # right, no tools
        _traj("Eiffel", [("search", None), ("code", None)]),  # partly right (F1 2/3) with two kinds of tools
        _traj("Eiffel Tower", [("search", None), ("search", None)]),  # one kind only: no bonus
        _traj("Eiffel Tower", [("search", None), ("code", "timeout")]),  # the second kind failed: no bonus
    ]
    assert REWARDS["tool_star"](trajectories, rows) == pytest.approx([-1.0, -1.0, 0.0, 1.0, 2 / 3 + 0.1, 1.0, 1.0])


def test_tool_star_wrong_with_tools_gets_no_bonus():
    assert REWARDS["tool_star"]([_traj("Big Ben", [("search", None), ("code", None)])], [_row()]) == [0.0]


# -- the client ---------------------------------------------------------------------------------------------------


class _Judge(BaseHTTPRequestHandler):
    """A scripted endpoint: the server's ``script`` lists (status, content, delay_s[, finish_reason]) per request."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        status, content, delay, *finish = self.server.script.pop(0) if self.server.script else (200, "Judgement: 1", 0)
        time.sleep(delay)
        choice = {"message": {"content": content}, "finish_reason": finish[0] if finish else "stop"}
        payload = {"choices": [choice]} if status == 200 else {"error": {"message": "no"}}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        data = json.dumps({"data": [{"id": "judge-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.script, server.seen = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_client_retries_5xx_and_caches_by_request(fake, tmp_path):
    server, url = fake
    server.script = [(503, "", 0), (200, "Judgement: 0", 0)]
    client = JudgeClient(url, "m", retries=2, backoff_s=0.01, cache_path=tmp_path / "cache.jsonl")
    messages = [{"role": "user", "content": "q"}]
    reply = client.complete(messages)
    assert (reply.text, reply.error, reply.attempts) == ("Judgement: 0", None, 2)
    assert client.complete(messages).cached and len(server.seen) == 2  # the same request is not sent again
    assert not client.complete([{"role": "user", "content": "other"}]).cached
    reloaded = JudgeClient(url, "m", cache_path=tmp_path / "cache.jsonl")  # the cache survives a restart
    assert reloaded.complete(messages).text == "Judgement: 0" and len(server.seen) == 3


def test_a_reply_cut_at_max_tokens_is_a_failure_cached_as_one(fake, tmp_path):
    """A CoT judge cut mid-reasoning (finish_reason length) names no verdict, whatever its reasoning says: the
    reply is a failure, not retried, and cached with its finish_reason (the same request is cut the same way)."""
    server, url = fake
    cut = "<think>1. Semantic accuracy: Answer 2 is better grounded in the image"
    server.script = [(200, cut, 0, "length")]
    messages = [{"role": "user", "content": "q"}]
    reply = JudgeClient(url, "m", retries=2, cache_path=tmp_path / "cache.jsonl").complete(messages)
    assert (reply.text, reply.error, reply.finish_reason, reply.attempts) == (cut, TRUNCATED, "length", 1)
    again = JudgeClient(url, "m", cache_path=tmp_path / "cache.jsonl").complete(messages)
    assert again.cached and again.error == TRUNCATED and len(server.seen) == 1
    assert parse_verdict(cut, "pairwise").score is None  # nor would the lenient parser read a verdict from it
    # a cache line from before finish_reason was kept may hold such a cut reply: it is asked again, not trusted
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"key": JudgeClient(url, "m").key(messages, temperature=0.0, max_tokens=512, seed=0),
                               "text": cut}) + "\n")  # fmt: skip
    server.script = [(200, "Judgement: 1", 0)]
    fresh = JudgeClient(url, "m", cache_path=old).complete(messages)
    assert (fresh.text, fresh.cached, len(server.seen)) == ("Judgement: 1", False, 2)


def test_a_judge_cut_mid_reasoning_fails_its_comparison_in_the_loop(fake):
    server, url = fake
    server.script = [(200, "<think>1. Semantic accuracy: Answer 2 is better grounded", 0, "length")]
    cfg = JudgeConfig(url=url, mode="pairwise", prompt="judgment")
    samples = [_sample("a"), _sample("b")]
    scores, failed = judge_scores(JudgeClient(url, "m", concurrency=1), cfg, samples, [_row()] * 2, group_size=2)
    assert scores == [None, None] and failed == [True, True]  # neutral and counted, not "Answer 2 won"
    assert samples[0].metrics["judge"]["comparisons"][0]["error"] == TRUNCATED


def test_client_does_not_retry_a_4xx_and_never_raises(fake):
    server, url = fake
    server.script = [(400, "", 0)]
    reply = JudgeClient(url, "m", retries=3, backoff_s=0.01).complete([{"role": "user", "content": "q"}])
    assert reply.error.startswith("http 400") and reply.attempts == 1 and len(server.seen) == 1


def test_client_timeout_and_dead_endpoint_are_failures(fake):
    server, url = fake
    server.script = [(200, "late", 1.0), (200, "late", 1.0)]
    reply = JudgeClient(url, "m", timeout_s=0.2, retries=1, backoff_s=0.01).complete([{"role": "user", "content": "q"}])
    assert reply.error == "timeout" and reply.attempts == 2
    dead = JudgeClient("http://127.0.0.1:9/v1", "m", timeout_s=1, retries=1, backoff_s=0.01)
    assert dead.complete([{"role": "user", "content": "q"}]).error.startswith("connection")


# -- the recipe's side ----------------------------------------------------------------------------------------------


def _sample(answer, text=None):
    messages = [Message.text("assistant", text if text is not None else f"<answer>{answer}</answer>")]
    return Trajectory("t", messages, answer=answer, stop_reason="answered" if answer else "no_action")


def test_pointwise_scores_failures_and_reasoning_in_the_trajectory(fake, tmp_path):
    server, url = fake
    server.script = [(200, "They agree.\nJudgement: 1", 0), (200, "no idea", 0)]
    cfg = JudgeConfig(url=url, mode="correct", retries=0, concurrency=1)  # in order: the script is sequential
    judged = JudgedRewards({"judge": 1.0}, {}, cfg, tmp_path)
    assert judged.client.model == "judge-model"  # judge.model null: the first model the server lists
    samples = [_sample("Paris"), _sample("Lyon"), _sample(None, text="")]
    totals, parts = judged.combine(samples, [_row("Paris")] * 3, group_size=3)
    assert totals == parts["judge"] == [1.0, 0.5, 0.0]  # unparseable -> neutral; an empty turn is wrong without a call
    assert parts["judge_failures"] == [0.0, 1.0, 0.0]
    assert samples[0].metrics["judge"]["reasoning"] == "They agree."
    assert samples[1].metrics["judge"]["error"] == "unparseable"
    assert "[Standard Answer]: Paris" in server.seen[0]["messages"][0]["content"][-1]["text"]


def test_pairwise_scores_are_win_rates_within_each_group(fake):
    server, url = fake
    # Group 1 (a, b, c): a beats b, a beats c, c beats b, asked as (b, a), (a, c), (c, b) (pair_order alternates
    # which sample is Answer 1). Group 2: two equal answers tie without a call.
    server.script = [(200, f"<answer>Answer {k} is better</answer>", 0) for k in (2, 1, 1)]
    client = JudgeClient(url, "m", concurrency=1)
    cfg = JudgeConfig(url=url, mode="pairwise")
    samples = [_sample("a"), _sample("b"), _sample("c"), _sample("same"), _sample("Same.")]
    scores, failed = judge_scores(client, cfg, samples, [_row()] * 5, group_size=3)
    assert scores == [1.0, 0.0, 0.5, 0.5, 0.5] and not any(failed)
    assert len(server.seen) == 3  # the equal pair cost no call
    shown = [[p["text"] for p in body["messages"][0]["content"]][-1] for body in server.seen]
    assert ["[Answer 1]: b\n[Answer 2]: a" in shown[0], "[Answer 1]: a\n[Answer 2]: c" in shown[1]] == [True, True]
    first = samples[0].metrics["judge"]["comparisons"][0]  # b (Answer 1) against a: 0, Answer 1 lost
    assert (first["answer1"], first["answer2"], first["score"]) == (1, 0, 0.0)


@pytest.mark.parametrize("both_orders", [False, True])
def test_a_judge_that_always_names_answer_1_moves_no_sample_of_a_group_more_than_another(fake, both_orders):
    """A judge with pure position bias: every sample of a group of 8 distinct answers is shown first in 3 or 4 of
    its 7 comparisons (pair_order), so win rates stay within 1/7 of a half; before, sample 0 (always Answer 1) won
    everything and sample 7 nothing. Both orders cancel the bias exactly."""
    server, url = fake
    server.script = [(200, "<answer>Answer 1 is better</answer>", 0)] * 56
    cfg = JudgeConfig(url=url, mode="pairwise", both_orders=both_orders)
    samples = [_sample(f"answer {k}") for k in range(8)]
    scores, failed = judge_scores(JudgeClient(url, "m", concurrency=1), cfg, samples, [_row()] * 8, group_size=8)
    assert not any(failed) and len(server.seen) == (56 if both_orders else 28)
    if both_orders:
        assert scores == [0.5] * 8
    else:
        assert sorted(scores) == [3 / 7] * 4 + [4 / 7] * 4

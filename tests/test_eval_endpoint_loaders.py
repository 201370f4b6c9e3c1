"""`vagent eval --endpoint` on every loader's published-layout file: a scripted OpenAI-compatible model on 127.0.0.1
that knows the answers scores 1.0 on each; one that answers in the harnesses' awkward formats scores as each
harness's rule reads them (the rules' own sources are cited in tests/test_eval_extract.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.test_eval_image_benchmarks import hrbench, mme, visualprobe, vstar  # noqa: F401  (fixtures)
from tests.test_eval_video_benchmarks import _charades, _lvb, _lvb_record, _mme
from vagent.cli import main
from vagent.eval import BENCHMARKS
from vagent.rollout import Task


class _Oracle(BaseHTTPRequestHandler):
    """Answers each request with ``server.reply(gold)``, ``gold`` being the answer of the record whose question the
    request's user text holds (``server.golds``: question text -> answer)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = " ".join(part.get("text", "") if isinstance(part, dict) else str(part) for m in body["messages"]
                        for part in (m["content"] if isinstance(m["content"], list) else [m["content"]]))  # fmt: skip
        golds = [gold for question, gold in self.server.golds.items() if question in text]
        reply = self.server.reply(golds[0]) if len(golds) == 1 else "I do not know which question this is."
        payload = {"id": "x", "object": "chat.completion", "model": "oracle",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}  # fmt: skip
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # /v1/models: --endpoint-model defaults to the first listed
        data = json.dumps({"object": "list", "data": [{"id": "oracle", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def oracle():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Oracle)
    httpd.golds, httpd.reply = {}, lambda gold: f"<answer>{gold}</answer>"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def _golds(name: str, data, image_root) -> dict[str, str]:
    """Each record's question as the model is asked it -> its answer as a right reply states it (the option letter,
    the span in seconds, or the text)."""
    rows, errors = BENCHMARKS[name].load(data, image_root)
    assert errors == [] and rows
    golds = {}
    for row in rows:
        question = Task.from_row(row, []).question  # as the prompt holds it (with the options, the subtitles)
        if row.choices:
            answer = str(row.answer)
            gold = answer if len(answer) == 1 else chr(ord("A") + row.choices.index(answer))
        elif row.answer_type == "span":
            gold = f"[{row.answer[0]}, {row.answer[1]}]"
        else:
            gold = row.answer if isinstance(row.answer, str) else row.answer[0]
        golds[question] = gold
    return golds


def _cases(tmp_path, vstar, hrbench, mme, visualprobe):  # noqa: F811
    lvb = tmp_path / "lvb"
    charades_txt, _ = _charades(tmp_path / "charades")
    return [
        ("vstar", vstar / "test_questions.jsonl", None),
        ("vstar", vstar, None),
        ("hr-bench", hrbench / "hr_bench_4k.tsv", None),
        ("hr-bench", hrbench / "hr_bench_8k.parquet", None),
        ("mme-realworld", mme / "MME_RealWorld.json", mme / "images"),
        ("visualprobe", visualprobe / "val.json", None),
        ("video-mme", _mme(tmp_path / "mme-video"), None),
        ("video-mme-sub", tmp_path / "mme-video" / "videomme" / "test-00000-of-00001.parquet", None),
        ("longvideobench", _lvb(lvb, [_lvb_record("86CxyhFV9MI_0", 2), _lvb_record("@user-7311_1", 0)]), None),
        ("temporal-grounding", charades_txt, tmp_path / "charades" / "Charades_v1_480"),
    ]


def test_a_model_knowing_the_answers_scores_one_on_each_loader(oracle, tmp_path, vstar, hrbench, mme, visualprobe):  # noqa: F811
    server, url = oracle
    for i, (name, data, image_root) in enumerate(_cases(tmp_path, vstar, hrbench, mme, visualprobe)):
        server.golds = _golds(name, data, image_root)
        out = tmp_path / f"run-{i}-{name}"
        args = ["eval", "--endpoint", url, "--benchmark", name, "--data", str(data), "--out", str(out),
                "--max-turns", "2"] + (["--image-root", str(image_root)] if image_root else [])  # fmt: skip
        assert main(args) == 0, name
        metrics = json.loads((out / "metrics.json").read_text())
        primary = BENCHMARKS[name].metrics[0]
        assert metrics[primary] == 1.0, (name, data.name, metrics[primary])
        assert metrics["endpoint_failures"] == 0 and metrics.get("parse_failures", 0) == 0, name
        card = json.loads((out / "protocol.json").read_text())
        assert card["backend"] == "endpoint" and card["endpoint_model"] == "oracle" and card["model"] == url


# Replies in the formats where the harnesses' rules part ways ({g}: the right letter, {o}: another one), and the
# accuracy each rule gives them (see tests/test_eval_extract.py for each rule's source).
AWKWARD = [
    ("<answer>{g}</answer>", {"vagent": 1.0, "strict": 1.0, "vlmevalkit": 1.0, "lmms-eval": 1.0}),
    # no answer tag: the profile reads none; the harnesses read the whole reply ("answer is X"; "(X)")
    ("The answer is ({g}).", {"vagent": 0.0, "strict": 0.0, "vlmevalkit": 1.0, "lmms-eval": 1.0}),
    # a lower-case letter: vagent's match ignores case; strict and both harnesses read capitals only
    ("<answer>{gl}</answer>", {"vagent": 1.0, "strict": 0.0, "vlmevalkit": 0.0, "lmms-eval": 0.0}),
    # two letters: no rule but lmms-eval's (its first character ranks highest) reads one
    ("<answer>{g} or {o}</answer>", {"vagent": 0.0, "strict": 0.0, "vlmevalkit": 0.0, "lmms-eval": 1.0}),
]


@pytest.mark.parametrize(("template", "expected"), AWKWARD, ids=[t for t, _ in AWKWARD])
def test_awkward_replies_score_as_each_harness_reads_them(oracle, tmp_path, vstar, template, expected):  # noqa: F811
    server, url = oracle
    data = vstar / "test_questions.jsonl"
    server.golds = _golds("vstar", data, None)
    server.reply = lambda g: template.format(g=g, gl=g.lower(), o="B" if g == "A" else "A")
    for rule, accuracy in expected.items():
        out = tmp_path / rule
        assert main(["eval", "--endpoint", url, "--benchmark", "vstar", "--data", str(data), "--out", str(out),
                     "--extract", rule, "--max-turns", "1"]) == 0  # fmt: skip
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["accuracy"] == accuracy, rule
        assert metrics["parse_failures"] == (metrics["samples"] if accuracy == 0.0 else 0), rule  # counted, not guessed

"""``vagent.eval.endpoint``: a model behind an OpenAI-compatible endpoint evaluated with vagent's tools run here.

The endpoint is a scripted server on 127.0.0.1 that reads the prompt the way a model would (the question's text,
the images' pixels) and answers in the agent profile's syntax, cutting its replies at the request's stop strings
as OpenAI does.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from vagent.eval import BENCHMARKS
from vagent.eval.endpoint import ENDPOINT_ERROR, _with_stop, endpoint_episodes
from vagent.eval.runner import evaluate
from vagent.judge.client import JudgeReply
from vagent.rollout import RolloutLimits, Task
from vagent.serve.request import parse_chat_request

BLUE = (20, 40, 220)
# A size the processor keeps as it is (sides multiples of 28, within Qwen2.5-VL's budget): the model's view is the
# original, so DeepEyes' original-pixel boxes and vagent's view-pixel boxes name the same square.
SIZE = (336, 280)
SQUARE = [0, 0, 112, 112]  # where the blue square is, in both frames
QUESTIONS = {"What color is the square in the corner?": ("blue", "red", "A"),
             "Which color is the small square?": ("green", "blue", "B")}  # fmt: skip
CALLS = {  # each profile's call syntax (vagent: boxes in the model's view; DeepEyes: in original pixels)
    "vagent": "<tool_call>" + json.dumps({"name": "crop", "arguments": {"bbox": SQUARE}}) + "</tool_call>",
    "deepeyes": "<think>too small</think><tool_call>"
    + json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": SQUARE}})
    + "</tool_call>",
}


class _Model(BaseHTTPRequestHandler):
    """Scripted chat completions; ``server.mode``: ``answer`` (reads the right letter off the question), ``crop``
    (zooms first, answers right only if the next request shows the blue crop), ``flaky`` (two 500s, then
    ``answer``), ``down`` (500 always), ``seeds`` (answers its seed, after a delay that reorders samples),
    ``swallowed`` (an answer closed around grammar tags)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.seen.append(body)
            server.count += 1
            count = server.count
        if server.mode == "down" or (server.mode == "flaky" and count <= 2):
            return self._send(500, {"error": {"message": "overloaded"}}, {"Retry-After": "0"})
        if server.mode == "seeds":
            time.sleep((body["seed"] % 4) * 0.03)
            return self._reply(body, f"<answer>{body['seed']}</answer>")
        if server.mode == "swallowed":  # an <answer> closed around tags, as the crop proof's GRPO wrote one
            return self._reply(body, "<answer>ris. rising. rising.</think>\n<answer>A</answer>")
        user = next(m for m in body["messages"] if m["role"] == "user")
        question = "".join(p["text"] for p in user["content"] if p["type"] == "text")
        letter = next(QUESTIONS[q][2] for q in QUESTIONS if q in question)
        if server.mode == "crop":
            if len(body["messages"]) == 2:  # system + question: look closer first
                return self._reply(body, CALLS[server.agent])
            last = body["messages"][-1]
            urls = [p["image_url"]["url"] for p in last["content"] if p["type"] == "image_url"]
            crop = _decode(urls[0]) if urls else None
            server.crops.append((last["role"], crop))
            blue = crop is not None and ImageStat.Stat(crop).mean[2] > 200
            letter = letter if blue else "Z"
        self._reply(body, f"<think>I see it.</think> <answer>{letter}</answer>")

    def _reply(self, body, text):
        stops = body.get("stop") or []
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        text = text[: min(hits)] if hits else text  # OpenAI leaves the stop string out
        usage = {"prompt_tokens": 100, "completion_tokens": len(text.split()), "total_tokens": 100}
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}], "usage": usage})  # fmt: skip

    def _send(self, status, payload, headers=None):
        data = json.dumps(payload).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _decode(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    httpd.mode, httpd.agent, httpd.seen, httpd.crops, httpd.count = "answer", "vagent", [], [], 0
    httpd.lock = threading.Lock()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


@pytest.fixture
def rows(tmp_path):
    image = Image.new("RGB", SIZE, (128, 128, 128))
    image.paste(BLUE, tuple(SQUARE))
    image.save(tmp_path / "scene.png")
    records = [{"id": f"q{i}", "image": "scene.png", "question": q, "options": [a, b], "answer": letter}
               for i, (q, (a, b, letter)) in enumerate(QUESTIONS.items())]  # fmt: skip
    (tmp_path / "vstar.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded, errors = BENCHMARKS["vstar"].load(tmp_path / "vstar.jsonl", None)
    assert errors == []
    return loaded


LIMITS = RolloutLimits(max_turns=3, max_new_tokens=64, temperature=0.7, top_p=0.9)


def _evaluate(url, rows, out: Path, agent="vagent", n_samples=1, **kwargs):
    episodes = endpoint_episodes(url, model="m", limits=LIMITS, agent=agent, concurrency=4, backoff_s=0.01, **kwargs)
    try:
        metrics = evaluate(None, BENCHMARKS["vstar"], rows, out, tools=None, limits=LIMITS, n_samples=n_samples,
                           progress=False, agent=agent, episodes=episodes)  # fmt: skip
    finally:
        episodes.close()
    trajectories = [json.loads(line) for line in (out / "trajectories.rank0.jsonl").read_text().splitlines()]
    return metrics, trajectories


@pytest.mark.parametrize("agent", ["vagent", "deepeyes"])
def test_a_model_that_answers_scores_every_row(server, rows, tmp_path, agent):
    httpd, url = server
    metrics, trajectories = _evaluate(url, rows, tmp_path / "out", agent=agent, n_samples=2)
    assert metrics["accuracy"] == 1.0 and metrics["n"] == 2
    assert {t["stop_reason"] for t in trajectories} == {"answered"} and len(trajectories) == 4
    body = httpd.seen[0]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("m", 0.7, 0.9, 64)
    assert body.get("stop") == (["</tool_call>", "</answer>"] if agent == "vagent" else None)
    image = next(p for p in body["messages"][1]["content"] if p["type"] == "image_url")
    assert _decode(image["image_url"]["url"]).size == SIZE  # the row's image, sent as a PNG data URL
    # one seed per (task, sample, turn): samples of a row differ, and a rerun asks the very same
    assert len({b["seed"] for b in httpd.seen}) == 4
    first = sorted(b["seed"] for b in httpd.seen)
    httpd.seen.clear()
    _evaluate(url, rows, tmp_path / "again", agent=agent, n_samples=2)
    assert sorted(b["seed"] for b in httpd.seen) == first


@pytest.mark.parametrize("agent", ["vagent", "deepeyes"])
def test_the_crop_runs_here_and_its_image_goes_back_to_the_model(server, rows, tmp_path, agent):
    httpd, url = server
    httpd.mode, httpd.agent = "crop", agent
    metrics, trajectories = _evaluate(url, rows, tmp_path / "out", agent=agent)
    assert metrics["accuracy"] == 1.0  # the server answered right only where it saw the blue crop
    role = "tool" if agent == "vagent" else "user"  # each profile's own observation turn
    assert [r for r, _ in httpd.crops] == [role, role] and all(c.size == (112, 112) for _, c in httpd.crops)
    for t in trajectories:
        assert t["metrics"]["turns"] == 2 and t["metrics"]["tool_calls"] == 1 and t["stop_reason"] == "answered"
        [result] = t["tool_results"]
        assert (result["name"], result["error"], result["metadata"]["box_original"]) == ("crop", None, SQUARE)
        observation = t["messages"][3]
        assert observation["role"] == role and any(p["type"] == "image" for p in observation["content"])
    # vagent's server cut the call at its stop string; the client put "</tool_call>" back for the parser
    assert trajectories[0]["messages"][2]["content"][0]["text"].endswith("</tool_call>")


def test_tool_turns_go_as_user_turns_for_apis_that_refuse_images_in_tool_messages(server, rows, tmp_path):
    httpd, url = server
    httpd.mode = "crop"
    metrics, _ = _evaluate(url, rows[:1], tmp_path / "out", tool_role="user")
    assert metrics["accuracy"] == 1.0 and [r for r, _ in httpd.crops] == ["user"]


def test_the_engines_limits_stop_episodes_as_the_engine_names_them(server, rows, tmp_path):
    """A crop past ``max_images`` ends the episode before its image is shown (the call ran and is counted); a turn
    budget of one ends it after the call."""
    httpd, url = server
    httpd.mode = "crop"
    for limits, stop in ((RolloutLimits(max_images=1), "max_images"), (RolloutLimits(max_turns=1), "max_turns")):
        [trajectory] = endpoint_episodes(url, model="m", limits=limits)(
            [Task("q0", next(iter(QUESTIONS)) + "\nA. blue\nB. red", images=[rows[0].images[0]])], 1
        )
        assert trajectory.stop_reason == stop and trajectory.metrics["tool_calls"] == 1
        assert len(trajectory.tool_results) == 1 and trajectory.answer is None
    assert len(httpd.seen) == 2 and httpd.crops == []  # one request each: the crop never went back


def test_an_answer_closed_around_tags_is_answered_but_not_well_formed(server, rows, tmp_path):
    httpd, url = server
    httpd.mode = "swallowed"
    metrics, trajectories = _evaluate(url, rows, tmp_path / "out")
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert {t["stop_reason"] for t in trajectories} == {"answered"} and metrics["answered"] == 1.0
    assert [s["parse_errors"] for s in samples] == [{"tag_in_answer": 1}] * 2 and metrics["well_formed"] == 0.0


def test_server_errors_are_retried(server, rows, tmp_path):
    httpd, url = server
    httpd.mode = "flaky"
    metrics, trajectories = _evaluate(url, rows, tmp_path / "out")
    assert metrics["accuracy"] == 1.0
    assert sum(t["metrics"].get("endpoint_retries", 0) for t in trajectories) == 2


def test_an_endpoint_that_never_answers_fails_its_episodes_and_they_are_counted(server, rows, tmp_path):
    httpd, url = server
    httpd.mode = "down"
    metrics, trajectories = _evaluate(url, rows, tmp_path / "out", retries=1)
    assert metrics["accuracy"] == 0.0 and metrics["answered"] == 0.0
    assert len(httpd.seen) == 4  # two rows, two attempts each
    for t in trajectories:
        assert t["stop_reason"] == "failed" and t["metrics"][ENDPOINT_ERROR].startswith("http 500: overloaded")
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [s["stop_reason"] for s in samples] == ["failed", "failed"]
    assert metrics["endpoint_failures"] == 2 and "parse_failures" in metrics and metrics["parse_failures"] == 0
    # the same command once the server is back retries the failed episodes (a resume does not take them as done)
    httpd.mode = "answer"
    metrics, _ = _evaluate(url, rows, tmp_path / "out", retries=1)
    assert metrics["accuracy"] == 1.0 and metrics["endpoint_failures"] == 0 and metrics["samples"] == 2


def test_a_tasks_samples_reach_progress_in_sample_order(server):
    """The runner numbers a task's samples by arrival; the server answers each sample's seed, later for some."""
    httpd, url = server
    httpd.mode = "seeds"
    tasks = [Task(id=f"t{i}", question="?", images=[Image.new("RGB", (56, 56))]) for i in range(2)]
    arrived = []
    episodes = endpoint_episodes(url, model="m", limits=LIMITS, concurrency=8, seed=5)
    returned = episodes(tasks, 4, arrived.append)
    expected = {t.id: [str(zlib.crc32(f"5/{t.id}/{s}/1".encode())) for s in range(4)] for t in tasks}
    for task in tasks:
        assert [t.answer for t in arrived if t.task_id == task.id] == expected[task.id]
    assert [t.answer for t in returned] == expected["t0"] + expected["t1"]  # rollout.run's order


def test_the_stop_string_a_server_left_out_is_put_back():
    stops = ("</tool_call>", "</answer>")
    assert _with_stop(JudgeReply("<think>x</think><answer>B", finish_reason="stop"), stops).endswith("B</answer>")
    assert _with_stop(JudgeReply("no tags", finish_reason="stop"), stops) == "no tags"  # ended at EOS
    assert _with_stop(JudgeReply("<answer>B", finish_reason="length"), stops) == "<answer>B"  # cut, not stopped
    vllm = JudgeReply("<answer>B", finish_reason="stop", choice={"stop_reason": None})  # vLLM says: EOS
    assert _with_stop(vllm, stops) == "<answer>B"
    vllm.choice["stop_reason"] = "</answer>"
    assert _with_stop(vllm, stops) == "<answer>B</answer>"


def test_vagent_serve_takes_a_tool_turn_with_its_image(tmp_path):
    """The vagent profile's observation is a ``tool`` turn with the crop: ``vagent serve`` accepts it."""
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), BLUE).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"model": "m", "messages": [
        {"role": "user", "content": "look"}, {"role": "assistant", "content": CALLS["vagent"]},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "ok"}]}]}  # fmt: skip
    request = parse_chat_request(json.dumps(body).encode(), model_name="m", allowed_roots=[], max_image_pixels=10**7)
    assert [m.role for m in request.messages] == ["user", "assistant", "tool"] and len(request.images) == 1

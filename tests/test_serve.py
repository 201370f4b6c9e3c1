"""``vagent serve`` end to end: a subprocess on the tiny checkpoint, driven with the official ``openai`` client."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import urllib.request

import pytest
from PIL import Image

from tests.serve_helpers import start_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MODEL = "tiny"
MAX_QUEUE = 24  # above the 20-request concurrency test, low enough to fill by hand
MAX_IMAGE_PIXELS = 1_000_000  # a 1200x1200 image is then a "bomb" without allocating gigabytes in the test


@pytest.fixture(scope="module")
def server(tiny_qwen25, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    process, url = start_server(tiny_qwen25, "--served-model-name", MODEL, "--allowed-media-root", str(media),
                                "--max-queue", str(MAX_QUEUE), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
                                log=media.parent / "serve.log")  # fmt: skip
    yield url, media
    stop_server(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "What color is the square?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def ask(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Say something."}])
    kwargs.setdefault("model", MODEL)
    return client.chat.completions.create(max_tokens=kwargs.pop("max_tokens", 8), **kwargs)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_with_an_image_counts_its_tokens(client, server):
    red = Image.new("RGB", (96, 64), (220, 20, 20))
    response = ask(client, messages=image_message(data_url(red)), max_tokens=6, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    text_only = ask(client, messages=[{"role": "user", "content": "What color is the square?"}], max_tokens=6)
    # The image adds its visual tokens to the prompt; the completion is what was sampled (at most max_tokens).
    assert response.usage.prompt_tokens > text_only.usage.prompt_tokens
    assert 1 <= response.usage.completion_tokens <= 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    # The same image from a local path under the allowed root gives the same greedy answer.
    path = server[1] / "red.png"
    red.save(path)
    again = ask(client, messages=image_message(str(path)), max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens == response.usage.prompt_tokens


def test_n_samples_and_seed(client):
    first = ask(client, n=2, seed=7, max_tokens=12, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1]
    assert 2 <= first.usage.completion_tokens <= 24  # both choices' sampled tokens (1 to 12 each)
    again = ask(client, n=2, seed=7, max_tokens=12, temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_logprobs_of_the_sampled_tokens(client):
    choice = ask(client, max_tokens=5, temperature=0, logprobs=True).choices[0]
    entries = choice.logprobs.content
    assert 1 <= len(entries) <= 5 and all(e.logprob <= 0.0 and e.top_logprobs == [] for e in entries)
    with pytest.raises(openai.BadRequestError):
        ask(client, logprobs=True, top_logprobs=3)


def test_streaming_matches_the_greedy_completion(client):
    whole = ask(client, max_tokens=10, temperature=0).choices[0].message.content
    chunks = list(ask(client, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_stop_string_is_cut_out(client):
    whole = ask(client, max_tokens=16, temperature=0).choices[0].message.content
    if len(whole) < 4:
        pytest.skip("the greedy completion is too short to pick a stop string from")
    stop = whole[2:4]
    cut = ask(client, max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert cut.message.content == whole[: whole.find(stop)] and cut.finish_reason == "stop"
    # Streamed, the text that might still become the stop string is held back, never sent and taken back.
    chunks = list(ask(client, max_tokens=16, temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut.message.content


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_tool_calls_come_back_in_openai_form(client):
    # A random model does not call tools by itself: the assistant turn is started for it
    # (vLLM's continue_final_message) with a call; the server parses the whole turn.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": call}]
    response = ask(client, messages=messages, tools=[WEATHER], max_tokens=4,
                   extra_body={"continue_final_message": True})  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    streamed = list(ask(client, messages=messages, tools=[WEATHER], max_tokens=4, stream=True,
                        extra_body={"continue_final_message": True}))  # fmt: skip
    calls = [call for c in streamed for call in (c.choices[0].delta.tool_calls or [])]
    assert [call.function.name for call in calls] == ["get_weather"] and streamed[-1].choices[
        0
    ].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in streamed)
    # The call and its result go back as history, as an OpenAI client sends them.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [choice.message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    follow_up = ask(client, messages=history, tools=[WEATHER], max_tokens=4)
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _error(client, **kwargs) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, **kwargs)
    return info.value.status_code, info.value.body


def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, server, tmp_path):
    status, body = _error(client, model="gpt-5")
    assert status == 404 and body["code"] == "model_not_found" and body["param"] == "model"
    status, body = _error(
        client, messages=image_message("data:image/png;base64," + base64.b64encode(b"not an image").decode())
    )
    assert status == 400 and body["code"] == "invalid_image" and body["param"] == "messages[0].content[0]"
    bomb = Image.new("1", (1200, 1200))  # 1.44 M pixels, above the server's 1 M limit
    status, body = _error(client, messages=image_message(data_url(bomb)))
    assert status == 400 and "above the limit" in body["message"]
    status, body = _error(client, messages=image_message("https://example.com/cat.png"))
    assert status == 400 and "not fetched" in body["message"]
    outside = tmp_path / "outside.png"
    Image.new("RGB", (32, 32)).save(outside)
    status, body = _error(client, messages=image_message(str(outside)))
    assert status == 400 and "allowed-media-root" in body["message"]
    status, body = _error(client, max_tokens=10**7)
    assert status == 400 and body["code"] == "context_length_exceeded"
    for bad in ({"temperature": 5}, {"n": 0}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}):
        status, body = _error(client, **bad)
        assert status == 400 and set(body) == {"message", "type", "param", "code"}
    request = urllib.request.Request(f"{server[0]}/chat/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and "not valid JSON" in json.loads(info.value.read())["error"]["message"]
    assert ask(client).choices[0].message.content is not None  # still serving


def _health(base: str) -> dict:
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=30) as response:
        return json.loads(response.read())


def test_twenty_concurrent_requests_all_complete_in_shared_batches(client, server):
    results, errors = [], []
    steps_before = _health(server[0])["steps"]

    def one(i: int) -> None:
        try:
            results.append(ask(client, max_tokens=6 + i % 5))  # no seed: a seeded request runs in a batch of its own
        except Exception as e:  # collected: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 20
    assert all(r.choices[0].message.content is not None for r in results)
    # One at a time, each sampled token would cost one step (the prefill samples the first): fewer steps than
    # tokens means requests shared forward passes.
    assert _health(server[0])["steps"] - steps_before < sum(r.usage.completion_tokens for r in results)


def test_over_the_queue_limit_is_429_then_serving_resumes(client, server):
    # Requests whose bodies are still arriving hold their place (a slow upload is held in memory too), so the
    # queue is filled deterministically: each socket sends its headers and half of its body, then waits.
    host, port = server[0].split("//")[1].split("/")[0].split(":")
    sockets = []
    try:
        for _ in range(MAX_QUEUE):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")  # fmt: skip
            sockets.append(sock)
        while _health(server[0])["requests"] < MAX_QUEUE:
            time.sleep(0.05)
        status, body = _error(client)
        assert status == 429 and body["type"] == "rate_limit_exceeded" and body["code"] == "queue_full"
    finally:
        for sock in sockets:
            sock.close()
    while _health(server[0])["requests"] > 0:  # the server notices the closed connections
        time.sleep(0.05)
    assert ask(client).choices[0].message.content is not None


def test_a_failing_model_step_is_a_500_and_the_server_goes_on(policy, monkeypatch):
    """In process (the failure is injected): the requests in flight get a 500 body, the next one is served."""
    from fastapi.testclient import TestClient

    from vagent.serve.app import ServerOptions, create_app
    from vagent.serve.backend import BatchedGenerator

    step = BatchedGenerator.step
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        return step(self)

    monkeypatch.setattr(BatchedGenerator, "step", flaky)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with TestClient(create_app(policy, ServerOptions(model_name="m"))) as http:
        failed = http.post("/v1/chat/completions", json=body)
        assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
        ok = http.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert http.get("/health").json()["requests"] == 0

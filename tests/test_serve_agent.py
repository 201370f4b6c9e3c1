"""``vagent serve --agent``: the tool loop runs on the server; the answer comes with its trajectory."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.serve_helpers import start_server, stop_server
from tests.test_serve import data_url

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tiny_qwen25, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent") / "serve.log"
    process, url = start_server(tiny_qwen25, "--served-model-name", "tiny", "--agent", "--tools", "crop,rotate",
                                "--max-turns", "2", log=log)  # fmt: skip
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    stop_server(process)


def _question(image: Image.Image) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                        {"type": "text", "text": "What is written in the corner?"}]}  # fmt: skip


def test_agent_mode_runs_a_crop_and_returns_the_trajectory(client):
    image = Image.new("RGB", (320, 240), (240, 240, 240))
    image.paste((10, 10, 200), (0, 0, 60, 60))
    # The first assistant turn is forced (a random model does not call tools by itself); the server runs its
    # crop, shows the crop to the model and lets it sample the next turn.
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 40, 40]}}</tool_call>'
    response = client.chat.completions.create(model="tiny", messages=[_question(image), {"role": "assistant",
                                              "content": crop}], max_tokens=8, temperature=0)  # fmt: skip
    choice = response.choices[0]
    trajectory = choice.model_extra["trajectory"]
    roles = [m["role"] for m in trajectory["messages"]]
    assert roles[:4] == ["system", "user", "assistant", "tool"]
    assert trajectory["tool_results"][0]["name"] == "crop" and trajectory["tool_results"][0]["error"] is None
    tool_images = [p for p in trajectory["messages"][3]["content"] if p["type"] == "image"]
    assert len(tool_images) == 1 and tool_images[0]["path"].startswith("data:image/png;base64,")
    assert "crop" in trajectory["messages"][0]["content"][0]["text"]  # the offered tools are in the system prompt
    # The forced turn is not counted as sampled; the model's own turns are.
    assert response.usage.completion_tokens == sum(trajectory["loss_mask"]) >= 1
    assert choice.message.content == (trajectory["answer"] or "")  # the answer, never the last turn's raw text


def test_an_episode_without_an_answer_has_empty_content_and_says_why():
    """``content`` is the final answer; an episode that ended without one (the model stopped without acting, or a
    cap cut it) gives "" rather than its last turn's text, with the stop reason in the trajectory and
    ``finish_reason`` "length" for a cap, as an OpenAI client reads it."""
    from vagent.serve.app import _agent_choice
    from vagent.types import Message, Trajectory

    def episode(last: str, answer: str | None, stop: str) -> Trajectory:
        return Trajectory("t", [Message.text("user", "q?"), Message.text("assistant", last)], answer=answer,
                          stop_reason=stop)  # fmt: skip

    answered = _agent_choice(0, episode("<think>a 7</think><answer>7</answer>", "7", "answered"))
    assert answered["message"]["content"] == "7" and answered["finish_reason"] == "stop"
    for last, stop, finish in (("I am not sure what", "no_action", "stop"), ('<tool_call>{"name": "cr', "max_tokens",
                                                                               "length")):  # fmt: skip
        choice = _agent_choice(0, episode(last, None, stop))
        assert choice["message"]["content"] == "" and choice["finish_reason"] == finish
        assert choice["trajectory"]["stop_reason"] == stop
        assert choice["trajectory"]["messages"][-1]["content"][0]["text"] == last  # the raw turn is still there


def test_agent_mode_refuses_what_it_cannot_do(client):
    image = Image.new("RGB", (64, 64))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[_question(image)], stream=True)
    assert info.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[_question(image)],
                                       tools=[{"type": "function", "function": {"name": "code"}}])  # fmt: skip
    assert "not offered" in info.value.body["message"]
    ok = client.chat.completions.create(model="tiny", messages=[_question(image)], max_tokens=4, n=2, seed=1)
    assert len(ok.choices) == 2 and all("trajectory" in c.model_extra for c in ok.choices)


def test_agent_mode_speaks_a_published_agents_protocol(tiny_qwen25, tmp_path):
    """`--agent-profile deepeyes`: DeepEyes' own tool call runs vagent's crop, and its observation comes back as
    DeepEyes renders it (a user turn wrapped in <tool_response>), not as vagent's tool turn."""
    process, url = start_server(tiny_qwen25, "--served-model-name", "tiny", "--agent", "--agent-profile", "deepeyes",
                                "--max-turns", "2", log=tmp_path / "serve.log")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        zoom = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 160, 120]}}</tool_call>'
        response = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
            _question(Image.new("RGB", (320, 240))), {"role": "assistant", "content": zoom}])  # fmt: skip
    finally:
        stop_server(process)
    trajectory = response.choices[0].model_extra["trajectory"]
    assert trajectory["tool_results"][0]["name"] == "crop" and trajectory["tool_results"][0]["error"] is None
    assert trajectory["tool_results"][0]["metadata"]["box_original"] == [0, 0, 160, 120]  # DeepEyes: original pixels
    assert trajectory["tool_results"][0]["native"] == "image_zoom_in_tool"  # what the model wrote
    observation = trajectory["messages"][3]
    assert observation["role"] == "user" and observation["content"][0]["text"].startswith("<tool_response>")


def test_agent_mode_serves_a_larger_turn_budget_with_an_image_a_turn(policy):
    """In process: `--max-turns 32 --max-images 40` (a policy trained at fewer turns, served at more): 32 forced crops
    each add an image and the 33rd turn is sampled; under the profile's own 8 images the episode stops at the 8th."""
    import argparse

    from fastapi.testclient import TestClient

    from vagent.serve import add_arguments
    from vagent.serve.app import ServerOptions, create_app

    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 56, 56]}}</tool_call>'
    image = Image.new("RGB", (112, 84), (200, 100, 50))  # small: 33 images stay near 3,600 tokens
    body = {"model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [_question(image)] + [{"role": "assistant", "content": crop}] * 32}  # fmt: skip
    trajectories = {}
    for images in (40, 8):
        options = ServerOptions(model_name="m", agent=True, max_turns=32, max_images=images)
        with TestClient(create_app(policy, options)) as http:
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        trajectories[images] = response.json()["choices"][0]["trajectory"]
    wide, capped = trajectories[40], trajectories[8]
    assert sum(p["type"] == "image" for m in wide["messages"] for p in m["content"]) == 33
    assert wide["metrics"]["turns"] == 33 and wide["stop_reason"] != "max_images" and sum(wide["loss_mask"]) >= 1
    assert capped["stop_reason"] == "max_images" and capped["metrics"]["turns"] == 8
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--max-images", "0"])
    assert parser.parse_args(["--model", "m", "--tool-workers", "3"]).tool_workers == 3  # reaches the engine's pool:
    with TestClient(create_app(policy, ServerOptions(model_name="m", agent=True, tool_workers=3))) as http:
        assert http.app.state.scheduler.tool_workers == 3


def test_a_request_picks_its_own_turn_budget_up_to_the_servers(policy):
    """``max_turns`` in the body (vagent's extension, ``extra_body`` in the OpenAI client) sets an agent request's
    budget, raised to leave one sampled turn after its forced ones; over the server's ``--max-turns``, or in plain
    mode, it is a 400."""
    from fastapi.testclient import TestClient

    from vagent.serve.app import ServerOptions, _agent_job, create_app
    from vagent.serve.request import APIError, parse_chat_request

    options = ServerOptions(model_name="m", agent=True, max_turns=4)
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 56, 56]}}</tool_call>'
    image = Image.new("RGB", (112, 84), (200, 100, 50))

    def limits(max_turns, forced=0):
        body = {"model": "m", "messages": [_question(image)] + [{"role": "assistant", "content": crop}] * forced}
        if max_turns is not None:
            body["max_turns"] = max_turns
        raw = json.dumps(body).encode()
        request = parse_chat_request(raw, model_name="m", allowed_roots=[], max_image_pixels=10**7,
                                     tools_in_prompt=False)  # fmt: skip
        return _agent_job(request, options, sink=None).limits.max_turns

    assert limits(None) == 4 and limits(2) == 2 and limits(1, forced=2) == 3  # 2 forced + 1 sampled
    with pytest.raises(APIError, match="max_turns 5 is over this server's 4"):
        limits(5)
    with pytest.raises(APIError, match="must be an integer >= 1"):
        limits(0)
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "max_turns": 2}
    with TestClient(create_app(policy, ServerOptions(model_name="m"))) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_turns"


def test_agent_requests_batched_together_keep_their_own_turn_budgets(policy):
    """Two agent requests that arrive together with the same sampling settings run as one batch only if their limits
    match too: one asks for 1 turn, the other for 8 with 3 forced crops. Each episode runs under its own budget (the
    batch used to run both with the first request's: the second stopped after 1 turn)."""
    from vagent.serve.app import ServerOptions, _agent_job
    from vagent.serve.request import parse_chat_request
    from vagent.serve.scheduler import Scheduler

    options = ServerOptions(model_name="m", agent=True, max_turns=8)
    crop = '<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 56, 56]}}</tool_call>'
    image = Image.new("RGB", (112, 84), (200, 100, 50))
    events: dict[int, list] = {1: [], 8: []}

    def job(max_turns, forced):
        body = {"model": "m", "max_tokens": 4, "max_turns": max_turns,
                "messages": [_question(image)] + [{"role": "assistant", "content": crop}] * forced}  # fmt: skip
        request = parse_chat_request(json.dumps(body).encode(), model_name="m", allowed_roots=[],
                                     max_image_pixels=10**7, tools_in_prompt=False)  # fmt: skip
        return _agent_job(request, options, sink=events[max_turns].append)

    short, long = job(1, forced=0), job(8, forced=3)
    assert short.sampling == long.sampling  # what the batch used to be grouped by alone
    scheduler = Scheduler(policy, agent_batch_size=4)
    try:
        scheduler._run_agents([short, long])  # the model thread's call for jobs that arrived in one loop
    finally:
        scheduler.close()
    [(kind, [one], _)], [(kind_long, [eight], _)] = events[1], events[8]
    assert kind == kind_long == "trajectories"
    assert one.metrics["turns"] == 1
    assert eight.metrics["turns"] >= 4  # its 3 forced crops and at least one sampled turn

"""``vagent serve --backend vllm`` against ``--backend hf``: the same greedy answers (with an image, streamed or not),
seeded samples that repeat, and agent mode's tool loop on the engine. Run in the vLLM environment (see
``tests/test_vllm_backend.py``)."""

from __future__ import annotations

import openai
import pytest
from PIL import Image

import tests.vllm_required  # noqa: F401  (fails, or skips, this module without vLLM)
from tests.serve_helpers import start_server, stop_server
from tests.test_serve import data_url, image_message

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def clients(small, tmp_path_factory):
    """One server per backend (plain mode) and one vLLM server in agent mode, each with an openai client."""
    logs = tmp_path_factory.mktemp("logs")
    servers = {}
    try:
        for name, args in (("hf", ["--backend", "hf"]), ("vllm", ["--backend", "vllm"]),
                           ("agent", ["--backend", "vllm", "--agent", "--max-turns", "2"])):  # fmt: skip
            servers[name] = start_server(small, "--served-model-name", "small", "--dtype", "float32", *args,
                                         log=logs / f"{name}.log")  # fmt: skip
        yield {name: openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
               for name, (_, url) in servers.items()}  # fmt: skip
    finally:
        for process, _ in servers.values():
            stop_server(process)


def _ask(client, **kwargs):
    kwargs.setdefault("messages", image_message(data_url(Image.new("RGB", (112, 84), (220, 20, 20)))))
    return client.chat.completions.create(model="small", max_tokens=kwargs.pop("max_tokens", 12), **kwargs)


def test_greedy_answers_with_an_image_are_the_hf_backends_streamed_or_not(clients):
    hf = _ask(clients["hf"], temperature=0, logprobs=True).choices[0]
    ours = _ask(clients["vllm"], temperature=0, logprobs=True).choices[0]
    assert ours.message.content == hf.message.content and ours.finish_reason == hf.finish_reason
    assert [e.token for e in ours.logprobs.content] == [e.token for e in hf.logprobs.content]
    assert [e.logprob for e in ours.logprobs.content] == pytest.approx([e.logprob for e in hf.logprobs.content],
                                                                        abs=1e-4)  # fmt: skip
    chunks = list(_ask(clients["vllm"], temperature=0, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == hf.message.content and len(pieces) >= 2  # streamed as sampled, not at the end


def test_a_request_the_engine_refuses_fails_alone(clients):
    """More images than the engine takes (vLLM's limit_mm_per_prompt, the server's --max-images): that request gets
    an error, and the server goes on answering (the same greedy answer as before)."""
    before = _ask(clients["vllm"], temperature=0).choices[0].message.content
    many = [{"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (56, 56), (9 * i, 0, 0)))}}
            for i in range(12)]  # fmt: skip
    with pytest.raises(openai.APIError, match="could not be scheduled"):
        _ask(clients["vllm"], messages=[{"role": "user", "content": [*many, {"type": "text", "text": "Count."}]}])
    assert _ask(clients["vllm"], temperature=0).choices[0].message.content == before


def test_a_seeded_request_samples_the_same_tokens_again(clients):
    first = _ask(clients["vllm"], n=2, seed=7, temperature=1.0)
    again = _ask(clients["vllm"], n=2, seed=7, temperature=1.0)
    other = _ask(clients["vllm"], n=2, seed=8, temperature=1.0)
    texts = lambda r: [c.message.content for c in r.choices]  # noqa: E731
    assert texts(again) == texts(first) and texts(other) != texts(first)
    assert texts(first)[0] != texts(first)[1]  # each sample its own seed
    negative = [_ask(clients["vllm"], seed=-1, temperature=1.0) for _ in range(2)]  # vLLM reads -1 as "no seed"
    assert negative[0].choices[0].message.content == negative[1].choices[0].message.content


def test_agent_mode_runs_its_episodes_on_the_engine(clients):
    first = _ask(clients["agent"], seed=3, temperature=1.0, max_tokens=16)
    again = _ask(clients["agent"], seed=3, temperature=1.0, max_tokens=16)
    assert first.choices[0].message.content == again.choices[0].message.content  # the answer, or "" without one
    episodes = [r.choices[0].model_extra["trajectory"] for r in (first, again)]
    assert episodes[0]["token_ids"] == episodes[1]["token_ids"]  # the same episode, whether it answered or not
    assert first.usage.completion_tokens >= 1

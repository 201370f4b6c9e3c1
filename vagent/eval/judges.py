"""Judges as endpoints: the request a judge trained by vagent gets, and judge benchmarks over any OpenAI-compatible
endpoint (``vagent eval --benchmark judge-pairs --endpoint URL``).

The prompt of a judgment row is built in one place for every stage: the row's question is
``vagent.data.judgment.render`` of its judgment, and the conversation around it is the rollout engine's
``prompt_messages`` (the agent profile's system prompt, the images, the question), which SFT and GRPO also use.
``judgment_request`` sends exactly that conversation, so a judge served by ``vagent serve`` reads, token for token,
the prompt it was trained on, for a training row (``row_request``) and for a policy's answers judged in a GRPO
loop (``vagent.recipes.judged`` with ``judge.prompt: judgment``) alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from vagent.data import Row
from vagent.data.judgment import Judgment, render
from vagent.eval.benchmarks import Benchmark
from vagent.eval.metrics import summarize
from vagent.eval.report import write_report
from vagent.judge import JudgeClient, chat_messages
from vagent.rewards.answer import gold_answers
from vagent.rollout import Task, prompt_messages
from vagent.types import Message, Trajectory

__all__ = ["evaluate_endpoint", "judgment_request", "row_request"]


def judgment_request(judgment: Judgment, images: Sequence[str | Image.Image] = (), agent: str = "vagent",
                     urls: dict[Any, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The chat messages asking a trained judge for ``judgment`` (its candidates and question; the label is not
    needed) about ``images``: the conversation a judgment row rendered from it trains on. ``urls``: the data URLs
    of a batch of requests, each image encoded once (``vagent.judge.chat_messages``)."""
    task = Task(id="judgment", question=render(judgment), images=list(images), tools=[])
    return chat_messages(prompt_messages(task, agent=agent), urls)


def row_request(row: Row, agent: str = "vagent", urls: dict[Any, str] | None = None) -> list[dict[str, Any]]:
    """The chat messages of a judgment row: the prompt SFT and the rollout engine show a policy for it (a judgment
    row offers no tools). Videos cannot be sent: only their names and lengths, which the prompt lists, reach an
    endpoint. ``urls``: as in ``judgment_request``."""
    return chat_messages(prompt_messages(Task.from_row(row, []), agent=agent), urls)


def evaluate_endpoint(client: JudgeClient, benchmark: Benchmark, rows: Sequence[Row], out_dir: Path, *,
                      max_tokens: int = 1024, temperature: float = 0.0, skipped: Sequence[tuple[str, str]] = ()
                      ) -> dict[str, Any]:  # fmt: skip
    """Judge every row through ``client`` and score the replies as ``vagent eval`` scores a checkpoint's (the same
    ``score`` and ``report``); writes ``samples.jsonl``, ``metrics.json`` and ``metrics.md`` to ``out_dir``.

    A request that fails (timeout, HTTP error, a reply cut at ``max_tokens``) is scored as an unparseable verdict
    and counted in ``judge_failures``; replies are cached in ``out_dir/judge_cache.jsonl`` by the client, so a rerun
    sends only the requests that got none (a cut reply is cached: the same request is cut the same way).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    urls: dict[Any, str] = {}  # a pair and its swap show the same images: one encoding each
    replies = client.complete_many([row_request(row, urls=urls) for row in rows], max_tokens=max_tokens,
                                   temperature=temperature)  # fmt: skip
    samples = []
    for row, reply in zip(rows, replies, strict=True):
        trajectory = Trajectory(row.id, [Message.text("assistant", reply.text)],
                                stop_reason="answered" if reply.error is None else "failed")  # fmt: skip
        scores = benchmark.score(row, trajectory, rule="vagent")
        samples.append({"id": row.id, "sample": 0, "prediction": reply.text,
                        "gold": gold_answers(row.answer, row.answer_type), **scores,
                        "error": reply.error})  # fmt: skip
    with open(out_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
    metrics = summarize(samples, benchmark.metrics)
    if benchmark.report is not None:
        metrics.update(benchmark.report(rows, samples))
    metrics["judge_failures"] = sum(1 for s in samples if s["error"] is not None)
    metrics.update(benchmark=benchmark.name, endpoint=client.url, model=client.model,
                   skipped=[{"record": r, "reason": why} for r, why in skipped])  # fmt: skip
    write_report(out_dir, metrics)
    return metrics

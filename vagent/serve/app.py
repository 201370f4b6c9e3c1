"""The OpenAI-compatible HTTP API (FastAPI): ``GET /v1/models``, ``POST /v1/chat/completions``, ``GET /health``.

Plain mode generates one assistant turn per choice; with ``tools`` in the request the model's
``<tool_call>`` blocks come back as OpenAI ``tool_calls``. Agent mode (``--agent``) runs vagent's tool loop
on the server and answers with the final answer plus the whole trajectory (``choices[i].trajectory``).

Admission: at most ``max_queue`` requests are in the server at once (parsed, generating, or streaming to the
client); one more gets a 429 at once, before its body is decoded. Every refusal is an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image
from starlette.exceptions import HTTPException

from vagent.chat import parse_turn
from vagent.data.encode import encode_prompt, template_suffix
from vagent.model import Policy
from vagent.rollout import GenerationBackend, RolloutLimits, Task
from vagent.serve.backend import Finished, Sampling
from vagent.serve.request import APIError, ChatRequest, parse_chat_request
from vagent.serve.scheduler import Job, Scheduler
from vagent.types import Trajectory

__all__ = ["ServerOptions", "create_app"]

log = logging.getLogger(__name__)
# Requests are encoded in a thread pool; a fast tokenizer that two threads drive at once can fail with
# "Already borrowed" (its padding/truncation state is mutable), so encoding is one at a time.
_ENCODE_LOCK = threading.Lock()
_TOOL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ServerOptions:
    """How the server behaves (the ``vagent serve`` flags).

    Attributes:
        model_name: The id clients pass as ``model``.
        allowed_media_roots: Local image paths must resolve under one of these; empty = data: URLs only.
        max_queue: Requests in the server at once; more get 429.
        max_image_pixels: Decompression-bomb guard per image.
        max_model_len: Prompt + completion tokens per sample; longer requests get 400.
        default_max_tokens: Completion budget when the request sets none (capped by the context left).
        max_request_bytes: Bigger bodies get 413 (images come inline as base64).
        agent: Run the tool loop server-side.
        tools: The tools agent mode offers (a request's ``tools`` may pick a subset by name).
        max_turns: Assistant turns per agent episode (forced turns of a request add to it).
        max_images: Images per agent episode, prompt included.
        tool_workers: Threads running the tool calls of an agent batch.
    """

    model_name: str
    allowed_media_roots: list[Path] = field(default_factory=list)
    max_queue: int = 64
    max_image_pixels: int = 40_000_000
    max_model_len: int = 32768
    default_max_tokens: int = 1024
    max_request_bytes: int = 64 * 2**20
    agent: bool = False
    agent_profile: str = "vagent"  # the protocol agent mode speaks (vagent.agents.PROFILES)
    tools: list[str] = field(default_factory=lambda: ["crop"])
    max_turns: int = 4
    max_images: int = 8
    tool_workers: int = 8


def create_app(policy: Policy, options: ServerOptions, engine: GenerationBackend | None = None) -> FastAPI:
    """The FastAPI app serving ``policy`` (generating with ``engine`` when given: ``--backend vllm``); its model thread
    starts now and stops with the app."""
    scheduler = Scheduler(policy, agent_profile=options.agent_profile, tool_workers=options.tool_workers,
                          engine=engine)  # fmt: skip
    header = policy.tokenizer.encode(template_suffix(policy.processor, [], add_generation_prompt=True))
    admitted = [0]  # requests in the server; touched only on the event loop, so no lock

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()

    app = FastAPI(title="vagent", lifespan=lifespan)
    app.state.scheduler = scheduler

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(str(e.errors())).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        error = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "requests": admitted[0], "steps": scheduler.steps, "threads": torch.get_num_threads()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": options.model_name, "object": "model", "created": 0, "owned_by": "vagent"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http: Request) -> JSONResponse | StreamingResponse:
        if admitted[0] >= options.max_queue:
            raise APIError(f"the server already holds {options.max_queue} requests; retry later", status=429,
                           type="rate_limit_exceeded", code="queue_full")  # fmt: skip
        if int(http.headers.get("content-length") or 0) > options.max_request_bytes:
            raise APIError(f"the request body is over {options.max_request_bytes} bytes", status=413)
        admitted[0] += 1
        handed_to_stream = False
        job: Job | None = None
        try:
            raw = await http.body()
            request = await run_in_threadpool(parse_chat_request, raw, model_name=options.model_name,
                                              allowed_roots=options.allowed_media_roots,
                                              max_image_pixels=options.max_image_pixels,
                                              tools_in_prompt=not options.agent)  # fmt: skip
            events: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731
            if options.agent:
                job = await run_in_threadpool(_agent_job, request, options, sink)
            else:
                job = await run_in_threadpool(_chat_job, policy, header, request, options, sink)
            scheduler.submit(job)
            if request.stream:
                handed_to_stream = True
                stream = _stream(policy, request, job, events, len(job.encoded["input_ids"]), admitted)
                return StreamingResponse(stream, media_type="text/event-stream")
            return JSONResponse(await _complete(policy, request, job, events, options.agent))
        finally:
            if not handed_to_stream:
                admitted[0] -= 1
                if job is not None:
                    job.cancelled = True  # finished, or the client left: later events are dropped

    return app


def _encode(policy: Policy, header: list[int], request: ChatRequest) -> tuple[dict[str, torch.Tensor], list]:
    """The prompt's ids (ending with the assistant header, or inside the assistant turn to continue) and images, and
    the model-sized images they were made from."""
    messages = request.messages
    shown = [policy.model_view(image) for image in request.images]
    with _ENCODE_LOCK:
        if request.continue_final_message:
            encoded = encode_prompt(policy.processor, messages[:-1], shown)
            tail = header + policy.tokenizer.encode(messages[-1].plain_text)
        else:
            encoded = encode_prompt(policy.processor, messages, shown)
            tail = header
    encoded["input_ids"] = torch.cat([encoded["input_ids"], torch.tensor(tail, dtype=torch.long)])
    return encoded, shown


def _chat_job(policy: Policy, header: list[int], request: ChatRequest, options: ServerOptions, sink) -> Job:
    if request.max_turns is not None:
        raise APIError("max_turns is a turn budget of agent mode (vagent serve --agent): a plain completion is one "
                       "turn", param="max_turns")  # fmt: skip
    encoded, shown = _encode(policy, header, request)
    prompt = len(encoded["input_ids"])
    room = options.max_model_len - prompt
    max_tokens = request.max_tokens or min(options.default_max_tokens, room)
    if max_tokens > room or room <= 0:
        raise APIError(f"this model's maximum context length is {options.max_model_len} tokens; the messages hold "
                       f"{prompt} and max_tokens asks for {max_tokens}", param="messages",
                       code="context_length_exceeded")  # fmt: skip
    seed = (request.seed, request.id) if request.seed is not None else None
    sampling = Sampling(request.temperature, request.top_p, request.stop, seed)
    return Job(request.id, request.n, sampling, sink, encoded=encoded, images=shown, max_tokens=max_tokens,
               stream=request.stream)  # fmt: skip


def _agent_job(request: ChatRequest, options: ServerOptions, sink) -> Job:
    """One user message (its text and images) and optional trailing assistant turns, which are forced (their tool
    calls run); the engine writes the system prompt with the offered tools."""
    messages = request.messages
    if request.stream:
        raise APIError("stream is not supported with --agent: the answer comes with its whole trajectory",
                       param="stream")  # fmt: skip
    if request.stop:
        raise APIError("stop is not supported with --agent: the tool grammar decides where turns end", param="stop")
    if messages[0].role != "user" or any(m.role != "assistant" for m in messages[1:]):
        raise APIError("agent mode takes one user message, optionally followed by assistant turns to force "
                       "(the system prompt is the agent's own)", param="messages")  # fmt: skip
    tools = [t["name"] for t in request.tools] or options.tools
    if unknown := sorted(set(tools) - set(options.tools)):
        raise APIError(f"tools {unknown} are not offered by this server (it offers {options.tools})", param="tools")
    user = messages[0]
    task = Task(id=request.id, question=user.plain_text, images=list(request.images), tools=tools,
                scripted_turns=[m.plain_text for m in messages[1:]])  # fmt: skip
    if request.max_turns is not None and request.max_turns > options.max_turns:
        raise APIError(f"max_turns {request.max_turns} is over this server's {options.max_turns} (vagent serve "
                       "--max-turns)", param="max_turns")  # fmt: skip
    turns = request.max_turns or options.max_turns
    budget = request.max_tokens or options.default_max_tokens
    limits = RolloutLimits(max_turns=max(turns, len(task.scripted_turns) + 1), max_new_tokens=budget,
                           max_total_tokens=options.max_model_len, max_images=options.max_images,
                           temperature=request.temperature, top_p=request.top_p)  # fmt: skip
    seed = (request.seed, request.id) if request.seed is not None else None
    sampling = Sampling(request.temperature, request.top_p, (), seed)
    return Job(request.id, request.n, sampling, sink, tasks=[task] * request.n, limits=limits, seed=request.seed)


def _cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to its first stop string (OpenAI leaves the stop out); whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _choice(policy: Policy, request: ChatRequest, index: int, result: Finished) -> dict[str, Any]:
    text = policy.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    text, stopped = _cut(text, request.stop)
    finish = "length" if result.stop == "length" and not stopped else "stop"
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if request.tools:
        prefix = request.messages[-1].plain_text if request.continue_final_message else ""
        calls = parse_turn(prefix + text).tool_calls
        if calls:
            message["tool_calls"] = [_tool_call(call.name, call.arguments) for call in calls]
            message["content"] = _TOOL_BLOCK.sub("", text).strip() or None
            finish = "tool_calls"
    logprobs = {"content": _logprobs(policy, result)} if request.logprobs else None
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def _logprobs(policy: Policy, result: Finished) -> list[dict[str, Any]]:
    """OpenAI's per-token entries for the sampled tokens (no alternatives: the backend keeps only the sampled one)."""
    out = []
    for token_id, logprob in zip(result.token_ids, result.logprobs, strict=True):
        token = policy.tokenizer.decode([token_id])
        out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return out


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


async def _next(events: asyncio.Queue) -> tuple:
    event = await events.get()
    if event[0] == "error":
        raise APIError(event[1], status=500, type="internal_error")
    return event


async def _complete(policy: Policy, request: ChatRequest, job: Job, events: asyncio.Queue, agent: bool) -> dict:
    """Wait for every choice of a non-streamed request and build the response body."""
    body = {"id": request.id, "object": "chat.completion", "created": int(time.time()), "model": "",
            "system_fingerprint": None}  # fmt: skip
    if agent:
        _, trajectories, _ = await _next(events)
        choices = [_agent_choice(i, t) for i, t in enumerate(trajectories)]
        sampled = sum(sum(t.loss_mask) for t in trajectories)
        prompt = sum(len(t.loss_mask) for t in trajectories) - sampled
    else:
        results: dict[int, Finished] = {}
        while len(results) < request.n:
            _, index, result = await _next(events)
            results[index] = result
        choices = [_choice(policy, request, i, results[i]) for i in range(request.n)]
        prompt = len(job.encoded["input_ids"])
        sampled = sum(len(r.token_ids) for r in results.values())
    body["model"] = request.model
    body["choices"] = choices
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled}
    return body


def _agent_choice(index: int, trajectory: Trajectory) -> dict[str, Any]:
    """An agent episode as an OpenAI choice: ``content`` is the final answer, or "" when the episode ended without
    one (a client that reads ``content`` as the answer must not take the last turn's reasoning or a half-written
    tool call for it); why it ended is ``trajectory.stop_reason``, and ``finish_reason`` is ``length`` when a cap
    ended it. The last turn's text stays in ``trajectory.messages``."""
    finish = "length" if trajectory.stop_reason in ("max_tokens", "max_turns", "max_images", "max_calls") else "stop"
    record = trajectory.to_dict(save_image=_data_url)
    return {"index": index, "message": {"role": "assistant", "content": trajectory.answer or ""},
            "finish_reason": finish, "logprobs": None, "trajectory": record}  # fmt: skip


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class _Visible:
    """The part of a choice's text that can be streamed: up to a stop string (or, with tools, the first
    ``<tool_call>``), holding back a tail that may still become one, and a half-decoded UTF-8 character."""

    def __init__(self, stops: tuple[str, ...], tools: bool) -> None:
        self.stops = stops
        self.holds = stops + (("<tool_call>",) if tools else ())
        self.sent = 0

    def delta(self, text: str, final: bool) -> str:
        text, _ = _cut(text, self.holds)
        if not final:
            text = text.rstrip("\ufffd")
            for hold in self.holds:
                for k in range(min(len(hold) - 1, len(text)), 0, -1):
                    if text.endswith(hold[:k]):
                        text = text[:-k]
                        break
        delta = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return delta


async def _stream(policy: Policy, request: ChatRequest, job: Job, events: asyncio.Queue, prompt: int,
                  admitted: list[int]) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
    created = int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": request.id, "object": "chat.completion.chunk", "created": created,
                "model": request.model, "system_fingerprint": None, "choices": choices}  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    tokenizer = policy.tokenizer
    visible = [_Visible(request.stop, bool(request.tools)) for _ in range(request.n)]
    sampled = 0
    try:
        for i in range(request.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        done = 0
        while done < request.n:
            try:
                kind, index, payload = await _next(events)
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
                break
            if kind == "tokens":
                delta = visible[index].delta(tokenizer.decode(payload, skip_special_tokens=True), final=False)
                if delta:
                    yield chunk([{"index": index, "delta": {"content": delta}, "finish_reason": None}])
                continue
            done += 1
            sampled += len(payload.token_ids)
            full = _choice(policy, request, index, payload)
            text = tokenizer.decode(payload.token_ids, skip_special_tokens=True)
            delta: dict[str, Any] = {}
            if rest := visible[index].delta(text, final=True):
                delta["content"] = rest
            if "tool_calls" in full["message"]:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(full["message"]["tool_calls"])]
            yield chunk([{"index": index, "delta": delta, "finish_reason": full["finish_reason"]}])
        if request.include_usage:
            yield chunk([], {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled})
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True
        admitted[0] -= 1

"""A client for any OpenAI-compatible chat endpoint (``vllm serve``, ``vagent serve``, hosted APIs), for judges.

Built for reward loops that must not stall or crash: requests run ``concurrency`` at a time, each attempt has a
timeout, connection errors / timeouts / 429 / 5xx are retried with exponential backoff and jitter (at least the
server's ``Retry-After`` seconds when it sends them), and a reply
that never comes back is returned as a failure (``JudgeReply.error``), never raised. A reply the server cut at
``max_tokens`` (``finish_reason: length``) is a failure too: a judge's reasoning cut short has no verdict, and
reading one from it would score a guess. Replies are cached by the request (model, messages, sampling settings),
in memory and optionally in a JSONL file, so a resumed run or a re-scored sample costs nothing. Only replies the
server sent are cached (a cut one with its ``finish_reason``: the same request is cut the same way); transport
failures are not.

The agent loop of ``vagent.eval.endpoint`` uses the same client with ``cache=False`` (each sample must be drawn, not
served again), reading the server's ``usage`` and the first choice as sent (``JudgeReply.usage``, ``.choice``).

Not covered: streaming, tool calls, and rate limits beyond backing off on 429 (and ``Retry-After``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import requests

__all__ = ["TRUNCATED", "JudgeClient", "JudgeReply"]

_RETRIED = {408, 409, 425, 429, 500, 502, 503, 504}
TRUNCATED = "length: the reply reached max_tokens"
MAX_RETRY_AFTER_S = 120.0  # a server asking for longer is obeyed up to this per retry (the backoff cap is 30 s)


@dataclass
class JudgeReply:
    """The judge's text, or why there is none.

    Attributes:
        text: The first choice's content ("" when none came back; a cut reply's text is kept).
        error: None on success, else a short reason (``timeout``, ``http 400: ...``, ``connection: ...``, or
            ``TRUNCATED`` when ``finish_reason`` is ``length``).
        cached: Served from the cache.
        attempts: HTTP attempts made.
        finish_reason: The server's ``finish_reason`` (``stop``, ``length``, ...; None when it sent none or no
            reply came).
        usage: The server's ``usage`` (``prompt_tokens``, ``completion_tokens``, ...) when it sent one; None for a
            cached reply.
        choice: The first choice as the server sent it (vLLM adds ``stop_reason``: the stop string it matched);
            empty for a cached reply or a failure.
    """

    text: str
    error: str | None = None
    cached: bool = False
    attempts: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    choice: dict[str, Any] = field(default_factory=dict)


class JudgeClient:
    """Chat completions against one endpoint and model.

    Args:
        base_url: The API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: The model id to send (``GET /v1/models`` lists it).
        api_key: Sent as a bearer token when given.
        concurrency: Requests in flight at once.
        timeout_s: Per attempt (connect + read).
        retries: Extra attempts after a retryable failure.
        backoff_s: First backoff; doubles each retry (with up to 50% jitter), capped at 30 s.
        cache_path: JSONL file of ``{"key", "text", "finish_reason"}`` lines read at start and appended to (a line
            without ``finish_reason``, from before it was kept, is asked again); None = memory only.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, concurrency: int = 8,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0,
                 cache_path: str | os.PathLike[str] | None = None) -> None:  # fmt: skip
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ValueError("concurrency >= 1, retries >= 0 and timeout_s > 0 are required")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s, self.retries, self.backoff_s = model, timeout_s, retries, backoff_s
        self.headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {api_key}"} if api_key else {}
        )
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="vagent-judge")
        self.cache: dict[str, tuple[str, str | None]] = {}  # key -> (text, finish_reason)
        self.cache_path = Path(cache_path) if cache_path else None
        self._lock = threading.Lock()
        self._session = threading.local()  # requests.Session is not thread-safe: one per worker
        if self.cache_path and self.cache_path.is_file():
            for line in self.cache_path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    # a line without finish_reason predates it: it may hold a reply cut at max_tokens, so ask again
                    self.cache[entry["key"]] = (entry["text"], entry["finish_reason"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by a killed run

    def key(self, messages: Sequence[dict[str, Any]], **params: Any) -> str:
        """The cache key of a request: a hash of the model, messages and sampling settings."""
        blob = json.dumps({"model": self.model, "messages": messages, **params}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def complete(self, messages: Sequence[dict[str, Any]], *, temperature: float = 0.0, max_tokens: int = 512,
                 seed: int | None = 0, stop: Sequence[str] | None = None, top_p: float | None = None,
                 extra: dict[str, Any] | None = None, cache: bool = True) -> JudgeReply:  # fmt: skip
        """One chat completion; never raises. ``stop``: strings that end the reply (not sent when None); ``top_p``:
        sent when given; ``extra``: more body fields (a server's extensions, e.g. vLLM's ``continue_final_message``);
        ``cache`` False: neither served from nor stored in the cache (a sample that must be drawn each time)."""
        params = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed,
                  **({"stop": list(stop)} if stop else {}), **({"top_p": top_p} if top_p is not None else {}),
                  **(extra or {})}  # fmt: skip
        key = self.key(messages, **params)
        with self._lock:
            if cache and key in self.cache:
                return _reply(*self.cache[key], cached=True)
        body = {"model": self.model, "messages": list(messages), **{k: v for k, v in params.items() if v is not None}}
        error, wait_s = "no attempt made", 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(30.0, self.backoff_s * 2 ** (attempt - 1)) * (1 + 0.5 * random.random())
                time.sleep(max(delay, wait_s))
            retry, text, finish, error, sent = self._attempt(body)
            if error is None:
                if cache:
                    self._store(key, text, finish)
                return _reply(text, finish, attempts=attempt + 1, usage=sent.get("usage"), choice=sent["choice"])
            if not retry:
                return JudgeReply("", error=error, attempts=attempt + 1)
            wait_s = sent.get("retry_after", 0.0)
        return JudgeReply("", error=error, attempts=self.retries + 1)

    def complete_many(self, requests_: Sequence[Sequence[dict[str, Any]]], **params: Any) -> list[JudgeReply]:
        """``complete`` for each message list, ``concurrency`` at a time; replies in order."""
        return list(self.pool.map(lambda messages: self.complete(messages, **params), requests_))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _attempt(self, body: dict[str, Any]) -> tuple[bool, str, str | None, str | None, dict[str, Any]]:
        """(retryable, text, finish_reason, error, sent) of one HTTP attempt; ``sent``: the first ``choice`` and the
        ``usage`` of a reply, the ``retry_after`` seconds of a refusal that named them."""
        session = getattr(self._session, "s", None) or requests.Session()
        self._session.s = session
        try:
            response = session.post(self.url, json=body, headers=self.headers, timeout=self.timeout_s)
        except requests.Timeout:
            return True, "", None, "timeout", {}
        except requests.RequestException as e:
            return True, "", None, f"connection: {type(e).__name__}", {}
        if response.status_code != 200:
            try:
                detail = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = response.text[:200]
            sent = {"retry_after": wait} if (wait := _retry_after(response.headers.get("Retry-After"))) else {}
            return response.status_code in _RETRIED, "", None, f"http {response.status_code}: {detail}", sent
        try:
            data = response.json()
            choice = data["choices"][0]
            content, finish = choice["message"]["content"], choice.get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return False, "", None, "malformed response", {}
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        return (False, content if isinstance(content, str) else "", finish if isinstance(finish, str) else None, None,
                {"choice": choice, "usage": usage})  # fmt: skip

    def _store(self, key: str, text: str, finish: str | None) -> None:
        with self._lock:
            self.cache[key] = (text, finish)
            if self.cache_path:
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.cache_path, "a") as f:
                    f.write(json.dumps({"key": key, "text": text, "finish_reason": finish}, ensure_ascii=False) + "\n")


def _retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), capped; 0 when absent or
    unreadable.

    >>> _retry_after("2"), _retry_after(None), _retry_after("soon")
    (2.0, 0.0, 0.0)
    """
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return 0.0
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def _reply(text: str, finish: str | None, **kwargs: Any) -> JudgeReply:
    """The reply the server sent: a failure (``TRUNCATED``) when it was cut at ``max_tokens``."""
    return JudgeReply(text, error=TRUNCATED if finish == "length" else None, finish_reason=finish, **kwargs)

"""``search``: look something up on the web (or in a local corpus) and read numbered title/snippet/url results.

Two backends share the ``SearchBackend`` protocol:

* ``BM25Backend`` ranks a local JSONL corpus with ``bm25s``. It is deterministic (no stemming, English
  stopwords, ties broken by corpus order), so training, tests and MAT-Search-style eval over a cached
  corpus give the same results on every machine.
* ``HTTPBackend`` asks a user-configured endpoint: ``GET {url}?q=<query>&k=<k>`` answered with JSON
  ``{"results": [{"title": str, "snippet": str, "url": str}, ...]}`` or the bare list. It retries
  connection errors, timeouts, 429 and 5xx with exponential backoff (not other 4xx, which a retry cannot
  fix) and keeps an optional on-disk cache, so a repeated query costs no request.

Guards against: empty or whitespace-only queries, malformed corpus records (named by line and field),
an empty corpus, backend failures (an error observation of kind ``search_failed``, never an exception),
malformed endpoint answers, torn cache files (written atomically; an unreadable one is refetched) and
results that would flood the context (snippets and the whole text are capped; newlines inside a
title or snippet are flattened so a document cannot fake extra results). Does not guard against:
untrue or adversarial page content, an endpoint that ignores ``k``, stale cache entries (the cache never
expires; delete the directory), nor ``Retry-After`` headers (the backoff schedule is fixed).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import requests

from vagent.toolbox.context import ToolContext
from vagent.types import Observation

__all__ = ["NAME", "SCHEMA", "BM25Backend", "HTTPBackend", "SearchBackend", "SearchError", "SearchResult", "call"]

NAME = "search"
MAX_K = 10
SNIPPET_CHARS = 300  # about two sentences: enough to judge relevance, cheap in tokens
MAX_TEXT_CHARS = 4000  # ~1k tokens for the whole observation, whatever the backend returns
SCHEMA = {
    "name": NAME,
    "description": "Search the web. Returns up to k numbered results, each with a title, a snippet and a url.",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 500, "description": "What to search for."},
            "k": {"type": "integer", "minimum": 1, "maximum": MAX_K, "description": "How many results. Default 5."},
        },
        "required": ["query"],
    },
}


class SearchError(Exception):
    """A backend could not answer (network failure, bad status, malformed response)."""


@dataclass(frozen=True)
class SearchResult:
    """One hit. ``score`` is the backend's relevance (BM25 score), None when the backend gives none."""

    title: str
    snippet: str
    url: str = ""
    score: float | None = None


class SearchBackend(Protocol):
    """Anything that answers a query with at most ``k`` results, best first."""

    def search(self, query: str, k: int) -> list[SearchResult]:
        """Raises ``SearchError`` when the backend fails; an empty list means nothing matched."""
        ...


def _clip(text: str, limit: int = SNIPPET_CHARS) -> str:
    """Flatten whitespace and cut at a word boundary, marking the cut with an ellipsis.

    >>> _clip("one two  three\\nfour", 12)
    'one two…'
    """
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:.") + "…"


def _bm25s():
    """``bm25s``, imported on first use and kept off the GPU. Importing it imports JAX when JAX is installed and
    runs a JAX op, and JAX on a GPU machine then reserves 75% of the GPU's memory for itself (on an H100 it took
    59 of 80 GB, and the policy's next load ran out of memory). Its top-k runs on the CPU instead, unless the
    user's environment names JAX's platforms itself."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def _tokens(texts: list[str]) -> list[list[str]]:
    # No stemmer on purpose: PyStemmer is optional, and results must not depend on what is installed.
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


_TEXT_FIELDS = ("text", "snippet", "contents")


def _parse_record(record: Any, where: str) -> tuple[str, str, str]:
    """``(title, text, url)`` of one corpus record, or a ValueError naming ``where`` and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    title = record.get("title")
    if not isinstance(title, str) or not title.strip():
        raise ValueError(f"{where}: field 'title' must be a non-empty string, got {title!r}")
    field = next((f for f in _TEXT_FIELDS if f in record), None)
    if field is None:
        raise ValueError(f"{where}: missing field 'text' (or 'snippet' / 'contents')")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {type(text).__name__}")
    url = record.get("url", "")
    if not isinstance(url, str):
        raise ValueError(f"{where}: field 'url' must be a string, got {type(url).__name__}")
    if "id" in record and not isinstance(record["id"], str | int):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {type(record['id']).__name__}")
    return title, text, url


class BM25Backend:
    """BM25 over a local corpus, held in memory. Read-only after construction, so safe to share across threads.

    Args:
        corpus_path: JSONL file, one record a line: ``title``, ``text`` (or ``snippet`` / ``contents``),
            optional ``url``, optional ``id``. Blank lines are skipped.

    Raises:
        ValueError: A malformed record (the message names the line and the field) or an empty corpus.
    """

    def __init__(self, corpus_path: str | Path) -> None:
        path = Path(corpus_path)
        records: list[tuple[str, str, str]] = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                records.append(_parse_record(record, f"{path}:{lineno}"))
        self._build(records, source=str(path))

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]]) -> BM25Backend:
        """Build from in-memory records (same fields as the JSONL lines; errors name ``record <i>``, from 1)."""
        backend = cls.__new__(cls)
        parsed = [_parse_record(r, f"record {i}") for i, r in enumerate(records, start=1)]
        backend._build(parsed, source="records")
        return backend

    def _build(self, records: list[tuple[str, str, str]], source: str) -> None:
        if not records:
            raise ValueError(f"search corpus {source} is empty: it needs at least one record")
        self.titles = [r[0] for r in records]
        self.snippets = [_clip(r[1]) for r in records]  # clipped once here, not on every query
        self.urls = [r[2] for r in records]
        self._index = _bm25s().BM25()
        # The title is indexed with the body: it is often the only place the entity's name appears.
        self._index.index(_tokens([f"{title}\n{text}" for title, text, _ in records]), show_progress=False)

    def __len__(self) -> int:
        return len(self.titles)

    def search(self, query: str, k: int) -> list[SearchResult]:
        """The ``k`` best documents with a positive score; ties go to the earlier document."""
        words = [w for w in _tokens([query])[0] if w in self._index.vocab_dict]
        if not words or k < 1:
            return []
        scores = self._index.get_scores(words)  # (N,) one score per document
        hits = np.flatnonzero(scores > 0)
        # lexsort sorts by the last key first: score descending, then corpus position (a stable tiebreak).
        order = hits[np.lexsort((hits, -scores[hits]))][:k]
        return [SearchResult(self.titles[i], self.snippets[i], self.urls[i], float(scores[i])) for i in order]


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


class HTTPBackend:
    """A user-configured search endpoint over HTTP: ``GET {url}?q=<query>&k=<k>`` returning JSON.

    The answer is ``{"results": [{"title": str, "snippet": str, "url": str}, ...]}`` or the bare list;
    ``snippet`` may be named ``text`` or ``content``, and ``url`` may be missing. Extra results beyond
    ``k`` are dropped. Each call opens its own connection, so one backend can serve concurrent rollouts.

    Args:
        url: Endpoint URL.
        timeout_s: Connect and read timeout of one attempt, in seconds.
        retries: Extra attempts after a failure that may pass (connection error, timeout, 429, 5xx).
        backoff_s: Wait before the first retry; doubled before each next one.
        cache_dir: Directory of cached answers (one JSON file per ``(url, query, k)``); None disables it.
        headers: Extra request headers.
        api_key_env: Name of an environment variable holding a key, sent as ``Authorization: Bearer <key>``.
            Read once here so a missing key fails at startup, not mid-rollout.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        cache_dir: str | Path | None = None,
        headers: dict[str, str] | None = None,
        api_key_env: str | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, backoff_s >= 0; got {timeout_s}, {retries}, {backoff_s}"
            )
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.headers = dict(headers or {})
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"environment variable {api_key_env} (the search API key) is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def search(self, query: str, k: int) -> list[SearchResult]:
        """Cached answer if there is one, else ask the endpoint (with retries) and cache what it says."""
        cache_file = self._cache_file(query, k)
        if cache_file is not None and cache_file.exists():
            try:
                return [SearchResult(**r) for r in json.loads(cache_file.read_text(encoding="utf-8"))["results"]]
            except (ValueError, KeyError, TypeError):
                pass  # a corrupt or foreign file: ask again, and overwrite it below
        results = self._parse(self._fetch(query, k), k)
        if cache_file is not None:
            self._store(cache_file, {"url": self.url, "query": query, "k": k, "results": [asdict(r) for r in results]})
        return results

    @staticmethod
    def _store(cache_file: Path, payload: dict[str, Any]) -> None:
        # Temp file + os.replace: a crash or a concurrent writer never leaves a half-written entry.
        with tempfile.NamedTemporaryFile("w", dir=cache_file.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
        try:
            tmp.write_text(json.dumps(payload), encoding="utf-8")
            os.replace(tmp, cache_file)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full or read-only disk costs the cache entry, not the answer

    def _cache_file(self, query: str, k: int) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(json.dumps([self.url, query, k]).encode()).hexdigest()
        return self.cache_dir / f"{key}.json"

    def _fetch(self, query: str, k: int) -> Any:
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = requests.get(
                    self.url, params={"q": query, "k": k}, headers=self.headers, timeout=self.timeout_s
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                problem = type(e).__name__
                continue
            except requests.RequestException as e:  # e.g. an invalid URL: no retry can fix it
                raise SearchError(f"request failed: {type(e).__name__}: {e}") from None
            if response.ok:
                try:
                    return response.json()
                except ValueError:
                    raise SearchError("the search endpoint did not return JSON") from None
            problem = f"HTTP {response.status_code}"
            if not _retryable(response.status_code):
                raise SearchError(f"the search endpoint answered {problem}")
        raise SearchError(f"the search endpoint failed {self.retries + 1} time(s); last: {problem}")

    @staticmethod
    def _parse(data: Any, k: int) -> list[SearchResult]:
        items = data.get("results") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise SearchError("malformed answer: expected a list of results or {'results': [...]}")
        results = []
        for i, item in enumerate(items[:k]):
            item = item if isinstance(item, dict) else {}
            snippet = next((item[f] for f in ("snippet", "text", "content") if f in item), None)
            title, url = item.get("title"), item.get("url", "")
            if not (isinstance(title, str) and isinstance(snippet, str) and isinstance(url, str)):
                raise SearchError(f"malformed answer: result {i} needs string 'title' and 'snippet' (and 'url')")
            results.append(SearchResult(title=title, snippet=snippet, url=url))
        return results


def _render(query: str, results: list[SearchResult]) -> str:
    lines = [f'Search results for "{query}":']
    for n, r in enumerate(results, start=1):
        url = f"\n   {r.url.strip()[:SNIPPET_CHARS]}" if r.url.strip() else ""
        entry = f"{n}. {_clip(r.title, 200)}\n   {_clip(r.snippet)}{url}"
        # Leave room for the closing note so the whole text stays within the cap.
        if sum(len(line) + 1 for line in lines) + len(entry) > MAX_TEXT_CHARS - 60:
            lines.append(f"({len(results) - n + 1} more result(s) left out to keep this short.)")
            break
        lines.append(entry)
    return "\n".join(lines)


def call(arguments: dict[str, Any], context: ToolContext) -> Observation:
    query = " ".join(arguments["query"].split())
    k = arguments.get("k", 5)
    if not query:
        return Observation(text="search failed: the query is empty; write what to search for.", error="bad_arguments")
    if context.search is None:
        return Observation(text="search is not available in this episode.", error="search_unavailable")
    try:
        results = context.search.search(query, k)[:k]
    except SearchError as e:
        return Observation(text=f"search failed: {e}. Try again later or answer without it.", error="search_failed")
    # The hits themselves ride along so agent profiles can write them in their own formats (vagent.agents).
    hits = [{"title": r.title, "snippet": r.snippet, "url": r.url} for r in results]
    metadata = {"query": query, "k": k, "n_results": len(results), "results": hits}
    if not results:
        return Observation(text=f'No results for "{query}". Try other words.', metadata=metadata)
    return Observation(text=_render(query, results), metadata=metadata)

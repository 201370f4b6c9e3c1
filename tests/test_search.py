"""The search tool: BM25 over a hand-written corpus, and the HTTP backend against a local server (no internet)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from vagent.toolbox import TOOLS, ToolContext, call_tool
from vagent.toolbox.search import BM25Backend, HTTPBackend, SearchError, SearchResult
from vagent.types import ToolCall

CORPUS = [
    {"id": "eiffel", "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, "
     "completed in 1889 for the World's Fair.", "url": "https://example.org/eiffel"},
    {"id": "louvre", "title": "Louvre", "text": "The Louvre in Paris is the world's most-visited art museum.",
     "url": "https://example.org/louvre"},
    {"id": "pisa", "title": "Leaning Tower of Pisa", "text": "A freestanding bell tower in Pisa, Italy, known for "
     "its tilt.", "url": "https://example.org/pisa"},
    {"title": "Giraffe", "contents": "The giraffe is the tallest living land animal."},
]  # fmt: skip


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_bm25_ranks_the_relevant_document_first_and_deterministically(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    first, second = BM25Backend(corpus), BM25Backend.from_records(CORPUS)
    results = first.search("wrought-iron tower Paris 1889", k=3)
    assert results[0].title == "Eiffel Tower"
    assert results == second.search("wrought-iron tower Paris 1889", k=3)  # same titles, urls and scores
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert first.search("tallest animal", k=5)[0] == SearchResult(
        "Giraffe", "The giraffe is the tallest living land animal.", "", first.search("tallest animal", 1)[0].score
    )
    assert first.search("the and of", k=5) == []  # only stopwords
    assert first.search("zeppelin", k=5) == []  # no term in the vocabulary


def test_bm25s_and_jax_are_imported_only_when_a_corpus_is_indexed_and_jax_stays_off_the_gpu():
    """bm25s runs a JAX op at import where JAX is installed, and JAX then reserves most of a GPU's memory: importing
    the tools and the rollout engine must not import it, and indexing a corpus keeps JAX on the CPU."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "import vagent.toolbox, vagent.rollout\n"
        "assert 'bm25s' not in sys.modules and 'jax' not in sys.modules, 'imported at startup'\n"
        "from vagent.toolbox.search import BM25Backend\n"
        "BM25Backend.from_records([{'title': 't', 'text': 'a tower in Paris'}])\n"
        "assert 'bm25s' in sys.modules and os.environ['JAX_PLATFORMS'] == 'cpu'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_bm25_breaks_ties_by_corpus_order():
    twins = [{"title": f"Copy {i}", "text": "identical body about quokkas"} for i in range(5)]
    assert [r.title for r in BM25Backend.from_records(twins).search("quokkas", k=3)] == ["Copy 0", "Copy 1", "Copy 2"]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"title": "", "text": "x"}', r":2: field 'title'"),
        ('{"title": "A"}', r":2: missing field 'text'"),
        ('{"title": "A", "text": 3}', r":2: field 'text' must be a string"),
        ('{"title": "A", "text": "x", "url": 5}', r":2: field 'url'"),
        ('{"title": "A", "text": "x", "id": [1]}', r":2: field 'id'"),
        ("[1, 2]", r":2: a record must be a JSON object"),
        ("{not json", r":2: not valid JSON"),
    ],
)
def test_bad_corpus_records_name_the_line_and_field(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CORPUS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        BM25Backend(path)


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        BM25Backend(_write_jsonl(tmp_path / "blank.jsonl", []))  # only a blank line
    with pytest.raises(ValueError, match="empty"):
        BM25Backend.from_records([])
    with pytest.raises(ValueError, match=r"record 2: field 'title'"):
        BM25Backend.from_records([CORPUS[0], {"text": "no title"}])


def test_tool_output_is_numbered_title_snippet_url():
    backend = BM25Backend.from_records(CORPUS)
    obs = call_tool(ToolCall("search", {"query": "  tower\nParis ", "k": 2}), ToolContext(search=backend))
    assert obs.ok, obs.text
    lines = obs.text.splitlines()
    assert lines[0] == 'Search results for "tower Paris":'
    assert lines[1] == "1. Eiffel Tower" and lines[2].startswith("   The Eiffel Tower is a wrought-iron")
    assert lines[3] == "   https://example.org/eiffel" and lines[4].startswith("2. ")
    assert len(lines) == 7 and obs.metadata["n_results"] == 2
    none = call_tool(ToolCall("search", {"query": "zeppelin"}), ToolContext(search=backend))
    assert none.ok and none.text.startswith('No results for "zeppelin"')


def test_long_snippets_and_many_results_are_capped():
    long_docs = [{"title": f"Doc {i}\nfake line", "text": "word " * 2000} for i in range(10)]
    context = ToolContext(search=BM25Backend.from_records(long_docs))
    obs = call_tool(ToolCall("search", {"query": "word", "k": 10}), context)
    assert obs.ok and len(obs.text) <= 4000
    assert "1. Doc 0 fake line\n" in obs.text and "…" in obs.text  # newlines flattened, snippet cut at a word
    assert "10. " in obs.text  # ten snippets of ~300 chars fit in the cap
    # Long titles and urls from a web backend: fewer entries fit, and the text says how many were left out.
    huge = [SearchResult("T" * 1000, "s " * 1000, "https://u/" + "x" * 1000)] * 10
    obs = call_tool(ToolCall("search", {"query": "q", "k": 10}), ToolContext(search=_Fixed(huge)))
    assert obs.ok and len(obs.text) <= 4000 and "more result(s) left out" in obs.text and "1. T" in obs.text


class _Fixed:
    """A backend that always answers the same results (only the rendering is under test)."""

    def __init__(self, results):
        self.results = results

    def search(self, query, k):
        return self.results


@pytest.mark.parametrize(
    ("arguments", "context", "kind"),
    [
        ({"query": "tower"}, ToolContext(), "search_unavailable"),
        ({"query": "   "}, ToolContext(search=BM25Backend.from_records(CORPUS)), "bad_arguments"),
        ({"query": ""}, ToolContext(search=BM25Backend.from_records(CORPUS)), "bad_arguments"),
        ({"query": "tower", "k": 0}, ToolContext(search=BM25Backend.from_records(CORPUS)), "bad_arguments"),
        ({"query": "tower", "k": 11}, ToolContext(search=BM25Backend.from_records(CORPUS)), "bad_arguments"),
        ({"query": "tower", "n": 3}, ToolContext(search=BM25Backend.from_records(CORPUS)), "bad_arguments"),
    ],
)
def test_bad_calls_become_error_observations(arguments, context, kind):
    obs = call_tool(ToolCall("search", arguments), context)
    assert obs.error == kind and obs.text


# --- HTTP backend against a local server ---------------------------------------------------------------------


class _Server:
    """A scripted endpoint: ``plan`` is a list of statuses (or "sleep") served in order, then 200 forever."""

    def __init__(self):
        self.plan: list[int | str] = []
        self.queries: list[dict[str, list[str]]] = []
        self.headers: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.queries.append(parse_qs(urlparse(self.path).query))
                server.headers.append(dict(self.headers))
                step = server.plan.pop(0) if server.plan else 200
                if step == "sleep":
                    time.sleep(0.5)  # longer than the client's timeout below
                    step = 200
                body = json.dumps({"results": [{"title": "Hit", "snippet": "A snippet.", "url": "https://h.example"}]})
                try:
                    self.send_response(step)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(body.encode() if step == 200 else b"{}")
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/search"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _http(server, **kwargs):
    # A tiny backoff keeps the retry tests fast; the schedule itself is what is under test, not its length.
    return HTTPBackend(server.url, **{"timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, **kwargs})


def test_http_success_sends_query_and_k(server, monkeypatch):
    monkeypatch.setenv("TEST_SEARCH_KEY", "s3cret")
    results = _http(server, api_key_env="TEST_SEARCH_KEY").search("eiffel tower", 3)
    assert results == [SearchResult("Hit", "A snippet.", "https://h.example")]
    assert server.queries == [{"q": ["eiffel tower"], "k": ["3"]}]
    assert server.headers[0]["Authorization"] == "Bearer s3cret"


def test_http_retries_after_two_503s_then_succeeds(server):
    server.plan = [503, 503]
    assert _http(server).search("q", 5)[0].title == "Hit"
    assert len(server.queries) == 3


def test_http_gives_up_after_retries_with_search_failed(server):
    server.plan = [503, 429, 500, 200]
    obs = call_tool(ToolCall("search", {"query": "q"}), ToolContext(search=_http(server)))
    assert obs.error == "search_failed" and "HTTP 500" in obs.text
    assert len(server.queries) == 3  # one try + two retries; the 200 was never asked for


def test_http_does_not_retry_a_404(server):
    server.plan = [404]
    with pytest.raises(SearchError, match="HTTP 404"):
        _http(server).search("q", 5)
    assert len(server.queries) == 1


def test_http_timeout_is_a_search_failure(server):
    server.plan = ["sleep"]
    start = time.monotonic()
    with pytest.raises(SearchError, match="Timeout"):
        _http(server, timeout_s=0.1, retries=0).search("q", 5)
    assert time.monotonic() - start < 0.45  # did not wait for the slow answer


def test_http_cache_serves_a_repeated_query_without_a_request(server, tmp_path):
    first = _http(server, cache_dir=tmp_path / "cache").search("q", 5)
    again = _http(server, cache_dir=tmp_path / "cache").search("q", 5)  # a fresh backend reads the same disk cache
    assert again == first and len(server.queries) == 1
    _http(server, cache_dir=tmp_path / "cache").search("q", 4)  # another k is another key
    assert len(server.queries) == 2
    assert not list((tmp_path / "cache").glob("*.tmp"))
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if json.loads(p.read_text())["k"] == 5]
    entry.write_text("{torn")  # an unreadable entry is refetched, not an error
    assert _http(server, cache_dir=tmp_path / "cache").search("q", 5) == first and len(server.queries) == 3


def test_http_malformed_answer_and_unreachable_endpoint():
    with pytest.raises(SearchError, match="malformed"):
        HTTPBackend._parse({"results": [{"title": "no snippet"}]}, 5)
    with pytest.raises(SearchError, match="malformed"):
        HTTPBackend._parse({"hits": []}, 5)
    assert HTTPBackend._parse([{"title": "T", "text": "S"}], 5) == [SearchResult("T", "S", "")]
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE"):
        HTTPBackend("http://127.0.0.1:9/", api_key_env="NOT_SET_ANYWHERE")
    # Port 9 (discard) on loopback refuses connections: a connection error, retried, then reported.
    with pytest.raises(SearchError, match="ConnectionError"):
        HTTPBackend("http://127.0.0.1:9/", retries=1, backoff_s=0.0).search("q", 5)


def test_call_tool_through_the_toolbox_with_http(server):
    assert "search" in TOOLS
    obs = call_tool(ToolCall("search", {"query": "eiffel", "k": 1}), ToolContext(search=_http(server)))
    assert obs.ok and obs.text == 'Search results for "eiffel":\n1. Hit\n   A snippet.\n   https://h.example'

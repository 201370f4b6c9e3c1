"""Throughput and latency of ``vagent serve`` on the tiny checkpoint: requests/s and p50/p95 latency at 1, 4
and 16 concurrent clients.

    python benchmarks/serve.py [--requests 48] [--max-tokens 32] [--concurrency 1 4 16] [--image]

Workload: a random tiny Qwen2.5-VL (the test preset, built here), one server process on this machine's CPU,
clients in threads of this process sending ``POST /v1/chat/completions`` (``requests``, one connection per
client). Every request asks for ``--max-tokens`` at temperature 1, no seed (a seeded request gets a batch of its own, so
seeds would measure the unbatched path; a random model rarely emits EOS early, so completions are nearly all
full length; completion tokens are counted from ``usage``).
``--image`` adds a 224x168 PNG data URL to every prompt. Each level first sends ``c`` warm-up requests
(not timed). Latency is a whole non-streamed request as the client sees it.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serve_helpers import start_server, stop_server
from vagent.tiny_model import build_tiny_checkpoint


def _body(args: argparse.Namespace) -> dict:
    content: list[dict] = [{"type": "text", "text": "Describe the picture in a few words."}]
    if args.image:
        buffer = io.BytesIO()
        Image.new("RGB", (224, 168), (30, 90, 200)).save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens,
            "temperature": 1.0}  # fmt: skip


def level(url: str, args: argparse.Namespace, clients: int) -> dict[str, float]:
    """Send ``args.requests`` requests from ``clients`` threads; returns rate and latency percentiles."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    next_index = [0]

    def client(warmup: bool) -> None:
        session = requests.Session()
        while True:
            with lock:
                if not warmup and next_index[0] >= args.requests:
                    return
                next_index[0] += 0 if warmup else 1
            start = time.perf_counter()
            response = session.post(f"{url}/chat/completions", json=_body(args), timeout=600)
            response.raise_for_status()
            if warmup:
                return
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += response.json()["usage"]["completion_tokens"]

    for warm in (True, False):
        threads = [threading.Thread(target=client, args=(warm,)) for _ in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    latencies.sort()
    return {"clients": clients, "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens[0] / wall,
            "p50_s": statistics.median(latencies), "p95_s": latencies[max(0, round(0.95 * len(latencies)) - 1)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="Timed requests per concurrency level.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--image", action="store_true", help="Send a 224x168 image with every request.")
    parser.add_argument("--threads", type=int, help="The server's torch CPU threads (default: torch's).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "tiny", family="qwen2_5_vl", size="tiny")
        process, url = start_server(model, "--served-model-name", "tiny", "--log-level", "warning",
                                    "--max-queue", "256", *(["--threads", str(args.threads)] if args.threads else []),
                                    log=Path(tmp) / "serve.log")  # fmt: skip
        try:
            print("| clients | requests/s | completion tokens/s | p50 latency (s) | p95 latency (s) |")
            print("|---:|---:|---:|---:|---:|")
            for clients in args.concurrency:
                r = level(url, args, clients)
                print(f"| {clients} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['p50_s']:.3f} | "
                      f"{r['p95_s']:.3f} |", flush=True)  # fmt: skip
            threads = requests.get(url.removesuffix("/v1") + "/health", timeout=30).json()["threads"]
            print(f"server torch threads after the run: {threads}")
        finally:
            stop_server(process)


if __name__ == "__main__":
    main()

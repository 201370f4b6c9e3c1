"""Start ``vagent serve`` as a subprocess for tests and benchmarks, and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, *args: str, log: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Launch ``vagent serve --model model *args`` on a free port; returns the process and its ``/v1`` base URL
    once ``/health`` answers. Raises with the server's log if it exits or never answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "vagent.cli", "serve", "--model", str(model), "--port", str(port), *args]
    out = open(log, "w")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vagent serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.3)
    stop_server(process)
    raise RuntimeError(f"vagent serve did not answer within {timeout_s:g} s:\n{log.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

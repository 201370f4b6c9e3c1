"""Start ``vagent serve`` as a subprocess on a free local port and stop it: what the judge quickstart's closed loop,
the tests and the benchmarks run a server with."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["free_port", "start_server", "stop_server"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout vagent is imported from, put first on the child's path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, *args: str, log: Path, timeout_s: float = 180.0,
                 cwd: Path | None = None) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Launch ``vagent serve --model model *args`` on a free port, its output to ``log``; returns the process and
    its ``/v1`` base URL once ``/health`` answers. Raises with the end of the log if it exits or never answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "vagent.cli", "serve", "--model", str(model), "--port", str(port), *args]
    with open(log, "w") as out:  # the child holds its own descriptor
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
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
    """SIGTERM (the server drains and exits), then SIGKILL after 15 s."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

"""Start ``vagent serve`` as a subprocess for tests and benchmarks, and stop it (``vagent.serve.launch``, run from
the repository root)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vagent.serve.launch import free_port, stop_server
from vagent.serve.launch import start_server as _start_server

__all__ = ["REPO", "free_port", "start_server", "stop_server"]

REPO = Path(__file__).resolve().parent.parent


def start_server(model: Path, *args: str, log: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    return _start_server(model, *args, log=log, timeout_s=timeout_s, cwd=REPO)

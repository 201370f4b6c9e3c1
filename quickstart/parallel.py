"""Two CPU jobs side by side: the quickstart's second process on half the threads, handed back at a fixed step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


class Beside:
    """A job in a second process on half the CPU threads, beside the main process on the other half.

    On 2 cores the tiny model's steps use two threads poorly, so two trainings side by side, one thread each,
    finish 1.3-1.5x sooner than one after the other on both (``benchmarks/cpu_step.py``). The job is the shorter
    side; ``hand_over`` lets the main side's training take the job's threads back at a fixed step, after waiting
    for the job if it is not done. A fixed step, not whenever the job happens to end: the thread count changes
    the floating-point sums, so a seed gives the same numbers however the two sides' timing falls. The job's
    output goes to ``log``; its result (or its traceback) comes back through a pipe, and ``stop`` ends it if the
    main process gives up first.
    """

    def __init__(self, process, conn, log: Path, threads: int, what: str) -> None:
        self.process, self.conn, self.log, self.threads, self.what = process, conn, log, threads, what
        self.done, self.value = False, None

    @classmethod
    def start(cls, on: bool, device: str, log: Path, what: str, fn, *args) -> Beside | None:
        """Start ``fn(*args)`` beside this process; ``what`` names it in messages. None (run it in this process)
        unless ``on``, on CPU, with two threads or more."""
        import multiprocessing

        import torch

        total = torch.get_num_threads()
        if not on or device != "cpu" or total < 2:
            return None
        log.parent.mkdir(parents=True, exist_ok=True)
        context = multiprocessing.get_context("spawn")  # a clean interpreter: no forked torch thread pools
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_beside_main, args=(send, total // 2, str(log), fn, args), daemon=True)
        process.start()
        send.close()  # the child holds the only write end: its death reads as EOF
        torch.set_num_threads(total - total // 2)
        print(f"beside it, in process {process.pid} on {total // 2} of {total} CPU threads: {what} (log: {log})",
              flush=True)  # fmt: skip
        return cls(process, receive, log, total, what)

    def result(self) -> Any:
        """The job's return value, once it ends (then this process has all the threads again)."""
        import torch

        if self.done:
            return self.value
        print(f"waiting for {self.what} (log: {self.log})", flush=True)
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join()
            status, value = "error", f"the process ended without a result (exit code {self.process.exitcode})"
        torch.set_num_threads(self.threads)
        if status != "ok":
            raise RuntimeError(f"{self.what} failed; its log is {self.log}:\n{value}")
        self.done, self.value = True, value
        return value

    def hand_over(self, at: float):
        """A ``before_step`` hook for the main side's training (SFT or GRPO): from the fraction ``at`` of its steps
        on, it runs on all the threads (waiting for the job first if the job is still running)."""

        def before_step(step: int, total_steps: int) -> None:
            if not self.done and step >= at * total_steps:
                self.result()

        return before_step

    def stop(self) -> None:
        import torch

        torch.set_num_threads(self.threads)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()


def _beside_main(conn, threads: int, log: str, fn, args) -> None:
    import traceback

    import torch

    with open(log, "a", buffering=1) as f:  # the job's prints, progress bars and warnings, fd-level included
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        torch.set_num_threads(threads)
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            conn.close()

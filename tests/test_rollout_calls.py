"""The rollout's tool pool on its own: start times, abandoned calls giving up their thread, shutdown."""

import threading

import pytest

from vagent.rollout.calls import ToolPool

WAIT_S = 10.0  # generous: these only wait for events the test sets itself, on 2 shared cores


def test_a_queued_call_has_no_start_time_until_a_worker_takes_it():
    pool = ToolPool(1)
    gate = threading.Event()
    try:
        first = pool.submit(gate.wait, WAIT_S)
        second = pool.submit(lambda: "done")
        assert _eventually(lambda: first.started is not None)
        assert second.started is None and not second.future.done()  # queued behind the first: its clock has not run
        gate.set()
        assert second.future.result(timeout=WAIT_S) == "done" and second.started >= first.started
    finally:
        gate.set()
        pool.shutdown()


def test_an_abandoned_call_gives_its_place_to_a_new_thread():
    """One worker, stuck on a call: once abandoned, the next call runs on a new thread while the stuck one still
    hangs, and when it returns its thread ends rather than go back to taking calls."""
    pool = ToolPool(1)
    release = threading.Event()
    threads = []

    def hang():
        threads.append(threading.current_thread())
        return release.wait(WAIT_S)

    try:
        stuck = pool.submit(hang)
        assert _eventually(lambda: stuck.started is not None)
        queued = pool.submit(threading.current_thread)
        assert pool.abandon(stuck) and stuck.abandoned
        ran_on = queued.future.result(timeout=WAIT_S)
        assert not stuck.future.done() and ran_on is not threads[0] and ran_on.daemon
        release.set()
        assert stuck.future.result(timeout=WAIT_S) is True
        threads[0].join(WAIT_S)
        assert not threads[0].is_alive()  # its place was taken: it ended after its call
        later = pool.submit(threading.current_thread)
        assert later.future.result(timeout=WAIT_S) is ran_on  # the new thread is the pool's one worker now
        assert not pool.abandon(later)  # a finished call cannot be abandoned: its result stands
    finally:
        release.set()
        pool.shutdown()


def test_shutdown_cancels_queued_calls_and_waits_for_none():
    pool = ToolPool(1)
    gate = threading.Event()
    running = pool.submit(gate.wait, WAIT_S)
    assert _eventually(lambda: running.started is not None)
    queued = pool.submit(lambda: "never")
    pool.shutdown()  # returns at once though a call still runs
    assert queued.future.cancelled() and not running.future.done()
    gate.set()
    assert running.future.result(timeout=WAIT_S) is True
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def _eventually(condition, timeout_s: float = WAIT_S) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()

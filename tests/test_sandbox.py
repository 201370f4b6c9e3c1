"""Adversarial tests of ``vagent.toolbox.sandbox``: each test attempts one escape or abuse and checks it fails.

They need a working bubblewrap, which ``make test`` installs; where it cannot run they skip (the
fail-closed behaviour without it is tested in test_code_tool.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from vagent.toolbox.sandbox import Sandbox

pytestmark = pytest.mark.skipif(not Sandbox().available(), reason="bubblewrap (bwrap) is missing or does not work here")

# Short, so the file runs in seconds on 2 cores, yet far above Python's ~20 ms start-up in the sandbox.
TIMEOUT_S = 1.5
# Slack on top of the timeout for the kill, namespace teardown and a loaded CI machine.
KILL_SLACK_S = 2.0
# Small limits make each attack hit its wall fast; 512 MB still fits Python + numpy.
MEMORY_MB = 512
MAX_PROCESSES = 16
MAX_OUTPUT = 4096
MAX_FILE_MB = 2


@pytest.fixture(scope="module")
def host_tmp(tmp_path_factory):
    """A private host temp dir that every sandbox run of this module uses for its workdir, so the last test
    can check that nothing was left behind."""
    path = tmp_path_factory.mktemp("sandbox_host")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(path))
        yield path


@pytest.fixture(scope="module")
def sandbox(host_tmp):
    return Sandbox(
        timeout_s=TIMEOUT_S,
        memory_mb=MEMORY_MB,
        max_processes=MAX_PROCESSES,
        max_output_bytes=MAX_OUTPUT,
        max_file_mb=MAX_FILE_MB,
    )


def run(sandbox: Sandbox, code: str, **kwargs):
    return sandbox.run(textwrap.dedent(code), **kwargs)


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:  # the process ended while we looked
                pass
    return found


# ---- network ------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", [("1.1.1.1", 53), ("8.8.8.8", 443)])
def test_no_network_to_the_internet(sandbox, address):
    result = run(
        sandbox,
        f"""
        import socket
        try:
            socket.create_connection({address!r}, timeout=1)
            print("connected")
        except OSError as e:
            print("blocked", e)
        """,
    )
    assert result.stdout.startswith("blocked"), result


def test_no_name_resolution(sandbox):
    result = run(
        sandbox,
        """
        import socket
        try:
            print("resolved", socket.getaddrinfo("example.com", 80))
        except OSError as e:
            print("blocked", e)
        """,
    )
    assert result.stdout.startswith("blocked"), result


def test_no_network_to_a_server_on_the_host_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        result = run(
            sandbox,
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
                print("connected")
            except OSError as e:
                print("blocked", e)
            """,
        )
        assert result.stdout.startswith("blocked"), result
        with pytest.raises(BlockingIOError):  # nothing ever reached the host's server
            server.accept()
    finally:
        server.close()


# ---- reading the host ---------------------------------------------------------------------------


def test_parent_environment_is_invisible(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("VAGENT_TEST_SECRET", secret)
    result = run(
        sandbox,
        """
        import os
        print(dict(os.environ))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                print(open(f"/proc/{pid}/environ", "rb").read())
            except OSError:
                pass
        """,
    )
    assert result.exit_code == 0, result
    assert secret not in result.stdout and "VAGENT_TEST_SECRET" not in result.stdout


@pytest.fixture
def host_file(request, tmp_path):
    """A host file readable here that the sandbox must not see: in /tmp, the home dir, the repository or /etc."""
    if request.param == "repository":
        return Path(__file__).resolve()
    if request.param == "etc":
        return Path("/etc/passwd")
    if request.param == "tmp":
        path = tmp_path / "secret.txt"
    else:
        try:
            fd, name = tempfile.mkstemp(dir=Path.home(), prefix=".vagent-test-")
        except OSError:
            pytest.skip("the home directory is not writable")
        os.close(fd)
        path = Path(name)
        request.addfinalizer(path.unlink)
    path.write_text(f"host-secret-{uuid.uuid4().hex}")
    return path


@pytest.mark.parametrize("host_file", ["tmp", "home", "repository", "etc"], indirect=True)
def test_cannot_read_host_files(sandbox, host_file):
    assert host_file.read_text()  # readable on the host
    result = run(
        sandbox,
        f"""
        try:
            print("READ", open({str(host_file)!r}).read())
        except OSError as e:
            print("denied", e)
        """,
    )
    assert result.stdout.startswith("denied"), result


def test_host_processes_are_invisible(sandbox):
    result = run(sandbox, "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    visible = eval(result.stdout)  # a printed list of ints
    assert os.getpid() not in visible and len(visible) <= 3, visible  # bwrap's init, the code, maybe one more


def test_cannot_signal_a_host_process(sandbox):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        result = run(
            sandbox,
            f"""
            import os
            try:
                os.kill({victim.pid}, 9)
                print("sent")
            except OSError as e:
                print("denied", e)
            """,
        )
        assert victim.poll() is None, result  # still running
    finally:
        victim.kill()
        victim.wait()


# ---- writing the host ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["host_tmp", "/tmp", "/usr", "home", "/", "/dev/shm", "repository"])
def test_writes_outside_the_workdir_fail(sandbox, tmp_path, where):
    name = f"escape-{uuid.uuid4().hex}"
    places = {"host_tmp": tmp_path, "home": Path.home(), "repository": Path(__file__).resolve().parent}
    path = Path(places.get(where, where)) / name
    result = run(
        sandbox,
        f"""
        try:
            open({str(path)!r}, "w").write("escaped")
            print("WROTE")
        except OSError as e:
            print("denied", e)
        """,
    )
    assert result.stdout.startswith("denied"), result
    assert not path.exists()


def test_file_size_is_limited(sandbox):
    result = run(sandbox, f"open('big.bin', 'wb').write(b'x' * {(MAX_FILE_MB + 1) * 2**20})")
    assert result.exit_code != 0 and "File too large" in result.stderr, result


def test_symlink_to_a_host_file_is_not_read_back(sandbox, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"host secret")
    result = run(sandbox, f"import os; os.symlink({str(secret)!r}, 'leak.png')")
    assert result.exit_code == 0, result
    assert "leak.png" not in result.files


def test_fifo_in_the_workdir_does_not_hang_the_caller(sandbox):
    result = run(sandbox, "import os; os.mkfifo('trap.png'); open('ok.png', 'wb').write(b'fine')")
    assert result.exit_code == 0 and not result.timed_out, result
    assert result.files == {"ok.png": b"fine"}


# ---- time, memory, processes, output ------------------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.timed_out and result.duration_s < TIMEOUT_S + KILL_SLACK_S, result


def test_sleep_is_killed_at_the_timeout(sandbox):
    result = run(sandbox, "import time\nprint('started')\ntime.sleep(100)")
    assert result.timed_out and result.duration_s < TIMEOUT_S + KILL_SLACK_S, result
    assert result.stdout == "started\n"  # output printed before the kill still arrives


def test_memory_bomb_is_contained(sandbox):
    result = run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))")
    assert not result.timed_out and result.exit_code != 0 and "MemoryError" in result.stderr, result
    assert run(sandbox, "print(1)").stdout == "1\n"  # and the sandbox still works


def test_process_limit_stops_forking(sandbox):
    result = run(
        sandbox,
        """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("refused after", n)
        """,
    )
    assert result.stdout.startswith("refused after"), result
    assert int(result.stdout.split()[-1]) < MAX_PROCESSES


def test_fork_bomb_dies_with_the_call(sandbox):
    marker = f"vagent-bomb-{uuid.uuid4().hex}"
    result = run(
        sandbox,
        f"""
        import os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
    )
    assert result.timed_out and result.duration_s < TIMEOUT_S + KILL_SLACK_S, result
    assert processes_with(marker) == []


def test_background_daemon_does_not_outlive_the_call(sandbox):
    marker = f"vagent-daemon-{uuid.uuid4().hex}"
    result = run(
        sandbox,
        f"""
        import os, sys
        if os.fork() == 0:  # the classic double fork: a new session, then an orphaned grandchild
            os.setsid()
            if os.fork() == 0:
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
            os._exit(0)
        os.wait()
        print("detached")
        """,
    )
    assert result.stdout == "detached\n" and not result.timed_out, result
    assert processes_with(marker) == []


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_truncated(sandbox, stream):
    size = 20 * 2**20
    result = run(sandbox, f"import sys\nsys.{stream}.write('x' * {size})")
    kept, dropped = getattr(result, stream), getattr(result, f"{stream}_dropped")
    assert not result.timed_out and result.truncated, result.exit_code
    assert len(kept) == MAX_OUTPUT and dropped == size - MAX_OUTPUT


def test_killing_its_parent_only_ends_the_sandbox(sandbox):
    # Its parent is the sandbox's PID 1; signalling "everyone" (-1) reaches only the sandbox's processes.
    result = run(sandbox, "import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)")
    assert result.exit_code != 0 and not result.timed_out, result
    assert run(sandbox, "print(2)").stdout == "2\n"


# ---- afterwards ---------------------------------------------------------------------------------


def test_host_is_unharmed(sandbox, host_tmp):
    """Runs last (tests run in file order): every workdir of the attacks above was removed, and it still works."""
    assert list(host_tmp.iterdir()) == []
    assert run(sandbox, "print('still fine')").stdout == "still fine\n"
    assert list(host_tmp.iterdir()) == []

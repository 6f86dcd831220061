"""The sandboxed child from the outside: wait for its exit without reaping it, then kill what it left.

Every run ends the same way, timed out or not: SIGKILL to the child's process group, then
to any process of its session or carrying the run's token in its environment (those that
left the group with setpgid/setsid), found in /proc.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess

TOKEN_VAR = "LLMOPT_SANDBOX_TOKEN"  # set in the child's environment, inherited by anything it spawns


def wait_for_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
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


def kill_everything(leader: int, token: str) -> None:
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
    needle = f"{TOKEN_VAR}={token}".encode()
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

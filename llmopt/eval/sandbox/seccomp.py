"""The seccomp filter every sandboxed process runs under, built with libseccomp (through `pyseccomp`,
its ctypes binding) and handed to bubblewrap as BPF (`bwrap --seccomp FD`).

Allow by default, deny what a HumanEval program never needs and an escape would: the namespaces
and mounts already stop most of these, the filter keeps the kernel surface behind them small
and closes what namespaces leave open (a process of its own, `setns` back). libseccomp also
kills a process that calls in through another ABI (x32, i386), which hand-written BPF forgets.
"""

from __future__ import annotations

import errno
import functools
import tempfile

CLONE_THREAD = 0x00010000
AF_UNIX = 1
TIOCSTI = 0x5412

# (why, syscalls): each refused with EPERM.
DENIED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reading or steering another process", ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
                                             "pidfd_open", "pidfd_getfd", "pidfd_send_signal")),
    ("new processes (a fork bomb, a child that outlives the sample, memory limits per process)",
     ("fork", "vfork")),
    ("mounting (binding a host folder somewhere the scorer would clean up)",
     ("mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
      "fspick", "mount_setattr")),
    ("entering or making namespaces (setns back into the host's network)", ("setns", "unshare")),
    ("kernel interfaces no program here needs, often the way in for kernel exploits",
     ("bpf", "perf_event_open", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
      "io_uring_register", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "kexec_load",
      "kexec_file_load", "init_module", "finit_module", "delete_module", "quotactl", "swapon", "swapoff", "reboot",
      "syslog", "acct")),
)


@functools.cache
def filter_bpf() -> bytes:
    """The filter as BPF for this machine's architecture; ImportError/OSError where libseccomp is missing."""
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for _, names in DENIED:
        for name in names:
            rules.add_rule(deny, name)
    # Threads only: clone without CLONE_THREAD makes a process; clone3 hides its flags in memory, so it
    # reports "not implemented" and the C library falls back to clone, which the rule above can read.
    rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    # Sockets: local (AF_UNIX) only, in a network namespace of their own; no TCP/UDP, netlink or raw packets.
    rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    # Typing into the terminal of whoever runs the scorer (bwrap --new-session also stops it).
    rules.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        return f.read()

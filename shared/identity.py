"""Who a process is, in the records other processes judge it by: its host, that host's boot, its pid namespace
and its pid.

A pid names the same process only to a process of the same host, boot and pid namespace. Containers with host
networking share the hostname but not their pids (each may run its producer as pid 1, and a pid gone in one
names nothing, or another process, in the other); a rebooted host reuses pids. Linux tells the boot
(/proc/sys/kernel/random/boot_id) and the namespace (the /proc/self/ns/pid link, `pid:[<inode>]`); where it
cannot be read both are "" and the host alone decides, as on a host without containers.
"""

from __future__ import annotations

import os
import socket

HOST = socket.gethostname()
INITIAL_PID_NS = "pid:[4026531836]"  # the host's own pid namespace (the kernel's fixed PROC_PID_INIT_INO)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


BOOT_ID = _boot_id()
PID_NS = _pid_ns()  # fixed for a process's life: unsharing one moves only its children


def identity() -> dict:
    """This process as a lease or a worker record names it: {"host", "boot_id", "pid_ns", "pid"}."""
    return {"host": HOST, "boot_id": BOOT_ID, "pid_ns": PID_NS, "pid": os.getpid()}


def shares_pids(record: dict) -> bool:
    """Whether the pid in `record` names a process of this one's pid space: the same host, boot and pid namespace.
    A record without them (written before vt recorded them) never does."""
    return (record.get("host"), record.get("boot_id"), record.get("pid_ns")) == (HOST, BOOT_ID, PID_NS)


def pid_tag() -> str:
    """ "" in the host's own pid namespace (or where it cannot be read), else "-ns<inode>": what tells apart two
    processes of one host with one pid, each in a container of its own."""
    return "" if PID_NS in ("", INITIAL_PID_NS) else f"-ns{PID_NS[len('pid:[') : -1]}"

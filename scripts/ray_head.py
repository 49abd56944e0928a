"""A local Ray head for the bench and the tests: `ray start --head --block` in a session of its own, reached through
RAY_ADDRESS as a cluster is, and stopped by its session's processes (`ray stop` would kill every Ray process on the
machine). ../shared/FACTS.md has what was seen working here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Loopback only, no usage report, no auth token file: for the head and every driver, set before a driver imports ray.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_head(log: Path, cpus: int = 2, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """A head of `cpus` CPUs (its output in `log`); (its process, whose pid is its session's id, and RAY_ADDRESS)
    once it says it started."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        f"--port={port}",
        f"--num-cpus={cpus}",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        f"--object-store-memory={256 << 20}",
        "--block",
    ]
    with open(log, "wb") as out:
        head = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **RAY_ENV}
        )
    deadline = time.monotonic() + timeout
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            stop_head(head)
            raise RuntimeError(f"the Ray head did not start: {log}")
        time.sleep(0.2)
    return head, f"127.0.0.1:{port}"


def session_processes(sid: int) -> list:
    """The processes of session `sid` (psutil.Process, with `cmdline` read)."""
    import psutil

    out = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(process.pid) == sid:
                out.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def stop_head(head: subprocess.Popen, grace: float = 3) -> None:
    """TERM every process of the head's session, KILL what is left after `grace` seconds (two of Ray's agents
    ignore TERM once their driver is gone)."""
    import psutil

    processes = session_processes(head.pid)
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)

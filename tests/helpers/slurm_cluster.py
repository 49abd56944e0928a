"""A real one-node Slurm on 127.0.0.1 for tests: munged, slurmctld and slurmd started as root, all state in
one temp dir, torn down by pid.

`slurm_cluster(cpus=4)` (a context manager) installs Slurm if missing (scripts/ensure_slurm.sh), writes a
slurm.conf naming this machine's short hostname as the controller (Slurm refuses any other) with free
ports, starts the three daemons in the background with their output in files, waits for the node to be
`idle` and yields a `SlurmCluster`: its `env` (SLURM_CONF, the sbin folder on PATH) for sbatch, squeue and
scancel, and helpers to submit, cancel and wait for array elements. Finished elements are read from
jobcomp/filetxt's file (one line per finished element: there is no accounting, so no sacct). An element
cancelled while still pending never ran and leaves no line.

Every wait has a deadline and every subprocess a timeout (a dead slurmctld makes the clients hang), and the
daemons are stopped by pid (TERM, then KILL after a grace period) however the test ends. Not root, or no
Slurm to be had: `pytest.fail` with the reason, unless VT_SKIP_SLURM=1 asks to skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TIMEOUT = 15.0  # seconds any one sbatch/squeue/scancel/sinfo call may take
GRACE = 5.0  # seconds a daemon has to exit after SIGTERM before SIGKILL
KILL_WAIT = 30  # slurm.conf KillWait (Slurm's default): seconds from a job's SIGTERM (scancel, time limit) to its
# SIGKILL. At 10 s a producer still releasing its lanes and writing its report on a loaded machine was killed first.


def _end(pids: list[int], alive) -> None:
    """TERM `pids`, then KILL those `alive()` still lists after the grace period (each waited for with a deadline)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            wait_for(lambda: not alive(), timeout=GRACE, interval=0.1, what=f"processes {pids} to end")
            return
        except AssertionError:
            pids = alive()
    if alive():
        warnings.warn(f"slurm_cluster: processes {alive()} outlived SIGKILL", stacklevel=2)


def _unavailable(reason: str) -> None:
    if os.environ.get("VT_SKIP_SLURM") == "1":
        pytest.skip(f"Slurm tests skipped (VT_SKIP_SLURM=1): {reason}")
    pytest.fail(f"cannot run a Slurm cluster: {reason} (set VT_SKIP_SLURM=1 to skip the Slurm tests)", pytrace=False)


def ensure_slurm() -> Path:
    """The folder of slurmctld/slurmd/munged, installed by scripts/ensure_slurm.sh if needed; fails the test
    (or skips it under VT_SKIP_SLURM=1) when that cannot be."""
    if os.geteuid() != 0:
        _unavailable(f"the daemons must run as root (SlurmUser=root) and this test runs as uid {os.geteuid()}")
    try:
        done = subprocess.run(
            [str(ROOT / "scripts" / "ensure_slurm.sh")],
            capture_output=True,
            text=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        _unavailable("scripts/ensure_slurm.sh did not finish in 900 s")
    if done.returncode != 0 or not done.stdout.strip():
        _unavailable(f"scripts/ensure_slurm.sh failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (held together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def parse_jobcomp(text: str) -> list[dict[str, str]]:
    """jobcomp/filetxt's lines as dicts of their `Key=value` fields (a value never holds a space there)."""
    records = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in fields:
            records.append(fields)
    return records


@dataclass
class SlurmCluster:
    base: Path  # every file of the cluster: config, keys, sockets, state, logs
    sbin: Path
    node: str
    cpus: int
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def jobcomp(self) -> Path:
        return self.base / "jobcomp.txt"

    # --- set-up and teardown -------------------------------------------------------------------------------

    def write_config(self) -> None:
        base, host = self.base, socket.gethostname().split(".")[0]
        ctld_port, slurmd_port = _free_ports(2)
        for sub in ("state", "spool", "munge"):
            (base / sub).mkdir(mode=0o755, exist_ok=True)
        key = base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=vt-test",
            f"SlurmctldHost={host}(127.0.0.1)",  # must be this machine's real short hostname
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={base}/munge/munge.socket.2",
            f"StateSaveLocation={base}/state",
            f"SlurmdSpoolDir={base}/spool",
            f"SlurmctldPidFile={base}/slurmctld.pid",
            f"SlurmdPidFile={base}/slurmd.pid",
            f"SlurmctldLogFile={base}/slurmctld.log",
            f"SlurmdLogFile={base}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",  # else array elements start in waves 3 s apart
            "SlurmdParameters=config_overrides",  # the node may claim more CPUs than the machine has
            "ReturnToService=2",
            "MinJobAge=300",
            f"KillWait={KILL_WAIT}",
            "InactiveLimit=0",
            "GresTypes=gpu",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        path = os.environ.get("PATH", "")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{self.sbin}:{path}"}
        for name in [name for name in self.env if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))]:
            if name != "SLURM_CONF":  # a test run inside a Slurm job must not hand its own job's settings on
                del self.env[name]

    def _daemon(self, name: str, *args: str) -> None:
        out = open(self.base / f"{name}.out", "wb")  # noqa: SIM115 - the daemon's, closed with it below
        self.procs[name] = subprocess.Popen(
            [str(self.sbin / name), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        out.close()

    def start(self, timeout: float = 60.0) -> None:
        munge = self.base / "munge"
        self._daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge}/munge.socket.2",
            f"--key-file={munge}/munge.key",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={self.base}/munged.log",
            f"--seed-file={munge}/munged.seed",
        )
        self.wait(lambda: (munge / "munge.socket.2").exists(), timeout, "munged's socket", "munged")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        self.wait(lambda: self.node_state().startswith("idle"), timeout, f"node {self.node} to be idle")

    def stop(self) -> None:
        """Cancel the cluster's jobs, stop slurmd, slurmctld and munged by pid (TERM, KILL after the grace period),
        then end what is left of the jobs: every process whose environment names this cluster's slurm.conf
        (slurmstepd and the jobs' own processes; sbatch hands its environment on)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(AssertionError):
                jobs = self.client("squeue", "-h", "-o", "%A", check=False).split()
                if jobs:
                    self.client("scancel", *sorted(set(jobs)), check=False)
                    self.wait(
                        lambda: not self.client("squeue", "-h", "-o", "%A", check=False).strip(),
                        KILL_WAIT + GRACE,
                        "the jobs to end at teardown",
                    )
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None:
                _end([proc.pid], lambda: [proc.pid] if proc.poll() is None else [])
        _end(self.job_pids(), self.job_pids)

    def job_pids(self) -> list[int]:
        """Processes started for this cluster's jobs (their environment holds SLURM_CONF=<this slurm.conf>)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(entry))
        return found

    # --- waiting -------------------------------------------------------------------------------------------

    def wait(self, condition, timeout: float, what, daemon: str | None = None):
        """Poll `condition()` until truthy and return its value; fail with the daemons' logs after `timeout` s or
        once a daemon died. `what` (a string, or a callable making one at the failure) names what was awaited."""

        def ready():
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            if dead:
                raise AssertionError(
                    f"{', '.join(dead)} exited waiting for {what() if callable(what) else what}\n"
                    f"{self.diagnosis(daemon)}"
                )
            return condition()

        try:
            return wait_for(ready, timeout=timeout, interval=0.2, what="a condition")
        except AssertionError as err:
            if not str(err).startswith("timed out"):
                raise
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}\n"
                f"{self.diagnosis(daemon)}"
            ) from None

    def diagnosis(self, daemon: str | None = None) -> str:
        """The tail of each daemon's log and output (or of one daemon's)."""
        parts = []
        for name in [daemon] if daemon else ["munged", "slurmctld", "slurmd"]:
            text = "".join(
                (self.base / f"{name}{ext}").read_text(errors="replace")
                for ext in (".log", ".out")
                if (self.base / f"{name}{ext}").exists()
            )
            parts.append(f"--- {name} ---\n{text[-2000:]}")
        return "\n".join(parts)

    # --- clients -------------------------------------------------------------------------------------------

    def client(self, *args: str, check: bool = True, timeout: float = CLIENT_TIMEOUT) -> str:
        """Run a Slurm client (sbatch, squeue, scancel, sinfo, scontrol) with a time limit; its stdout."""
        try:
            done = subprocess.run(
                list(args), capture_output=True, text=True, env=self.env, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as err:
            raise AssertionError(f"{' '.join(args)} took over {timeout:.0f} s\n{self.diagnosis()}") from err
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        try:
            done = subprocess.run(
                ["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=5,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    def sbatch(self, *args: str) -> str:
        """Submit (`sbatch --parsable ARGS`); returns the job id."""
        return self.client("sbatch", "--parsable", *args).strip().split(";")[0]

    def scancel(self, *ids: str) -> None:
        self.client("scancel", *ids)

    def queue(self, job: str) -> dict[str, str]:
        """{array task id (or job id): state} of the job's elements still known to the controller."""
        out = self.client("squeue", "-h", "-r", "-j", job, "-o", "%K %T", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def finished(self, job: str) -> dict[int, dict[str, str]]:
        """{array task id: jobcomp record} of the array `job`'s elements that have ended (a non-array job: id 0)."""
        text = self.jobcomp.read_text(errors="replace") if self.jobcomp.exists() else ""
        found = {}
        for record in parse_jobcomp(text):
            if record.get("ArrayJobId") == job:
                found[int(record["ArrayTaskId"])] = record
            elif record["JobId"] == job and "ArrayTaskId" not in record:
                found[0] = record
        return found

    def wait_finished(self, job: str, tasks, timeout: float) -> dict[int, dict[str, str]]:
        """Wait until every array task in `tasks` of `job` has a jobcomp record; those records."""
        tasks = set(tasks)
        return self.wait(
            lambda: (found := self.finished(job)) and tasks <= found.keys() and {t: found[t] for t in tasks},
            timeout,
            f"array {job} elements {sorted(tasks)} to finish",
        )

    def wait_gone(self, job: str, timeout: float) -> None:
        """Wait until no element of `job` is pending or running (cancelled while pending leaves no jobcomp line)."""
        self.wait(
            lambda: (
                not {
                    s
                    for s in self.queue(job).values()
                    if s in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")
                }
            ),
            timeout,
            f"job {job} to leave the queue",
        )


@contextlib.contextmanager
def slurm_cluster(cpus: int = 4, node: str = "vt-node", timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """A running one-node cluster (see the module docstring); torn down however the block ends."""
    sbin = ensure_slurm()
    base = Path(tempfile.mkdtemp(prefix="vt-slurm-"))  # short: unix socket paths are limited to 108 bytes
    cluster = SlurmCluster(base, sbin, node, cpus)
    try:
        cluster.write_config()
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("VT_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def slurm() -> Iterator[SlurmCluster]:
    """A fresh one-node Slurm cluster for one test (import this fixture into the test module)."""
    with slurm_cluster() as cluster:
        yield cluster

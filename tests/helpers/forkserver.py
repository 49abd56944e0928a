"""Real CLI processes without the import bill: forked from one warm interpreter per pytest worker.

A test that starts `vt-train run ...` pays some 8 CPU seconds importing torch, diffusers, transformers
and peft before the CLI reads its config, and the suite starts hundreds of such processes (torchrun's
ranks, both stages of every end-to-end run). `launch()` forks them instead from a server process that
imported those libraries once and did nothing else (no threads, no tensors, no thread pools). Each
child is a real OS process: its own pid, memory, file descriptors and signals, and the real entry
point (the `vt-train`/`vt-precompute` console scripts, run as Python runs them) with the arguments,
working directory and environment asked for; it exits with the CLI's code, after its atexit hooks.
`launch_ranks()` starts the ranks of one node as torchrun does: its environment variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), one shared log, and when one rank fails the others are
killed and the group exits 1.

Environment read at import time is the server's: it is started with the variables every test child
gets (`BASE_ENV`), and a launch whose environment differs in an import-time variable a library reads
must not use it. Tests that measure a process's memory, launch through torchrun or accelerate
themselves, or need a fresh interpreter start plain subprocesses.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

BIN = Path(sys.executable).parent
BASE_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
# What the server imports before it forks anything: what the CLIs import on the way to their first step.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "diffusers",
    "transformers",
    "peft",
    "av",
    "webdataset",
    "safetensors.torch",
    "fsspec",
    "typer",
    "vt.train.cli",
    "vt.train.trainer",
    "vt.train.model_build",
    "vt.train.validation",
    "vt.train.export",
    "vt.precompute.cli",
    "vt.precompute.service",
    "vt.shared.models",
    # What a run imports on its way out (rank 0's loss plot and run page) and on the way in (weights, env):
    # some 1.5 CPU seconds a process that every forked run paid again.
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "plotly.graph_objects",
    "plotly.io",
    "vt.train.plots",
    "vt.train.report",
    "vt.train.env",
    "vt.shared.weights.gguf_file",
    "vt.shared.weights.lineage",
    "vt.shared.weights.single_file",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the server side: runs in its own process (`python forkserver.py`) -----------------------------------


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from vt.shared.models import FAMILIES, components, get_spec_class

    for family in FAMILIES:  # the diffusers and transformers classes of every family's parts and pipelines
        spec = get_spec_class(family)
        tasks = spec.task_components if isinstance(spec.task_components, dict) else {}  # some compute theirs
        parts = [spec.components, *tasks.values(), spec.pipelines]
        for target in {target for part in parts for target in part.values()}:
            components.load_class(target)
    if threading.active_count() != 1:
        raise RuntimeError(f"forkserver: imports started threads {threading.enumerate()}; forking them is unsafe")
    # The imported objects never die: out of the collector's sight, a child's collections (the CLI's own
    # gc.collect() at the end of a run among them) skip them instead of walking and touching every page of them.
    gc.collect()
    gc.freeze()


def _run_child(request: dict) -> int:
    """In the forked child: become the process asked for and run its entry point; returns the exit code."""
    import atexit
    import faulthandler
    import runpy
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = str(Path(script).parent)  # as `python SCRIPT` has it, with PYTHONPATH's folders next
    extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    sys.path[1:1] = extra
    code: int = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return code


def _fork(request: dict, server_fds: list[int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
        out = os.open(request["log"], flags, 0o644) if request["log"] else os.open(os.devnull, os.O_WRONLY)
        for source, target in ((null, 0), (out, 1), (out, 2)):
            if source != target:
                os.dup2(source, target)
        for fd in {null, out} - {0, 1, 2}:
            os.close(fd)
        code = _run_child(request)
    finally:
        os._exit(code)


def serve() -> None:
    """Read launch requests (JSON lines) on stdin; answer each with the child's pid, and report every
    child's exit code when it ends. Protocol output goes to a private copy of stdout."""
    import selectors

    replies = os.dup(1)
    os.dup2(2, 1)  # a stray print of an import lands in stderr, not in the protocol
    os.environ.update(BASE_ENV)
    _preload()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    reply({"ready": os.getpid()})
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_read:
                os.read(wake_read, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if not pid:
                        break
                    reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the test process is gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = _fork(request, [0, replies, wake_read, wake_write, selector.fileno()])
                reply({"id": request["id"], "pid": pid})


# --- the test side --------------------------------------------------------------------------------------


class ForkServer:
    """The test process's handle on its server: started on first use, one per pytest worker."""

    def __init__(self) -> None:
        env = {**os.environ, **BASE_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=Path(__file__).parent,
        )
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.next_id = 0
        self.dead = False  # the server is gone: no child will be reported again
        first = json.loads(self.proc.stdout.readline() or b'{"ready": null}')
        if not first.get("ready"):
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()}); see the test's stderr")
        self.reader = threading.Thread(target=self._read, daemon=True, name="forkserver-replies")
        self.reader.start()
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (its stdin closed, it returns) and reap it, so that its children's CPU time counts in
        the test process's (`time make test` sees the whole tree); a server that does not end in 10 s is killed."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def _read(self) -> None:
        """The server's messages in the order it sent them. The kernel reuses a pid once its process is reaped (pid_max
        is 32,768 on many machines; a suite forks tens of thousands of processes): an exit reported before a launch's
        pid is an earlier process's, never the new one's (the server reaps and reports before it forks again), and is
        forgotten there."""
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "exited" in message:
                    self.codes[message["exited"]] = message["code"]
                else:
                    self.pids[message["id"]] = message["pid"]
                    self.codes.pop(message["pid"], None)
                self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()

    def fork(self, script: Path, args: list[str], env: dict, log: Path | None, append: bool = False) -> int:
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            request = {
                "id": ident,
                "script": str(script),
                "args": [str(a) for a in args],
                "env": env,
                "cwd": os.getcwd(),
                "log": str(log) if log else None,
                "append": append,
            }
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        with self.changed:
            self.changed.wait_for(lambda: ident in self.pids or self.dead, timeout=60)
            if ident not in self.pids:
                raise RuntimeError("the fork server did not answer a launch")
            return self.pids.pop(ident)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.codes or self.dead, timeout=timeout)
            if pid not in self.codes and self.dead:
                raise RuntimeError(f"the fork server died; the exit of process {pid} is unknown")
            return self.codes.pop(pid, None)  # (the caller keeps it: Forked.returncode)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = ForkServer()
        return _server


class Forked:
    """A forked process, with the part of subprocess.Popen the tests use (args, pid, poll, wait, kill)."""

    def __init__(self, args: list[str], pid: int, owner: ForkServer):
        self.args, self.pid, self.returncode, self._owner = args, pid, None, owner

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._owner.wait(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._owner.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(command: str, *args: str, env: dict | None = None, log: Path | None = None, append: bool = False) -> Forked:
    """Start console script `command` (vt-train, vt-precompute, or a Python file's path) with `args`,
    as a process forked from the warm server; stdout and stderr to `log`."""
    script = Path(command) if os.sep in command else BIN / command
    owner = server()
    full_env = {**os.environ, **BASE_ENV, **(env or {})}
    pid = owner.fork(script, list(args), full_env, log, append)
    return Forked([str(script), *args], pid, owner)


def bench_launch(args: list[str], log: Path, env: dict) -> Forked:
    """The benches' `launch` (scripts/bench_common.popen) for the tests: `args` (a console script's path, or
    `python FILE ...`) forked from the warm server instead of started fresh; stdout and stderr to `log`."""
    if args[0] == sys.executable:
        args = args[1:]
    return launch(str(args[0]), *map(str, args[1:]), env=env, log=log)


class RankGroup:
    """The ranks of one node, started as torchrun starts them; Popen-like, the group's exit code is 0 when
    every rank exits 0, else 1 (torchrun's), after the others are killed."""

    def __init__(self, args: list[str], ranks: list[Forked]):
        self.args, self.ranks, self.returncode = args, ranks, None
        self.pid = ranks[0].pid

    def _settle(self, timeout: float | None) -> int | None:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [rank.poll() for rank in self.ranks]
            if any(code not in (None, 0) for code in codes):
                for rank in self.ranks:
                    rank.kill()
                for rank in self.ranks:
                    rank.wait(60)
                return 1
            if all(code == 0 for code in codes):
                return 0
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            running = next(rank for rank, code in zip(self.ranks, codes) if code is None)
            try:  # wake when that rank ends, or now and then to see whether another one failed
                running.wait(min(0.5, left) if left is not None else 0.5)
            except subprocess.TimeoutExpired:
                pass

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._settle(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._settle(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


def launch_ranks(command: str, nproc: int, *args: str, log: Path, env: dict | None = None) -> RankGroup:
    """`torchrun --standalone --nproc-per-node=nproc COMMAND ARGS`, its ranks forked from the warm server,
    all writing to `log`."""
    port = free_port()
    log.write_bytes(b"")
    ranks = []
    for rank in range(nproc):
        rank_env = {
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"vt-test-{port}",
        }
        ranks.append(launch(command, *args, env=rank_env, log=log, append=True))
    return RankGroup([command, *args], ranks)


if __name__ == "__main__":
    serve()

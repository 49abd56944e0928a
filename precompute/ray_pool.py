"""Decoding on a Ray cluster (`precompute.engine = "ray"`): the decode chain runs in a pool of Ray actors on any
node's CPUs, feeding this producer's encoder, so one encoder is fed by as many cores as the cluster has.

The cluster is the one RAY_ADDRESS names (Ray's own convention: `ray start --head` prints it); unset, Ray starts a
local one on this machine. `RayDecodePool` is `DecodePool`'s interface (workers.py): an ordered map with at most
`inflight` clips submitted, so a slow encoder holds the decoding back (and the object store stays bounded). An actor
that dies mid-clip (its process killed, its node lost) or passes `precompute.ray_timeout_seconds` on one clip is
replaced, and the clip runs again on the new actor; a clip that has taken `precompute.ray_tries` actors with it is
rejected as `decoder_crashed`, like a clip that kills a local decode worker (a clip whose actor another clip took
down runs again without spending a try). A clip's deadline counts its own run only: a fresh actor is first waited
for until it has started (its process imports torch and PyAV, slow on a loaded machine), within
`max(timeout, START_SECONDS)`. Every `ray.get` has a deadline, so a lost cluster stops the producer with an error
instead of a hang; what it committed stays committed. So does a cluster that does not answer at the start: the
address Ray will dial is tried first (`ray.init` retries a refused address for many minutes).
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vt.shared.errors import UserError
from vt.shared.log import get_logger

log = get_logger("vt.precompute.ray")
# A local cluster this pool starts (no RAY_ADDRESS) listens on loopback only and sends no usage report; a cluster
# the user started is reached as it was started (a driver must match its settings).
LOCAL_CLUSTER_ENVIRONMENT = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
START_SECONDS = 300.0  # the least a fresh actor is given to start, whatever the clip deadline
REACH_SECONDS = 20.0  # how long the cluster's address is tried before the producer stops (a head may be starting)


def check_reachable(address: str, seconds: float = REACH_SECONDS) -> None:
    """Stop with what to do unless the address Ray's driver will dial for `address` accepts a connection within
    `seconds` (`ray.init` would retry a refused one for many minutes). Ray dials the node's own address for a loopback
    one unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set when ray was first imported in this process; a head started
    with it listens on loopback only, which is told at once."""
    from ray._private import services

    dial = services.canonicalize_bootstrap_address(address)
    if dial is None:  # "local": this process starts the cluster
        return
    deadline = time.monotonic() + seconds
    while not _accepts(dial):
        if dial != address and _accepts(address):
            raise UserError(
                f"the Ray head at RAY_ADDRESS={address} listens on loopback only (it was started with "
                f"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), and this producer's driver dials {dial}: set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for the producer too, or start the head without it"
            )
        if time.monotonic() >= deadline:
            raise UserError(
                f"the Ray cluster at RAY_ADDRESS={address} does not answer at {dial} after {seconds:g} s: start it "
                "(`ray start --head`) or fix RAY_ADDRESS"
            )
        time.sleep(0.5)


def _accepts(address: str) -> bool:
    from ray._private import services

    host, port = services.parse_address(address)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        return False
    return True


class DecodeActor:
    """One decode process of the cluster: the decode chain's worker set-up once, then clips one at a time."""

    def __init__(self, initializer: Callable[[], None] | None):
        if initializer is not None:
            initializer()

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[[Any], Any], item: Any) -> Any:
        return fn(item)


class RayDecodePool:
    def __init__(
        self, actors: int, initializer: Callable[[], None] | None = None, tries: int = 3, timeout_seconds: float = 600.0
    ):
        if not os.environ.get("RAY_ADDRESS"):  # a local cluster of this process's own: before ray reads them
            for name, value in LOCAL_CLUSTER_ENVIRONMENT.items():
                os.environ.setdefault(name, value)
        try:
            import ray
        except ImportError as err:
            raise UserError(
                "precompute.engine = \"ray\" needs Ray: pip install 'vt[ray]' (ray==2.60.0), or set "
                'precompute.engine = "local"'
            ) from err
        self.ray = ray
        self.tries, self.timeout = tries, timeout_seconds
        self.crashes = 0  # clips rejected for taking `tries` actors with them
        self.restarts = 0  # actors replaced (died or timed out)
        self._started = not ray.is_initialized()
        if self._started:
            if os.environ.get("RAY_ADDRESS"):
                check_reachable(os.environ["RAY_ADDRESS"])
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        if actors == 0:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(num_cpus=1, max_restarts=0)(DecodeActor)
        self.initializer = initializer
        self.actors: list = []
        self._starts: list = []  # per actor, its first call (`pid`) until answered (the actor started), then None
        self.awaiting_start: int | None = None  # the actor whose start this driver waits for now, if any
        for _ in range(actors):
            self._new_actor()
        self._turn = 0
        log.info("decoding on Ray (%s): %d actors", os.environ.get("RAY_ADDRESS") or "a local cluster", actors)

    @property
    def workers(self) -> int:
        return len(self.actors)

    def warm_up(self) -> None:
        """Wait until every actor has started (its process imports torch and PyAV). One that dies starting (its
        process killed, its node lost) is replaced, up to `tries` starts an actor; then the producer stops saying
        why (an initializer that fails every time, say)."""
        for index in range(len(self.actors)):
            for started in range(1, self.tries + 1):
                try:
                    self._get(self._starts[index], max(self.timeout, START_SECONDS))
                    break
                except self.ray.exceptions.RayActorError as err:
                    if started == self.tries:
                        raise UserError(
                            f"decode actor {index} died while starting, {started} times in a row (precompute.ray_tries"
                            f" = {self.tries}): {str(err).splitlines()[0]}; see the Ray worker logs"
                        ) from err
                    self._replace(index, self.actors[index], timed_out=False)
        self._starts = [None] * len(self._starts)

    def close(self) -> None:
        """Stop the actors at once, and the local cluster if this pool started one."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()

    def _get(self, refs, timeout: float):
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError as err:
            raise UserError(
                f"the Ray cluster started no decode actor in {timeout:g} s (precompute.ray_timeout_seconds = "
                f"{self.timeout:g}): is it up (RAY_ADDRESS)?"
            ) from err

    def _new_actor(self, index: int | None = None) -> None:
        """A new actor (at `index`, or appended), its first call made at once: an actor runs its calls in order, so
        that one's answer says the process has started, whatever clips are queued behind it."""
        actor = self._remote.remote(self.initializer)
        if index is None:
            self.actors.append(actor)
            self._starts.append(actor.pid.remote())
        else:
            self.actors[index], self._starts[index] = actor, actor.pid.remote()

    def _wait_started(self, index: int, actor) -> None:
        """Until actor `index` has started, once per actor (a clip's deadline then counts its run only)."""
        if self.actors[index] is not actor or self._starts[index] is None:
            return
        self.awaiting_start = index
        try:
            self._get(self._starts[index], max(self.timeout, START_SECONDS))
        except self.ray.exceptions.RayActorError:
            return  # died starting: the clip's own get reports it
        finally:
            self.awaiting_start = None
        self._starts[index] = None

    def map(self, fn: Callable[[Any], Any], items: Iterable, inflight: int, on_crash: Callable[[Any], Any]) -> Iterator:
        """fn over items in order, with at most `inflight` submitted (no eager read-ahead)."""
        fn_ref = self.ray.put(fn)  # sent once, not with every clip
        queue: deque = deque()
        for item in items:
            queue.append(self._submit(fn_ref, item, 0))
            while len(queue) >= inflight:
                yield self._take(fn_ref, queue, on_crash)
        while queue:
            yield self._take(fn_ref, queue, on_crash)

    def _submit(self, fn_ref, item, tries: int) -> tuple:
        index = self._turn % len(self.actors)
        self._turn += 1
        actor = self.actors[index]
        return item, tries, index, actor, actor.run.remote(fn_ref, item)

    def _take(self, fn_ref, queue: deque, on_crash) -> Any:
        exceptions = self.ray.exceptions
        while True:
            item, tries, index, actor, ref = queue[0]
            self._wait_started(index, actor)
            try:
                result = self.ray.get(ref, timeout=self.timeout)
            except (exceptions.RayActorError, exceptions.GetTimeoutError) as err:
                if self.actors[index] is actor:  # this clip's own actor died or hung on it: a try spent
                    self._replace(index, actor, timed_out=isinstance(err, exceptions.GetTimeoutError))
                    tries += 1
                if tries >= self.tries:
                    queue.popleft()
                    self.crashes += 1
                    return on_crash(item)
                queue[0] = self._submit(fn_ref, item, tries)
                continue
            queue.popleft()
            return result

    def _replace(self, index: int, actor, timed_out: bool) -> None:
        """A fresh actor in place of one that died or hung on a clip (`_take` calls it once per actor)."""
        self.ray.kill(actor)
        self._new_actor(index)
        self.restarts += 1
        log.warning(
            "decode actor %d %s; replaced, its clips run again",
            index,
            "passed precompute.ray_timeout_seconds on one clip" if timed_out else "died",
        )

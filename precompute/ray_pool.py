"""Decoding on a Ray cluster (`precompute.engine = "ray"`): the decode chain runs in a pool of Ray actors on any
node's CPUs, feeding this producer's encoder, so one encoder is fed by as many cores as the cluster has.

The cluster is the one RAY_ADDRESS names (Ray's own convention: `ray start --head` prints it); unset, Ray starts a
local one on this machine. `RayDecodePool` is `DecodePool`'s interface (workers.py): an ordered map with at most
`inflight` clips submitted, so a slow encoder holds the decoding back (and the object store stays bounded). An actor
that dies mid-clip (its process killed, its node lost) or passes `precompute.ray_timeout_seconds` on one clip is
replaced, and the clip runs again on the new actor; a clip that has taken `precompute.ray_tries` actors with it is
rejected as `decoder_crashed`, like a clip that kills a local decode worker. Every `ray.get` has that deadline, so a
lost cluster stops the producer with an error instead of a hang; what it committed stays committed.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vt.shared.errors import UserError
from vt.shared.log import get_logger

log = get_logger("vt.precompute.ray")
# A local cluster this pool starts (no RAY_ADDRESS) listens on loopback only and sends no usage report; a cluster
# the user started is reached as it was started (a driver must match its settings).
LOCAL_CLUSTER_ENVIRONMENT = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        if actors == 0:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(num_cpus=1, max_restarts=0)(DecodeActor)
        self.initializer = initializer
        self.actors = [self._remote.remote(initializer) for _ in range(actors)]
        self._turn = 0
        log.info("decoding on Ray (%s): %d actors", os.environ.get("RAY_ADDRESS") or "a local cluster", actors)

    @property
    def workers(self) -> int:
        return len(self.actors)

    def warm_up(self) -> None:
        """Wait until every actor has started (its process imports torch and PyAV)."""
        self._get([actor.pid.remote() for actor in self.actors])

    def close(self) -> None:
        """Stop the actors at once, and the local cluster if this pool started one."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()

    def _get(self, refs):
        try:
            return self.ray.get(refs, timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError as err:
            raise UserError(
                f"the Ray cluster answered nothing in precompute.ray_timeout_seconds = {self.timeout:g}: "
                "is it up (RAY_ADDRESS)?"
            ) from err

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
            try:
                result = self.ray.get(ref, timeout=self.timeout)
            except (exceptions.RayActorError, exceptions.GetTimeoutError) as err:
                self._replace(index, actor, timed_out=isinstance(err, exceptions.GetTimeoutError))
                if tries + 1 >= self.tries:
                    queue.popleft()
                    self.crashes += 1
                    return on_crash(item)
                queue[0] = self._submit(fn_ref, item, tries + 1)
                continue
            queue.popleft()
            return result

    def _replace(self, index: int, actor, timed_out: bool) -> None:
        """A fresh actor in place of one that died or hung (once, however many of its clips report it)."""
        if self.actors[index] is not actor:
            return
        self.ray.kill(actor)
        self.actors[index] = self._remote.remote(self.initializer)
        self.restarts += 1
        log.warning(
            "decode actor %d %s; replaced, its clips run again",
            index,
            "passed precompute.ray_timeout_seconds on one clip" if timed_out else "died",
        )

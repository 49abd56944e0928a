"""Decode workers: an ordered, bounded map over processes that survives a worker dying on one clip.

A decoder can crash its whole process on a hostile file (a segfault in a codec, an out-of-memory
kill). A plain multiprocessing.Pool then waits forever for that task's result. Here a dead worker
breaks the executor, and the items that were in flight when it died are run again one at a time
in a fresh one: the item that kills a worker alone is the culprit, and it becomes `on_crash(item)`
(a sample rejected with its reason) while the rest of the stream goes on.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from vt.shared.errors import UserError


class DecodePool:
    def __init__(self, workers: int, initializer: Callable[[], None] | None = None):
        if workers < 1:
            raise UserError(f"precompute.workers must be >= 1 for a pool, got {workers}")
        self.workers = workers
        self.initializer = initializer
        self.crashes = 0
        self._executor: ProcessPoolExecutor | None = None
        self._restart()

    def _restart(self) -> None:
        self.close()
        self._executor = ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=self.initializer
        )

    def warm_up(self) -> None:
        """Start every worker process now (the executor starts them at the first tasks): a spawned worker
        spends seconds importing torch and PyAV, which then overlaps the encoders' loading."""
        for _ in range(self.workers):
            self._executor.submit(os.getpid)  # a no-op task: its only effect is a started worker

    def close(self) -> None:
        """Stop at once: queued work is dropped and running workers are terminated."""
        if self._executor is None:
            return
        processes = list((self._executor._processes or {}).values())  # no public handle on them
        self._executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        self._executor = None

    def map(self, fn: Callable[[Any], Any], items: Iterable, inflight: int, on_crash: Callable[[Any], Any]) -> Iterator:
        """fn over items in order, with at most `inflight` submitted (no eager read-ahead)."""
        queue: deque = deque()
        for item in items:
            queue.append((item, self._submit(fn, item)))
            while len(queue) >= inflight:
                yield from self._take(fn, queue, on_crash)
        while queue:
            yield from self._take(fn, queue, on_crash)

    def _submit(self, fn, item) -> Future:
        try:
            return self._executor.submit(fn, item)
        except BrokenProcessPool as err:  # a worker already died: settled when this item's turn comes
            future: Future = Future()
            future.set_exception(err)
            return future

    def _take(self, fn, queue: deque, on_crash) -> Iterator:
        item, future = queue[0]
        try:
            result = future.result()
        except BrokenProcessPool:
            in_flight = [it for it, _ in queue]
            queue.clear()
            yield from self._replay(fn, in_flight, on_crash)
            return
        queue.popleft()
        yield result

    def _replay(self, fn, items: list, on_crash) -> Iterator:
        """A worker died and which in-flight item killed it is unknown: run them again one at a time."""
        self._restart()
        for item in items:
            try:
                result = self._executor.submit(fn, item).result()
            except BrokenProcessPool:
                self.crashes += 1
                result = on_crash(item)
                self._restart()
            yield result

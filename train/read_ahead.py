"""Read ahead: the next batches are read and decoded in background threads while the model steps.

The reader's work splits in two (train/data.py): planning (which samples form the next batch; commit
records only, and in a distributed run a broadcast from the order's reader) stays on the training
thread, so every rank plans in lock-step; loading (this rank's rows by byte range, checked, stacked,
on CUDA copied into pinned memory so the step's host-to-device copy does not block) runs in a small
thread pool. Before each step the trainer tops the queue up with every batch it can plan without
waiting for a producer: looking ahead never blocks on a shard that is not committed yet (rank 0 says
"not yet" and every rank stops looking there), so it cannot hold up a step whose own data is here or
ask the window for more than the producers have made.

Memory is bounded: batches are planned ahead only while the bytes they will hold (`Plan.nbytes`) stay
within `max_bytes` (train.read_ahead_mb) and their number within `max_batches`; one batch is always
allowed, so a batch larger than the budget is still read, alone. `max_bytes` 0 reads synchronously.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from vt.train.data import Batch, BatchReader, Plan

__all__ = ["ReadAhead"]


class ReadAhead:
    """Iterates `reader`'s batches, up to `max_bytes` / `max_batches` of them loaded ahead of the one in use."""

    def __init__(self, reader: BatchReader, max_bytes: int, max_batches: int = 8, pin: bool = False, threads: int = 2):
        self.reader = reader
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self.pin = pin
        self.threads = threads
        self.queue: deque[tuple[Plan, Future]] = deque()
        self.held = 0  # Plan.nbytes of the queued batches
        self.peak_held = 0  # the most bytes ever queued at once (tests and the bench read it)
        self._pool: ThreadPoolExecutor | None = None
        self._plans: Iterator[Plan | None] | None = None
        self._next: Plan | None = None  # planned, not queued yet: it did not fit the budget
        self._ended = False

    def __iter__(self) -> Iterator[Batch]:
        self._plans = self.reader.plans()
        try:
            while True:
                self.top_up()
                if not self.queue and not self._plan(block=True):
                    return
                plan, future = self.queue.popleft()
                self.held -= plan.nbytes
                yield future.result()
        finally:
            self.close()

    def top_up(self) -> None:
        """Queue every batch that can be planned now without waiting for a commit and fits the budget."""
        if self.max_bytes <= 0:
            return
        while len(self.queue) < self.max_batches:
            if self._next is None and not self._take_plan(block=False):
                return
            if self.queue and self.held + self._next.nbytes > self.max_bytes:
                return
            self._submit()

    def _plan(self, block: bool) -> bool:
        """Plan and queue one batch; False when the data has ended."""
        if self._next is None and not self._take_plan(block):
            return False
        self._submit()
        return True

    def _take_plan(self, block: bool) -> bool:
        """Into `_next` the next plan; False if there is none now (not committed yet, or the end)."""
        if self._ended:
            return False
        self.reader.block = block
        plan = next(self._plans, StopIteration)
        if plan is StopIteration:
            self._ended = True
            return False
        if plan is None:  # the next shard is not committed yet (only without blocking)
            return False
        self._next = plan
        return True

    def _submit(self) -> None:
        plan, self._next = self._next, None
        if self.max_bytes <= 0:  # synchronous
            future: Future = Future()
            future.set_result(self.reader.load(plan, self.pin))
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="vt-read-ahead")
            future = self._pool.submit(self.reader.load, plan, self.pin)
        self.queue.append((plan, future))
        self.held += plan.nbytes
        self.peak_held = max(self.peak_held, self.held)

    def close(self) -> None:
        """Stop the threads (reads in flight finish; their batches are dropped)."""
        for _, future in self.queue:
            future.cancel()
        self.queue.clear()
        self.held = 0
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

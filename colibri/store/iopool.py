"""The reader's threads, with reads a step waits for ahead of reads ahead.

A fixed set of threads runs two queues: jobs submitted with `submit` (a step's misses, loads, checks) first,
then the look-ahead's reads (`submit_ahead`), so that a read a step waits for never queues behind a guess.
A read ahead that a step comes to need is `promote`d into the first queue. A job already running is never
interrupted: the most a demand read waits for the look-ahead is the reads ahead in flight.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_Job = tuple[Future, Callable[..., Any], tuple]


class IOPool:
    """Runs on a ThreadPoolExecutor (its threads are joined at interpreter exit, so no read is cut off): each job
    queued adds one task to the executor, and a task runs whichever job is first when a thread takes it."""

    def __init__(self, threads: int, name: str = "colibri-io"):
        self._now: deque[_Job] = deque()  # run first, in order
        self._ahead: deque[_Job] = deque()  # run when nothing waits in _now, in order
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._put(self._now, fn, args)

    def submit_ahead(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._put(self._ahead, fn, args)

    def _put(self, q: deque[_Job], fn: Callable[..., Any], args: tuple) -> Future:
        f: Future = Future()
        job = (f, fn, args)
        with self._lock:
            q.append(job)
        try:
            self._pool.submit(self._run_next)
        except RuntimeError:  # (shut down)
            with self._lock:
                for i, other in enumerate(q):
                    if other is job:
                        del q[i]
                        break
            raise RuntimeError("the reader is closed") from None
        return f

    def promote(self, f: Future) -> None:
        """Move a read ahead that has not started into the first queue (a step waits for it now)."""
        with self._lock:
            for i, job in enumerate(self._ahead):
                if job[0] is f:
                    del self._ahead[i]
                    self._now.append(job)
                    return

    def waiting_ahead(self) -> int:
        """Reads ahead queued and not started."""
        return len(self._ahead)

    def _run_next(self) -> None:
        with self._lock:
            f, fn, args = (self._now or self._ahead).popleft()  # (one job queued per task: never empty)
        if not f.set_running_or_notify_cancel():
            return
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            f.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """Stop taking jobs; the queued ones still run (a slot waits on each). `wait`: until they have."""
        self._pool.shutdown(wait=wait)

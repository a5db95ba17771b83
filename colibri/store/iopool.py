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
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future, Callable[..., Any], tuple]


class IOPool:
    def __init__(self, threads: int, name: str = "colibri-io"):
        self._now: deque[_Job] = deque()  # run first, in order
        self._ahead: deque[_Job] = deque()  # run when nothing waits in _now, in order
        self._cv = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._put(self._now, fn, args)

    def submit_ahead(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._put(self._ahead, fn, args)

    def _put(self, q: deque[_Job], fn: Callable[..., Any], args: tuple) -> Future:
        f: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the reader is closed")
            q.append((f, fn, args))
            self._cv.notify()
        return f

    def promote(self, f: Future) -> None:
        """Move a read ahead that has not started into the first queue (a step waits for it now)."""
        with self._cv:
            for i, job in enumerate(self._ahead):
                if job[0] is f:
                    del self._ahead[i]
                    self._now.append(job)
                    return

    def waiting_ahead(self) -> int:
        """Reads ahead queued and not started."""
        return len(self._ahead)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._now or self._ahead or self._stopping):
                    self._cv.wait()
                if not (self._now or self._ahead):
                    return  # (stopping, and every queued job has run)
                f, fn, args = (self._now or self._ahead).popleft()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                f.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """Stop taking jobs; the queued ones still run (a slot waits on each). `wait`: until they have."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join()

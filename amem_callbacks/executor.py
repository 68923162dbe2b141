"""Runs suspend/resume calls on one daemon thread, so that the caller can wait
with a deadline and an overlapped transition can run while the caller goes on.

Why not concurrent.futures: its worker threads are joined at interpreter exit,
so an NCCL call stuck on a dead peer would keep the process from ever exiting.
One thread also keeps every rank's calls in the order they were submitted,
which collective calls require.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .errors import TransitionTimeout


class Task:
    """One submitted call; ``wait`` returns its result or raises its error."""

    def __init__(self, fn: Callable, what: str):
        self.fn = fn
        self.what = what
        self._done = threading.Event()
        self._result = None
        self._error = None

    def run(self) -> None:
        try:
            self._result = self.fn()
        except BaseException as exc:  # handed to the waiter, never lost
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float):
        if not self._done.wait(timeout_s):
            raise TransitionTimeout(
                f"{self.what} did not finish within {timeout_s:g} s: a peer rank is probably "
                "missing, dead or in a different phase. The communicators' state is unknown; "
                "stop the job (every rank must call begin/end in the same order).")
        if self._error is not None:
            raise self._error
        return self._result


class SerialExecutor:
    """A single daemon worker; tasks run one at a time in submission order."""

    def __init__(self, name: str = "amem-transitions"):
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            task.run()

    def submit(self, fn: Callable, what: str) -> Task:
        task = Task(fn, what)
        self._queue.put(task)
        return task

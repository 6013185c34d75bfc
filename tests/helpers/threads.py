"""Calls on other threads, for the tests of what MLX keeps per thread (its
compile cache, its default stream) and of objects shared between threads:
every thread is joined, a hung one fails the test, and what a call raised
is raised on the test's thread."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def running_on_threads(
    *calls: Callable[[], Any], timeout: float = 120.0, together: bool = False
) -> Iterator[list]:
    """Starts one thread per call (``together``: each waits until all have
    started, so they overlap) and yields the list their results fill, by
    position, while the test's thread goes on. On leaving, joins them: a
    thread still running ``timeout`` seconds on fails the test, and the
    first exception a call raised is raised here."""
    results: list = [None] * len(calls)
    failures: list = []
    start = threading.Barrier(len(calls)) if together else None

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            if start is not None:
                start.wait(timeout=timeout)
            results[index] = call()
        except BaseException as failure:  # raised on the test's thread
            failures.append(failure)

    threads = [threading.Thread(target=run, args=item) for item in enumerate(calls)]
    for thread in threads:
        thread.start()
    try:
        yield results
    finally:
        for thread in threads:
            thread.join(timeout=timeout)
        # Also where the body failed (often because a thread did): a
        # thread's failure or hang is raised, the body's as its context.
        if failures:
            raise failures[0]
        if any(thread.is_alive() for thread in threads):
            raise AssertionError("a thread hung")


def run_on_threads(*calls: Callable[[], Any], timeout: float = 120.0, together: bool = False) -> list:
    """Runs each call on a thread of its own (see :func:`running_on_threads`)
    and returns their results, in order."""
    with running_on_threads(*calls, timeout=timeout, together=together) as results:
        pass
    return results


class WorkerThread:
    """One long-lived thread that runs the calls handed to it one at a time
    and hands back each result or exception, as a server's generation
    thread does. A context manager: leaving stops and joins it."""

    def __init__(self, timeout: float = 120.0) -> None:
        self._timeout = timeout
        self._jobs: queue.Queue = queue.Queue()
        self._outcomes: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for job in iter(self._jobs.get, None):
            try:
                self._outcomes.put((True, job()))
            except BaseException as failure:  # raised by call() on the caller's thread
                self._outcomes.put((False, failure))

    def call(self, job: Callable[[], Any]) -> Any:
        self._jobs.put(job)
        succeeded, outcome = self._outcomes.get(timeout=self._timeout)
        if not succeeded:
            raise outcome
        return outcome

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=self._timeout)
        assert not self._thread.is_alive(), "the worker thread hung"

    def __enter__(self) -> "WorkerThread":
        return self

    def __exit__(self, *exception: object) -> None:
        self.stop()

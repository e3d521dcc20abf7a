"""The staging thread of asynchronous staging: runs, one at a time and in the order given,
the work an asynchronous save leaves behind it (walking and pickling the object, staging
its records; see nebulite._staging). The optimizer's barrier waits for it.

Jobs wait until start() (a checkpoint's commit, or anyone who waits for them): the work is
Python that needs the interpreter's lock, and taking it from the saves of the checkpoint's
other objects, made right after, would make each of them wait for it.

The jobs never take nebulite.api's lock: the callers that wait for them hold it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable


class Job:
    """One piece of work; `result` or `error` once `done` (wait for it with drain()).
    `nbytes`: at most how much memory it will stage (as its submitter estimated)."""

    __slots__ = ("fn", "done", "result", "error", "nbytes")

    def __init__(self, fn: Callable[[], Any], nbytes: int = 0) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.nbytes = nbytes


class Stager:
    """A thread while started jobs wait or run; drain() stops it once they are done (no
    thread outlives the work, as Lightning's tests of leftover threads expect). Driven by
    one thread at a time (the callers hold nebulite.api's lock)."""

    def __init__(self) -> None:
        self._jobs: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._started = 0  # jobs that may run: those submitted before the last start()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False

    def submit(self, fn: Callable[[], Any], nbytes: int = 0) -> Job:
        """Queues `fn` (that will stage at most `nbytes`); it runs after the next start()."""
        job = Job(fn, nbytes)
        with self._cv:
            if self._closed:
                raise RuntimeError("the staging thread is closed")
            self._jobs.append(job)
        return job

    def start(self) -> None:
        """Lets every job submitted so far run."""
        with self._cv:
            if self._started < len(self._jobs):
                self._started = len(self._jobs)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="nebulite-stager",
                                                    daemon=True)
                    self._thread.start()
                self._cv.notify_all()

    def drain(self, stop: bool = True) -> None:
        """Returns once every job submitted so far is done and, with `stop`, the thread has
        stopped (the optimizer's barrier keeps it for the next checkpoint: starting a thread
        in the commit would cost its caller a tenth of a millisecond)."""
        self.start()
        with self._cv:
            while self._jobs or self._busy:
                self._cv.wait()
            if not stop:
                return
            thread, self._stop = self._thread, True
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            self._thread, self._stop = None, False

    def close(self) -> None:
        """Runs what was submitted, then stops the thread for good."""
        self.drain()
        with self._cv:
            self._closed = True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._started and not self._stop:
                    self._cv.wait()
                if not self._started:
                    return
                job = self._jobs.popleft()
                self._started -= 1
                self._busy = True
            try:
                job.result = job.fn()  # type: ignore[misc]
            except BaseException as e:  # handed to whoever waits for the job
                job.error = e
            finally:
                job.fn = None
                with self._cv:
                    self._busy = False
                    job.done = True
                    self._cv.notify_all()

"""The engine's one thread: a bounded queue of generation jobs, served in arrival order.

The HTTP side (app.py) runs on asyncio; the model runs here, on one thread that owns the
`LLM`, so no forward pass ever waits on the event loop and no two run at once. A job
carries a thunk that opens the request (bind, retrieve, assemble, prefill: errors come out
before any text) and an asyncio queue its events go to:

    ("opened", None)     the request is prefilled; deltas follow
    ("delta", text)      generated text
    ("done", Result)     the end, with the runtime's Result (usage, timings)
    ("error", exc)       the request failed (a PromptLangError is the client's fault)

`Job.cancel()` (a client that went away) stops the job between two decode steps; its
request buffer goes back to the pool then (TextStream.close). A full queue refuses new
jobs at once (`QueueFull`: the server answers 429). `close(drain=True)` serves what was
queued, then stops the thread.

Requests are served one at a time: continuous batching of decode steps across requests
is not built yet (docs/SERVING.md says so).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


class QueueFull(Exception):
    """The job queue holds `max_queue` jobs: the request is refused (HTTP 429)."""


@dataclass
class Job:
    open: Callable[[], Any]          # -> a TextStream (runtime/engine.py), or raises
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the job's event loop (thread-safe; dropped once it is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:           # the loop is closed: nobody is listening
            pass


@dataclass
class WorkerStats:
    served: int = 0                  # jobs that ran to the end
    failed: int = 0                  # jobs whose request raised
    cancelled: int = 0               # jobs stopped because their client went away
    busy_seconds: float = 0.0


class EngineWorker:
    """Runs jobs on one thread, at most `max_queue` waiting (see the module docstring)."""

    def __init__(self, max_queue: int = 64):
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.max_queue = max_queue
        self.stats = WorkerStats()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._serve, name="promptlang-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        """Jobs waiting, not counting the one running."""
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull if `max_queue` jobs are already waiting."""
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting (the limit is "
                                f"{self.max_queue}); retry later")
            self._waiting += 1
        self._jobs.put(job)

    def close(self, timeout: float | None = 30.0) -> None:
        """Serve the jobs already queued, then stop the thread (waits up to `timeout` s)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
            if job.cancelled.is_set():
                self.stats.cancelled += 1
                continue
            self._running = job
            started = time.perf_counter()
            try:
                self._run(job)
            finally:
                self._running = None
                self.stats.busy_seconds += time.perf_counter() - started

    def _run(self, job: Job) -> None:
        try:
            stream = job.open()
        except BaseException as error:          # the client's request, or a fault here
            self.stats.failed += 1
            job.emit("error", error)
            if not isinstance(error, Exception):
                raise
            return
        job.emit("opened")
        try:
            for delta in stream:
                if job.cancelled.is_set():
                    break
                if delta:
                    job.emit("delta", delta)
        except Exception as error:
            self.stats.failed += 1
            job.emit("error", error)
            return
        finally:
            if job.cancelled.is_set():
                stream.close()                  # the buffer goes back to the pool now
        if job.cancelled.is_set():
            self.stats.cancelled += 1
            return
        self.stats.served += 1
        job.emit("done", stream.result)

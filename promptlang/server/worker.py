"""The engine's one thread: a bounded queue of generation jobs, decoded together.

The HTTP side (app.py) runs on asyncio; the model runs here, on one thread that owns the
`LLM`, so no forward pass ever waits on the event loop. A job carries a thunk that opens its
request (bind, retrieve, assemble, prefill: `LLM.start`, errors before any text) and an
asyncio queue its events go to:

    ("opened", None)     the request is prefilled; deltas follow
    ("delta", text)      generated text
    ("done", Result)     the end, with the runtime's Result (usage, timings)
    ("error", exc)       the request failed (a PromptLangError is the client's fault)

Continuous batching: the open requests decode together, one forward pass per step for all
of them (runtime/decoding/decode.py `BatchStepper`: the linear layers read each weight once per step
for the whole batch, each token sees its own request's KV only, and each request's output is
the one it gets alone). Between two steps the thread admits waiting jobs, up to `max_batch`
requests at once: each is bound and assembled then, and a prefill of at most
`prefill_in_step` tokens (a question after cached modules) runs in the next step: alone,
before the decoders' next token, one prefill a step, while fewer than `prefill_first_below`
requests decode (its first token comes sooner, and few streams wait for it), else together
with the decoders' tokens in one pass (the batch does not stall). A longer prefill (new
text, recomputed module seams) runs alone, there and then.

`Job.cancel()` (a client that went away) takes the job out before the next step; its
request buffer goes back to the pool then. A full queue refuses new jobs at once
(`QueueFullError`: the server answers 429). `close()` serves what was queued, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from promptlang.errors import InvalidArgumentError, QueueFullError

log = logging.getLogger("promptlang.server")


@dataclass(eq=False)
class Job:
    open: Callable[[], Any]          # -> a runtime Generation (LLM.start), or raises
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
    steps: int = 0                   # decode steps run
    batched_steps: int = 0           # ... of which fused passes over 2+ requests
    busy_seconds: float = 0.0


class EngineWorker:
    """Runs jobs on one thread, decoding up to `max_batch` together, at most `max_queue`
    waiting (see the module docstring)."""

    def __init__(self, max_queue: int = 64, max_batch: int = 16, prefill_in_step: int = 48,
                 prefill_first_below: int = 8):
        if max_queue < 1 or max_batch < 1 or prefill_in_step < 0 or prefill_first_below < 0:
            raise InvalidArgumentError("max_queue and max_batch must be at least 1, "
                                       "prefill_in_step and prefill_first_below at least 0")
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.prefill_in_step = prefill_in_step
        self.prefill_first_below = prefill_first_below
        self.stats = WorkerStats()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._active: dict[Job, Any] = {}        # job -> its Generation
        self._thread = threading.Thread(target=self._serve, name="promptlang-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        """Jobs waiting, not counting the ones decoding."""
        return self._waiting

    @property
    def busy(self) -> bool:
        return bool(self._active)

    @property
    def running(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFullError if `max_queue` jobs are already waiting."""
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFullError(f"{self._waiting} requests are waiting (the limit is "
                                f"{self.max_queue}); retry later")
            self._waiting += 1
        self._jobs.put(job)

    def close(self, timeout: float | None = 30.0) -> None:
        """Serve the jobs already queued, then stop the thread (waits up to `timeout` s)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    # --- the thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        from promptlang.runtime.decoding.decode import BatchStepper

        stepper: BatchStepper | None = None
        closing = False
        while True:
            while not closing and len(self._active) < self.max_batch:
                try:
                    job = self._jobs.get(block=not self._active)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                    break
                with self._lock:
                    self._waiting -= 1
                if job.cancelled.is_set():
                    self.stats.cancelled += 1
                    continue
                generation = self._open(job)
                if generation is None:
                    continue
                if stepper is None:
                    stepper = BatchStepper(generation.decoder.adapter,
                                           prefill_first_below=self.prefill_first_below)
                self._active[job] = generation
                pending = generation.opened.pending
                try:
                    if pending is not None:               # its prefill runs in the next step
                        stepper.join(job, generation.decoder, pending)
                    else:
                        self._handle(stepper, job, *stepper.add(job, generation.decoder,
                                                                generation.opened.logits))
                except Exception as error:                # this request's fault: fail it alone
                    self._fail(stepper, job, error)
            for job in [j for j in self._active if j.cancelled.is_set()]:
                stepper.remove(job)
                self._active.pop(job).release()       # the buffer goes back now
                self.stats.cancelled += 1
            if not self._active:
                if closing:
                    return
                continue
            began = time.perf_counter()
            try:
                before = stepper.batched
                events = stepper.step()
                self.stats.steps += 1
                self.stats.batched_steps += stepper.batched - before
            except Exception as error:                # a fault of the engine: fail them all
                for job, generation in list(self._active.items()):
                    stepper.remove(job)
                    generation.release()
                    self.stats.failed += 1
                    job.emit("error", error)
                self._active.clear()
                continue
            finally:
                self.stats.busy_seconds += time.perf_counter() - began
            for job, token, delta, finished in events:
                try:
                    self._handle(stepper, job, token, delta, finished)
                except Exception as error:
                    self._fail(stepper, job, error)

    def _open(self, job: Job):
        began = time.perf_counter()
        try:
            generation = job.open()
        except BaseException as error:          # the client's request, or a fault here
            self.stats.failed += 1
            job.emit("error", error)
            if not isinstance(error, Exception):
                raise
            return None
        finally:
            self.stats.busy_seconds += time.perf_counter() - began
        job.emit("opened")
        return generation

    def _fail(self, stepper, job: Job, error: Exception) -> None:
        """Take `job` out of the batch (its buffer back to the pool) and hand it `error`:
        a fault in one request neither stops the thread nor stays counted as running."""
        generation = self._active.pop(job, None)
        stepper.remove(job)
        if generation is not None:
            try:
                generation.release()
            except Exception:           # noqa: BLE001 - `error` is what the client gets
                log.exception("releasing a failed request's buffer failed")
        self.stats.failed += 1
        job.emit("error", error)

    def _handle(self, stepper, job: Job, token, delta: str, finished: bool) -> None:
        generation = self._active[job]
        text = generation.delta(delta)
        if text:
            job.emit("delta", text)
        if finished:
            del self._active[job]
            self.stats.served += 1
            job.emit("done", generation.result())

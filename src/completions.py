"""Answers off the compute thread: Futures resolved on a thread of their own, in order.

A Future's callbacks run in the thread that resolves it. The Triton model's callback updates the
metrics (IPC round trips to Triton, and Engine.stats() under the engine's lock) and sends the
response; resolved on the engine's worker, all of that would run before the next forward starts.
The worker hands each answer here instead and goes straight on to the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError

log = logging.getLogger("prefillonly")

_STOP = object()


class CompletionThread:
    def __init__(self, name: str = "prefillonly-completions"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def deliver(self, future: Future, result=None, error: BaseException | None = None) -> None:
        """Resolve `future` (with `error` if given, else `result`) on the completion thread."""
        self._queue.put((future, result, error))

    def stop(self) -> None:
        """No more deliveries: everything already handed over is still resolved, then the thread ends."""
        self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() is not self._thread:  # a callback may close the engine
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, result, error = item
            # Future runs the callbacks and logs (never raises) what they raise
            try:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            except InvalidStateError:  # resolved twice would be an engine bug: the thread must live on
                log.exception("a request's answer was delivered twice; the second is dropped")

"""Requests in flight inside the Triton model, from the engine's Futures to the one final response.

- `PendingRequest`  a request the engine has taken: Triton's request and response sender, its id,
                    when it arrived, and its engine Futures (one per prompt, or one for items);
- `when_all_done`   one callback once every Future of a request is done: the results in order,
                    or the first error;
- `InFlightWatcher` a low-rate poll that cancels the Futures of requests whose client cancelled
                    them while they still wait.

The model (model_repository/prefillonly/1/model.py) turns these into Triton responses. Standard
library only: of Triton's request object only is_cancelled() is used.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Callable

_log = logging.getLogger(__name__)


@dataclass
class PendingRequest:
    """A request the engine has taken, until its final response is sent.

    Triton frees a request once its final response is sent, and asking a freed request whether it
    was cancelled crashes the server (SIGSEGV in the Python backend, seen under load when the poll's
    round trip overlapped the answer). So the poll's question and the final send take one lock,
    and no question is asked once the request is answered."""

    request: object  # Triton's InferenceRequest (is_cancelled())
    sender: object  # its InferenceResponseSender
    request_id: str
    received_at: float  # time.monotonic()
    futures: list = field(default_factory=list)
    answered: bool = False
    on_final: object = None  # called once the final response is sent (or failed to send): the tenant's slot freed
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def send_final(self, response, flags) -> None:
        """sender.send(response, flags=flags) for the final response, once: after it the request
        is never touched again (a second call raises)."""
        with self._lock:
            if self.answered:
                raise RuntimeError(f"request {self.request_id!r} was already answered")
            self.answered = True
            try:
                self.sender.send(response, flags=flags)
            finally:
                if self.on_final is not None:
                    self.on_final()

    def client_cancelled(self) -> bool:
        """The client cancelled the request (False once it is answered, or if Triton refuses to say)."""
        with self._lock:
            if self.answered:
                return False
            try:
                return self.request.is_cancelled()
            except Exception:  # the request was already released: nothing left to cancel
                return False


def when_all_done(futures: list[Future], callback: Callable[[list, BaseException | None], None]) -> None:
    """callback(results, error) once, when every one of `futures` (at least one) is done: results
    flattened in the futures' order (a list result contributes its elements), error None; or
    results [] and the error of the first future, in their order, that failed (CancelledError for
    a cancelled one). It runs on the thread that completes the last future, or at once on this one
    if all are done already."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        error = next((e for e in map(_error_of, futures) if e is not None), None)
        results = []
        if error is None:
            for f in futures:
                r = f.result()
                results.extend(r if isinstance(r, list) else [r])
        callback(results, error)

    for f in futures:
        f.add_done_callback(one_done)


def _error_of(future: Future) -> BaseException | None:
    return CancelledError() if future.cancelled() else future.exception()


class InFlightWatcher:
    """A low-rate poll over the requests in flight. It cancels the engine Futures of those whose
    client cancelled them (gRPC stream cancel, closed HTTP connection) while they still wait: the
    engine drops them from its queue and the done callback answers them. Polled, because nothing
    pushes cancellation to a Python model (is_cancelled() is a round trip to Triton). Each round
    with requests in flight also calls on_tick (the metrics refresh: the waiting gauge drops when
    the engine's worker starts a request, which the model does not otherwise see); on_round runs
    every round, with or without requests in flight (the drain check). An exception of on_round
    is passed to `warn` and the watcher keeps running: it also answers cancellations."""

    def __init__(self, interval_s: float, on_tick: Callable[[], None], on_round: Callable[[], None] | None = None,
                 warn: Callable[[str], None] = _log.warning):
        self._interval_s = interval_s
        self._on_tick = on_tick
        self._on_round = on_round
        self._warn = warn
        self._lock = threading.Lock()
        self._watched: dict[int, PendingRequest] = {}  # id(pending) -> pending
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefillonly-cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, pending: PendingRequest) -> None:
        with self._lock:
            self._watched[id(pending)] = pending

    def forget(self, pending: PendingRequest) -> None:
        with self._lock:
            self._watched.pop(id(pending), None)

    def close(self) -> None:
        """Stop polling (waits up to 5 s for the round in progress)."""
        self._stopped.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            if self._on_round is not None:
                try:
                    self._on_round()
                except Exception as e:  # the watcher must keep running: it also answers cancellations
                    self._warn(f"prefillonly: watcher round failed: {e}")
            with self._lock:
                watched = list(self._watched.values())
            for pending in watched:
                if _still_waiting(pending) and pending.client_cancelled():
                    for f in pending.futures:
                        f.cancel()  # a no-op on one already running: it finishes and is answered
            if watched:
                self._on_tick()


def _still_waiting(pending: PendingRequest) -> bool:
    return any(not f.running() and not f.done() for f in pending.futures)

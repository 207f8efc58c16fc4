"""Requests in flight (prefillonly.serving.model.inflight): when_all_done's one callback and the
InFlightWatcher's cancellation poll, with real Futures completed from real threads. Triton's
request object is stood in for by a class with its is_cancelled()."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future

import pytest

from prefillonly.serving.model.inflight import InFlightWatcher, PendingRequest, when_all_done

INTERVAL_S = 0.01


class Request:
    """What the watcher uses of Triton's InferenceRequest."""

    def __init__(self, cancelled: bool = False):
        self.cancelled = threading.Event()
        if cancelled:
            self.cancelled.set()

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()


class ReleasedRequest:
    def is_cancelled(self) -> bool:
        raise RuntimeError("request already released")


class Recorder:
    """A when_all_done callback: each call's (results, error, thread)."""

    def __init__(self):
        self.calls: list[tuple[list, BaseException | None, threading.Thread]] = []
        self.called = threading.Event()

    def __call__(self, results, error):
        self.calls.append((results, error, threading.current_thread()))
        self.called.set()


def pending(request=None, futures=()) -> PendingRequest:
    return PendingRequest(request or Request(), sender=None, request_id="r", received_at=time.monotonic(),
                          futures=list(futures))


def complete_from_threads(actions) -> None:
    """Run each action (a Future completion) on its own thread, all at once."""
    start = threading.Barrier(len(actions))

    def run(action):
        start.wait()
        action()

    threads = [threading.Thread(target=run, args=(a,)) for a in actions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(INTERVAL_S / 2)
    return True


# -- when_all_done ----------------------------------------------------------------------------


def test_results_flattened_in_the_futures_order_whatever_order_they_complete():
    futures = [Future() for _ in range(3)]
    done = Recorder()
    when_all_done(futures, done)
    futures[2].set_result("c")
    futures[0].set_result(["a1", "a2"])  # a list result (multi-item) contributes its elements
    assert not done.called.is_set()  # one still running
    futures[1].set_result("b")
    assert done.calls == [(["a1", "a2", "b", "c"], None, threading.current_thread())]


def test_called_exactly_once_when_many_threads_complete_the_futures_together():
    for _ in range(20):
        futures = [Future() for _ in range(8)]
        done = Recorder()
        when_all_done(futures, done)
        complete_from_threads([lambda f=f, i=i: f.set_result(i) for i, f in enumerate(futures)])
        assert len(done.calls) == 1
        assert done.calls[0][:2] == (list(range(8)), None)


def test_runs_on_the_thread_that_completes_the_last_future():
    futures = [Future(), Future()]
    done = Recorder()
    when_all_done(futures, done)
    futures[0].set_result(1)
    worker = threading.Thread(target=futures[1].set_result, args=(2,), name="engine-worker")
    worker.start()
    worker.join(10)
    assert done.calls == [([1, 2], None, worker)]


def test_futures_already_done_call_back_at_once():
    futures = [Future(), Future()]
    for i, f in enumerate(futures):
        f.set_result(i)
    done = Recorder()
    when_all_done(futures, done)
    assert done.calls == [([0, 1], None, threading.current_thread())]


def test_an_error_is_reported_without_results():
    futures = [Future(), Future()]
    done = Recorder()
    when_all_done(futures, done)
    futures[0].set_result("fine")
    boom = ValueError("prompt too long")
    futures[1].set_exception(boom)
    [(results, error, _)] = done.calls
    assert results == [] and error is boom


def test_the_first_error_in_the_futures_order_wins_not_the_first_to_happen():
    futures = [Future() for _ in range(3)]
    done = Recorder()
    when_all_done(futures, done)
    later = RuntimeError("second future")
    futures[2].set_exception(later)
    earlier = ValueError("first future")
    futures[0].set_exception(earlier)
    futures[1].set_result("fine")
    assert done.calls[0][1] is earlier


def test_a_cancelled_future_is_a_cancelled_error():
    futures = [Future(), Future()]
    done = Recorder()
    when_all_done(futures, done)
    futures[0].set_result("fine")
    assert futures[1].cancel()
    [(results, error, _)] = done.calls
    assert results == [] and isinstance(error, CancelledError)


def test_the_callback_waits_for_every_future_even_after_an_error():
    futures = [Future(), Future()]
    done = Recorder()
    when_all_done(futures, done)
    futures[0].set_exception(ValueError("bad"))
    assert not done.called.is_set()  # the other prompt still runs: the request is answered once, after it
    futures[1].set_result("fine")
    assert len(done.calls) == 1


# -- InFlightWatcher --------------------------------------------------------------------------


@pytest.fixture
def ticks():
    counts = {"tick": 0, "round": 0}
    lock = threading.Lock()

    def bump(name):
        with lock:
            counts[name] += 1

    return counts, bump


def make_watcher(bump, **kwargs) -> InFlightWatcher:
    kwargs.setdefault("on_round", lambda: bump("round"))
    return InFlightWatcher(INTERVAL_S, on_tick=lambda: bump("tick"), **kwargs)


def test_cancels_the_waiting_futures_of_a_request_its_client_cancelled(ticks):
    counts, bump = ticks
    request = Request()
    futures = [Future(), Future()]
    done = Recorder()
    when_all_done(futures, done)
    watcher = make_watcher(bump)
    try:
        watcher.watch(pending(request, futures))
        assert wait_until(lambda: counts["tick"] >= 3)
        assert not any(f.cancelled() for f in futures)  # not cancelled by its client: left alone
        request.cancelled.set()
        assert done.called.wait(5)
    finally:
        watcher.close()
    assert all(f.cancelled() for f in futures)
    [(results, error, _)] = done.calls  # the all-done callback answers it
    assert results == [] and isinstance(error, CancelledError)


def test_a_running_future_is_left_to_finish_and_the_waiting_ones_are_cancelled(ticks):
    _, bump = ticks
    running, waiting = Future(), Future()
    assert running.set_running_or_notify_cancel()  # the engine's worker took this prompt
    done = Recorder()
    when_all_done([running, waiting], done)
    watcher = make_watcher(bump)
    try:
        watcher.watch(pending(Request(cancelled=True), [running, waiting]))
        assert wait_until(waiting.cancelled)
        assert running.running()
        running.set_result("finished")  # it is answered once it finishes
        assert done.called.wait(5)
    finally:
        watcher.close()
    assert isinstance(done.calls[0][1], CancelledError)


def test_a_request_that_only_runs_is_not_touched(ticks):
    counts, bump = ticks
    running = Future()
    assert running.set_running_or_notify_cancel()
    watcher = make_watcher(bump)
    try:
        watcher.watch(pending(Request(cancelled=True), [running]))
        assert wait_until(lambda: counts["tick"] >= 3)
        assert running.running()
    finally:
        watcher.close()


def test_a_forgotten_request_is_no_longer_watched(ticks):
    counts, bump = ticks
    request, future = Request(), Future()
    p = pending(request, [future])
    watcher = make_watcher(bump)
    try:
        watcher.watch(p)
        assert wait_until(lambda: counts["tick"] >= 1)
        watcher.forget(p)
        rounds = counts["round"]
        assert wait_until(lambda: counts["round"] >= rounds + 2)  # no round still holds it
        request.cancelled.set()
        rounds = counts["round"]
        assert wait_until(lambda: counts["round"] >= rounds + 3)
        assert not future.cancelled()
    finally:
        watcher.close()


def test_a_released_request_counts_as_not_cancelled(ticks):
    counts, bump = ticks
    future = Future()
    watcher = make_watcher(bump)
    try:
        watcher.watch(pending(ReleasedRequest(), [future]))
        assert wait_until(lambda: counts["tick"] >= 3)  # the poll goes on
        assert not future.cancelled()
    finally:
        watcher.close()


def test_on_round_runs_every_round_and_on_tick_only_with_requests_in_flight(ticks):
    counts, bump = ticks
    watcher = make_watcher(bump)
    try:
        assert wait_until(lambda: counts["round"] >= 5)
        assert counts["tick"] == 0
        p = pending(futures=[Future()])
        watcher.watch(p)
        assert wait_until(lambda: counts["tick"] >= 2)
        watcher.forget(p)
        rounds = counts["round"]
        assert wait_until(lambda: counts["round"] >= rounds + 2)  # a round in progress may still tick once
        ticked = counts["tick"]
        rounds = counts["round"]
        assert wait_until(lambda: counts["round"] >= rounds + 3)
        assert counts["tick"] == ticked
    finally:
        watcher.close()


def test_a_failing_round_is_warned_about_and_cancellations_still_answered(ticks):
    counts, bump = ticks
    warnings: list[str] = []

    def failing_round():
        bump("round")
        raise OSError("drain file unreadable")

    watcher = make_watcher(bump, on_round=failing_round, warn=warnings.append)
    future = Future()
    try:
        assert wait_until(lambda: counts["round"] >= 3)
        watcher.watch(pending(Request(cancelled=True), [future]))
        assert wait_until(future.cancelled)
    finally:
        watcher.close()
    assert warnings and all("drain file unreadable" in w for w in warnings)


def test_close_stops_the_poll(ticks):
    counts, bump = ticks
    watcher = make_watcher(bump)
    assert wait_until(lambda: counts["round"] >= 1)
    watcher.close()
    rounds = counts["round"]
    time.sleep(5 * INTERVAL_S)
    assert counts["round"] == rounds


class FreedOnAnswer:
    """Triton's request and sender as far as their lifetimes go: sending the final response frees
    the request, and asking a freed request anything is the crash the lock prevents. Its
    is_cancelled() is a slow round trip (as over the stub's IPC), so an answer sent during it
    would land inside it."""

    def __init__(self):
        self.freed = False
        self.asked_after_free = False
        self.asking = threading.Event()
        self.sent = []

    def is_cancelled(self) -> bool:
        self.asking.set()
        time.sleep(0.05)
        self.asked_after_free |= self.freed
        return False

    def send(self, response, flags) -> None:
        self.sent.append((response, flags))
        self.freed = True


def test_the_final_answer_never_overlaps_or_precedes_a_cancellation_question(ticks):
    counts, bump = ticks
    triton = FreedOnAnswer()
    future = Future()
    p = PendingRequest(triton, triton, request_id="r", received_at=time.monotonic(), futures=[future])
    watcher = make_watcher(bump)
    try:
        watcher.watch(p)
        assert triton.asking.wait(5)  # the poll is inside is_cancelled() now
        future.set_result("done")
        p.send_final("response", flags=2)  # waits for the question in progress to end
        assert triton.sent == [("response", 2)] and p.answered
        assert not triton.asked_after_free
        rounds = counts["round"]
        assert wait_until(lambda: counts["round"] >= rounds + 3)
        assert not p.client_cancelled() and not triton.asked_after_free  # never asked again once answered
    finally:
        watcher.close()
    with pytest.raises(RuntimeError, match="already answered"):
        p.send_final("again", flags=2)
    assert len(triton.sent) == 1

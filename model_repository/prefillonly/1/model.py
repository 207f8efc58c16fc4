"""Triton Python-backend adapter over prefillonly.Engine (decoupled).

execute() converts each request (prefillonly.serving.protocol), submits it to the engine's
queue and returns at once; the engine's worker completes the Future, whose callback sends the
one final response through the request's response sender. Bad input is answered at once with
an error naming the problem; every request gets exactly one final response. A request whose
client cancels it while it still waits is taken out of the engine's queue (InFlightWatcher).
initialize() runs one warm-up request, so Triton reports the model ready only once it is warm.
Logs: one line per event, with the request id.
"""

import json
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from prefillonly import Engine, EngineConfig
from prefillonly.serving.metrics import EngineMetrics
from prefillonly.serving.protocol import INPUTS, error_reply, parse_request, results_to_outputs

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WARMUP_TOKENS = 16
WATCH_INTERVAL_S = 0.1  # how often requests in flight are checked for client cancellation


@dataclass
class _Pending:
    """A request the engine has taken, until its final response is sent."""

    request: object
    sender: object
    request_id: str
    received_at: float
    futures: list = field(default_factory=list)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        settings = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if args.get("model_instance_kind") == "GPU":  # KIND_GPU: one engine per device Triton assigns
            settings["device"] = f"cuda:{args['model_instance_device_id']}"
        self.engine = Engine(EngineConfig.from_strings(settings))
        warmup_s = self._warm_up()
        self.metrics = EngineMetrics(pb_utils, baseline=self.engine.stats())
        self.metrics.set_warmup_seconds(warmup_s)
        self.watcher = InFlightWatcher(WATCH_INTERVAL_S, on_tick=lambda: self.metrics.update(self.engine.stats()))
        pb_utils.Logger.log_info(f"prefillonly: engine ready and warm ({self.engine.model_path}; "
                                 f"warm-up request of {WARMUP_TOKENS} tokens took {warmup_s * 1e3:.0f} ms)")

    def _warm_up(self) -> float:
        """One short request through the whole engine path (queue, cache, forward, scoring),
        so that the first client request does not pay for lazy initialisation. Token ids, so it
        works without a tokenizer; nothing is kept in the prefix cache."""
        t0 = time.perf_counter()
        self.engine.score([0] * WARMUP_TOKENS, [0], cache_prefix_len=0)
        return time.perf_counter() - t0

    def execute(self, requests):
        for request in requests:
            pending = _Pending(request, request.get_response_sender(), request.request_id() or "<no id>", time.monotonic())
            try:
                pending.futures = self._submit(_parse(request))
            except Exception as e:  # bad input or overload: answer now, keep serving
                self.metrics.update(self.engine.stats())
                _send_error(pending, e)
                continue
            self.watcher.watch(pending)  # before the callback: it may run at once and forget it
            _when_all_done(pending.futures, lambda results, error, p=pending: self._done(p, results, error))
        self.metrics.update(self.engine.stats())  # the waiting gauge counts what just arrived
        return None

    def _submit(self, call):
        if call.items is not None:
            return [self.engine.submit_items(call.prompts[0], call.items, call.allowed, **call.options)]
        futures = []
        try:
            for prompt in call.prompts:
                futures.append(self.engine.submit(prompt, call.allowed, **call.options))
        except Exception:  # all or nothing: the request is answered with the error, so run none of it
            for f in futures:
                f.cancel()
            raise
        return futures

    def _done(self, pending, results, error):
        self.watcher.forget(pending)
        # metrics before answering: a client may scrape them the moment it has its answer
        self.metrics.update(self.engine.stats())
        if error is None:
            waits = [f.started_at - pending.received_at for f in pending.futures if f.started_at is not None]
            self.metrics.observe_latency(waits, time.monotonic() - pending.received_at)
            _send_results(pending, results)
        else:
            _send_error(pending, error)

    def finalize(self):
        self.watcher.close()
        self.engine.close()  # fails every waiting request: each still gets its final response


def _parse(request):
    tensors = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()
    call = parse_request(tensors)
    timeout_us = request.timeout()
    if timeout_us:
        call.options["deadline_s"] = timeout_us / 1e6
    return call


class InFlightWatcher:
    """A low-rate poll over the requests in flight. It cancels the engine Futures of those whose
    client cancelled them (gRPC stream cancel, closed HTTP connection) while they still wait: the
    engine drops them from its queue and the done callback answers them. Polled, because nothing
    pushes cancellation to a Python model (is_cancelled() is a round trip to Triton). Each round
    with requests in flight also calls on_tick (the metrics refresh: the waiting gauge drops when
    the engine's worker starts a request, which the model does not otherwise see)."""

    def __init__(self, interval_s: float, on_tick):
        self._interval_s = interval_s
        self._on_tick = on_tick
        self._lock = threading.Lock()
        self._watched = {}  # id(pending) -> pending
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefillonly-cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, pending):
        with self._lock:
            self._watched[id(pending)] = pending

    def forget(self, pending):
        with self._lock:
            self._watched.pop(id(pending), None)

    def close(self):
        self._stopped.set()
        self._thread.join(5)

    def _run(self):
        while not self._stopped.wait(self._interval_s):
            with self._lock:
                watched = list(self._watched.values())
            for pending in watched:
                if _still_waiting(pending) and _client_cancelled(pending):
                    for f in pending.futures:
                        f.cancel()  # a no-op on one already running: it finishes and is answered
            if watched:
                self._on_tick()


def _still_waiting(pending) -> bool:
    return any(not f.running() and not f.done() for f in pending.futures)


def _client_cancelled(pending) -> bool:
    try:
        return pending.request.is_cancelled()
    except Exception:  # the request was already released: nothing left to cancel
        return False


def _when_all_done(futures, callback):
    """callback(results, error) once every future is done (results flattened, in order)."""
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


def _error_of(future):
    return CancelledError() if future.cancelled() else future.exception()


def _send_results(pending, results):
    outputs = [pb_utils.Tensor(name, value) for name, value in results_to_outputs(results).items()]
    _send(pending, pb_utils.InferenceResponse(output_tensors=outputs))


def _send_error(pending, error):
    status, message = error_reply(error)
    log = pb_utils.Logger.log_info if status == "CANCELLED" else pb_utils.Logger.log_warn
    log(f"prefillonly: request {pending.request_id!r} failed: {message}")
    _send(pending, pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, status))))


def _send(pending, response):
    try:
        pending.sender.send(response, flags=FINAL)
    except Exception as e:  # e.g. the client is gone and Triton closed the sender: nothing to answer
        pb_utils.Logger.log_warn(f"prefillonly: request {pending.request_id!r}: final response not sent: {e}")

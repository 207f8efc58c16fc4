"""Triton Python-backend adapter over prefillonly.Engine (decoupled).

execute() checks each request's shape and sizes (prefillonly.serving.model.protocol: cheap, no
tokenizing), hands it to the intake threads and returns at once; an intake thread tokenizes and
submits it to the engine's queue, so no prompt holds up the thread that feeds Triton's other
requests. The engine's worker completes the Future, whose callback sends the one final response
through the request's response sender. Bad input is answered with an error naming the problem
(from execute() or from intake); every request gets exactly one final response. TritonServer's
drain file (prefillonly.serving.model.drain) closes the engine before Triton's shutdown. A request whose
client cancels it while it still waits is taken out of the engine's queue (InFlightWatcher, in
prefillonly.serving.model.inflight with the rest of the bookkeeping of requests in flight).
initialize() runs one warm-up request, so Triton reports the model ready only once it is warm.
Logs: one line per event, with the request id; the ready line names the compute dtype and why
(dtype "auto" picks per host), which the metrics' prefillonly_engine_info labels carry too.
"""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from prefillonly import Engine, EngineConfig
from prefillonly.contract.errors import InvalidRequestError
from prefillonly.contract.tenants import TENANT_HEADER, TENANTS_FILE_ENV, tenant_of_parameters
from prefillonly.serving.model.drain import DrainWatch, drain_file_from_env
from prefillonly.serving.model.inflight import InFlightWatcher, PendingRequest, when_all_done
from prefillonly.serving.model.metrics import EngineMetrics
from prefillonly.serving.model.protocol import ScoreCall, error_reply, make_answerable, parse_request, results_to_outputs, submit_call
from prefillonly.serving.model.tenant_gate import TenantGate
from prefillonly.serving.model.tenant_metrics import TenantMetrics
from prefillonly.contract.wire import INPUTS, LIVENESS_USER

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WARMUP_TOKENS = 16
WATCH_INTERVAL_S = 0.1  # how often requests in flight are checked for client cancellation
# Tokenizing threads: the tokenizer releases the GIL, so a long prompt on one leaves the other
# (and execute()) free; two keep a 2-core host's engine worker fed without crowding it.
INTAKE_THREADS = 2


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
        # API keys on: each request's tenant (from Envoy), its quota and its own metrics
        self.gate = TenantGate(os.environ.get(TENANTS_FILE_ENV))
        self.tenant_metrics = TenantMetrics(pb_utils) if self.gate.enabled else None
        self.intake = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="prefillonly-intake")
        self.drain = DrainWatch(drain_file_from_env())
        self.watcher = InFlightWatcher(WATCH_INTERVAL_S, on_tick=lambda: self.metrics.update(self.engine.stats()),
                                       on_round=self._check_drain, warn=pb_utils.Logger.log_warn)
        cfg = self.engine.config
        pb_utils.Logger.log_info(f"prefillonly: engine ready and warm ({self.engine.model_path}; dtype {cfg.dtype}: "
                                 f"{cfg.dtype_reason}; warm-up request of {WARMUP_TOKENS} tokens took {warmup_s * 1e3:.0f} ms)")

    def _warm_up(self) -> float:
        """One short request through the whole engine path (queue, cache, forward, scoring or
        pooling: a kind the checkpoint answers), so that the first client request does not pay for
        lazy initialisation. Token ids, so it works without a tokenizer; nothing is kept in the
        prefix cache."""
        t0 = time.perf_counter()
        call = make_answerable(self.engine, ScoreCall([[0] * WARMUP_TOKENS], [0], options={"cache_prefix_len": 0}))
        for future in submit_call(self.engine, call):
            future.result()
        return time.perf_counter() - t0

    def execute(self, requests):
        for request in requests:
            pending = PendingRequest(request, request.get_response_sender(), request.request_id() or "<no id>", time.monotonic())
            try:
                call = _parse(request, self.engine.limits, self.gate.enabled)
                pending.on_final = self.gate.admit(call.options.get("tenant"))  # or rate_limited
                self.intake.submit(self._admit, pending, call)
            except Exception as e:  # bad input, over quota (or intake shut down): answer now, keep serving
                self._publish_tenants()  # before the answer, like every metric: a client may scrape at once
                _send_error(pending, e)
        return None

    def _publish_tenants(self):
        if self.tenant_metrics is not None:
            self.tenant_metrics.update(self.gate.snapshot())

    def _admit(self, pending, call):
        """Intake thread: tokenize and queue one request, or answer its error."""
        try:
            pending.futures = submit_call(self.engine, call)
        except Exception as e:  # bad input or overload: answer now, keep serving
            self.metrics.update(self.engine.stats())
            self.gate.finished(call.options.get("tenant"), [], e, [])
            self._publish_tenants()
            _send_error(pending, e)
            return
        self.watcher.watch(pending)  # before the callback: it may run at once and forget it
        when_all_done(pending.futures, lambda results, error, p=pending: self._done(p, call, results, error))
        self.metrics.update(self.engine.stats())  # the waiting gauge counts what just arrived

    def _check_drain(self):
        if self.drain.requested():
            pb_utils.Logger.log_info("prefillonly: drain requested: no new work; failing every waiting request with "
                                     "engine_closed; the running one finishes")
            # answers every waiting request, then waits for the running one: the ack means
            # "nothing left to answer", so TritonServer.stop() can close client connections
            self.engine.close()
            self.drain.acknowledge()
            pb_utils.Logger.log_info("prefillonly: drained")

    def _done(self, pending, call, results, error):
        self.watcher.forget(pending)
        # metrics before answering: a client may scrape them the moment it has its answer
        self.metrics.update(self.engine.stats())
        waits = [f.started_at - pending.received_at for f in pending.futures if f.started_at is not None]
        self.gate.finished(call.options.get("tenant"), pending.futures, error, waits)
        self._publish_tenants()
        if error is None:
            self.metrics.observe_latency(waits, time.monotonic() - pending.received_at)
            _send_results(pending, call, results)
        else:
            _send_error(pending, error)

    def finalize(self):
        self.watcher.close()
        self.engine.close()  # fails every waiting request: each still gets its final response
        self.intake.shutdown(wait=True)  # what intake still holds is refused by the closed engine


def _parse(request, limits, tenants: bool):
    tensors = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()
    tenant = _check_parameters(request, tenants)
    call = parse_request(tensors, limits)
    if tenant is not None:  # the cache namespace and the fair share are the tenant's (Engine.submit_task)
        call.options["tenant"] = tenant
    elif tenants and call.options.get("user") != LIVENESS_USER:  # the supervisor's probe comes from inside
        raise InvalidRequestError("this server has API keys and the request came without its tenant: it did not come "
                                  "through the front door (Envoy) that sets it")
    timeout_us = request.timeout()
    if timeout_us:
        call.options["deadline_s"] = timeout_us / 1e6
    return call


def _check_parameters(request, tenants: bool):
    """HTTP generate turns every JSON field that is not an input into a request parameter, which
    would be ignored without a word (a misspelt `allowed_token` scored against nothing asked for).
    Triton's own parameters (triton_*) pass. With tenants (API keys on), the tenant parameter
    Triton copied from the front door's header is the request's tenant, returned (None: none)."""
    text = request.parameters() or "{}"
    try:
        params = json.loads(text)
    except ValueError:
        return None
    unknown = sorted(k for k in params if not k.startswith("triton_") and not (tenants and k == TENANT_HEADER))
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}: not inputs of this model "
                                  f"(inputs: {', '.join(INPUTS)})")
    try:
        return tenant_of_parameters(text) if tenants else None
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def _send_results(pending, call, results):
    outputs = [pb_utils.Tensor(name, value) for name, value in results_to_outputs(call, results).items()]
    _send(pending, pb_utils.InferenceResponse(output_tensors=outputs))


def _send_error(pending, error):
    status, message = error_reply(error)
    log = pb_utils.Logger.log_info if status == "CANCELLED" else pb_utils.Logger.log_warn
    log(f"prefillonly: request {pending.request_id!r} failed: {message}")
    _send(pending, pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, status))))


def _send(pending, response):
    try:
        pending.send_final(response, FINAL)  # under the lock the cancellation poll takes (inflight.py)
    except Exception as e:  # e.g. the client is gone and Triton closed the sender: nothing to answer
        pb_utils.Logger.log_warn(f"prefillonly: request {pending.request_id!r}: final response not sent: {e}")

"""Triton Python-backend adapter over prefillonly.Engine (decoupled).

execute() converts each request (prefillonly.serving.protocol), submits it to the engine's
queue and returns at once; the engine's worker completes the Future, whose callback sends the
one final response through the request's response sender. Bad input is answered at once with
an error naming the problem; every request gets exactly one final response.
"""

import json
import threading
from concurrent.futures import CancelledError

import triton_python_backend_utils as pb_utils

from prefillonly import Engine, EngineConfig, PrefillOnlyError
from prefillonly.serving.metrics import EngineMetrics
from prefillonly.serving.protocol import INPUTS, parse_request, results_to_outputs

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# engine error code -> Triton status (HTTP 503 for overload, so clients back off)
_STATUS = {"overloaded": "UNAVAILABLE", "engine_closed": "UNAVAILABLE", "deadline_exceeded": "UNAVAILABLE"}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        settings = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if args.get("model_instance_kind") == "GPU":  # KIND_GPU: one engine per device Triton assigns
            settings["device"] = f"cuda:{args['model_instance_device_id']}"
        self.engine = Engine(EngineConfig.from_strings(settings))
        self.metrics = EngineMetrics(pb_utils)
        self.metrics.update(self.engine.stats())
        pb_utils.Logger.log_info(f"prefillonly: engine ready ({self.engine.model_path})")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = {}
                for name in INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        tensors[name] = tensor.as_numpy()
                call = parse_request(tensors)
                timeout_us = request.timeout()
                if timeout_us:
                    call.options["deadline_s"] = timeout_us / 1e6
                futures = self._submit(call)
            except Exception as e:  # bad input: answer now, keep serving
                self.metrics.update(self.engine.stats())
                _send_error(sender, e, request.request_id())
                continue
            _when_all_done(futures, lambda results, error, s=sender, rid=request.request_id(): self._done(s, results, error, rid))
        return None

    def _done(self, sender, results, error, request_id):
        self.metrics.update(self.engine.stats())  # before answering: a client may scrape next
        _send(sender, results, error, request_id)

    def _submit(self, call):
        if call.items is not None:
            return [self.engine.submit_items(call.prompts[0], call.items, call.allowed, **call.options)]
        return [self.engine.submit(p, call.allowed, **call.options) for p in call.prompts]

    def finalize(self):
        self.engine.close()


def _when_all_done(futures, callback):
    """callback(results, error) once every future is done (results flattened, in order)."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        error = next((CancelledError("request cancelled") if f.cancelled() else f.exception()
                      for f in futures if f.cancelled() or f.exception() is not None), None)
        results = []
        if error is None:
            for f in futures:
                r = f.result()
                results.extend(r if isinstance(r, list) else [r])
        callback(results, error)

    for f in futures:
        f.add_done_callback(one_done)


def _send(sender, results, error, request_id):
    if error is not None:
        _send_error(sender, error, request_id)
        return
    outputs = [pb_utils.Tensor(name, value) for name, value in results_to_outputs(results).items()]
    sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)


def _send_error(sender, error, request_id):
    code = getattr(error, "code", None) or type(error).__name__
    message = str(error) if str(error).startswith(code) else f"{code}: {error}"
    pb_utils.Logger.log_warn(f"prefillonly: request {request_id!r} failed: {message}")
    kind = _STATUS.get(code, "INVALID_ARG") if isinstance(error, PrefillOnlyError) else "INTERNAL"
    status = getattr(pb_utils.TritonError, kind, None)
    err = pb_utils.TritonError(message, status) if status is not None else pb_utils.TritonError(message)
    sender.send(pb_utils.InferenceResponse(error=err), flags=FINAL)

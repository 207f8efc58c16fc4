"""Forwards each request to the decoupled prefillonly model (BLS) and returns its one final
response as an ordinary (non-decoupled) response. No engine here: one queue, one scheduler.
It imports nothing of prefillonly (so no torch): the tensor names come from this model's config,
which mirrors the target's.

Error status: the Python backend's BLS hands every error of the target back as INTERNAL (r24.10
keeps only the message), so the status is recovered from the message's "<code>: " prefix, which
the target always writes (prefillonly.serving.model.protocol.error_reply)."""

import json

import triton_python_backend_utils as pb_utils

# Same as prefillonly.serving.model.protocol.RETRY_LATER_CODES (a test checks): not imported, no torch here.
RETRY_LATER_CODES = ("overloaded", "engine_closed", "deadline_exceeded")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.target = config["parameters"]["target_model"]["string_value"]
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        return [self._forward(r) for r in requests]

    def _forward(self, request):
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, name) for name in self.inputs) if t is not None]
        try:
            responses = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=self.outputs,
                                                  timeout=request.timeout()).exec(decoupled=True)
            for response in responses:
                if response.has_error():
                    message = response.error().message()
                    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, status_of(message)))
                if response.output_tensors():
                    return pb_utils.InferenceResponse(output_tensors=response.output_tensors())
            return _internal_error(f"{self.target} sent no result")
        except Exception as e:  # the forwarder must answer every request, whatever happened
            return _internal_error(f"forwarding to {self.target} failed: {e}")


def status_of(message: str):
    """The Triton status of a target's error, from its "<code>: " prefix: retry-later codes are
    UNAVAILABLE (HTTP 503), "internal" stays INTERNAL (500), the rest are the caller's input (400)."""
    code = message.split(":", 1)[0]
    if code in RETRY_LATER_CODES:
        return pb_utils.TritonError.UNAVAILABLE
    if code == "cancelled":
        return pb_utils.TritonError.CANCELLED
    return pb_utils.TritonError.INTERNAL if code == "internal" else pb_utils.TritonError.INVALID_ARG


def _internal_error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal: {message}", pb_utils.TritonError.INTERNAL))

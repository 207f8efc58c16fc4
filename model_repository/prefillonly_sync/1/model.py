"""Forwards each request to the decoupled prefillonly model (BLS) and returns its one final
response as an ordinary (non-decoupled) response. No engine here: one queue, one scheduler.
Of prefillonly it imports only the wire contract (prefillonly.contract.wire: standard library, no torch,
no engine); the tensor names come from this model's config, which declares the same inputs and
outputs as the target's (tests/serving/test_wire.py checks both against prefillonly.contract.wire).

Error status: the Python backend's BLS hands every error of the target back as INTERNAL (r24.10
keeps only the message), so the status is recovered from the message's "<code>: " prefix, which
the target always writes (prefillonly.serving.model.protocol.error_reply), by the same rule the
target chose it with (prefillonly.contract.wire.triton_status)."""

import json

import triton_python_backend_utils as pb_utils

from prefillonly.contract.tenants import TENANT_HEADER, tenant_of_parameters
from prefillonly.contract.wire import INTERNAL, code_of, triton_status


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
            # the tenant Triton copied from the front door's header (API keys on) goes on with the request
            tenant = tenant_of_parameters(request.parameters())
        except ValueError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid_request: {e}", pb_utils.TritonError.INVALID_ARG))
        try:
            responses = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=self.outputs,
                                                  timeout=request.timeout(),
                                                  parameters={TENANT_HEADER: tenant} if tenant else {}).exec(decoupled=True)
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
    return getattr(pb_utils.TritonError, triton_status(code_of(message)))


def _internal_error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{INTERNAL}: {message}", pb_utils.TritonError.INTERNAL))

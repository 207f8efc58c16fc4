"""Forwards each request to the decoupled prefillonly model (BLS) and returns its one final
response as an ordinary (non-decoupled) response. No engine here: one queue, one scheduler.
It imports nothing of prefillonly (so no torch): the tensor names come from this model's config,
which mirrors the target's."""

import json

import triton_python_backend_utils as pb_utils


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
                if response.has_error():  # keep the target's status (UNAVAILABLE for overload, ...)
                    err = response.error()
                    code = err.code() if hasattr(err, "code") else None
                    return pb_utils.InferenceResponse(error=pb_utils.TritonError(err.message(), code) if code is not None
                                                      else pb_utils.TritonError(err.message()))
                if response.output_tensors():
                    return pb_utils.InferenceResponse(output_tensors=response.output_tensors())
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.target} sent no result"))
        except Exception as e:  # the forwarder must answer every request, whatever happened
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"forwarding to {self.target} failed: {e}"))

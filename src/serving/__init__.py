"""Serving prefillonly behind Triton Inference Server, split by the process each part runs in.

model/  inside the Triton model's Python stub (model_repository/prefillonly/1/model.py imports it):
        protocol.py (the wire format), inflight.py (requests in flight), metrics.py, drain.py (the
        graceful-stop handshake the host starts and the model answers).
host/   around it, in the `python -m prefillonly.serving serve` process (cli.py): supervisor.py,
        triton_server.py + server_tree.py (the tritonserver process and its tree), envoy_config.py
        (the front door's configuration; deploy/ uses only this) + envoy.py (the Envoy process),
        frontend_process.py, fleet.py, probe.py, prometheus.py (reading a metrics endpoint),
        model_settings.py (config.pbtxt's engine settings), addresses.py, process.py.
picker/ the fleet's endpoint picker: choice.py (which replica completes a request soonest).
Nothing is imported here, so that the model's imports inside the Triton stub load only what they
name; host/ never imports torch.
"""

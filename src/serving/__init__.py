"""Serving prefillonly behind Triton Inference Server.

Inside the Triton model: protocol.py (the wire format), metrics.py, drain.py, inflight.py (requests
in flight). Around it: server_tree.py (the server from the nvidia-pytriton wheel), triton_server.py
(the tritonserver process), envoy.py (the front door), supervisor.py (`python -m prefillonly.serving
serve`), fleet.py, probe.py, prometheus.py (reading a metrics endpoint), addresses.py (ports,
hosts), process.py (a logged child process), testing.py. Nothing is imported here, so that the
model's imports inside the Triton stub load only what they name.
"""

"""What runs around the Triton model: the serve supervisor and its processes (tritonserver, Envoy,
the scoring-API frontend), the fleet, the liveness probe. Standard library only: no torch, no
tritonclient. Nothing is imported here (see serving/)."""

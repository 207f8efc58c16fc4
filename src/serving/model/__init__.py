"""What runs inside the Triton model's Python stub, beside the engine: the wire format, requests
in flight, the engine's metrics, the drain handshake. Nothing is imported here (see serving/)."""

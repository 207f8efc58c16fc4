"""Serving prefillonly behind Triton Inference Server: the wire format (protocol.py) and the server launcher."""

#!/usr/bin/env bash
# The README's main command: set up (or refresh) the environment, then run a real tritonserver
# serving model_repository/ (the prefillonly model on the embedded default SmolLM2-135M) behind
# the Envoy front door, supervised; wait until it is ready, print how to call it, and stay in the
# foreground (Ctrl-C drains and stops it). Binds 127.0.0.1 unless told otherwise.
# Extra arguments go to `python -m prefillonly.serving serve` (e.g. --http-port 9000, --host 0.0.0.0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "${PREFILLONLY_VENV:-$ROOT/.venv}/bin/python" -m prefillonly.serving serve --model-repository "$ROOT/model_repository" "$@"

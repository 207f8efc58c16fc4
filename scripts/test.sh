#!/usr/bin/env bash
# The README's test command: set up (or refresh) the environment, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k memory).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${PREFILLONLY_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"

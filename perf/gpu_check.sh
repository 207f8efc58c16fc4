#!/usr/bin/env bash
# One-shot GPU check of prefillonly (correctness, speed/MFU, peak memory, SDPA backends).
#
#   bash perf/gpu_check.sh OUT_DIR [extra perf.gpu_check args, e.g. --smoke]
#
# Run from anywhere; it works in the repository root. Writes OUT_DIR/env.txt (nvidia-smi and
# library versions), OUT_DIR/gpu_check.log (everything printed), OUT_DIR/gpu_check.json and
# OUT_DIR/gpu_check.md (results, rewritten after every measurement so a cut-short run keeps
# what it measured), OUT_DIR/kernel_cases.log (the Triton kernels' cases, run natively first).
# Ends within 8 minutes whatever happens: every stage has a timeout, and the Python part gets
# what is left of a 470 s allowance (at most 450 s). Exits non-zero on any failed case, failed
# row or exception, after running everything it can.
# Set PYTHON to choose the interpreter (default: python, else python3).
set -u

OUT="${1:?usage: bash perf/gpu_check.sh OUT_DIR [perf.gpu_check args]}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.." || exit 1
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

# 1. Make `import prefillonly` work: pip install if needed, else a symlink shim on PYTHONPATH
#    (pyproject maps the package name prefillonly to src/).
if ! timeout 60 "$PY" -c 'import prefillonly' >/dev/null 2>&1; then
    echo "prefillonly not importable: pip install --no-deps --no-build-isolation ."
    if ! timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index . >"$OUT/pip_install.log" 2>&1 \
        || ! timeout 60 "$PY" -c 'import prefillonly' >/dev/null 2>&1; then
        echo "pip install failed (see $OUT/pip_install.log); using a PYTHONPATH shim to src/"
        SHIM="$(mktemp -d)"
        trap 'rm -rf "$SHIM"' EXIT
        ln -s "$PWD/src" "$SHIM/prefillonly"
        export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

# 2. Environment: GPU and library versions
{
    echo "date: $(date -Is)   host: $(hostname)   python: $(command -v "$PY")"
    timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
    timeout 60 "$PY" - <<'EOF' 2>&1 || echo "version probe failed"
import importlib
import prefillonly
print("prefillonly from", prefillonly.__file__)
for name in ("torch", "transformers", "triton", "safetensors", "flash_attn"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "unavailable:", type(exc).__name__, exc)
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| cudnn", torch.backends.cudnn.version() if torch.cuda.is_available() else None)
EOF
} >"$OUT/env.txt"
cat "$OUT/env.txt"

# 3. The Triton kernels' own cases natively first (tests/kernels/gpu_kernel_cases.py: every kernel
#    against float64 references, the self-check's fallbacks, offsets past 2^31): any failure, or no
#    pytest to run them with, fails the whole check; the rest still runs.
echo "running the Triton kernel cases natively (tests/kernels/gpu_kernel_cases.py, limit 150s)"
timeout -k 10 150 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/kernels/gpu_kernel_cases.py \
    >"$OUT/kernel_cases.log" 2>&1
KERNEL_RC=$?
tail -3 "$OUT/kernel_cases.log"
if [ "$KERNEL_RC" -ne 0 ] || grep -q skipped "$OUT/kernel_cases.log"; then
    echo "FAILED: the kernel cases (status $KERNEL_RC, or some skipped): see $OUT/kernel_cases.log"
    [ "$KERNEL_RC" -eq 0 ] && KERNEL_RC=1
fi

# 4. The check itself, under a hard time limit; its own budget ends it cleanly before that
LIMIT=$((470 - SECONDS))
[ "$LIMIT" -gt 450 ] && LIMIT=450
[ "$LIMIT" -lt 60 ] && LIMIT=60
BUDGET=$((LIMIT - 40))
[ "$BUDGET" -lt 30 ] && BUDGET=30
echo "running python -m perf.gpu_check (hard limit ${LIMIT}s, own budget ${BUDGET}s)"
# -m from the repository root (the cd above): perf is imported as a package from here
timeout -k 10 "$LIMIT" "$PY" -u -m perf.gpu_check --out "$OUT" --budget-s "$BUDGET" "$@" 2>&1 | tee "$OUT/gpu_check.log"
RC=${PIPESTATUS[0]}
if [ "$RC" -ne 0 ]; then
    echo "perf.gpu_check exited with status $RC (124/137: hit the ${LIMIT}s limit); partial results:" | tee -a "$OUT/gpu_check.log"
    [ -f "$OUT/gpu_check.md" ] && cat "$OUT/gpu_check.md"
fi
[ "$RC" -eq 0 ] && RC=$KERNEL_RC
exit "$RC"

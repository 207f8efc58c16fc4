#!/usr/bin/env bash
# The README's test command: set up (or refresh) the environment, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k memory; -n 0 runs in this one process).
# The test files run on parallel pytest-xdist workers, a file's tests together on one worker (its
# module fixtures, servers included, are started once): one per core, at most 4
# (PREFILLONLY_TEST_WORKERS sets the number). Much of the suite waits on processes starting, so two
# workers on 2 cores take about 0.6x the time of one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# The workers and the servers they start each run torch on every core, so the cores are shared
# several ways; OpenMP threads that spin while they wait (libgomp's default) then burn the time
# slices another process needed. Sleeping instead changes no result and took the suite from 722 s
# to 636 s of pytest on 2 cores (docs/testing.md). A caller's own setting wins.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
cores="$(nproc 2>/dev/null || echo 1)"
workers="${PREFILLONLY_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec "${PREFILLONLY_VENV:-$ROOT/.venv}/bin/python" -m pytest ${parallel[@]+"${parallel[@]}"} "$@"

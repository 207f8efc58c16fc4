"""Benchmarks, evaluations and their tools: the scripts that measure prefillonly against its baselines.

Not part of the installed product. Every script is a module of this package; run it from the
repository root with the project's venv:

    .venv/bin/python -m perf.<name> [args]        # e.g. python -m perf.eval all --quick

Scripts import each other as `from perf import benchutil as bu`. One half of perf/vllm_runner.py
runs inside vLLM's own venv (perf/.venv-vllm), where prefillonly is not installed: that module,
and what it imports at module level (benchutil, this file), use the standard library only.
"""

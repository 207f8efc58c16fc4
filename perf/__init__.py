"""Benchmarks, evaluations and their tools: the scripts that measure prefillonly against its baselines.

Not part of the installed product. Every script is a module of this package (the reliability
benchmark a subpackage, reliability/); run it from the repository root with the project's venv:

    .venv/bin/python -m perf.<name> [args]        # e.g. python -m perf.eval all --quick

Each script builds its command line in `build_parser()`, so that tests/house/test_perf_cli.py can check
every command the results record against it. Scripts import each other as
`from perf import benchutil as bu`; requests to the server go through clients/transport.py. One
half of perf/vllm_runner.py runs inside vLLM's own venv (perf/.venv-vllm), where prefillonly is not
installed: that module, and what it imports at module level (benchutil, this file), use the
standard library only; its server for the load runs is perf/vllm_server.py, on the main venv's side.
"""

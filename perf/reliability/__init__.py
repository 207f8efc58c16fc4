"""Reliability benchmark: the serve stack as `scripts/serve.sh` runs it (Envoy in front of a
supervised tritonserver, default model) under bad input and under a long mixed soak.

    .venv/bin/python -m perf.reliability all              # matrix, faults, soak (3,000 requests, 400 users), ~1-1.5 h on 2 cores
    .venv/bin/python -m perf.reliability matrix           # the bad-input matrix only (~1 min)
    .venv/bin/python -m perf.reliability soak --requests 5000 --users 600 --concurrency 8
    .venv/bin/python -m perf.reliability all --quick --out /tmp/rel-quick   # smoke run (200 requests, 20 users), ~4 min

1. matrix: ~25 request cases (bad inputs, limits, a 2 MB prompt, a body over Envoy's ~4 MB limit,
   the `triton_grpc_error` header, a few good requests), each sent in every call style: HTTP
   generate and gRPC streaming on the decoupled `prefillonly`, HTTP /infer and gRPC unary through
   the `prefillonly_sync` forwarder. Each cell records the status and the start of the message;
   a cell that differs from what the case expects (an answer for bad input, an error for good
   input, a 5xx/INTERNAL status for bad input, no answer at all) is flagged. Afterwards: the
   server must be alive with `restarts == 0`.
2. soak: a fresh stack with the engine's DEFAULT cache budget, `--requests` mixed requests
   (70% single prompt = user profile + post, 10% multi-item, 10% three prompts, 10% bad input)
   from `--users` cache namespaces, split between HTTP generate and gRPC streaming over
   `--concurrency` client threads, one request in flight per thread. Every request must get a
   final response (lost = none within `--timeout`). Every second: VmRSS of tritonserver, of each
   Python backend stub and of Envoy, plus the engine's metrics (cache bytes, budgets). The
   engine stub's RSS is compared with baseline (RSS after ready) + cache budget + the largest
   measured activation peak (ScoreResult.peak_bytes).
3. faults: kill -9 of the engine's process with 6 requests in flight, then a stop with a backlog
   of 16 long requests (longer than the exit timeout): what every request got, and the recovery.

Writes <out>/matrix.json, faults.json, soak.json, soak_samples.csv, soak_requests.csv, soak_rss.png and the
"## Reliability" section of perf/RESULTS.md (with --quick: <out>/RESULTS.md, so a smoke run never
overwrites the real results). Default out: perf/results/reliability (quick: perf/out/reliability_quick).

The parts: stack.py (the serve stack and its processes), matrix.py, soak.py, faults.py (the three
phases), report.py (the RESULTS.md section), __main__.py (the command line). Every request goes
through clients/transport.py, whose Answer says how it ended.
"""

"""perf/perf_analyzer_inputs.py: the --input-data JSON replays the seeded traces exactly (same ids,
deterministic for a seed, perf_analyzer's {"content", "shape"} layout, types the model declares),
and a real perf_analyzer run with it against a real tritonserver reports zero errors on both the
decoupled model (gRPC streaming) and the forwarder (plain gRPC)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from perf import perf_analyzer_inputs as pai
from perf import workloads as wl
from prefillonly.serving.model.protocol import INPUTS

ROOT = Path(__file__).resolve().parents[2]

WORKLOADS = ("post_rec", "credit")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_entries_are_the_trace_in_perf_analyzer_layout(workload):
    trace = wl.generate(workload, "tiny", 0)
    data = pai.input_data(trace)
    assert set(data) == {"data"} and len(data["data"]) == len(trace.requests)
    for entry, req in zip(data["data"], trace.requests):
        assert set(entry) == {"input_ids", "allowed_token_ids", "cache_prefix_len", "user"} <= set(INPUTS)
        for name, tensor in entry.items():
            assert set(tensor) == {"content", "shape"}, name
            assert tensor["shape"] == [len(tensor["content"])], name  # max_batch_size 0: the full shape
            want = str if INPUTS[name] == "BYTES" else int
            assert all(type(v) is want for v in tensor["content"]), name
        assert entry["input_ids"]["content"] == req.prompt_token_ids
        assert entry["allowed_token_ids"]["content"] == trace.allowed_token_ids == wl.ALLOWED_TOKEN_IDS
        assert entry["cache_prefix_len"]["content"] == [req.cache_prefix_len]
        assert entry["user"]["content"] == [f"u{req.user}"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_deterministic_for_a_seed(workload, tmp_path):
    a = pai.write_input_data(tmp_path / "a.json", pai.build_trace(workload, "tiny", 3))
    b = pai.write_input_data(tmp_path / "b.json", pai.build_trace(workload, "tiny", 3))
    c = pai.write_input_data(tmp_path / "c.json", pai.build_trace(workload, "tiny", 4))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert json.loads(a.read_text()) == pai.input_data(wl.generate(workload, "tiny", 3))


def test_repeats_namespace_each_pass_and_arrival_order():
    trace = wl.generate("post_rec", "tiny", 0)
    n = len(trace.requests)
    entries = pai.trace_entries(trace, repeats=3, namespace="lvl1/")
    assert len(entries) == 3 * n
    assert [e["input_ids"]["content"] for e in entries] == [r.prompt_token_ids for r in trace.requests] * 3
    users = [e["user"]["content"][0] for e in entries]
    assert users[:n] == [f"lvl1/u{r.user}" for r in trace.requests]
    assert users[n:2 * n] == [f"lvl1/p1/u{r.user}" for r in trace.requests]
    assert len(set(users)) == 3 * trace.num_users  # no pass shares a cache namespace with another
    timed = pai.build_trace("post_rec", "tiny", 0, arrival_qps=50.0)
    got = [e["input_ids"]["content"] for e in pai.trace_entries(timed)]
    assert got == [r.prompt_token_ids for r in sorted(timed.requests, key=lambda r: r.arrival_s)]
    assert [e for e in pai.trace_entries(trace, with_user=False, with_cache_prefix_len=False)
            if set(e) != {"input_ids", "allowed_token_ids"}] == []
    with pytest.raises(ValueError):
        pai.trace_entries(trace, repeats=0)


def test_cli_writes_the_file(tmp_path, capsys):
    out = tmp_path / "credit.json"
    assert pai.main(["credit", "--scale", "tiny", "--seed", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == pai.input_data(wl.generate("credit", "tiny", 1))
    assert "2 entries written" in capsys.readouterr().out


# -- a real perf_analyzer run against a real server -------------------------------------------------
def _failures(server) -> dict[str, float]:
    from prefillonly.serving.host.prometheus import scrape_metrics

    return scrape_metrics(server.metrics_url, prefixes=("nv_inference_request_failure{",))


def test_perf_analyzer_on_both_models_with_trace_inputs_has_zero_errors(tmp_path):
    from perf.perf_analyzer import PerfAnalyzerUnavailable, perf_analyzer_path, read_perf_analyzer_csv, run_perf_analyzer
    from prefillonly.serving.host.triton_server import running_server

    try:
        perf_analyzer_path()
    except PerfAnalyzerUnavailable as e:
        pytest.skip(str(e))
    repo = tmp_path / "repo"
    for model in ("prefillonly", "prefillonly_sync"):
        shutil.copytree(ROOT / "model_repository" / model, repo / model, ignore=shutil.ignore_patterns("__pycache__"))
    runs = [("prefillonly", ["-i", "grpc", "--streaming"], "post_rec"), ("prefillonly_sync", ["-i", "grpc"], "credit")]
    with running_server(repo, ready_timeout=180) as server:
        before = _failures(server)
        for model, call, workload in runs:
            trace = wl.generate(workload, "tiny", 0)
            inputs = pai.write_input_data(tmp_path / f"{model}.json", trace, repeats=2, namespace=f"{model}/")
            csv = tmp_path / f"{model}.csv"
            pa = run_perf_analyzer(["-m", model, "-u", server.grpc_url, *call, "--input-data", inputs, "--concurrency-range", "2",
                                    "--measurement-mode", "count_windows", "--measurement-request-count", "2", "-s", "999",
                                    "--max-trials", "3", "-f", csv], timeout=120)
            # perf_analyzer exits non-zero when any request failed
            assert pa.returncode == 0, pa.stdout[-3000:] + pa.stderr[-3000:]
            assert f"Successfully read data for 1 stream/streams with {2 * len(trace.requests)} step/steps" in pa.stdout
            rows = read_perf_analyzer_csv(csv)
            assert len(rows) == 1 and rows[0]["Concurrency"] == "2" and float(rows[0]["Inferences/Second"]) > 0
            assert float(rows[0]["p99 latency"]) > 0
        after = _failures(server)
    assert after and after == before, (before, after)  # Triton counted no failed request on either model

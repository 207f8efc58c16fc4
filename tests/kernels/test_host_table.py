"""perf/host_table.py keeps every other host's table when it writes this host's, and reads the
recorded side-by-side results into ratios of medians (no measuring here: recorded-looking inputs)."""

from __future__ import annotations

from perf import host_table as ht

MACHINE = {"cpu": "AMD EPYC", "isa_flags": ["avx2", "avx512_bf16"]}
OTHER = {"cpu": "Intel(R) Xeon(R)", "isa_flags": ["avx2", "amx_bf16"]}


def test_merge_replaces_only_this_hosts_table():
    key, other = ht.host_key(MACHINE), ht.host_key(OTHER)
    existing = f"{ht.HEADING}\n\nold intro\n\n### {other}\n\nxeon rows\n\n### {key}\n\nstale rows\n"
    merged = ht.merge(existing, key, f"### {key}\n\nnew rows\n")
    assert f"### {other}\n\nxeon rows" in merged and "new rows" in merged
    assert "stale rows" not in merged and "old intro" not in merged and merged.startswith(ht.INTRO)
    assert merged.count(f"### {key}") == 1


def test_rows_are_ratios_of_medians_and_other_hosts_results_are_not_mixed_in():
    key = ht.host_key(MACHINE)
    offline = {"machine": MACHINE, "dtype": "bfloat16", "command": "python -m perf.eval offline", "date": "2026-12-03T00:00:00",
               "summary": {"post_rec": {"systems": {"ours": {"walls_s": [6.0, 8.0]}, "vllm": {"walls_s": [10.0, 10.0]}}}},
               "runs": [{"backends": {"dtype": "bfloat16", "linear": "onednn", "attention": "cpu_flash"}}]}
    rows = ht.offline_rows(offline, key)
    assert rows == [["offline post_rec (bfloat16), s", "6.00 / 8.00", "10.00 / 10.00", "0.70", "<= 0.7"]]
    assert "another host" in ht.offline_rows({**offline, "machine": OTHER}, key)[0][1]
    level = lambda f, system, mean, rps: {"factor": f, "system": system,  # noqa: E731
                                          "summary": {"mean_latency_s": mean, "p99_latency_s": 2 * mean, "throughput_rps": rps}}
    load = {"machine": MACHINE, "factors": [1.0, 2.0], "saturated_qps": 4.0,
            "levels": [level(1.0, "ours", 1.0, 3.0), level(1.0, "vllm", 2.0, 3.0), level(2.0, "ours", 1.5, 4.0),
                       level(2.0, "vllm", 3.0, 2.0)]}
    load_rows = ht.load_rows(load, key)
    assert [r[3] for r in load_rows] == ["0.50", "0.50", "0.50", "0.50", "2.00"]
    section = ht.host_section(key, offline, load, {}, {})
    assert "linear `onednn`" in section and "rerank 1 x 100 | (not run on this host)" in section

"""perf/bench_tenants.py without a server: the module imports and its command line parses (the
default run and --quick). Fast; no model."""

from __future__ import annotations

import pytest

from perf import bench_tenants as bt

pytestmark = pytest.mark.fast  # no server, no model: the quick tier (tests/conftest.py FAST names files)


def test_default_and_quick_command_lines_parse():
    a = bt.build_parser().parse_args([])
    assert (a.quick, a.write, a.requests, a.reps) == (False, False, None, None)
    assert a.steady_load == pytest.approx(0.35) and a.flood_share == pytest.approx(0.15)
    q = bt.build_parser().parse_args(["--quick", "--write", "--requests", "40", "--no-quota-phases", "on"])
    assert (q.quick, q.write, q.requests, q.no_quota_phases) == (True, True, 40, "on")


def test_arrivals_and_key_file():
    offsets = bt.poisson_times(2.0, 200, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and 60 < offsets[-1] < 140
    text = bt.key_file_text("in_flight=2 rps=1.5")
    assert f"{bt.KEYS['flood']} flood in_flight=2 rps=1.5" in text and f"{bt.KEYS['steady']} steady\n" in text

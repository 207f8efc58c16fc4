"""The fleet picker's decision (prefillonly.serving.picker.choice), without processes: its
prediction is the replica's JCT model on the blocks it holds plus its backlog, it picks the
lowest, keeps a user where it was within the margin, and its view of each replica's cache is
an LRU chain of what it sent there."""

from __future__ import annotations

import pytest

from prefillonly.contract.jct import JctCoefficients, JctEstimator
from prefillonly.serving.picker.choice import HeldBlocks, Picker

COEF = JctCoefficients(fixed_s=0.01, per_token_s=1e-3, attention_s=1e-7)
BLOCK = 16


def _picker(replicas=("a", "b", "c"), capacity=1000, margin=0.05) -> Picker:
    p = Picker(BLOCK, capacity, fallback_s_per_token=2e-3, stick_margin_s=margin)
    p.set_members(list(replicas))
    for r in replicas:
        p.report(r, 0.0, COEF, at=0.0)
    return p


def _keys(user: str, blocks: int) -> list[str]:
    return [f"{user}/{i}" for i in range(blocks)]


def test_the_prediction_is_the_replicas_jct_model_on_its_held_blocks_plus_its_backlog():
    p = _picker()
    estimator = JctEstimator()
    estimator._coef = COEF  # the replica's fit, as it reported it
    keys = _keys("u", 8)
    p.replicas["a"].held.record(keys[:5])
    p.report("b", 0.7, COEF, at=10.0)
    for replica, backlog, cached in (("a", 0.0, 5 * BLOCK), ("b", 0.7 - 0.2, 0), ("c", 0.0, 0)):
        seconds, compute, held = p.predict(replica, keys, 8 * BLOCK + 3, now=10.2)
        assert held * BLOCK == cached and compute == pytest.approx(estimator.predict(8 * BLOCK + 3 - cached, cached))
        assert seconds == pytest.approx(backlog + compute)


def test_a_warm_replica_wins_until_its_backlog_costs_more_than_recomputing():
    # cost = completion + work_weight x compute: recomputing the profile elsewhere also delays
    # everyone queued behind it there, so a warm replica keeps the user past the point where a
    # cold one would finish this request sooner, until its backlog outweighs that weighted work
    p = _picker(margin=0.0)
    keys = _keys("u", 64)  # 1,024 tokens: ~1.1 s cold here
    p.replicas["b"].held.record(keys)
    assert p.pick("u", keys, 64 * BLOCK + 1, now=1.0).replica == "b"
    p.report("b", 5.0, COEF, at=2.0)  # a cold replica would finish sooner, but costs more work
    choice = p.pick("u", keys, 64 * BLOCK + 1, now=2.0)
    assert choice.replica == "b" and choice.predicted_s["b"] > choice.predicted_s["a"]
    cold = choice.predicted_s["a"]
    p.report("b", (1 + p.work_weight) * cold + 1.0, COEF, at=3.0)  # now b's queue costs more
    choice = p.pick("u", keys, 64 * BLOCK + 1, now=3.0)
    assert choice.replica != "b" and choice.predicted_s["b"] > choice.predicted_s[choice.replica]


def test_a_burst_is_spread_because_each_pick_adds_to_the_backlog():
    p = _picker(margin=0.0)
    chosen = [p.pick(None, _keys(f"user{i}", 4), 4 * BLOCK, now=0.0).replica for i in range(9)]
    assert sorted(chosen.count(r) for r in "abc") == [3, 3, 3]
    # and the backlog drains at one second per second
    view = p.replicas[chosen[-1]]
    assert view.backlog(now=view.backlog_at + 0.01) == pytest.approx(view.backlog_s - 0.01)
    assert view.backlog(now=view.backlog_at + 1e6) == 0.0


def test_a_user_stays_within_the_margin_and_moves_beyond_it():
    p = _picker(margin=0.5)
    keys = _keys("u", 2)
    first = p.pick("u", keys, 2 * BLOCK + 5, now=0.0).replica
    p.report(first, 0.3, COEF, at=1.0)  # slower by 0.3 s than the others: within the margin
    assert p.pick("u", _keys("v", 2), 2 * BLOCK + 5, now=1.0).replica == first
    p.report(first, 3.0, COEF, at=2.0)  # slower by 3 s: beyond it
    assert p.pick("u", _keys("w", 2), 2 * BLOCK + 5, now=2.0).replica != first


def test_membership_and_reports_of_strangers():
    p = _picker()
    p.replicas["a"].held.record(["x"])
    p.set_members(["a", "d"])
    assert set(p.replicas) == {"a", "d"} and p.replicas["a"].held.leading(["x"]) == 1  # a kept its view
    p.report("b", 9.0, COEF, at=0.0)  # gone: ignored
    assert "b" not in p.replicas and p.replicas["d"].reported_at is None
    p.set_members([])
    with pytest.raises(LookupError):
        p.pick("u", ["x"], 20, now=0.0)


def test_held_blocks_are_an_lru_chain_of_bounded_size():
    held = HeldBlocks(capacity=3)
    held.record(["a", "b", "c"])
    assert held.leading(["a", "b", "c", "d"]) == 3 and held.leading(["d", "a"]) == 0
    held.record(["a"])  # a most recently used: b is the oldest
    held.record(["z"])
    assert len(held) == 3 and held.leading(["b"]) == 0 and held.leading(["a"]) == 1
    assert held.leading(["a", "x", "z"]) == 1  # a chain: the first miss ends the match


def test_the_pickers_default_block_size_is_the_engines():
    # the picker hashes a prompt into the engine's block keys: another block size would match nothing
    from prefillonly.config import EngineConfig
    from prefillonly.serving.picker.__main__ import DEFAULT_BLOCK_SIZE, build_parser

    assert DEFAULT_BLOCK_SIZE == EngineConfig.default_of("cache_block_size")
    assert build_parser().parse_args(["--dns", "replicas"]).block_size == DEFAULT_BLOCK_SIZE


def test_with_api_keys_the_same_user_of_two_tenants_is_two_users(tmp_path):
    # Envoy's key filter writes the tenant header before the picker sees a request: the engine
    # keeps each tenant's cache apart, so the picker must not believe tenant b's "u" holds what
    # tenant a's "u" sent, nor keep them on one replica as one user
    import json

    from prefillonly.contract.tenants import tenant_namespace
    from prefillonly.serving.picker.service import Members, PickerState

    members = Members(tmp_path / "members.json")
    members.by_key = {r: (f"10.0.0.{i}:8000", "") for i, r in enumerate("abc")}
    log = tmp_path / "decisions.jsonl"
    state = PickerState(_picker(margin=0.0), members, report_interval_s=1.0, decisions_log=log)
    prompt = list(range(64 * BLOCK))
    first = state.decide("u", prompt, tenant="acme")
    state.decide("u", prompt, tenant="acme")
    state.decide("u", prompt, tenant="globex")
    state.decide("u", prompt)  # no keys: the key-less cache is a tenant's neither
    # and the ext_proc service reads the tenant from the header Envoy set
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from prefillonly.contract.tenants import TENANT_HEADER
    from prefillonly.contract.wire import USER_HEADER
    from prefillonly.serving.picker.service import servicer

    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                                          ((":method", "POST"), (USER_HEADER, "u"), (TENANT_HEADER, "globex"))])
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))
    answers = list(servicer(state)[0].Process(iter([request]), None))
    assert len(answers) == 1 and answers[0].request_headers.response.header_mutation.set_headers
    state.close()
    decisions = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["tenant"], d["user"]) for d in decisions][-1] == ("globex", "u")
    assert [(d["tenant"], d["cached_blocks"]) for d in decisions[:4]] == [("acme", 0), ("acme", 64), ("globex", 0), (None, 0)]
    assert decisions[1]["destination"] == first
    assert ("acme", "u") in state.picker._last and ("globex", "u") in state.picker._last
    assert len({tenant_namespace("acme", "u"), tenant_namespace("globex", "u"), tenant_namespace(None, "u"),
                tenant_namespace("acme", None), tenant_namespace("acme", "")}) == 4  # no user: the tenant's shared cache

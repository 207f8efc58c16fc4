"""The endpoint picker in a real fleet on loopback: 3 real tritonserver replicas (the small
random-weight model, one thread each) behind a real Envoy whose HTTP listener asks the real picker
process (ext_proc) where each request goes. The replica that answers is the one the picker's
decision names, a user's requests stay on one replica and hit its cache, a killed picker loses no
request (Envoy falls back to Maglev) and routing returns to it when it is back, and a replica that
dies leaves the picker's decisions within a second or two."""

from __future__ import annotations

import json
import time

import pytest
import torch

from clients.transport import json_body, post
from prefillonly.serving.host.envoy_config import REPLICA_HEADER, USER_HEADER
from prefillonly.serving.host.fleet import LocalFleet
from prefillonly.serving.host.model_settings import copy_model_repository

from .test_fleet import ALLOWED, REPO

PROFILE = 256


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, small_served_model):
    repo = copy_model_repository(REPO, tmp_path_factory.mktemp("picker-fleet") / "repo", model=small_served_model,
                                 dtype="float32", threads="1")
    logs = tmp_path_factory.mktemp("picker-fleet-logs")
    # two gRPC workers: fewer than the requests in flight in the concurrent test below
    options = {"report_interval_s": 0.1, "decisions_log": logs / "decisions.jsonl", "workers": 2}
    with LocalFleet(repo, replicas=3, log_dir=logs, picker=True, picker_options=options).start() as f:
        f.decisions_path = options["decisions_log"]
        yield f


def _decisions(fleet) -> list[dict]:
    return [json.loads(line) for line in fleet.decisions_path.read_text().splitlines() if line.strip()]


def _ask(fleet, ids: list[int], user: str) -> tuple[int, dict, str]:
    status, raw, headers = post(f"{fleet.http_url}/v2/models/prefillonly/generate",
                                json_body({"input_ids": ids, "allowed_token_ids": ALLOWED}), {USER_HEADER: user}, 120)
    reply = json.loads(raw or b"{}")
    result = json.loads(reply["result_json"]) if status == 200 else {}
    return status, result, headers.get(REPLICA_HEADER)


def _profile(seed: int, length: int = PROFILE) -> list[int]:
    return torch.randint(10, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_request_goes_where_the_picker_decided(fleet):
    for i in range(12):
        before = len(_decisions(fleet))
        status, result, replica = _ask(fleet, _profile(i) + [7, 8, 9], f"user-{i}")
        decisions = _decisions(fleet)
        assert status == 200, result
        assert len(decisions) == before + 1, decisions[before:]  # one decision per request
        assert replica == decisions[-1]["destination"], (replica, decisions[-1])
    assert len({d["destination"] for d in _decisions(fleet)}) >= 2  # spread, not one replica for all


def test_more_requests_in_flight_than_picker_workers_are_all_picked(fleet):
    """Each ext_proc stream must free its worker once the request is routed, not when the request
    ends: with 2 workers and 9 requests computing at once, a held worker would make the later
    streams wait past Envoy's 0.2 s message timeout and go to Maglev, undecided."""
    from concurrent.futures import ThreadPoolExecutor

    before = len(_decisions(fleet))
    users = [f"burst-{i}" for i in range(9)]
    with ThreadPoolExecutor(len(users)) as pool:  # ~2K-token prompts: each computes for a while
        answers = list(pool.map(lambda iu: _ask(fleet, _profile(500 + iu[0], 2000) + [5], iu[1]), enumerate(users)))
    assert all(status == 200 for status, _, _ in answers), answers
    decided = {d["user"]: d["destination"] for d in _decisions(fleet)[before:]}
    assert sorted(decided) == users, f"picked {sorted(decided)}; the rest fell back to Maglev"
    assert [replica for _, _, replica in answers] == [decided[u] for u in users]


def test_a_users_requests_stay_together_and_hit_its_cache(fleet):
    profile = _profile(100)
    answers = [_ask(fleet, profile + [11 + k, 12, 13], "steady-user") for k in range(5)]
    assert all(status == 200 for status, _, _ in answers), answers
    assert len({replica for _, _, replica in answers}) == 1, [r for *_, r in answers]
    assert all(result["cached_tokens"] >= PROFILE - 64 for _, result, _ in answers[1:]), [a[1] for a in answers]


def test_a_killed_picker_loses_no_request_and_routing_returns_to_it(fleet):
    fleet.stop_picker(kill=True)
    try:
        before = len(_decisions(fleet))
        answers = [_ask(fleet, _profile(200 + i) + [5], f"fallback-{i}") for i in range(6)]
        assert [status for status, _, _ in answers] == [200] * 6, answers  # Maglev took them
        assert len(_decisions(fleet)) == before  # no picker decided them
    finally:
        fleet.start_picker()
    deadline = time.monotonic() + 30
    while True:  # Envoy reconnects to the picker's cluster on the next request
        before = len(_decisions(fleet))
        status, _, replica = _ask(fleet, _profile(300) + [5], "back")
        if len(_decisions(fleet)) == before + 1:
            assert status == 200 and replica == _decisions(fleet)[-1]["destination"]
            break
        assert status == 200 and time.monotonic() < deadline, "the picker was not used again within 30 s"
        time.sleep(0.2)


def test_a_replica_that_dies_leaves_the_pickers_decisions(fleet):
    victim = fleet.members[-1]
    gone = f"127.0.0.1:{fleet.replicas[victim].http_port}"
    fleet.replicas[victim].send_signal(9)
    deadline = time.monotonic() + 30
    while victim not in fleet.reaped:  # the fleet reaps it and rewrites the picker's members file
        assert time.monotonic() < deadline, "the killed replica was not reaped"
        time.sleep(0.1)
    time.sleep(1.0)  # the picker rereads the members within its report interval (0.1 s)
    before = len(_decisions(fleet))
    answers = [_ask(fleet, _profile(400 + i) + [5], f"after-{i}") for i in range(9)]
    assert all(status == 200 for status, _, _ in answers), answers
    assert all(d["destination"] != gone for d in _decisions(fleet)[before:])


def test_dns_members_are_what_the_name_resolves_to():
    """On Kubernetes the picker's members are the replicas' headless Service's A records."""
    from prefillonly.serving.picker.service import DnsMembers

    members = DnsMembers("localhost", 8000, 8002)
    assert members.reload() is True and members.by_key == {"127.0.0.1:8000": ("127.0.0.1:8000", "http://127.0.0.1:8002/metrics")}
    assert members.reload() is False  # unchanged
    gone = DnsMembers("no-such-host.invalid", 8000, 8002)
    assert gone.reload() is False and gone.by_key == {}  # a failed lookup keeps the last members (none yet)

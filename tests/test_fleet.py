"""A fleet on loopback: 3 real tritonserver replicas (small random-weight model, one thread each,
each replica's prefix cache sized for a third of the test users' profiles) behind a real Envoy
with user-affinity routing (prefillonly.serving.host.fleet). Results through Envoy equal a replica's
own, a user's requests stay on one replica, affinity at least doubles the fleet's hit rate, and
a SIGKILLed replica leaves rotation while every request still gets one final answer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from clients.transport import json_body, post
from prefillonly.cache.kv_pool import KVPool
from prefillonly.model_spec import ModelSpec
from prefillonly.serving.host.envoy_config import REPLICA_HEADER, USER_HEADER
from prefillonly.serving.host.fleet import LocalFleet
from prefillonly.serving.host.model_settings import copy_model_repository
from prefillonly.serving.host.prometheus import scrape_metrics

ROOT = Path(__file__).resolve().parents[1]
REPO = ROOT / "model_repository"
PROFILE, POST, BLOCK = 256, 20, 64  # tokens: a user's profile is 4 whole cache blocks
ALLOWED = [9230, 2838]
USERS_PER_REPLICA = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, small_served_model):
    spec = ModelSpec.from_folder(small_served_model)
    block = KVPool.bytes_per_block(spec.num_layers, spec.num_kv_heads, BLOCK, spec.head_dim, torch.float32)
    # room for two profiles per replica: a third of the 6 test users'
    repo = copy_model_repository(REPO, tmp_path_factory.mktemp("fleet") / "repo", model=small_served_model,
                                 dtype="float32", threads="1",
                                 cache_budget_bytes=str(USERS_PER_REPLICA * (PROFILE // BLOCK) * block))
    logs = tmp_path_factory.mktemp("fleet-logs")
    # Maglev: on a failover Envoy's ring hash also moves ~13% of the survivors' users to the other
    # survivor (cold there), which made the survivors' hit check below fail now and then; Maglev
    # moved none in the same runs (making it the fleets' default is the next issue's work)
    with LocalFleet(repo, replicas=3, log_dir=logs, affinity_lb="MAGLEV").start() as f:
        yield f


def _generate(url: str, body: dict, header_user: str | None = None, timeout: float = 120) -> tuple[int, dict, str | None]:
    headers = {USER_HEADER: header_user} if header_user is not None else None
    status, raw, reply_headers = post(f"{url}/v2/models/prefillonly/generate", json_body(body), headers, timeout)
    return status, json.loads(raw or b"{}"), reply_headers.get(REPLICA_HEADER)


def _body(ids: list[int], user: str) -> dict:
    return {"input_ids": ids, "allowed_token_ids": ALLOWED, "user": user}


def _result(reply: dict) -> dict:
    return json.loads(reply["result_json"] if isinstance(reply["result_json"], str) else reply["result_json"][0])


def _replica(fleet: LocalFleet, header: str) -> int:
    return fleet.replica_of_port(int(header.rsplit(":", 1)[1]))


def _balanced_users(fleet: LocalFleet, prefix: str) -> dict[str, int]:
    """USERS_PER_REPLICA users per replica, found by asking Envoy where candidates land (a probe
    is a 1-token request in the user's namespace, so no profile is cached by it)."""
    chosen: dict[str, int] = {}
    per = [0] * len(fleet.replicas)
    for n in range(200):
        user = f"{prefix}{n}"
        status, _, header = _generate(fleet.http_url, _body([5], user), header_user=user)
        assert status == 200
        i = _replica(fleet, header)
        if per[i] < USERS_PER_REPLICA:
            per[i] += 1
            chosen[user] = i
        if min(per) == USERS_PER_REPLICA:
            return chosen
    pytest.fail(f"200 candidate users never filled every replica: {per}")


def _profiles(users, seed: int, length: int = PROFILE) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {u: torch.randint(10, 40000, (length,), generator=gen).tolist() for u in users}


def _hit_rate(replies: list[dict]) -> float:
    results = [_result(r) for r in replies]
    return sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)


def test_every_call_style_through_envoy_equals_a_replica_queried_directly(fleet):
    from clients.prefillonly_client import PrefillOnlyClient

    ids = torch.randint(10, 40000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    direct = fleet.replicas[0]
    with PrefillOnlyClient(direct.http_url, "http") as c:
        want = [t["logprob"] for t in c.score(ids, ALLOWED, user="direct")["tokens"]]
    for protocol, url in (("http", fleet.http_url), ("grpc", fleet.grpc_url), ("infer", fleet.http_url)):
        with PrefillOnlyClient(url, protocol) as c:
            got = [t["logprob"] for t in c.score(ids, ALLOWED, user="someone")["tokens"]]
        assert got == pytest.approx(want, abs=1e-4), protocol
        with PrefillOnlyClient(url, protocol) as c:  # no user: the least-request route
            assert [t["logprob"] for t in c.score(ids, ALLOWED)["tokens"]] == pytest.approx(want, abs=1e-4), protocol


def test_affinity_keeps_each_user_on_one_replica_and_at_least_doubles_the_hit_rate(fleet):
    users = _balanced_users(fleet, "aff")
    before = [scrape_metrics(r.metrics_url) for r in fleet.replicas]
    with_header, landed = [], {u: set() for u in users}
    profiles = _profiles(users, seed=2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):  # rounds: every user's next request, users interleaved
        for u in users:
            status, reply, header = _generate(fleet.http_url, _body(profiles[u] + torch.randint(10, 40000, (POST,), generator=gen).tolist(), u),
                                              header_user=u)
            assert status == 200, reply
            landed[u].add(_replica(fleet, header))
            with_header.append(reply)
    assert all(len(s) == 1 for s in landed.values()), landed
    assert {u: s.pop() for u, s in landed.items()} == users
    # each replica's own metrics saw exactly its users' 16 requests
    after = [scrape_metrics(r.metrics_url) for r in fleet.replicas]
    for i, (a, b) in enumerate(zip(before, after)):
        done = {k: b[k] - a.get(k, 0.0) for k in b if k.startswith("prefillonly_requests_total") and 'outcome="completed"' in k}
        assert sum(done.values()) == 8 * USERS_PER_REPLICA, (i, done)

    without = []
    fresh = _profiles(users, seed=4)  # profiles no cache holds yet
    for _ in range(8):
        for u in users:
            status, reply, _ = _generate(fleet.http_url, _body(fresh[u] + torch.randint(10, 40000, (POST,), generator=gen).tolist(), u))
            assert status == 200, reply
            without.append(reply)
    rate_with, rate_without = _hit_rate(with_header), _hit_rate(without)
    print(f"fleet hit rate: with the header {rate_with:.3f}, without {rate_without:.3f}")
    assert rate_with >= 2 * rate_without and rate_with >= 0.7, (rate_with, rate_without)


def test_a_killed_replica_leaves_rotation_and_every_request_gets_one_answer(fleet):
    users = _balanced_users(fleet, "fail")
    # half-length profiles: a surviving replica's cache then holds its own users' and the moved
    # users' profiles together, so what is measured is routing, not the cache's size
    short = PROFILE // 2
    profiles = _profiles(users, seed=5, length=short)
    for u in users:  # cache each user's profile on its replica
        assert _generate(fleet.http_url, _body(profiles[u] + [7] * POST, u), header_user=u)[0] == 200
    victim = 2
    answers: list[tuple[float, str, int, dict, str | None]] = []
    lock, stop = threading.Lock(), threading.Event()

    def client(u: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            t = time.monotonic()
            status, reply, header = _generate(fleet.http_url, _body(profiles[u] + [n % 900 + 10] * POST, u), header_user=u)
            with lock:
                answers.append((t, u, status, reply, header))

    threads = [threading.Thread(target=client, args=(u,)) for u in users]
    for t in threads:
        t.start()
    time.sleep(3)
    killed_at = time.monotonic()
    fleet.replicas[victim].kill()
    time.sleep(25)
    stop.set()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request never got its answer"

    statuses = [a[2] for a in answers]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))  # an answer each: a result, or a clear "unavailable"
    assert all("unavailable" in a[3].get("error", "") for a in answers if a[2] == 503)
    assert statuses.count(200) >= 0.9 * len(statuses), (statuses.count(200), len(statuses))
    # within a bound generous for a loaded 2-core host, Envoy no longer sends anything to the dead replica
    bound = 10.0
    late = [a for a in answers if a[0] > killed_at + bound]
    assert late and all(a[2] == 200 and _replica(fleet, a[4]) != victim for a in late)
    # the surviving replicas' users kept their cache hits
    survivors = {u for u, i in users.items() if i != victim}
    hits = [_result(a[3])["cached_tokens"] for a in late if a[1] in survivors]
    # on failure: (user, its replica, the answering replica, seconds after the kill, cached tokens) of each miss
    misses = [(a[1], users[a[1]], _replica(fleet, a[4]), round(a[0] - killed_at, 1), _result(a[3])["cached_tokens"])
              for a in late if a[1] in survivors and _result(a[3])["cached_tokens"] != short]
    assert hits and all(h == short for h in hits), misses
    moved = [_result(a[3])["cached_tokens"] for a in late if a[1] not in survivors]
    print(f"failover: {len(answers)} answers ({statuses.count(503)} unavailable), {len(late)} after the bound; "
          f"moved users' late hits {sum(h == short for h in moved)}/{len(moved)}")

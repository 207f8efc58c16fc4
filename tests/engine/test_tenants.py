"""Tenants in the engine: a tenant's cache namespace is its own (hits never cross tenants, whatever
cache_namespace or user a client sends), and the checks on a tenant's name. The scheduler's turns
between tenants: tests/cache_scheduler/test_scheduler.py."""

from __future__ import annotations

import pytest

from prefillonly import InvalidRequestError
from prefillonly.contract.tenants import tenant_namespace
from prefillonly.request import check_namespace, check_tenant

# a prompt of its own (the session engine's cache is shared with other tests), several blocks long
PROMPT = "Tenant isolation check: the orchard keeps seven kinds of apple trees. " * 6 + "Is this about fruit? Answer:"


def test_cache_hits_never_cross_tenants(default_engine):
    e = default_engine
    cold = e.score(PROMPT, [" Yes", " No"], tenant="a", user="u")
    assert cold.cached_tokens == 0
    other = e.score(PROMPT, [" Yes", " No"], tenant="b", user="u")  # same user, same prompt, another tenant
    assert other.cached_tokens == 0
    keyless = e.score(PROMPT, [" Yes", " No"], user="u")  # a tenant's cache is not the key-less namespace
    assert keyless.cached_tokens == 0
    warm = e.score(PROMPT, [" Yes", " No"], tenant="a", user="u")
    assert warm.cached_tokens > 0
    # a client namespace is still a namespace inside the tenant's
    assert e.score(PROMPT, [" Yes", " No"], tenant="a", cache_namespace="elsewhere").cached_tokens == 0
    # the same answer whichever namespace computed it
    for r in (other, keyless, warm):
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(cold.tokens, r.tokens))


def test_every_submit_passes_the_tenant_through(default_engine):
    context = "Tenant pass-through: rivers run to the sea and the sea gives rain back. " * 5 + "\nQ: what flows?\nA:"
    cold = default_engine.loglikelihood(context, [" water", " sand"], tenant="ll-a", cache_namespace="n")
    assert cold[0].cached_tokens == 0
    assert default_engine.loglikelihood(context, [" water", " sand"], tenant="ll-b", cache_namespace="n")[0].cached_tokens == 0
    assert default_engine.loglikelihood(context, [" water", " sand"], tenant="ll-a", cache_namespace="n")[0].cached_tokens > 0


@pytest.mark.parametrize("kwargs, match", [(dict(user="u\x1f"), "user"),
                                           (dict(cache_namespace="\x1fa\x1f"), "cache_namespace"),
                                           (dict(tenant=""), "tenant"),
                                           (dict(tenant="a b"), "tenant"),
                                           (dict(tenant="x" * 65), "tenant"),
                                           (dict(tenant="a\n"), "tenant"),
                                           (dict(tenant="é"), "tenant"),
                                           (dict(tenant=3), "tenant"),
                                           (dict(tenant=b"a"), "tenant")])
def test_bad_tenant_or_namespace_is_refused(default_engine, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        default_engine.submit(PROMPT, [" Yes"], **kwargs)


def test_tenant_name_rule_and_namespace_form():
    assert check_tenant(None) is None
    for good in ("a", "team-1", "A.b_c-9", "x" * 64):
        assert check_tenant(good) == good
    for bad in ("", "a b", "x" * 65, "a/b", "a\x1f", 1, None.__class__):
        with pytest.raises(InvalidRequestError, match="tenant"):
            check_tenant(bad)
    assert tenant_namespace(None, "u") == "u" and tenant_namespace(None, None) is None
    assert tenant_namespace("a", "u") == "\x1fa\x1fu" and tenant_namespace("a", None) == "\x1fa\x1f"
    # no client namespace takes a tenant's form: the mark is refused in both client arguments
    for ns, user, name in (("\x1fa\x1fu", None, "cache_namespace"), (None, "\x1fa\x1f", "user")):
        with pytest.raises(InvalidRequestError, match=name):
            check_namespace(ns, user)

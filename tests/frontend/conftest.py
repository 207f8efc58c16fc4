"""The frontend layer's shared parts: one serve stack (Envoy, the supervised tritonserver and the
scoring frontend, on the small random-weight model in float32, one thread) and one in-process
Engine on the same weights and kernels, for every file of the layer that talks to them. Each test
leaves the stack serving and counts only its own requests (before/after), so sharing them changes
nothing a test sees but the ~15 s each would spend starting."""

from __future__ import annotations

import pytest

from ..conftest import SAME_KERNELS
from ..serving.test_faults import supervised


@pytest.fixture(scope="session")
def stack(tmp_path_factory, small_served_model):
    # no liveness probes during the tests: they are engine requests too, and tests count requests
    with supervised(tmp_path_factory.mktemp("frontend"), small_served_model, probe_interval_s=3600) as sup:
        yield sup


@pytest.fixture(scope="session")
def engine(small_served_model):
    from prefillonly import Engine, EngineConfig

    # the stack's kernels (tests/serving/test_faults.supervised pins them): auto may pick others
    with Engine(EngineConfig(model=small_served_model, dtype="float32", threads=1, cache_budget_bytes=0, **SAME_KERNELS)) as e:
        yield e


@pytest.fixture(scope="session")
def tokenizer(small_served_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(small_served_model)

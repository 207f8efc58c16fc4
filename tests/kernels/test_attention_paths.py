"""The attention paths (kernels/attention_paths.py): one object per engine that the executor attends
with and the memory prediction counts by; a new backend is one class plus its entry in
backend.ATTENTION_PATHS. Also the GEMM the backend hands the executor."""

from __future__ import annotations

import pytest
import torch
import transformers

from prefillonly.kernels import backend as backend_mod
from prefillonly.kernels.attention import AttentionShape
from prefillonly.kernels.attention_paths import AttentionPath, TorchAttention, TritonAttention
from prefillonly.kernels.backend import KernelBackend
from prefillonly.kernels.linear import aten_linear, onednn_linear, pack, why_onednn_unavailable
from prefillonly.model.spec import ModelSpec
from prefillonly.model.weights import ModelWeights
from prefillonly.worker.executor import ForwardBatch, HybridPrefillExecutor, Sequence
from prefillonly.worker.memory import batch_peak_components

from ..reference import attention_float64

CPU = torch.device("cpu")
TOY_SCRATCH = 123_457  # what the toy path says it allocates: memory.py must report exactly this


class ToyAttention(AttentionPath):
    """A backend written against the interface only: explicit float64 softmax, a new output tensor."""

    name = "toy"

    def __init__(self):
        self.calls = 0

    @classmethod
    def build(cls, backend, device, dtype, head_dim):
        return cls() if backend == "toy" else None

    def attend(self, q, k, v, scale, inplace=False, window=0, softcap=0.0):
        self.calls += 1
        return attention_float64(q, k, v, scale, window, softcap).to(q.dtype)

    def scratch_bytes(self, shape, members, windows, softcap, inplace):
        return TOY_SCRATCH


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(backend_mod, "ATTENTION_PATHS", (ToyAttention, *backend_mod.ATTENTION_PATHS))


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=512)
    config.architectures = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(config)
    return spec, ModelWeights.random(spec, torch.float32, CPU, seed=4, std=0.2)


def test_a_registered_backend_runs_the_executor_end_to_end(toy_registered, model):
    """Registered in ATTENTION_PATHS alone, the toy runs every sequence's attention of a batch (odd
    lengths, one after a cached prefix, odd chunks) and gives SDPA's logits."""
    spec, weights = model
    toy = HybridPrefillExecutor(spec, weights, KernelBackend(CPU, torch.float32, spec.head_dim, "toy"))
    sdpa = HybridPrefillExecutor(spec, weights, KernelBackend(CPU, torch.float32, spec.head_dim, "sdpa"))
    assert toy.kernels.attention_path.name == "toy" and sdpa.kernels.attention_path.name == "torch"
    g = torch.Generator().manual_seed(8)
    ids = lambda n: torch.randint(0, spec.vocab_size, (n,), generator=g)  # noqa: E731
    prefix = sdpa.forward(ids(19), None, capture=(0, 19)).captured
    batch = lambda: ForwardBatch([Sequence(ids(37)), Sequence(ids(13), prefix=prefix), Sequence(ids(1))])  # noqa: E731
    g.manual_seed(9)
    want = sdpa.forward_batch(batch(), 11).logits
    g.manual_seed(9)
    got = toy.forward_batch(batch(), 11).logits
    assert toy.kernels.attention_path.calls == 3 * spec.num_layers  # every sequence, every layer, on the toy
    assert (got - want).abs().max().item() < 1e-4


def test_memory_asks_the_path_for_its_scratch(toy_registered, model):
    spec, _ = model
    members = [(37, 0), (13, 19)]
    toy = batch_peak_components(spec, members, 16, KernelBackend(CPU, torch.float32, spec.head_dim, "toy"))
    assert toy["attention"] == TOY_SCRATCH and toy["prefix_gather"] == 4 * 2 * 19 * spec.kv_width


def test_memory_of_each_path_is_its_own(model):
    """The prediction's attention, linear and prefix parts by path: torch's measured SDPA estimate,
    the compiled kernel's self-reported scratch (over Q: only the GEMMs' excess counts), and the
    Triton kernel's nothing, with no prefix gathered."""
    spec, _ = model
    members = [(37, 0), (13, 19)]
    shape = AttentionShape(torch.float32, spec.head_dim, spec.num_heads, spec.num_kv_heads)
    for backend in ("sdpa", "cpu_flash"):
        kernels = KernelBackend(CPU, torch.float32, spec.head_dim, backend)
        path = kernels.attention_path
        parts = batch_peak_components(spec, members, 16, kernels)
        assert parts["attention"] == path.scratch_bytes(shape, members, {0}, 0.0, False)
        assert parts["prefix_gather"] == 4 * 2 * 19 * spec.kv_width
    assert TorchAttention("sdpa").scratch_bytes(shape, members, {0}, 0.0, False) == 6 * 50 * spec.q_width + (2 << 20)
    kernels = KernelBackend(CPU, torch.float32, spec.head_dim, "sdpa")
    object.__setattr__(kernels, "attention_path", TritonAttention(CPU))  # its facts, without a GPU
    parts = batch_peak_components(spec, members, 16, kernels)
    assert parts["attention"] == 0 and parts["prefix_gather"] == 0 and kernels.writes_over_q


def test_a_backend_that_takes_no_model_falls_through_to_torch(toy_registered):
    k = KernelBackend(CPU, torch.float64, 64, "cpu_flash")  # the compiled kernel takes no float64
    assert k.attention_path.name == "torch" and k.attention_path.backend == "sdpa"


def test_the_executor_gets_one_gemm_per_backend(model):
    spec, weights = model
    assert KernelBackend(CPU, torch.float32, spec.head_dim, "sdpa", "aten").gemm is aten_linear
    if why_onednn_unavailable("cpu", torch.float32) is None:
        kernels = KernelBackend(CPU, torch.float32, spec.head_dim, "sdpa", "onednn")
        assert kernels.gemm is onednn_linear
        packed = pack(weights.layers[0].wo, "onednn")
        assert pack(packed, "onednn") is packed  # packed once
        with pytest.raises(ValueError, match="packed for oneDNN cannot run on the 'aten'"):
            pack(packed, "aten")  # aten's gemm never looks at the layout: refused at load

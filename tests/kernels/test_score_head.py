"""The score head (src/kernels/score_head.py, cpu_score_head.h): float32 logits of bf16 rows and a
bf16 LM head, against float64, on every ISA path this CPU runs (a path it lacks is reported as
skipped, never as passed); the same bits for a row alone or in a batch; the choice per dtype and
device, and the fall-back when a head fails its self-check."""

from __future__ import annotations

import pytest
import torch

from prefillonly.kernels import cpu_ext, score_head
from prefillonly.kernels.backend import KernelBackend

CPU = torch.device("cpu")
ISAS = ("amx_bf16", "avx512_bf16", "avx512_pairs", "avx512", "avx2_pairs", "avx2")  # AMX tiles, and every kIsas entry's ISA


@pytest.fixture(scope="module")
def kernel():
    module = cpu_ext.load_attention()
    assert module is not None, cpu_ext.why_attention_unavailable()  # gcc and AVX2 on every host this suite runs on
    return module


def _supported(kernel) -> list[str]:
    return (["amx_bf16"] if kernel.amx_bf16() else []) + kernel.supported_isas()


@pytest.fixture(params=ISAS)
def isa(request, kernel):
    if request.param not in _supported(kernel):
        pytest.skip(f"this CPU lacks the {request.param} instructions: that path was not run")
    return request.param


def _operands(rows, k, vocab, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, k, generator=g)).bfloat16(), (scale * torch.randn(vocab, k, generator=g)).bfloat16()


def _float32_sum_bound(x, w) -> torch.Tensor:
    """What float32 summation may add to exact bf16 products: k units of 2^-24 of sum |x||w|."""
    return x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())


# rows 1 (a scored prompt), 3 and 5 (tile remainders), 64 (a span block), 100; k with a tail of
# pairs (66, 98), SmolLM2's 576, an 8B model's 4096; vocabularies not a multiple of the tile
@pytest.mark.parametrize("rows,k,vocab", [(1, 576, 1001), (3, 66, 301), (5, 98, 37), (64, 576, 515), (100, 64, 300),
                                          (2, 4096, 77), (7, 2, 9)])
def test_kernel_sums_exact_products_in_float32(kernel, isa, rows, k, vocab):
    x, w = _operands(rows, k, vocab, seed=rows * 1000 + k)
    out = torch.full((rows, vocab), float("nan"))
    kernel.score_head(x, w, out, isa)
    want = x.double() @ w.double().t()
    assert torch.all((out.double() - want).abs() <= _float32_sum_bound(x, w)), isa


def test_kernel_keeps_what_bf16_logits_would_round_away(kernel, isa):
    # logits near 16 (a confident reranker): bf16 steps there are 0.0625-0.125
    x, w = _operands(8, 576, 64, seed=3, scale=0.4)
    out = torch.empty(8, 64)
    kernel.score_head(x, w, out, isa)
    bf16_rounded = out.bfloat16().float()
    assert out.abs().max() > 8 and (out - bf16_rounded).abs().max() > 1e-3
    assert len(set(out.flatten().tolist())) > len(set(bf16_rounded.flatten().tolist()))


def test_a_row_has_the_same_bits_alone_and_in_a_batch(kernel, isa):
    x, w = _operands(11, 576, 2000, seed=9)
    batch = torch.empty(11, 2000)
    kernel.score_head(x, w, batch, isa)
    for r in (0, 4, 10):
        alone = torch.empty(1, 2000)
        kernel.score_head(x[r : r + 1].clone(), w, alone, isa)
        assert torch.equal(alone[0], batch[r]), r


def test_kernel_refuses_what_it_cannot_read(kernel):
    x, w = _operands(2, 64, 10, seed=1)
    with pytest.raises(RuntimeError, match="bfloat16 x and w"):
        kernel.score_head(x.float(), w, torch.empty(2, 10), "avx2")
    with pytest.raises(RuntimeError, match="shapes"):
        kernel.score_head(x, w[:, :32], torch.empty(2, 10), "avx2")
    with pytest.raises(RuntimeError, match="k even"):
        kernel.score_head(x[:, :63], w[:, :63], torch.empty(2, 10), "avx2")


@pytest.mark.parametrize("head", ["cpu_amx", "cpu_pairs", "upcast"])
def test_heads_on_views_and_gathered_rows(kernel, head):
    if head == "cpu_amx" and not kernel.amx_bf16():
        pytest.skip("this CPU (or the OS) gives no AMX-BF16 tiles: the cpu_amx head was not run")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 130, generator=g).bfloat16()[:, 1:-1]  # rows that are views, 2 bytes off alignment
    w = torch.randn(4999, 129, generator=g).bfloat16()[:, :128]  # the upcast head's blocks and a row stride of its own
    got = score_head.logits(head, x, w if head == "upcast" else w.contiguous())
    assert got.dtype == torch.float32 and got.shape == (9, 4999)
    assert torch.all((got.double() - x.double() @ w.double().t()).abs() <= 2 * _float32_sum_bound(x, w))


def test_choice_per_dtype_and_setting(kernel):
    assert score_head.choose(CPU, torch.float32) == "linear"
    assert score_head.choose(CPU, torch.float64) == "linear"
    assert score_head.choose(CPU, torch.bfloat16, "model") == "linear"
    best = "cpu_amx" if kernel.amx_bf16() else "cpu_pairs"
    assert score_head.choose(CPU, torch.bfloat16) == best
    assert KernelBackend(CPU, torch.bfloat16, 64, "sdpa").score_head == best  # the default where none is named
    with pytest.raises(ValueError, match="head_dtype"):
        score_head.choose(CPU, torch.bfloat16, "float16")


def test_a_head_that_fails_its_self_check_is_not_used(monkeypatch):
    # a real failure: torch's CPU build has no float32-output mm (the CUDA head)
    assert "Error" in score_head._self_check("out_dtype", "cpu", torch.bfloat16)
    monkeypatch.setattr(score_head, "_candidates", lambda device_type, dtype: ["out_dtype"])
    assert score_head.choose(CPU, torch.bfloat16) == "upcast"
    monkeypatch.undo()
    monkeypatch.setattr(cpu_ext, "load_attention", lambda: None)  # no compiled kernels (no compiler, or switched off)
    assert score_head._candidates("cpu", torch.bfloat16) == []
    assert score_head.choose(CPU, torch.bfloat16) == "upcast"


def test_a_wrong_head_fails_its_self_check(monkeypatch):
    real = score_head.logits
    monkeypatch.setattr(score_head, "logits", lambda head, x, w: real(head, x, w).bfloat16().float())  # bf16-rounded
    score_head._self_check.cache_clear()
    try:
        assert "max difference" in score_head._self_check("cpu_pairs", "cpu", torch.bfloat16)
        monkeypatch.setattr(score_head, "_candidates", lambda device_type, dtype: ["cpu_amx", "cpu_pairs"])
        assert score_head.choose(CPU, torch.bfloat16) == "upcast"  # every candidate failed
    finally:
        score_head._self_check.cache_clear()


@pytest.mark.parametrize("head,extra", [("linear", 2), ("cpu_pairs", 0), ("cpu_amx", None), ("upcast", None)])
def test_call_bytes_count_the_float32_logits_and_what_the_head_adds(head, extra):
    rows, hidden, vocab = 3, 576, 49152
    got = score_head.call_bytes(head, rows, hidden, vocab, element_size=2)
    if head == "cpu_amx":
        assert got == 4 * rows * vocab + 2 * 16 * hidden  # x packed in pairs, one group of 16 rows
    elif extra is None:
        assert got == 4 * rows * vocab + 4 * rows * hidden + 4 * 4096 * hidden
    else:
        assert got == (4 + extra) * rows * vocab


@pytest.mark.parametrize("head", ["cpu_amx", "cpu_pairs"])
def test_call_bytes_of_an_odd_hidden_size_are_the_upcast_heads(head):
    # logits() runs such a weight on the upcast path: the prediction counts that path's rows and block
    assert score_head.call_bytes(head, 3, 65, 40, element_size=2) == score_head.call_bytes("upcast", 3, 65, 40, element_size=2)


def test_amx_tiles_and_avx512_agree_to_float32_summation(kernel):
    """The two CPU heads sum the same exact products in different orders: they differ by rounding only,
    and a vocabulary that is no multiple of the tiles' 32 rows gets its last rows from the AVX-512 path."""
    if not kernel.amx_bf16():
        pytest.skip("this CPU (or the OS) gives no AMX-BF16 tiles: the cpu_amx head was not run")
    x, w = _operands(19, 130, 101, seed=12)
    tiles, pairs = torch.empty(19, 101), torch.empty(19, 101)
    kernel.score_head(x, w, tiles, "amx_bf16")
    kernel.score_head(x, w, pairs, "avx512_pairs")
    assert torch.all((tiles.double() - pairs.double()).abs() <= 2 * _float32_sum_bound(x, w))


@pytest.mark.parametrize("head", ["cpu_amx", "cpu_pairs"])
def test_an_odd_hidden_size_is_still_scored_exactly(kernel, head):
    """The CPU kernels read bf16 pairs; a weight with an odd row length takes the upcast path instead
    of failing the request."""
    x, w = _operands(3, 65, 40, seed=8)
    got = score_head.logits(head, x, w)
    assert torch.all((got.double() - x.double() @ w.double().t()).abs() <= 2 * _float32_sum_bound(x, w))

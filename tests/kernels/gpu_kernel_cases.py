"""The Triton-language kernels against float64 references and the torch path.

Not collected by the main run (no test_ prefix): tests/kernels/test_gpu_kernels.py runs this file
in a subprocess, under Triton's interpreter on CPU (TRITON_INTERPRET=1 must be set before the
kernels are defined, i.e. before they are imported) and natively on CUDA when a GPU is present.
The interpreter has no bfloat16 (numpy), so it runs float16, which is the same kernel code;
bfloat16 runs where CUDA does.
"""

from __future__ import annotations

import os

import pytest
import torch

from prefillonly.cache.prefix_cache import PrefixCache
from prefillonly.worker.executor import ForwardBatch, HybridPrefillExecutor, Sequence
from prefillonly.kernels.backend import KernelBackend
from prefillonly.kernels.gpu_selfcheck import ATTENTION_KERNELS, OP_KERNELS, ModelShapes
from prefillonly.kernels import gpu_support
from prefillonly.kernels.attention import banded_attention, causal_attention, resolve_backend
from prefillonly.kernels.gpu_attention import BatchLayout, prefill_attention
from prefillonly.kernels import gpu_ops
from prefillonly.model.spec import ModelSpec
from prefillonly.model.weights import ModelWeights

from ..conftest import FAMILY_CONFIGS, make_random_model
from ..reference import attention_float64, hf_logprobs, load_hf, max_abs

INTERPRETED = gpu_support.interpreting()
DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")
DTYPES = [torch.float16] if DEVICE.type == "cpu" else [torch.float16, torch.bfloat16]
# one rounding of the output in these dtypes, plus float32 accumulation over <= ~1,000 keys
ATTN_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

pytestmark = pytest.mark.skipif(not gpu_support.runs_on(DEVICE), reason="needs CUDA, or TRITON_INTERPRET=1 on CPU")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _pool(gen, slots, hkv, page, d, dtype):
    return _randn(gen, slots, hkv, page, d, dtype=dtype), _randn(gen, slots, hkv, page, d, dtype=dtype)


def _batch(gen, members, hq, hkv, d, page, dtype, slots=64):
    """members = [(new, prefix, paged?)]: packed Q/K/V, pages, a block table, and per member
    its full K/V ([Hkv, prefix + new, d]: the pages' rows first where paged) for the reference."""
    rows = sum(n for n, _, _ in members)
    kv_rows = sum(n + p for n, p, _ in members)
    q, k, v = (_randn(gen, h, r, d, dtype=dtype) for h, r in ((hq, rows), (hkv, kv_rows), (hkv, kv_rows)))
    kp, vp = _pool(gen, slots, hkv, page, d, dtype)
    perm = torch.randperm(slots, generator=gen)
    max_blocks = max([-(-p // page) for _, p, _ in members] + [1])
    table = torch.zeros((len(members), max_blocks), dtype=torch.int32, device=DEVICE)
    q_starts, kv_starts, fulls, used = [], [], [], 0
    r = a = 0
    for i, (n, p, paged) in enumerate(members):
        kk, vv = k[:, a : a + p + n].clone(), v[:, a : a + p + n].clone()
        if paged and p:
            nb = -(-p // page)
            sl = perm[used : used + nb].to(DEVICE)
            used += nb
            table[i, :nb] = sl.int()
            kk[:, :p] = kp[sl].transpose(0, 1).reshape(hkv, -1, d)[:, :p]
            vv[:, :p] = vp[sl].transpose(0, 1).reshape(hkv, -1, d)[:, :p]
        q_starts.append(r)
        kv_starts.append(a)
        fulls.append((kk, vv))
        r, a = r + n, a + p + n
    layout = BatchLayout(q_starts, [n for n, _, _ in members], kv_starts, [n + p for n, p, _ in members],
                         [p if paged else 0 for _, p, paged in members], DEVICE)
    return q, k, v, (kp, vp, table), layout, fulls


def _check_batch(members, hq, hkv, d, page, dtype, tiles=None, seed=0, window=0, softcap=0.0):
    gen = _gen(seed)
    q, k, v, pages, layout, fulls = _batch(gen, members, hq, hkv, d, page, dtype)
    scale = d ** -0.5
    out = prefill_attention(q, k, v, torch.empty_like(q), layout, scale, pages, tiles=tiles, window=window, softcap=softcap)
    for (n, _, _), start, (kk, vv) in zip(members, layout.q_start.tolist(), fulls):
        want = attention_float64(q[:, start : start + n].cpu(), kk.cpu(), vv.cpu(), scale, window=window, softcap=softcap)
        got = out[:, start : start + n].cpu()
        assert max_abs(got, want) <= ATTN_TOL[dtype], (members, hq, hkv, d, page, tiles, window, softcap)
        # and the torch path on the same inputs (SDPA, or the explicit banded path: the fallbacks the engine would use)
        if window or softcap:
            torch_path = banded_attention(q[:, start : start + n], kk, vv, scale, window=window, softcap=softcap).cpu()
        else:
            torch_path = causal_attention(q[:, start : start + n], kk, vv, scale, "sdpa").cpu()
        assert max_abs(got, torch_path) <= 2 * ATTN_TOL[dtype]
    return q, k, v, pages, layout, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("new", [1, 7, 63, 64, 65])
@pytest.mark.parametrize("prefix", [0, 1, 15, 48])  # 15 = block - 1 of 16-token pages, 48 = 3 blocks
def test_attention_lengths_and_prefixes(new, prefix, dtype):
    for paged in ((False, True) if prefix else (False,)):
        _check_batch([(new, prefix, paged)], hq=4, hkv=1, d=64, page=16, dtype=dtype, seed=new * 100 + prefix)


def test_attention_every_prefix_offset():
    """Prefix lengths 0..33 with 16-key tiles: every residue of the diagonal against the tile
    grid (the unmasked/masked split is right at each), loaded and paged prefixes alike."""
    for p in range(34):
        _check_batch([(20, p, p % 2 == 1), (3, 33 - p, p % 3 == 0)], hq=2, hkv=1, d=16, page=16, dtype=torch.float16,
                     tiles=(16, 16, 1, 1), seed=p)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 1), (8, 2)])  # GQA groups 1, 4, 8, 4
@pytest.mark.parametrize("d", [16, 64, 128])
def test_attention_gqa_and_head_dims(hq, hkv, d):
    _check_batch([(33, 20, True), (5, 0, False)], hq, hkv, d, page=16, dtype=torch.float16, seed=hq * 10 + d)


def test_attention_long_sequence_several_tiles():
    """1,000 new queries after a 130-token paged prefix (64-token pages, not a tile multiple)."""
    _check_batch([(1000, 130, True)], hq=4, hkv=1, d=64, page=64, dtype=torch.float16, tiles=(64, 64, 4, 2))


@pytest.mark.parametrize("tiles", [(16, 16, 1, 1), (32, 16, 1, 1), (16, 64, 1, 1)])
def test_attention_packed_batch_any_tiles(tiles):
    """A mixed batch (cold, warm paged, warm loaded, fully cached but one) in one launch; tiles
    smaller and larger than the 16-token pages."""
    members = [(7, 0, False), (40, 33, True), (1, 47, True), (20, 16, False), (65, 64, True)]
    _check_batch(members, hq=4, hkv=2, d=32, page=16, dtype=torch.float16, tiles=tiles, seed=sum(tiles))


def test_attention_in_place_over_q_equals_out_of_place():
    members = [(70, 20, True), (9, 0, False), (33, 5, False)]
    q, k, v, pages, layout, out = _check_batch(members, hq=8, hkv=2, d=64, page=16, dtype=torch.float16, seed=5)
    prefill_attention(q, k, v, q, layout, 64 ** -0.5, pages)
    assert torch.equal(q, out)


@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])  # 1000: longer than any sequence here
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_attention_sliding_window_and_softcap(window, softcap):
    """Windows against the 16-key tile grid and the 16-token pages: prefixes crossing the window's
    edge (paged and loaded), far past it (whole key tiles skipped), a packed mixed batch, GQA."""
    members = [(7, 0, False), (40, 33, True), (1, 47, True), (20, 16, False), (65, 64, True), (30, 50, False)]
    _check_batch(members, hq=4, hkv=2, d=32, page=16, dtype=torch.float16, tiles=(16, 16, 1, 1), seed=window,
                 window=window, softcap=softcap)


def test_attention_window_never_reads_keys_before_it():
    """K/V of positions no query's window reaches (workspace and paged) are never loaded: NaNs
    there leave every output finite and equal."""
    members = [(20, 60, True), (25, 70, False)]
    q, k, v, pages, layout, out = _check_batch(members, hq=2, hkv=1, d=16, page=16, dtype=torch.float16,
                                               tiles=(16, 16, 1, 1), seed=3, window=8)
    kp, vp, table = pages
    for i, (n, p, paged) in enumerate(members):
        first = p - 8 + 1  # the first key the first query sees
        if paged:
            kp[table[i, : first // 16].long()] = float("nan")  # whole pages before the window
            vp[table[i, : first // 16].long()] = float("nan")
        else:
            a = layout.kv_start[i].item()
            k[:, a : a + first], v[:, a : a + first] = float("nan"), float("nan")
    again = prefill_attention(q, k, v, torch.empty_like(q), layout, 16 ** -0.5, (kp, vp, table), tiles=(16, 16, 1, 1), window=8)
    assert torch.equal(again, out)


def test_attention_rejects_bad_layouts():
    gen = _gen(1)
    q = _randn(gen, 3, 5, 64, dtype=torch.float16)
    k = _randn(gen, 2, 5, 64, dtype=torch.float16)
    layout = BatchLayout([0], [5], [0], [5], [0], DEVICE)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        prefill_attention(q, k, k, q, layout, 0.1)
    paged = BatchLayout([0], [5], [0], [5], [2], DEVICE)
    with pytest.raises(ValueError, match="no pages"):
        prefill_attention(q[:2], k, k, q[:2], paged, 0.1)


# -- per-token kernels ---------------------------------------------------------------------------
def _norm64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("rows,n", [(1, 64), (13, 100), (64, 576)])
def test_rms_norm_and_add_rms_norm(rows, n):
    gen = _gen(rows)
    dtype = DTYPES[-1]
    tol = 2 * ATTN_TOL[dtype]  # one output rounding of values ~ +-4
    x, delta = _randn(gen, rows, n, dtype=dtype), _randn(gen, rows, n, dtype=dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(DEVICE)
    out = torch.empty_like(x)
    gpu_ops.rms_norm(out, x, w, 1e-5)
    assert max_abs(out.cpu(), _norm64(x.cpu(), w.cpu(), 1e-5)) <= tol
    h = x.clone()
    gpu_ops.add_rms_norm(h, delta, w, 1e-5, out)
    assert torch.equal(h, x + delta)  # rounded as torch's add_ rounds
    assert max_abs(out.cpu(), _norm64(h.cpu(), w.cpu(), 1e-5)) <= tol


@pytest.mark.parametrize("hq,hkv,hd", [(4, 2, 24), (4, 4, 64), (8, 1, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_qkv(hq, hkv, hd, qk_norm):
    gen = _gen(hd)
    dtype, n, off = DTYPES[-1], 19, 3
    qkv = _randn(gen, n, (hq + 2 * hkv) * hd, dtype=dtype)
    ang = torch.rand(n, hd // 2, generator=gen) * 50
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    norms = ((torch.rand(hd, generator=gen) + 0.5).to(DEVICE), (torch.rand(hd, generator=gen) + 0.5).to(DEVICE), 1e-6)
    q_dst = torch.zeros(hq, n, hd, dtype=dtype, device=DEVICE)
    k_buf = torch.zeros(hkv, n + 2 * off, hd, dtype=dtype, device=DEVICE)  # a segment in the middle of a buffer
    v_buf = torch.zeros_like(k_buf)
    gpu_ops.rope_qkv(q_dst, k_buf[:, off : off + n], v_buf[:, off : off + n], qkv, cos, sin, hq, hkv,
                        norms if qk_norm else None)

    def rotated(x, w):  # x [n, H, hd] -> [H, n, hd] float64
        x = x.cpu().double()
        if w is not None:
            x = _norm64(x, w.cpu(), 1e-6)
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        c, s = cos.cpu().double()[:, None], sin.cpu().double()[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], -1).transpose(0, 1)

    q = qkv[:, : hq * hd].view(n, hq, hd)
    k = qkv[:, hq * hd : (hq + hkv) * hd].view(n, hkv, hd)
    v = qkv[:, (hq + hkv) * hd :].view(n, hkv, hd)
    tol = 3 * ATTN_TOL[dtype] if qk_norm else 2 * ATTN_TOL[dtype]
    assert max_abs(q_dst.cpu(), rotated(q, norms[0] if qk_norm else None)) <= tol
    assert max_abs(k_buf[:, off : off + n].cpu(), rotated(k, norms[1] if qk_norm else None)) <= tol
    assert torch.equal(v_buf[:, off : off + n], v.transpose(0, 1))
    assert not k_buf[:, :off].any() and not k_buf[:, off + n :].any()  # nothing written outside the segment


@pytest.mark.parametrize("rows,f", [(1, 16), (9, 37), (5, 1500)])
def test_swiglu(rows, f):
    gen = _gen(f)
    dtype = DTYPES[-1]
    gu = _randn(gen, rows, 2 * f, dtype=dtype)
    before = gu.clone()
    out = torch.empty(rows, f, dtype=dtype, device=DEVICE)
    gpu_ops.swiglu(out, gu)
    want = torch.nn.functional.silu(gu[:, :f].cpu().double()) * gu[:, f:].cpu().double()
    assert max_abs(out.cpu(), want) <= 2 * ATTN_TOL[dtype]
    assert torch.equal(gu, before)


# -- the executor on the Triton path ---------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (cls, kwargs) in FAMILY_CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        make_random_model(cls, kwargs).save_pretrained(folder)
        out[name] = str(folder)
    return out


def _executor(folder, dtype, backend="triton"):
    spec = ModelSpec.from_folder(folder)
    return HybridPrefillExecutor(spec, ModelWeights.load(folder, spec, dtype, DEVICE), KernelBackend(DEVICE, dtype, spec.head_dim, backend))


def _ids(gen, vocab, n):
    return torch.randint(0, vocab, (n,), generator=gen)


def test_backend_resolution():
    assert resolve_backend("triton", DEVICE) == "triton"
    if DEVICE.type == "cuda":
        assert resolve_backend("auto", DEVICE) == "triton"
    path = lambda dtype, head_dim: KernelBackend(DEVICE, dtype, head_dim, "triton").attention_path.name  # noqa: E731
    assert path(torch.float16, 64) == "triton"
    assert path(torch.float32, 64) == "torch"  # float32 runs on the torch ops
    assert path(torch.float16, 24) == "torch"  # not a power of two: SDPA
    assert KernelBackend(DEVICE, torch.float16, 64, "triton").ops.name == "triton"  # the fused per-token kernels too


@pytest.mark.parametrize("window", [0, 5])
def test_the_triton_path_attends_one_sequence_over_q(window):
    """The path object's one-sequence entry (a batch of one, its prefix in k/v): over q, as the
    float64 reference; and the memory facts memory.py reads from it."""
    path = KernelBackend(DEVICE, torch.float16, 64, "triton").attention_path
    assert path.writes_over_q and path.reads_prefix_in_place
    gen = _gen(31 + window)
    q = _randn(gen, 4, 13, 64, dtype=torch.float16)
    k, v = (_randn(gen, 2, 21 + 13, 64, dtype=torch.float16) for _ in range(2))
    want = attention_float64(q.cpu(), k.cpu(), v.cpu(), 0.125, window=window)
    got = path.attend(q, k, v, 0.125, window=window)
    assert got.data_ptr() == q.data_ptr() and max_abs(got.cpu(), want) <= ATTN_TOL[torch.float16]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_executor_within_transformers_own_error(family, folders):
    """Our forward on the Triton path (every family; Qwen3's head_dim 24 attends on SDPA but
    norms and rotates in the fused kernel) against transformers in float64, no worse than
    transformers' own forward in the same dtype."""
    dtype = DTYPES[-1]
    ex = _executor(folders[family], dtype)
    ref64, ref_low = load_hf(folders[family], torch.float64), load_hf(folders[family], dtype)
    if DEVICE.type == "cuda":
        ref_low = ref_low.to(DEVICE)
    gen = _gen(len(family))
    ours_err = hf_err = 0.0
    for n, chunks in ((1, (None,)), (17, (7, None)), (130, (None,))):  # few launches: the interpreter is slow
        ids = _ids(gen, ex.spec.vocab_size, n)
        want = hf_logprobs(ref64, ids.tolist())
        hf_err = max(hf_err, max_abs(_hf_low(ref_low, ids), want))
        for chunk in chunks:
            got = ex.forward(ids, chunk).logits.double().log_softmax(-1).cpu()
            ours_err = max(ours_err, max_abs(got, want))
    assert ours_err <= 1.5 * hf_err + 1e-3, f"{family}: ours {ours_err:.4f} vs transformers {hf_err:.4f}"


@torch.inference_mode()
def _hf_low(model, ids):
    out = model(ids[None].to(next(model.parameters()).device), logits_to_keep=1, use_cache=False)
    return out.logits[0, -1].double().log_softmax(-1).cpu()


def test_executor_triton_equals_torch_path(folders):
    """Same weights, same dtype: the Triton path against the torch ops (PREFILLONLY_TRITON_KERNELS=0)."""
    ex = _executor(folders["llama_gqa_llama3rope_untied"], DTYPES[-1])
    ids = _ids(_gen(9), ex.spec.vocab_size, 150)
    fast = ex.forward(ids, 64).logits.double().log_softmax(-1)
    os.environ["PREFILLONLY_TRITON_KERNELS"] = "0"
    try:
        slow = _executor(folders["llama_gqa_llama3rope_untied"], DTYPES[-1], "sdpa").forward(ids, 64).logits.double().log_softmax(-1)
    finally:
        del os.environ["PREFILLONLY_TRITON_KERNELS"]
    assert max_abs(fast, slow) <= 0.05


def _begin(cache: PrefixCache, ids: torch.Tensor, kept_blocks: int):
    """A prompt's cache ticket as the engine begins one (the index pins and reserves, the cache
    executes the moves) and the executor's view of it (PrefixCache.access); commit with
    cache.index.commit(ticket)."""
    ticket, moves = cache.index.begin(cache.hashes(ids.tolist(), None), len(ids), kept_blocks)
    cache.execute(moves)
    return ticket, cache.access(ticket)


def test_warm_requests_read_the_pool_in_place_batched(folders, monkeypatch):
    """Prefixes cached in a real PrefixCache: a batch of warm requests whose attention reads the
    pool's blocks in place (no load, and no workspace rows for them) equals each prompt computed
    whole, and so does a request whose prefix is a captured PrefixKV (loaded) in the same batch.
    The memory prediction of the pooled requests' step plans no prefix rows either."""
    from prefillonly.worker import executor as executor_module
    from prefillonly.worker.memory import batch_peak_components
    from prefillonly.worker.workspace import plan_workspace

    real_allocate = executor_module.allocate
    folder = folders["llama_gqa_llama3rope_untied"]
    ex = _executor(folder, DTYPES[-1])
    spec, gen = ex.spec, _gen(11)
    cache = PrefixCache(spec, DTYPES[-1], DEVICE, block_size=16, budget_bytes=64 << 20)
    prompts = [_ids(gen, spec.vocab_size, n) for n in (50, 33, 70)]
    for ids in prompts:  # cold: computes and keeps every whole block
        t, view = _begin(cache, ids, len(ids) // cache.block_size)
        ex.forward(ids, None, prefix=view.source, sink=view.sink)
        cache.index.commit(t)
    loads = []
    seqs, wholes, tickets = [], [], []
    for ids in prompts:
        longer = torch.cat([ids, _ids(gen, spec.vocab_size, 11)])
        t, view = _begin(cache, longer, 0)
        assert view.cached_tokens == (len(ids) // 16) * 16 and view.source.paged() is not None
        view.source.load = lambda *a, _l=loads: _l.append(a)  # must not be called: read in place
        tickets.append(t)
        seqs.append(Sequence(longer[view.cached_tokens :], prefix=view.source))
        wholes.append(ex.forward(longer, None).logits.double().log_softmax(-1))
    shared = _ids(gen, spec.vocab_size, 20)
    captured = ex.forward(shared, None, capture=(0, 20)).captured
    tail = _ids(gen, spec.vocab_size, 5)
    seqs.append(Sequence(tail, prefix=captured))
    wholes.append(ex.forward(torch.cat([shared, tail]), None).logits.double().log_softmax(-1))
    plans = []
    monkeypatch.setattr(executor_module, "allocate", lambda plan, device: plans.append(plan) or real_allocate(plan, device))
    out = ex.forward_batch(ForwardBatch(seqs), 24).logits.double().log_softmax(-1)
    assert not loads
    # the workspace holds the new rows and the captured (loaded) prefix, no row of a pooled prefix
    new_rows = sum(s.new_tokens for s in seqs)
    assert plans[-1].shapes["k"][0][1] == new_rows + 20 == plans[-1].prefix_tokens + plans[-1].new_tokens
    members = [(s.new_tokens, s.prefix_tokens) for s in seqs[:-1]]
    predicted = batch_peak_components(spec, members, 24, ex.kernels)["workspace"]
    assert predicted == plan_workspace(spec, sum(n for n, _ in members), 24, DTYPES[-1], 0,
                                       fp32_scratch=ex.kernels.norm_scratch(spec.qk_norm)).nbytes()
    for i, whole in enumerate(wholes):
        assert max_abs(out[i], whole) <= 0.05, i
    for t in tickets:
        cache.index.commit(t)


# -- the start-up self-check and its fallback (kernels/gpu_selfcheck.py) ---------------------------
SHAPES = ModelShapes(hidden=256, intermediate=384, window=10, softcap=2.0, qk_norm=True)


def _choose(shapes=SHAPES, attention="triton"):
    return KernelBackend.choose(DEVICE, DTYPES[-1], 64, 4, 2, attention, "aten", model=shapes)


def test_self_check_passes_the_kernels_and_keeps_them():
    for shapes in (SHAPES, ModelShapes(hidden=576, intermediate=1536)):
        kernels = _choose(shapes)
        check = kernels.self_check
        assert check is not None and not check.failed, check.summary()
        sliding = {"attention_sliding"} if shapes.window else set()  # only where the model has a window
        assert {v.kernel for v in check.verdicts} == set(ATTENTION_KERNELS) - {"attention_sliding"} | sliding | set(OP_KERNELS)
        assert kernels.attention == "triton" and kernels.ops.name == "triton" and not kernels.on_torch


def _torch_path_logprobs(folder, ids):
    os.environ["PREFILLONLY_TRITON_KERNELS"] = "0"
    try:
        return _executor(folder, DTYPES[-1], "sdpa").forward(ids, 64).logits.double().log_softmax(-1)
    finally:
        del os.environ["PREFILLONLY_TRITON_KERNELS"]


def _checked_executor(folder):
    spec = ModelSpec.from_folder(folder)
    shapes = ModelShapes.of(spec)
    kernels = KernelBackend.choose(DEVICE, DTYPES[-1], spec.head_dim, spec.num_heads, spec.num_kv_heads, "triton", "aten",
                                   model=shapes)
    return HybridPrefillExecutor(spec, ModelWeights.load(folder, spec, DTYPES[-1], DEVICE), kernels)


def test_a_wrong_op_kernel_falls_back_to_torch_and_the_answer_is_right(folders, monkeypatch):
    """SwiGLU's kernel made wrong by 10%: the check names it, torch runs it, the others stay fast,
    and the forward equals the torch path's."""
    real, calls = gpu_ops.swiglu, []

    def wrong(out, gate_up):
        calls.append(1)
        return real(out, gate_up).mul_(1.1)

    monkeypatch.setattr(gpu_ops, "swiglu", wrong)
    folder = folders["llama_gqa_llama3rope_untied"]
    ex = _checked_executor(folder)
    check = ex.kernels.self_check
    assert check.failed == {"swiglu"} and "swiglu (max error" in check.summary(), check.summary()
    assert ex.kernels.on_torch == {"swiglu"} and ex.kernels.attention == "triton" and ex.kernels.ops.name == "triton"
    ids, checked_calls = _ids(_gen(21), ex.spec.vocab_size, 40), len(calls)
    fast = ex.forward(ids, 16).logits.double().log_softmax(-1)
    assert len(calls) == checked_calls, "the failed kernel ran after the check"
    assert max_abs(fast, _torch_path_logprobs(folder, ids)) <= 0.05


def test_a_raising_attention_kernel_falls_back_to_sdpa_and_the_answer_is_right(folders, monkeypatch):
    from prefillonly.kernels import gpu_attention

    def raising(self, *args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(gpu_attention.BatchAttention, "run", raising)
    folder = folders["llama_gqa_llama3rope_untied"]
    ex = _checked_executor(folder)
    check = ex.kernels.self_check
    assert check.failed == set(ATTENTION_KERNELS) - {"attention_sliding"}, check.summary()  # this model has no window
    assert "RuntimeError: out of resources" in check.summary()
    assert ex.kernels.attention == "sdpa" and ex.kernels.attention_path.name == "torch" and not ex.kernels.on_torch
    ids = _ids(_gen(22), ex.spec.vocab_size, 40)
    assert max_abs(ex.forward(ids, 16).logits.double().log_softmax(-1), _torch_path_logprobs(folder, ids)) <= 0.05


def test_the_engine_reports_the_check_and_answers_after_a_fallback(folders, monkeypatch):
    from prefillonly import Engine, EngineConfig

    real = gpu_ops.rms_norm
    monkeypatch.setattr(gpu_ops, "rms_norm", lambda out, x, w, eps: real(out, x, w, eps).neg_())
    folder = folders["llama_gqa_llama3rope_untied"]
    engine = Engine(EngineConfig(model=folder, dtype="float16", attention_backend="triton", linear_backend="aten",
                                 cache_budget_bytes=0, threads=1))
    try:
        assert engine.stats().kernel_check.startswith("fell back to torch: rms_norm (max error"), engine.stats().kernel_check
        ids = _ids(_gen(23), engine.spec.vocab_size, 30)
        got = engine.score(ids.tolist(), [1, 2, 3]).tokens
        want = _torch_path_logprobs(folder, ids).reshape(-1)[[1, 2, 3]]  # over the whole vocabulary, as logprob is
        assert max_abs(torch.tensor([t.logprob for t in got], dtype=torch.float64), want) <= 0.05
    finally:
        engine.close()


def test_forcing_torch_runs_no_triton_kernel_and_no_check(monkeypatch):
    monkeypatch.setenv("PREFILLONLY_TRITON_KERNELS", "0")
    kernels = _choose(attention="sdpa")
    assert kernels.self_check is None and kernels.ops.name == "torch" and kernels.attention_path.name == "torch"
    with pytest.raises(ValueError, match="PREFILLONLY_TRITON_KERNELS=0"):
        _choose(attention="triton")


# -- offsets past 2^31 elements ---------------------------------------------------------------------
# Rows 2^30 + 64 elements apart: row 2 starts past 2^31, where a 32-bit row x stride product wraps
# (to a negative offset: a wrong or illegal address). The storage is reserved, not touched: only the
# rows read and written get pages. The largest offset checked: 3 x (2^30 + 64) + a row (~3.2e9).
_FAR = 2 ** 30 + 64


def _far_rows(gen, rows, width, dtype, far=_FAR):
    """A [rows, width] view whose rows lie `far` elements apart in one huge storage, filled."""
    base = torch.empty((rows - 1) * far + width, dtype=dtype, device=DEVICE)
    view = base.as_strided((rows, width), (far, 1))
    view.copy_(_randn(gen, rows, width, dtype=dtype))
    return view


def test_per_token_kernels_reach_rows_past_2_31_elements():
    gen, dtype = _gen(31), DTYPES[-1]
    gu = _far_rows(gen, 3, 2 * 40, dtype)
    out = gpu_ops.swiglu(torch.empty(3, 40, dtype=dtype, device=DEVICE), gu)
    want = torch.nn.functional.silu(gu[:, :40].cpu().double()) * gu[:, 40:].cpu().double()
    assert max_abs(out.cpu(), want) <= 2 * ATTN_TOL[dtype]
    x, w = _far_rows(gen, 3, 96, dtype), (torch.rand(96, generator=gen) + 0.5).to(DEVICE)
    normed = gpu_ops.rms_norm(torch.empty(3, 96, dtype=dtype, device=DEVICE), x, w, 1e-5)
    assert max_abs(normed.cpu(), _norm64(x.cpu(), w.cpu(), 1e-5)) <= 2 * ATTN_TOL[dtype]
    qkv = _far_rows(gen, 3, 4 * 32, dtype)  # 2 q heads, 1 kv head of 32
    q_dst, k_dst, v_dst = (torch.empty(h, 3, 32, dtype=dtype, device=DEVICE) for h in (2, 1, 1))
    ones = torch.ones(3, 16, device=DEVICE)
    gpu_ops.rope_qkv(q_dst, k_dst, v_dst, qkv, ones, torch.zeros_like(ones), 2, 1)  # angle 0: a copy
    assert torch.equal(q_dst.cpu(), qkv[:, :64].cpu().view(3, 2, 32).transpose(0, 1))
    assert torch.equal(v_dst.cpu(), qkv[:, 96:].cpu().view(3, 1, 32).transpose(0, 1))


def test_attention_reaches_heads_past_2_31_elements():
    """Q's heads 2^30 + 64 elements apart (head 2 starts past 2^31)."""
    gen, dtype = _gen(32), DTYPES[-1]
    q = _far_rows(gen, 4, 5 * 64, dtype).view(4, 5, 64)
    k, v = (_randn(gen, 2, 9, 64, dtype=dtype) for _ in range(2))
    want = attention_float64(q.cpu(), k.cpu(), v.cpu(), 0.125)
    got = KernelBackend(DEVICE, dtype, 64, "triton").attention_path.attend(q, k, v, 0.125)
    assert max_abs(got.cpu(), want) <= ATTN_TOL[dtype]


def test_an_engine_on_the_triton_path_keeps_and_reads_blocks_written_after_an_in_place_prefix(folders):
    """Warm requests whose prefix is read in place keep their new blocks (the sink finds them at
    their absolute positions in a segment that starts at P): a third request over both answers as
    the torch path computes the whole prompt."""
    from prefillonly import Engine, EngineConfig

    folder = folders["llama_gqa_llama3rope_untied"]
    gen = _gen(41)
    vocab = ModelSpec.from_folder(folder).vocab_size
    first = _ids(gen, vocab, 48).tolist()
    second = first + _ids(gen, vocab, 37).tolist()
    third = second + _ids(gen, vocab, 9).tolist()
    with Engine(EngineConfig(model=folder, dtype="float16", attention_backend="triton", linear_backend="aten", threads=1,
                             cache_budget_bytes=8 << 20)) as engine:
        assert engine.executor.kernels.attention_path.reads_prefix_in_place
        results = [engine.score(ids, [1, 2, 3]) for ids in (first, second, third)]
    assert [r.cached_tokens for r in results] == [0, 48, 80]  # the second request's new blocks were kept and read
    for ids, r in zip((first, second, third), results):
        want = _torch_path_logprobs(folder, torch.tensor(ids)).reshape(-1)[[1, 2, 3]]
        assert max_abs(torch.tensor([t.logprob for t in r.tokens], dtype=torch.float64), want) <= 0.05

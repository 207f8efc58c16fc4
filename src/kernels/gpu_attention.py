"""Prefill attention over a packed batch of sequences with paged cached prefixes (Triton).

One launch serves a whole ForwardBatch: cold prompts (no prefix), warm suffixes and batched
steps alike. Sequence i has q_len[i] new queries (packed rows q_start[i] ... of Q) and ctx[i]
keys: its first paged[i] keys are read in place from the prefix pool's blocks through its
block table (no copy into the workspace), the rest from its workspace K/V segment (starting
at kv_start[i], at the same absolute positions). Query m of sequence i sits at absolute
position ctx[i] - q_len[i] + m and sees keys 0 .. that position (bottom-right causal).

Layouts (strides are passed, so views work):
  q, out   [Hq, rows, D]        out may be q itself: a program reads its query tile before it
                                writes its output tile, and no other program touches those rows
  k, v     [Hkv, kv_rows, D]    the workspace's per-layer K/V (sequence segments back to back)
  pages    [slots, Hkv, B, D]   one layer of the prefix pool (kv_pool.KVPool.pages(layer), by strides)
  table    [n_seq, max_blocks]  int32 slot of each prefix block

Online softmax in float32 (exp2 with log2(e) folded into the scale), GQA by indexing (query head
h reads K/V head h // group), grid (query blocks of the longest sequence, sequences, Hq); programs
past a sequence's end return at once. Keys below every query of a tile run unmasked; only the
diagonal tiles apply the causal mask.

A sliding window (window > 0: a query at t sees keys (t - window, t] only, Gemma's local layers)
starts each query tile's key loop at the first key its first query sees, so key tiles wholly
before the window are neither loaded nor scored; those tiles then all run masked (the window's
edge moves with each query). Soft-capping (softcap > 0, Gemma 2): scaled scores s become
softcap * tanh(s / softcap) before the mask.
"""

# no `from __future__ import annotations` here: triton < 3.3 reads tl.constexpr from real annotations
import torch
import triton
import triton.language as tl

from .gpu_tuning import attention_tiles

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, kmask, visible, m_i, l_i, acc, qk_scale, softcap, MASKED: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One key tile of the online softmax: returns the updated (m_i, l_i, acc). MASKED: keys
    outside `kmask` are not loaded and scores outside `visible` drop out (both unused otherwise).
    SOFTCAP: qk_scale is the plain scale, and scores become softcap * tanh(s / softcap) * log2(e)."""
    if MASKED:
        k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without overflow trouble
        s = (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0)) * (softcap * 1.4426950408889634)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet (a window's edge tile) keeps m = -inf: subtract 0
    # there, so its probabilities are exp2(-inf) = 0 rather than NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _attend_paged_prefix(q, KP, VP, Table, seq, kvh, pos_m, offs_n0, offs_d, lo, paged, s_ps, s_ph, s_pt, s_tb, window,
                         m_i, l_i, acc, qk_scale, softcap, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                         WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """1. the paged prefix [lo, paged), read from the pool's blocks through the block table: every
    query sees all of it, within its window."""
    for n0 in range(lo, paged, BLOCK_N):
        offs_n = n0 + offs_n0
        kmask = offs_n < paged
        slot = tl.load(Table + seq * s_tb + offs_n // PAGE, mask=kmask, other=0).to(tl.int64)  # slots x page stride: 64-bit
        row = slot[:, None] * s_ps + kvh * s_ph + (offs_n % PAGE)[:, None] * s_pt + offs_d[None, :]
        visible = kmask[None, :]
        if WINDOW:
            visible = visible & (pos_m[:, None] - offs_n[None, :] < window)
        m_i, l_i, acc = _attend_tile(q, KP + row, VP + row, kmask, visible, m_i, l_i, acc, qk_scale, softcap,
                                     MASKED=True, SOFTCAP=SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _attend_workspace(q, K, V, kvh, pos_m, seg, offs_n0, offs_d, lo, paged, hi, ctx, tile_first_pos, s_kh, s_kt, window,
                      m_i, l_i, acc, qk_scale, softcap, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                      SOFTCAP: tl.constexpr):
    """2. the keys in the sequence's workspace segment [paged, hi) (tile_first_pos: the absolute
    position of the tile's first query)."""
    if WINDOW:  # the keys in the window: every tile masked (the window's edge moves per query)
        for n0 in range(tl.maximum(lo, paged), hi, BLOCK_N):
            offs_n = n0 + offs_n0
            kmask = offs_n < hi
            visible = ((offs_n[None, :] <= pos_m[:, None]) & kmask[None, :]
                       & (pos_m[:, None] - offs_n[None, :] < window))
            row = kvh * s_kh + (seg + n0)[:, None] * s_kt + offs_d[None, :]
            m_i, l_i, acc = _attend_tile(q, K + row, V + row, kmask, visible, m_i, l_i, acc, qk_scale, softcap,
                                         MASKED=True, SOFTCAP=SOFTCAP)
    else:
        # unmasked while below the tile's first query, then causal
        diag = tl.minimum(tile_first_pos + 1, ctx)  # keys < diag are visible to every query here
        n_full = paged + ((diag - paged) // BLOCK_N) * BLOCK_N
        for n0 in range(paged, n_full, BLOCK_N):
            row = kvh * s_kh + (seg + n0)[:, None] * s_kt + offs_d[None, :]
            m_i, l_i, acc = _attend_tile(q, K + row, V + row, offs_n0, offs_n0, m_i, l_i, acc, qk_scale, softcap,
                                         MASKED=False, SOFTCAP=SOFTCAP)
        for n0 in range(n_full, hi, BLOCK_N):
            offs_n = n0 + offs_n0
            kmask = offs_n < ctx
            visible = (offs_n[None, :] <= pos_m[:, None]) & kmask[None, :]
            row = kvh * s_kh + (seg + n0)[:, None] * s_kt + offs_d[None, :]
            m_i, l_i, acc = _attend_tile(q, K + row, V + row, kmask, visible, m_i, l_i, acc, qk_scale, softcap,
                                         MASKED=True, SOFTCAP=SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _prefill_attention_kernel(
    Q, K, V, Out, KP, VP, Table,
    q_start_ptr, q_len_ptr, kv_start_ptr, ctx_ptr, paged_ptr,
    s_qh, s_qt, s_kh, s_kt, s_oh, s_ot,
    s_ps, s_ph, s_pt, s_tb,
    qk_scale, window, softcap,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)  # 64-bit offsets from here: heads x rows x D passes 2^31 on long prompts
    q_len = tl.load(q_len_ptr + seq)
    if pid_m * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + seq)
    kv_start = tl.load(kv_start_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    paged = tl.load(paged_ptr + seq)
    first_pos = ctx - q_len  # absolute position of query 0 (= the prefix length)
    kvh = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n0 = tl.arange(0, BLOCK_N)
    qmask = offs_m < q_len
    rows_m = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + h * s_qh + rows_m[:, None] * s_qt + offs_d[None, :], mask=qmask[:, None], other=0.0)
    pos_m = first_pos + offs_m  # each query's absolute position

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    seg = (kv_start + offs_n0).to(tl.int64)
    hi = tl.minimum(ctx, first_pos + (pid_m + 1) * BLOCK_M)
    # with a window only keys (pos - window, pos] of some query of the tile: from its first query's
    # first key on (every prefix key is before every query, so the window is the only mask there)
    lo = tl.maximum(first_pos + pid_m * BLOCK_M - window + 1, 0) if WINDOW else 0

    m_i, l_i, acc = _attend_paged_prefix(q, KP, VP, Table, seq, kvh, pos_m, offs_n0, offs_d, lo, paged, s_ps, s_ph, s_pt,
                                         s_tb, window, m_i, l_i, acc, qk_scale, softcap, PAGE, BLOCK_N, WINDOW, SOFTCAP)
    m_i, l_i, acc = _attend_workspace(q, K, V, kvh, pos_m, seg, offs_n0, offs_d, lo, paged, hi, ctx, first_pos + pid_m * BLOCK_M,
                                      s_kh, s_kt, window, m_i, l_i, acc, qk_scale, softcap, BLOCK_N, WINDOW, SOFTCAP)

    out = acc / l_i[:, None]
    tl.store(Out + h * s_oh + rows_m[:, None] * s_ot + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=qmask[:, None])


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


class BatchLayout:
    """The per-sequence offsets of one packed batch, as device tensors, built once per forward."""

    def __init__(self, q_starts: list[int], q_lens: list[int], kv_starts: list[int], ctx_lens: list[int],
                 paged_lens: list[int], device: torch.device):
        self.n = len(q_lens)
        self.max_q = max(q_lens)
        self.q_start, self.q_len = _int32(q_starts, device), _int32(q_lens, device)
        self.kv_start, self.ctx = _int32(kv_starts, device), _int32(ctx_lens, device)
        self.paged = _int32(paged_lens, device)
        self.any_paged = any(paged_lens)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layout: BatchLayout,
                      scale: float, pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      tiles: tuple[int, int, int, int] | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of every sequence of `layout` (see the module docstring), written into `out`.

    pages = (k_pages, v_pages, table) when any sequence reads a paged prefix. `tiles` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the tuned choice (tests, the tuner).
    window > 0: a query at t sees keys (t - window, t] only; softcap > 0: soft-capped scores.
    """
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap are >= 0 (0: none), got {window} and {softcap}")
    hq, _, d = q.shape
    hkv = k.shape[0]
    for t in (q, k, v, out):
        if t.stride(-1) != 1:
            raise ValueError("prefill_attention needs unit stride in head_dim")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if layout.any_paged and pages is None:
        raise ValueError("a sequence reads a paged prefix but no pages were given")
    if pages is None:  # never read: any tensors with the right dtype
        kp = vp = k
        table = layout.paged
        s_ps = s_ph = s_pt = s_tb = 0
        page = 1
    else:
        kp, vp, table = pages
        if kp.stride() != vp.stride() or kp.stride(-1) != 1:
            raise ValueError("k and v pages need the same layout, unit stride in head_dim")
        s_ps, s_ph, s_pt = kp.stride(0), kp.stride(1), kp.stride(2)
        s_tb = table.stride(0)
        page = kp.shape[2]
    if k.stride() != v.stride():
        raise ValueError("k and v need the same strides")
    block_m, block_n, warps, stages = tiles or attention_tiles(d, q.dtype, q.device)
    grid = (triton.cdiv(layout.max_q, block_m), layout.n, hq)
    _prefill_attention_kernel[grid](
        q, k, v, out, kp, vp, table,
        layout.q_start, layout.q_len, layout.kv_start, layout.ctx, layout.paged,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        s_ps, s_ph, s_pt, s_tb,
        float(scale) * (1.0 if softcap else _LOG2E), int(window), float(softcap) or 1.0,
        GROUP=hq // hkv, PAGE=page, D=d, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=window > 0, SOFTCAP=softcap > 0,
        num_warps=warps, num_stages=stages,
    )
    return out


class BatchAttention:
    """One forward's attention on this kernel: the layout and block table built once, then
    `run(layer, q, k, v)` per layer, output over q.

    paged[i] = (pool, slots) for a sequence whose cached prefix attention reads in place from
    the pool (all from the same pool), None for one whose prefix (if any) was loaded into its
    workspace segment."""

    def __init__(self, row_starts: list[int], new_tokens: list[int], kv_starts: list[int], prefix_tokens: list[int],
                 paged: list[tuple[object, torch.Tensor] | None], scale: float, device: torch.device):
        paged_lens = [p if pg is not None else 0 for p, pg in zip(prefix_tokens, paged)]
        self.layout = BatchLayout(row_starts, new_tokens, kv_starts, [p + n for p, n in zip(prefix_tokens, new_tokens)],
                                  paged_lens, device)
        self.scale = scale
        self.pool, self.table = None, None
        used = [pg for pg in paged if pg is not None]
        if used:
            self.pool = used[0][0]
            if any(pool is not self.pool for pool, _ in used):
                raise ValueError("paged prefixes of one batch must come from one pool")
            self.table = torch.zeros((len(paged), max(s.shape[0] for _, s in used)), dtype=torch.int32, device=device)
            for i, pg in enumerate(paged):
                if pg is not None:
                    self.table[i, : pg[1].shape[0]] = pg[1].to(device=device, dtype=torch.int32)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
            softcap: float = 0.0) -> torch.Tensor:
        pages = (*self.pool.pages(layer), self.table) if self.pool is not None else None
        return prefill_attention(q, k, v, q, self.layout, self.scale, pages, window=window, softcap=softcap)

"""Peak memory, measured as docs define it: peak-RSS growth over the RSS after loading, one
fresh process per run (prefillonly.worker.memory_probe: forked from a process that only imported
the libraries, or `python -m` where an environment variable must be set before they load).

Random config with FFN = 8 x hidden, where the MLP intermediates dominate an unchunked pass.

What must hold on every host, and why these bounds:
* The prediction is never below the measured peak (admission control relies on it).
* With the compiled attention kernel (backend cpu_flash) every tensor the forward allocates is a
  buffer the prediction lists (workspace plan, the kernel's self-reported scratch, RoPE tables,
  logits). What it cannot see exactly: one page per allocation (rounding, malloc headers: the
  `pages` allowance), how much of the kernel's scratch a run touches (padding rows of short
  tasks: the `attention` part), and the forward's non-tensor allocations (Python objects,
  per-call library buffers: the `unseen` allowance, checked against a measured 16-token forward).
  Since every listed tensor is touched, over-prediction is at most the sum of those three parts,
  plus the token ids (`ids`), which the request holds but the caller builds before the measured
  forward starts (in the probe as in the engine's runner).
* Why hosts used to disagree (bf16 16K predicted 20% over the measured peak on one host, 28%
  over at 8K on an AVX2 host): (1) glibc reuse — memory freed before the request (weight
  conversion, the warm-up) stays resident in glibc's arenas once its dynamic mmap threshold has
  grown, and the request reused 4-7 MiB of it without any RSS growth, and the heap's holes moved
  the peak by +-1-2 MiB from run to run; the probe now pins the mmap threshold (every large
  buffer its own mapping), gives free heap pages back (malloc_trim) before measuring, and runs
  every thread on one malloc arena (a second thread's own arena moved the 16K bf16 peak by up to
  2.7 MiB from run to run; with one arena the spread is 0.2 MiB). (2) torch SDPA's internal
  buffers depend on which CPU path it takes on that ISA: measured here (AVX2, no AMX) ~1 B per
  query element beyond its output, where the SDPA constant was fitted on hosts that needed
  ~4. So for SDPA (the fallback) only "never below" is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from prefillonly.kernels.linear import why_onednn_unavailable
from prefillonly.worker.memory_probe import forked_probes, measure_argv

CONFIG = dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=1000, max_position_embeddings=32768)


def allowance(r: dict) -> int:
    """How far a probe's prediction may exceed its measured peak: the prediction's allowances (a
    page per allocation, attention's scratch, which is freed before the largest projection runs,
    the unseen non-tensor bytes, the ids built before the forward) and what the measurement cannot
    see: the C heap's free bytes at the start, which a forward may reuse without the RSS growing
    (measured on Gemma 3's mixed layers: 0.4-0.6 MiB, and in some runs the growth fell that much
    below the same forward's other runs)."""
    parts = r["predicted_parts"]
    return parts["pages"] + parts["attention"] + parts["unseen"] + parts["ids"] + (r["heap_free_bytes"] or 0)


class Probes:
    """The module's measurements, each in a process of its own (memory_probe.forked_probes)."""
    pool = None


@pytest.fixture(scope="module", autouse=True)
def probe_processes():
    with forked_probes() as Probes.pool:
        yield
    Probes.pool = None


def probe(tokens: int, chunk_size: int, dtype: str = "bfloat16", backend: str = "cpu_flash", config=CONFIG, *flags,
          env: dict | None = None) -> dict:
    argv = ["--tokens", str(tokens), "--chunk-size", str(chunk_size), "--dtype", dtype, "--random-config", json.dumps(config),
            "--threads", "2", "--attention-backend", backend, *flags]
    if not env:
        return Probes.pool.submit(measure_argv, argv).result(timeout=600)
    # read when the libraries load: a process started with it
    out = subprocess.run([sys.executable, "-m", "prefillonly.worker.memory_probe", *argv], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The GEMM backends that run each dtype here: aten everywhere, oneDNN with packed weights where it
# takes the dtype (not bf16 on an AVX2-only host). Each memory case runs on every one of them.
LINEARS = {dt: ["aten"] + (["onednn"] if why_onednn_unavailable("cpu", getattr(torch, dt)) is None else [])
           for dt in ("bfloat16", "float32")}


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# (tokens, chunk) per dtype. 16K tokens in float32 only: where bf16 matmuls are emulated (AVX2, AVX-512
# without BF16) a 16K bf16 forward takes minutes, and 8K already checks bf16's buffers; the float32 16K
# case checks the prediction as the length doubles.
SHAPES = {"bfloat16": [(8192, 512), (8192, 0)], "float32": [(8192, 512), (8192, 0), (16384, 512)]}


@pytest.fixture(scope="module")
def runs():
    cases = [(n, c, dt, lin) for dt, shapes in SHAPES.items() for n, c in shapes for lin in LINEARS[dt]]
    return {case: probe(*case[:3], "cpu_flash", CONFIG, "--linear-backend", case[3]) for case in cases}


def run_cases(chunked_only: bool = False):
    return [pytest.param(n, c, dt, lin, id=f"{n}-{c}-{dt}-{lin}") for dt, shapes in SHAPES.items() for n, c in shapes
            if not (chunked_only and c == 0) for lin in ("aten", "onednn")]


def linear_cases(dtypes=("bfloat16", "float32")):
    return [pytest.param(dt, lin, id=f"{dt}-{lin}") for dt in dtypes for lin in ("aten", "onednn")]


def _runs_on(linear: str, dtype: str) -> None:
    if linear not in LINEARS[dtype]:
        pytest.skip(f"linear backend {linear} does not run {dtype} here: {why_onednn_unavailable('cpu', getattr(torch, dtype))}")


@pytest.mark.parametrize("dtype,linear", linear_cases())
def test_chunking_cuts_peak_to_a_third(runs, dtype, linear):
    _runs_on(linear, dtype)
    chunked, unchunked = runs[(8192, 512, dtype, linear)]["measured_bytes"], runs[(8192, 0, dtype, linear)]["measured_bytes"]
    assert chunked <= unchunked / 3, f"chunk 512: {mib(chunked)} vs unchunked {mib(unchunked)}"


@pytest.mark.parametrize("tokens,chunk,dtype,linear", run_cases())
def test_prediction_never_below(runs, tokens, chunk, dtype, linear):
    _runs_on(linear, dtype)
    r = runs[(tokens, chunk, dtype, linear)]
    assert r["linear_backend"] == linear, r
    assert r["predicted_bytes"] >= r["measured_bytes"], f"predicted {mib(r['predicted_bytes'])}, measured {mib(r['measured_bytes'])}"


@pytest.mark.parametrize("tokens,chunk,dtype,linear", run_cases(chunked_only=True))
def test_chunked_prediction_over_by_at_most_its_allowances(runs, tokens, chunk, dtype, linear):
    """Chunked, as the engine runs by default. (Unchunked, one 8K chunk, came out ~1 MiB further
    over, 2.3 MiB of 260, on an AVX2 host; torch's own allocation trace (profiler) matched the
    plan within 0.3 MiB there, so the gap is RSS below what torch allocated, not yet explained:
    only "never below" is asserted for it.)"""
    _runs_on(linear, dtype)
    r = runs[(tokens, chunk, dtype, linear)]
    assert r["attention_backend"] == "cpu_flash" and r["heap_trimmed"] and r["mmap_pinned"], r
    over = r["predicted_bytes"] - r["measured_bytes"]
    parts = r["predicted_parts"]
    allowed = allowance(r)
    detail = f"{tokens} tokens {dtype} {linear} chunk {chunk}: predicted {mib(r['predicted_bytes'])}, measured {mib(r['measured_bytes'])}"
    assert r["small_forward_bytes"] <= parts["unseen"], f"a 16-token forward took {mib(r['small_forward_bytes'])} outside its buffers"
    assert over >= 0, detail
    assert over <= allowed, f"{detail}: over by more than the page, scratch and unseen allowances and the heap's free bytes ({mib(allowed)})"


@pytest.mark.parametrize("linear", LINEARS["bfloat16"])
def test_bf16_prediction_holds_where_onednn_emulates_bf16(linear):
    """On a CPU without a bf16 dot product (an Intel Xeon with AVX-512 but no AVX512_BF16/AMX)
    torch still sends bf16 GEMMs to oneDNN, which runs them as float32 GEMMs into a float32 copy
    of the whole output: an 8K unchunked forward peaked at 260 MiB there against 134 predicted.
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI makes oneDNN behave so on any CPU that has more (the cap
    changes nothing below it, where the prediction then expects no such buffer): the prediction
    counts those buffers (kernels.linear.call_scratch_bytes) and holds as elsewhere."""
    emulate = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
    for chunk in (0, 512):
        r = probe(8192, chunk, "bfloat16", "cpu_flash", CONFIG, "--linear-backend", linear, env=emulate)
        parts = r["predicted_parts"]
        detail = (f"emulated bf16, {linear}, chunk {chunk}: predicted {mib(r['predicted_bytes'])} "
                  f"(linear {mib(parts['linear'])}), measured {mib(r['measured_bytes'])}")
        assert r["predicted_bytes"] >= r["measured_bytes"], detail
        if chunk:
            assert r["predicted_bytes"] - r["measured_bytes"] <= allowance(r), detail


@pytest.mark.parametrize("linear", LINEARS["float32"])
def test_batched_step_prediction_never_below_and_over_by_at_most_its_allowances(linear):
    """A step of 12 sequences packed into 8,191 rows (chunk 512: chunks span sequences): its
    prediction (the batch's workspace plan, the B last rows and logits) holds like a single
    forward's."""
    r = probe(8191, 512, "float32", "cpu_flash", CONFIG, "--members", "12", "--linear-backend", linear)
    assert r["members"] == 12 and r["heap_trimmed"] and r["mmap_pinned"] and r["linear_backend"] == linear, r
    detail = f"step of 12, 8191 tokens: predicted {mib(r['predicted_bytes'])}, measured {mib(r['measured_bytes'])}"
    assert r["predicted_bytes"] >= r["measured_bytes"], detail
    assert r["predicted_bytes"] - r["measured_bytes"] <= allowance(r), detail


@pytest.mark.parametrize("linear", LINEARS["float32"])
def test_batched_logprob_spans_prediction_never_below_and_over_by_at_most_its_allowances(linear):
    """A step of 12 sequences, each with a logprob span over all its rows but its last: the spans
    run one after another (one LM-head block alive at a time) and every member's outputs stay.
    Each linear backend named (auto picks one by timing, so a case left to it differs from run to run)."""
    wide_vocab = dict(CONFIG, vocab_size=32000)
    r = probe(8192, 512, "float32", "cpu_flash", wide_vocab, "--members", "12", "--logprob-rows", "8191", "--logprob-top-k", "5",
              "--linear-backend", linear)
    assert r["members"] == 12 and r["linear_backend"] == linear, r
    detail = f"12 spans, 8192 tokens: predicted {mib(r['predicted_bytes'])} (span {mib(r['predicted_parts']['logprob_span'])}), measured {mib(r['measured_bytes'])}"
    assert r["predicted_bytes"] >= r["measured_bytes"], detail
    assert r["predicted_bytes"] - r["measured_bytes"] <= allowance(r), detail


@pytest.mark.parametrize("dtype,backend", [("float32", "cpu_flash"), ("bfloat16", "sdpa")])
def test_items_over_one_shared_prompt_prediction_never_below(dtype, backend):
    """64 items (2,560 rows) after one captured 3,000-token prompt: attention reads that prompt once
    for them all (kernels/shared_prefix.py) with its own temporaries. The workspace plans every item's
    segment with the prompt's positions, which this pass never touches (never resident): the
    prediction without them must still cover the step."""
    r = probe(2560, 512, dtype, backend, CONFIG, "--members", "64", "--shared-prefix", "3000", "--linear-backend", "aten")
    assert r["members"] == 64, r
    kv_width = CONFIG["num_key_value_heads"] * CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    untouched = 64 * 3000 * 2 * kv_width * getattr(torch, dtype).itemsize  # the prompt's positions in every segment
    rest = r["predicted_bytes"] - untouched
    detail = (f"64 items over 3000 shared: predicted {mib(r['predicted_bytes'])} less {mib(untouched)} never touched, "
              f"attention {mib(r['predicted_parts']['attention'])}; measured {mib(r['measured_bytes'])}")
    assert rest >= r["measured_bytes"], detail


def test_sdpa_prediction_never_below():
    tokens = 16384
    r = probe(tokens, 512, "bfloat16", "sdpa")
    assert r["predicted_bytes"] >= r["measured_bytes"], f"sdpa {tokens}: predicted {mib(r['predicted_bytes'])}, measured {mib(r['measured_bytes'])}"


def test_prediction_grows_with_length_and_chunk():
    import transformers
    import torch

    from prefillonly.worker.memory import predict_peak_bytes
    from prefillonly.model.spec import ModelSpec

    cfg = transformers.LlamaConfig(**CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    for backend in ("sdpa", "cpu_flash"):
        p = lambda n, c: predict_peak_bytes(spec, n, c, torch.bfloat16, attention_backend=backend)
        assert p(1000, 512) < p(2000, 512) < p(4000, 512)
        assert p(8192, 512) < p(8192, 2048) < p(8192, None)
        assert p(8192, None) == p(8192, 8192) == p(8192, 100000)


def test_attention_over_q_lowers_the_peak_and_is_predicted():
    """Writing attention over Q saves one [S, q_width] tensor: SDPA does it block by block when
    asked (--inplace-attention), the compiled kernel always. A wide q (8 heads x 64) makes that
    saving (16 MiB at 16K tokens) well above run-to-run RSS noise (a few MiB)."""
    wide = dict(CONFIG, num_attention_heads=8, head_dim=64)
    sdpa = probe(16384, 512, "float32", "sdpa", wide)  # float32: bf16 matmuls are ~10x slower on AVX2 hosts
    sdpa_inplace = probe(16384, 512, "float32", "sdpa", wide, "--inplace-attention")
    kernel = probe(16384, 512, "float32", "cpu_flash", wide)
    q_bytes = 16384 * 8 * 64 * 4
    for r in (sdpa_inplace, kernel):
        assert r["measured_bytes"] < sdpa["measured_bytes"] - q_bytes // 2
        assert r["predicted_bytes"] >= r["measured_bytes"]
    assert kernel["predicted_bytes"] - kernel["measured_bytes"] <= allowance(kernel)


# Gemma 3's mixed layers: a 512-key window on one layer, full attention on the other, two RoPE tables
GEMMA3 = dict(CONFIG, config_class="Gemma3TextConfig", architecture="Gemma3ForCausalLM", head_dim=64, query_pre_attn_scalar=64,
              layer_types=["sliding_attention", "full_attention"], sliding_window=512,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def test_mixed_layer_prediction_holds_on_the_kernel_and_the_banded_path():
    """Gemma 3 (windowed + full layers): with the compiled kernel the chunked prediction is never
    below the measured peak and over by at most its allowances, as for one layer kind; on the torch
    path (the banded fallback for the windowed layer, SDPA for the full one) never below."""
    kernel = probe(8192, 512, "float32", "cpu_flash", GEMMA3)
    detail = f"gemma3 cpu_flash: predicted {mib(kernel['predicted_bytes'])}, measured {mib(kernel['measured_bytes'])}"
    assert 0 <= kernel["predicted_bytes"] - kernel["measured_bytes"] <= allowance(kernel), detail
    torch_path = probe(8192, 512, "float32", "sdpa", GEMMA3)
    assert torch_path["predicted_bytes"] >= torch_path["measured_bytes"], (
        f"gemma3 sdpa: predicted {mib(torch_path['predicted_bytes'])}, measured {mib(torch_path['measured_bytes'])}")


def test_logprob_span_prediction_never_below_and_over_by_at_most_its_allowances():
    """A logprob span over every row of an 8K prompt with a 32K vocabulary: the LM head runs on
    LOGPROB_ROWS rows at a time (16 MiB of logits and temporaries, not 8K x 32K = 1 GiB), and the
    prediction counts that block and the outputs like the rest of the forward."""
    wide_vocab = dict(CONFIG, vocab_size=32000)
    r = probe(8192, 512, "float32", "cpu_flash", wide_vocab, "--logprob-rows", "8191", "--logprob-top-k", "5")
    parts = r["predicted_parts"]
    # the block is counted (less the layers' transients, freed before it runs)
    assert parts["logprob_span"] + parts["linear"] + parts["attention"] >= 64 * 32000 * 8, parts
    detail = f"8K span: predicted {mib(r['predicted_bytes'])} (span {mib(parts['logprob_span'])}), measured {mib(r['measured_bytes'])}"
    assert r["predicted_bytes"] >= r["measured_bytes"], detail
    assert r["predicted_bytes"] - r["measured_bytes"] <= allowance(r), detail
    plain = probe(8192, 512, "float32", "cpu_flash", wide_vocab)
    assert r["measured_bytes"] - plain["measured_bytes"] < 2 * parts["logprob_span"], (detail, mib(plain["measured_bytes"]))

"""Peak memory, measured as DESIGN.md §10 defines it (peak-RSS growth, one fresh process per run).

Random config with FFN = 8 x hidden, where the MLP intermediates dominate an unchunked pass.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CONFIG = dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=1000, max_position_embeddings=32768)


def probe(tokens: int, chunk_size: int, dtype: str = "bfloat16") -> dict:
    cmd = [sys.executable, "-m", "prefillonly.memory_probe", "--tokens", str(tokens), "--chunk-size", str(chunk_size),
           "--dtype", dtype, "--random-config", json.dumps(CONFIG), "--threads", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    return {(n, c, dt): probe(n, c, dt) for n in (8192, 16384) for c in (512, 0) for dt in ("bfloat16", "float32") if not (n == 16384 and c == 0)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chunking_cuts_peak_to_a_third(runs, dtype):
    chunked, unchunked = runs[(8192, 512, dtype)]["measured_bytes"], runs[(8192, 0, dtype)]["measured_bytes"]
    assert chunked <= unchunked / 3, f"chunk 512: {chunked / 2**20:.1f} MiB vs unchunked {unchunked / 2**20:.1f} MiB"


@pytest.mark.parametrize("tokens", [8192, 16384])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prediction_within_15_percent(runs, tokens, dtype):
    r = runs[(tokens, 512, dtype)]
    err = r["predicted_bytes"] / r["measured_bytes"] - 1
    assert abs(err) <= 0.15, f"{tokens} tokens {dtype}: predicted {r['predicted_bytes']/2**20:.1f} MiB, measured {r['measured_bytes']/2**20:.1f} MiB"


def test_prediction_grows_with_length_and_chunk():
    import transformers
    import torch

    from prefillonly.memory import predict_peak_bytes
    from prefillonly.model_spec import ModelSpec

    cfg = transformers.LlamaConfig(**CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(cfg)
    p = lambda n, c: predict_peak_bytes(spec, n, c, torch.bfloat16)
    assert p(1000, 512) < p(2000, 512) < p(4000, 512)
    assert p(8192, 512) < p(8192, 2048) < p(8192, None)
    assert p(8192, None) == p(8192, 8192) == p(8192, 100000)


def test_inplace_attention_lowers_the_peak_and_is_predicted():
    """Writing attention over Q saves about one [S, q_width] tensor. A wide q (8 heads x 64) makes
    that saving (16 MiB at 16K tokens) well above this host's run-to-run RSS noise (a few MiB)."""
    wide = dict(CONFIG, num_attention_heads=8, head_dim=64)
    runs = {}
    for flag in ([], ["--inplace-attention"]):
        cmd = [sys.executable, "-m", "prefillonly.memory_probe", "--tokens", "16384", "--chunk-size", "512", "--dtype",
               "bfloat16", "--random-config", json.dumps(wide), "--threads", "2", *flag]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[bool(flag)] = json.loads(out.stdout.strip().splitlines()[-1])
    q_bytes = 16384 * 8 * 64 * 2
    assert runs[True]["measured_bytes"] < runs[False]["measured_bytes"] - q_bytes // 2
    assert abs(runs[True]["predicted_bytes"] / runs[True]["measured_bytes"] - 1) <= 0.15

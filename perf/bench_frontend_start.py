"""What the scoring frontend pays at start for its tokenizer and the model's context length: the
torch-free path it takes (contract/tokenizer_file.py + contract/checkpoint.py) against the one it
took before (transformers' AutoTokenizer + ModelSpec.from_folder, which import torch), each in a
fresh process, interleaved, on the default model.

    python -m perf.bench_frontend_start [--reps 3]

Prints per run the seconds from process start (imports included) to the first encoded prompt,
the peak RSS, and whether torch was loaded; the two paths' ids must be equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from perf import benchutil as bu

# one fresh process per run: imports are most of the cost, and a second run in-process would skip them
_RUN = r"""
import json, resource, sys, time
t0 = time.perf_counter()
ckpt, path = sys.argv[1], sys.argv[2]
if path == "transformers":
    from transformers import AutoTokenizer
    from prefillonly.model.spec import ModelSpec
    tok, n = AutoTokenizer.from_pretrained(ckpt), ModelSpec.from_folder(ckpt).context_length
else:
    from prefillonly.contract.checkpoint import context_length_of
    from prefillonly.contract.tokenizer_file import load_tokenizer
    tok, n = load_tokenizer(ckpt), context_length_of(ckpt)
ids = tok.encode("Is the sky blue on a clear day? Answer:")
print(json.dumps({"path": path, "seconds": time.perf_counter() - t0, "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "torch": "torch" in sys.modules, "ids": ids, "context_length": n}))
"""
PATHS = ("transformers", "tokenizer_file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.bench_frontend_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="runs of each path, interleaved (default 3)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ckpt = bu.default_model_dir()
    runs = []
    for _ in range(args.reps):
        for path in PATHS:
            out = subprocess.run([sys.executable, "-c", _RUN, ckpt, path], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by_path = {p: [r for r in runs if r["path"] == p] for p in PATHS}
    same = len({(json.dumps(r["ids"]), r["context_length"]) for r in runs}) == 1
    print(f"{bu.machine_line(bu.machine_info(1))}; ids and context length equal on both paths: {same}\n")
    print("| path | seconds to the first encoded prompt | peak RSS | torch loaded |\n|---|---|---|---|")
    for p, rs in by_path.items():
        seconds = " / ".join(f"{r['seconds']:.2f}" for r in rs)
        print(f"| {p} | {seconds} | {bu.median([r['peak_rss_mib'] for r in rs]):.0f} MiB | {rs[0]['torch']} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

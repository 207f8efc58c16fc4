"""How much a decision's numbers depend on the rest of its call, per dtype: each question asked alone
and then among 399 others (one call of 400, OpenAI's limit), the largest probability difference.

    python -m perf.decisions_precision [--dtypes float32 bfloat16] [--inputs 3] [--seed 0]

In float32 the two agree to rounding (the tests hold them to 1e-5); in bfloat16 the question's
rows are computed in other batch shapes (GEMMs of other row counts round differently), so the
difference is the bf16 model's own noise, reported here rather than asserted. The default model,
2 threads; prints a markdown table (paste into perf/RESULTS.md with the date and the host).
"""

from __future__ import annotations

import argparse
import random

from perf import benchutil as bu

WORDS = ("order parcel late box torn blender works support refund delay customer happy price quality "
         "delivery courier damaged replaced quickly polite slow expensive cheap").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def questions(rng: random.Random) -> list:
    from prefillonly.contract.decisions import CHOICE, PREDICATE, SCORE, Option, Question

    return [Question(PREDICATE, "Was the delivery late?", (Option(True), Option(False))),
            Question(CHOICE, "Who should handle this?", (Option("customer support"), Option("logistics and shipping"),
                                                          Option("billing"), Option("quality assurance team"))),
            Question(SCORE, "How satisfied is the customer?",
                     tuple(Option(x) for x in ("very unhappy", "unhappy", "neutral", "happy", "very happy")))]


def largest_gap(dtype: str, inputs: int, seed: int) -> float:
    from prefillonly import Engine, EngineConfig
    from prefillonly.contract.decisions import PREDICATE, Option, Question

    rng = random.Random(seed)
    gap = 0.0
    with Engine(EngineConfig(dtype=dtype, threads=2)) as engine:
        for i in range(inputs):
            text, asked = _text(rng, rng.randint(200, 900)), questions(rng)
            others = [Question(PREDICATE, _text(rng, rng.randint(3, 15)) + "?", (Option(True), Option(False)))
                      for _ in range(400 - len(asked))]
            among = engine.decide(text, asked + others, user=f"among-{i}").answers
            for q, b in zip(asked, among):
                a = engine.decide(text, [q], user=f"alone-{i}").answers[0]
                gap = max(gap, max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities)))
            bu.log(f"{dtype}: input {i + 1}/{inputs}, largest gap so far {gap:.2e}")
    return gap


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.decisions_precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--inputs", type=int, default=3, help="inputs, each with 3 questions asked alone and among 400")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    rows = [(dt, largest_gap(dt, a.inputs, a.seed)) for dt in a.dtypes]
    print("| dtype | largest probability difference, a question alone vs among 399 others |\n|---|---|")
    for dt, gap in rows:
        print(f"| {dt} | {gap:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

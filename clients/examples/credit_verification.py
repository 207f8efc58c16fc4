"""Credit verification: one long history per applicant, P(" Yes") that it should be approved.

    python clients/examples/credit_verification.py [--url localhost:8000] [--months 24]

Each request is a long prompt with nothing shared, so no prefix is worth caching:
cache_prefix_len=0 keeps these one-off histories out of the prefix cache.
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from prefillonly_client import PrefillOnlyClient  # noqa: E402


def history(seed: int, months: int) -> str:
    rng = random.Random(seed)
    lines = [f"Month {m + 1}: income {rng.randint(2500, 6000)} EUR, spent {rng.randint(1500, 6500)} EUR, "
             f"{'paid on time' if rng.random() > 0.15 else 'payment 30 days late'}." for m in range(months)]
    return "Credit history:\n" + "\n".join(lines) + "\nShould this credit application be approved? Answer:"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--protocol", default="http", choices=["http", "grpc"])
    p.add_argument("--months", type=int, default=24)
    a = p.parse_args()
    with PrefillOnlyClient(a.url, a.protocol) as client:
        for applicant in range(3):
            r = client.score(history(applicant, a.months), [" Yes", " No"], cache_prefix_len=0)
            print(f"applicant {applicant}: P(approve) = {r['tokens'][0]['prob']:.3f} ({r['prompt_tokens']} tokens)")

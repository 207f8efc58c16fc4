"""Post recommendation: one user profile, several candidate posts, P(" Yes") per post, ranked.

    python clients/examples/post_recommendation.py [--url localhost:8001 --protocol grpc]

One multi-item request per user: the server computes the profile once and scores every post
as a suffix over it; the profile also stays in the prefix cache for the user's next request.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from prefillonly_client import PrefillOnlyClient  # noqa: E402

PROFILE = ("User profile: 34, lives in Innsbruck. Follows mountain guides, film photographers and two "
           "cooking channels. Liked: 'Ten huts worth the climb', 'Developing Portra at home'. "
           "Skipped: celebrity news, crypto, football transfers.")
POSTS = ["A three-day hut-to-hut route in the Stubai Alps", "Top ten crypto coins to buy this week",
         "Why medium format film is back", "The transfer window's biggest deals"]

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--protocol", default="http", choices=["http", "grpc"])
    a = p.parse_args()
    with PrefillOnlyClient(a.url, a.protocol) as client:
        results = client.score_items(PROFILE, POSTS, [" Yes", " No"], user="user-34",
                                     item_template="\nPost: {item}\nWould the user engage with this post? Answer:")
    for post, r in sorted(zip(POSTS, results), key=lambda x: -x[1]["tokens"][0]["prob"]):
        print(f"{r['tokens'][0]['prob']:.3f}  {post}")

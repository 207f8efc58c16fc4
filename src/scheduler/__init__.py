"""Request scheduling (JCT-calibrated queue). Requests currently run in arrival order under a lock."""

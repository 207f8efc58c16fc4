"""JCT estimator: how long a request will take, from the tokens it really has to compute.

    jct(u, c) = a + b * u + k * u * (u + 2c)      u = uncached tokens, c = cached tokens

b is the per-token linear-layer cost, k the attention cost (a query over the u + c keys it
sees, causal within the new part: u * (u + 2c) / 2 key visits, constant folded into k), a a
fixed per-request cost. Fitted online as requests complete: least squares of the *relative*
error over a window of recent requests (so short and long requests are predicted equally
well: the scheduler compares them), all coefficients kept >= 0; until a fit exists, `fallback_s_per_token * u`
(the paper's proxy: uncached tokens). The error of every prediction against the measured time
is tracked (mean absolute relative error) for the metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

_MIN_SAMPLES = 4


@dataclass(frozen=True)
class JctCoefficients:
    fixed_s: float
    per_token_s: float
    attention_s: float  # per unit of u * (u + 2c)


class JctEstimator:
    def __init__(self, fallback_s_per_token: float = 1e-3, window: int = 256):
        self.fallback_s_per_token = fallback_s_per_token
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coef: JctCoefficients | None = None
        self._abs_rel_err_sum = 0.0
        self._errors = 0
        self._lock = threading.Lock()

    @property
    def coefficients(self) -> JctCoefficients | None:
        return self._coef

    @property
    def seconds_per_token(self) -> float:
        """The marginal cost of one uncached token without context (for lambda conversion)."""
        c = self._coef
        return c.per_token_s if c and c.per_token_s > 0 else self.fallback_s_per_token

    def predict(self, uncached: int, cached: int) -> float:
        c = self._coef
        if c is None:
            return self.fallback_s_per_token * max(uncached, 1)
        return c.fixed_s + c.per_token_s * uncached + c.attention_s * uncached * (uncached + 2 * cached)

    def observe(self, uncached: int, cached: int, seconds: float) -> None:
        """Record a completed request's measured time and refit."""
        with self._lock:
            predicted = self.predict(uncached, cached)
            if seconds > 0:
                self._abs_rel_err_sum += abs(predicted - seconds) / seconds
                self._errors += 1
            self._samples.append((uncached, cached, seconds))
            if len(self._samples) >= _MIN_SAMPLES:
                self._coef = self._fit()

    def mean_abs_relative_error(self) -> float | None:
        return self._abs_rel_err_sum / self._errors if self._errors else None

    def _fit(self) -> JctCoefficients | None:
        u, c, t = (np.array(x, dtype=np.float64) for x in zip(*self._samples))
        keep = t > 0
        u, c, t = u[keep], c[keep], t[keep]
        features = np.stack([np.ones_like(u), u, u * (u + 2 * c)], axis=1) / t[:, None]  # relative error
        scale = features.max(axis=0)
        scale[scale == 0] = 1.0
        coef = _nonnegative_least_squares(features / scale, np.ones_like(t)) / scale
        if coef[1] <= 0 and coef[2] <= 0:
            return self._coef  # degenerate window (e.g. all the same size): keep the last fit
        return JctCoefficients(*map(float, coef))


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient until none is
    (3 unknowns: at most 3 rounds; scipy's nnls would be one more dependency for this)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x

"""JCT estimator: how long a request will take, from the tokens it really has to compute.

    jct(u, c) = a + b * u + k * u * (u + 2c)      u = uncached tokens, c = cached tokens

b is the per-token linear-layer cost, k the attention cost (a query over the u + c keys it
sees, causal within the new part: u * (u + 2c) / 2 key visits, constant folded into k), a a
fixed per-request cost. Fitted online as requests complete: least squares of the *relative*
error over a window of recent requests (so short and long requests are predicted equally
well: the scheduler compares them), all coefficients kept >= 0; until a fit exists, `fallback_s_per_token * u`
(the paper's proxy: uncached tokens). The error of every prediction against the measured time
is tracked (mean absolute relative error) for the metrics.

A forward step that computes several requests at once is one sample of the step cost model

    step(members) = a + sum over members of (b * u_i + k * u_i * (u_i + 2 c_i))

(one fixed cost per step: the weight reads and per-layer work the batch shares; the linear and
attention terms per member, since attention is computed per sequence). A single request is a
step of one, so both fit the same three coefficients, and a request's own estimate
predict(u, c) is its term of the model plus a: what CSJF compares, like with like.
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
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)  # (sum u, sum u(u+2c), seconds)
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
        return predict_jct(self._coef, self.fallback_s_per_token, uncached, cached)

    def predict_step(self, members: list[tuple[int, int]]) -> float:
        """A step computing every (uncached, cached) member at once."""
        c = self._coef
        linear, attention = _step_features(members)
        if c is None:
            return self.fallback_s_per_token * max(linear, 1)
        return c.fixed_s + c.per_token_s * linear + c.attention_s * attention

    def observe(self, uncached: int, cached: int, seconds: float) -> None:
        """Record a completed request's measured time (a step of one) and refit."""
        self.observe_step([(uncached, cached)], seconds)

    def observe_step(self, members: list[tuple[int, int]], seconds: float) -> None:
        """Record a completed step's measured time and refit."""
        with self._lock:
            predicted = self.predict_step(members)
            if seconds > 0:
                self._abs_rel_err_sum += abs(predicted - seconds) / seconds
                self._errors += 1
            self._samples.append((*_step_features(members), seconds))
            if len(self._samples) >= _MIN_SAMPLES:
                self._coef = self._fit()

    def mean_abs_relative_error(self) -> float | None:
        return self._abs_rel_err_sum / self._errors if self._errors else None

    def _fit(self) -> JctCoefficients | None:
        linear, attention, t = (np.array(x, dtype=np.float64) for x in zip(*self._samples))
        keep = t > 0
        linear, attention, t = linear[keep], attention[keep], t[keep]
        features = np.stack([np.ones_like(linear), linear, attention], axis=1) / t[:, None]  # relative error
        scale = features.max(axis=0)
        scale[scale == 0] = 1.0
        coef = _nonnegative_least_squares(features / scale, np.ones_like(t)) / scale
        if coef[1] <= 0 and coef[2] <= 0:
            return self._coef  # degenerate window (e.g. all the same size): keep the last fit
        return JctCoefficients(*map(float, coef))


def predict_jct(coef: JctCoefficients | None, fallback_s_per_token: float, uncached: int, cached: int) -> float:
    """A request's predicted seconds under a fit (or, with none yet, fallback_s_per_token per
    uncached token): the estimator's, and the fleet picker's with a replica's reported fit."""
    if coef is None:
        return fallback_s_per_token * max(uncached, 1)
    return coef.fixed_s + coef.per_token_s * uncached + coef.attention_s * uncached * (uncached + 2 * cached)


def _step_features(members: list[tuple[int, int]]) -> tuple[float, float]:
    """(sum of u, sum of u * (u + 2c)) over a step's (uncached, cached) members."""
    return (float(sum(u for u, _ in members)), float(sum(u * (u + 2 * c) for u, c in members)))


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

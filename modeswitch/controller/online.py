"""Recursive least squares with exponential forgetting: the online fit each batch of the learned policy
(:mod:`.learned`) keeps for its latency and energy.

Plain numpy least squares rather than river or scikit-learn: three small models per batch, an exact closed-form
update, and predictions as Python dot products keep a decision in microseconds.
"""

from __future__ import annotations

import numpy as np


class OnlineLinear:
    """Recursive least squares with exponential forgetting: the exact running solution of a (weighted)
    least-squares fit, updated one observation at a time in O(d^2).

    With ``head`` > 0 a second fit over the first ``head`` features (the intercept, and the one feature that
    matters most) makes the predictions until the model has seen twice as many observations as it has
    features: a fit over all of them from fewer requests than it has features extrapolates freely, and can
    predict a long prompt served in no time, which would win requests for a slow mode."""

    def __init__(self, dim: int, forgetting: float, prior: float = 100.0, head: int = 0) -> None:
        self.forgetting = forgetting
        self.n = 0
        self.w = np.zeros(dim)
        self.P = np.eye(dim) * prior
        self.head = OnlineLinear(head, forgetting, prior) if 0 < head < dim else None
        self._w = [0.0] * dim  # plain floats: a Python dot product beats numpy's call overhead at this size

    @property
    def fitted(self) -> bool:
        """Whether the fit over every feature makes the predictions (else the head's fit does)."""
        return self.head is None or self.n >= 2 * len(self.w)

    def predict(self, x: list[float]) -> float:
        return sum(a * b for a, b in zip(self._w, x))

    def update(self, x: list[float], y: float) -> None:
        xv = np.asarray(x, dtype=float)
        px = self.P @ xv
        gain = px / (self.forgetting + xv @ px)
        self.w = self.w + gain * (y - self.w @ xv)
        self.P = (self.P - np.outer(gain, px)) / self.forgetting
        self.n += 1
        if self.head is not None:
            self.head.update(x[:len(self.head.w)], y)
        self._publish()

    def _publish(self) -> None:
        """The weights :meth:`predict` uses: the full fit's, or the head's padded with zeros."""
        if self.fitted:
            self._w = self.w.tolist()
        else:
            self._w = self.head.w.tolist() + [0.0] * (len(self.w) - len(self.head.w))

    def to_dict(self) -> dict:
        out = {"n": self.n, "w": self.w.tolist(), "P": self.P.tolist()}
        return out | ({"head": self.head.to_dict()} if self.head is not None else {})

    def load(self, data: dict) -> None:
        self.n = int(data["n"])
        self.w, self.P = np.asarray(data["w"], dtype=float), np.asarray(data["P"], dtype=float)
        if self.head is not None:
            self.head.load(data["head"])
        self._publish()

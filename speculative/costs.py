"""What a forward pass costs, learned online from the passes the engine times.

Passes are of three kinds: ``plain`` decoding, a ``draft`` pass, a ``verify`` pass. A plain pass
is a verification pass with no drafts (the target model over each sequence's pending rows), so
the two share one fit, the *target* fit, and the draft passes have their own:

    seconds = θ0 + θ1 · rows / 16 + θ2 · context / 16384

(``rows``: the query tokens of the pass; ``context``: the tokens they attend to, summed over rows),
by exponentially weighted least squares: every observation multiplies the past's weight by
``decay``, so the fit follows the batch and the contexts as they move. A small ridge term makes
one observation enough for a usable (minimum-norm) fit. Interference only ever adds time (a pass
that met another process on a shared core), so the fit leans on the fast passes: an observation
above the prediction of the last fit solved weighs ``SLOW_WEIGHT``, and one more than ``SPIKE``
times that prediction counts as ``SPIKE`` times it.

Why shared: plain decoding's cost is what every round is weighed against, and while rounds run
there are no plain passes to time. A fit of its own kept whatever its first passes measured: on
the bundled model a cold 1.9 ms against the 1.0 ms its steps took later, so rounds that lost a
quarter of plain decoding's speed looked twice as good. Every verification pass now keeps it
current.

Invariant: every prediction is the current fit's, and positive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("plain", "draft", "verify")
FIT_OF = {"plain": "target", "verify": "target", "draft": "draft"}
ROW_SCALE, CONTEXT_SCALE = 16.0, 16384.0
SPIKE = 2.0  # observations above SPIKE x the prediction count as SPIKE x the prediction
SLOW_WEIGHT = 0.25  # the weight of an observation above the prediction


def _features(rows: float, context: float) -> tuple[float, float, float]:
    return 1.0, rows / ROW_SCALE, context / CONTEXT_SCALE


@dataclass(slots=True)
class LinearFit:
    """Exponentially weighted ridge regression of seconds on ``(1, rows, context)``."""

    decay: float = 0.97
    ridge: float = 1e-3
    gram: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    moment: list[float] = field(default_factory=lambda: [0.0] * 3)
    _theta: tuple[float, float, float] | None = None  # None: observed since last solved
    _solved: tuple[float, float, float] | None = None  # the last fit solved

    def observe(self, rows: float, context: float, seconds: float) -> None:
        x, d, w = _features(rows, context), self.decay, 1.0
        if self._solved is not None:
            expected = max(sum(t * f for t, f in zip(self._solved, x)), 1e-7)
            if seconds > expected:
                seconds, w = min(seconds, SPIKE * expected), SLOW_WEIGHT
        for i in range(3):
            self.moment[i] = d * self.moment[i] + w * x[i] * seconds
            for j in range(3):
                self.gram[i][j] = d * self.gram[i][j] + w * x[i] * x[j]
        self._theta = None

    @property
    def theta(self) -> tuple[float, float, float]:
        if self._theta is None:
            a = [[g + (self.ridge if i == j else 0.0) for j, g in enumerate(row)] + [m]
                 for i, (row, m) in enumerate(zip(self.gram, self.moment))]
            self._theta = self._solved = _solve3(a)
        return self._theta

    def predict(self, rows: float, context: float) -> float:
        t0, t1, t2 = self.theta
        x = _features(rows, context)
        return max(t0 + t1 * x[1] + t2 * x[2], 1e-7)

    def variable(self, rows: float, context: float) -> float:
        """The part of ``predict`` that grows with rows and context, at least 0."""
        _, t1, t2 = self.theta
        return max(t1 * rows / ROW_SCALE + t2 * context / CONTEXT_SCALE, 0.0)


def _solve3(a: list[list[float]]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting on a 3 x 4 augmented matrix."""
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for c in range(col, 4):
                a[r][c] -= f * a[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x[0], x[1], x[2]


class PassCosts:
    """The learned cost of each kind of pass. ``observe`` what a pass took; ``predict`` what one
    will take (from nothing observed, the ridge's nothing: time passes first); ``count`` how many
    of a kind were observed."""

    def __init__(self) -> None:
        self.fits = {name: LinearFit() for name in set(FIT_OF.values())}
        self.counts = dict.fromkeys(KINDS, 0)

    def fit(self, kind: str) -> LinearFit:
        return self.fits[FIT_OF[kind]]

    def observe(self, kind: str, rows: int, context: int, seconds: float) -> None:
        self.fit(kind).observe(rows, context, seconds)
        self.counts[kind] += 1

    def count(self, kind: str) -> int:
        return self.counts[kind]

    def predict(self, kind: str, rows: float, context: float) -> float:
        return self.fit(kind).predict(rows, context)

    def fixed(self, kind: str) -> float:
        """Seconds a pass of this kind costs whatever its rows (the intercept, at least 0)."""
        return max(self.fit(kind).theta[0], 0.0)

    def variable(self, kind: str, rows: float, context: float) -> float:
        return self.fit(kind).variable(rows, context)

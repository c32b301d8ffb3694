"""What a forward pass costs, learned online from the passes the engine times.

Five kinds of pass: ``plain`` decoding, ``verify``, a round's ``first_draft`` and later ``draft``
passes, and a draft model's ``catch_up`` over positions it skipped. A plain pass is a verification
pass with no drafts, so the two share the *target* fit (every round keeps plain decoding's cost
current); the draft passes share the *draft* fit; catch-ups (many rows of few sequences) have their
own. Each fit is

    seconds = θ0 + θ1 · rows / 16 + θ2 · sequences / 16 + θ3 · context / 16384 + θ4 · extra

(``rows``: query tokens; ``sequences``: how many sequences they belong to, since a pass costs
mostly per sequence; ``context``: tokens attended, summed over rows; ``extra``: 1 for a
verification pass or a round's first draft pass), exponentially weighted least squares with every
coefficient but θ0 at least 0 and a small ridge. Interference only adds time, so the fit leans on
the fast passes: an observation above the last solved fit's prediction weighs ``SLOW_WEIGHT`` and
counts as at most ``SPIKE`` times it. A fit read before any pass predicts nothing.

Invariant: every prediction is the current fit's, and positive. How the controller uses the fits:
docs/speculation.md (Pass costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import mul

KINDS = ("plain", "verify", "first_draft", "draft", "catch_up")
FIT_OF = {"plain": "target", "verify": "target", "first_draft": "draft", "draft": "draft",
          "catch_up": "catch_up"}
EXTRA = {"verify", "first_draft"}  # kinds that pay their fit's extra fixed cost
ROW_SCALE, CONTEXT_SCALE = 16.0, 16384.0
SPIKE = 2.0  # observations above SPIKE x the prediction count as SPIKE x the prediction
SLOW_WEIGHT = 0.25  # the weight of an observation above the prediction


def _features(rows: float, context: float, sequences: float, extra: bool) -> tuple[float, ...]:
    return 1.0, rows / ROW_SCALE, sequences / ROW_SCALE, context / CONTEXT_SCALE, float(extra)


NUM_FEATURES = 5
SLOPE_SETS = tuple(tuple(f for f in range(1, NUM_FEATURES) if mask >> (f - 1) & 1)
                   for mask in range(2 ** (NUM_FEATURES - 1)))  # every set of slopes left free
ACTIVE_SET_STEPS = 4 * NUM_FEATURES  # active-set solves before every set is tried instead
FOLD_EVERY = 64  # observations kept unfolded at most (a fold of 64 takes about 0.2 ms)


@dataclass(slots=True)
class LinearFit:
    """Exponentially weighted ridge regression of seconds on ``(1, rows, sequences, context,
    extra)`` with every coefficient but the intercept at least 0 (``theta``).

    Observations are kept as they come and folded into the Gram matrix and moments together
    when the fit is next read (a fold per plan, not per pass). Every observation kept is weighed against
    the same last solved fit as it would have been when it came, since nothing is solved
    between two reads."""

    decay: float = 0.97
    ridge: float = 1e-3
    _gram: list[list[float]] = field(default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    _moment: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _pending: list[tuple[tuple[float, ...], float]] = field(default_factory=list)  # not folded yet
    _theta: tuple[float, ...] | None = None  # None: observed since last solved
    _solved: tuple[float, ...] | None = None  # the last fit solved from passes
    _free: tuple[int, ...] = tuple(range(NUM_FEATURES))  # the last solve's free coefficients

    def observe(self, rows: float, context: float, seconds: float,
                sequences: float | None = None, extra: bool = False) -> None:
        """A pass over ``rows`` query tokens of ``sequences`` sequences (default: one row each)
        attending ``context`` tokens took ``seconds``; ``extra``: a pass of the kind that pays
        the extra fixed cost."""
        self._pending.append((_features(rows, context, rows if sequences is None else sequences, extra),
                              seconds))
        self._theta = None
        if len(self._pending) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Fold the kept observations in: each decays the past by ``decay``; one slower than the
        last solved fit predicts weighs ``SLOW_WEIGHT`` and counts as at most ``SPIKE`` times
        the prediction. Scalar loops: a fold meets the few passes since the fit was last read."""
        pending, self._pending, solved = self._pending, [], self._solved
        past = self.decay ** len(pending)
        gram, moment = [[g * past for g in row] for row in self._gram], [m * past for m in self._moment]
        for age, (x, seconds) in enumerate(reversed(pending)):
            weight = self.decay ** age  # decayed by those after it
            if solved is not None and seconds > (expected := max(sum(map(mul, x, solved)), 1e-7)):
                seconds, weight = min(seconds, SPIKE * expected), weight * SLOW_WEIGHT
            for i, (xi, row) in enumerate(zip(x, gram)):
                moment[i] += weight * xi * seconds
                for j, xj in enumerate(x):
                    row[j] += weight * xi * xj
        self._gram, self._moment = gram, moment

    def folded(self) -> tuple[list[list[float]], list[float]]:
        """The weighted Gram matrix of the features of every pass observed, and the weighted
        features times seconds summed over them."""
        if self._pending:
            self._fold()
        return self._gram, self._moment

    @property
    def theta(self) -> tuple[float, ...]:
        """The ridge fit whose slopes are at least 0 (a pass never costs less for more rows,
        sequences or context), by active sets: a negative slope is held at 0 and the fit solved
        again; a held one whose gradient says the error falls if it grows is freed. Where neither
        applies the optimality conditions of this convex problem hold. Each solve starts from the
        last one's set; should the sets cycle, every set is tried."""
        if self._theta is None:
            gram, moment = self.folded()
            free = list(self._free)
            for _ in range(ACTIVE_SET_STEPS):
                theta = _ridge_solve(gram, moment, self.ridge, tuple(free))
                negative = [i for i in free[1:] if theta[i] < 0.0]
                if negative:
                    free.remove(min(negative, key=lambda i: theta[i]))
                    continue
                gradient = _gradient(gram, moment, self.ridge, theta)
                growing = [i for i in range(1, NUM_FEATURES) if i not in free and gradient[i] < 0.0]
                if not growing:
                    break
                free = sorted([*free, min(growing, key=lambda i: gradient[i])])
            else:
                free = list(range(NUM_FEATURES))
                theta = min((_ridge_solve(gram, moment, self.ridge, (0, *kept)) for kept in SLOPE_SETS),
                            key=lambda t: self.objective(t) if min(t[1:]) >= 0.0 else float("inf"))
            self._theta, self._free = theta, tuple(free)
            if gram[0][0] > 0.0:  # solved from passes: later ones are weighed against it
                self._solved = theta
        return self._theta

    def objective(self, theta: tuple[float, ...]) -> float:
        """The ridge-weighted squared error of ``theta`` less its constant part:
        ``theta' (G + ridge) theta - 2 theta' m``."""
        gram, moment = self.folded()
        gradient = _gradient(gram, moment, self.ridge, theta)
        return sum(t * (g - m) for t, g, m in zip(theta, gradient, moment))

    def predict(self, rows: float, context: float, sequences: float | None = None,
                extra: bool = False) -> float:
        return max(sum(map(mul, self.theta,
                           _features(rows, context, rows if sequences is None else sequences, extra))),
                   1e-7)


def _gradient(gram: list[list[float]], moment: list[float], ridge: float,
              theta: tuple[float, ...]) -> list[float]:
    """Half the ridge objective's gradient: ``(G + ridge) theta - m``."""
    return [sum(map(mul, row, theta)) + ridge * t - m for row, t, m in zip(gram, theta, moment)]


def _ridge_solve(gram: list[list[float]], moment: list[float], ridge: float,
                 kept: tuple[int, ...]) -> tuple[float, ...]:
    """The ridge fit on the features ``kept`` (the others' coefficients 0); ``G + ridge`` is
    positive definite, so its Cholesky factor solves it."""
    a = [[gram[i][j] + (ridge if i == j else 0.0) for j in kept] for i in kept]
    theta = [0.0] * NUM_FEATURES
    for i, value in zip(kept, _cholesky_solve(a, [moment[i] for i in kept])):
        theta[i] = value
    return tuple(theta)


def _cholesky_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a x = b`` for a symmetric positive definite ``a`` of a few rows: ``a = L L'``,
    then ``L y = b`` and ``L' x = y`` (scalar loops: at a few rows, slicing's and numpy's
    per-call overhead would outweigh the arithmetic)."""
    n = len(a)
    lower: list[list[float]] = []
    for i in range(n):
        row: list[float] = []
        for j in range(i):
            other, value = lower[j], a[i][j]
            for k in range(j):
                value -= row[k] * other[k]
            row.append(value / other[j])
        value = a[i][i]
        for entry in row:
            value -= entry * entry
        row.append(math.sqrt(value))
        lower.append(row)
    y: list[float] = []
    for i, row in enumerate(lower):
        value = b[i]
        for k in range(i):
            value -= row[k] * y[k]
        y.append(value / row[i])
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        value = y[i]
        for j in range(i + 1, n):
            value -= lower[j][i] * x[j]
        x[i] = value / lower[i][i]
    return x


class PassCosts:
    """The learned cost of each kind of pass. ``observe`` what a pass took; ``predict`` what one
    will take (from nothing observed, the ridge's nothing: time passes first); ``count`` how many
    of a kind were observed."""

    def __init__(self) -> None:
        self.fits = {name: LinearFit() for name in set(FIT_OF.values())}
        self.counts = dict.fromkeys(KINDS, 0)

    def fit(self, kind: str) -> LinearFit:
        return self.fits[FIT_OF[kind]]

    def observe(self, kind: str, rows: int, context: int, seconds: float,
                sequences: int | None = None) -> None:
        self.fit(kind).observe(rows, context, seconds, sequences, kind in EXTRA)
        self.counts[kind] += 1

    def count(self, kind: str) -> int:
        return self.counts[kind]

    def predict(self, kind: str, rows: float, context: float, sequences: float | None = None) -> float:
        return self.fit(kind).predict(rows, context, sequences, kind in EXTRA)

    def intercept(self, kind: str) -> float:
        """The fit's part of a pass of this kind that does not grow with its rows, sequences or
        context: the intercept and, for a kind that pays it, the extra fixed cost."""
        theta = self.fit(kind).theta
        return theta[0] + theta[4] * (kind in EXTRA)

    def fixed(self, kind: str) -> float:
        """Seconds a pass of this kind costs whatever its rows (``intercept``, at least 0)."""
        return max(self.intercept(kind), 0.0)

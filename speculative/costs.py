"""What a forward pass costs, learned online from the passes the engine times.

Kinds: ``plain`` decoding and ``verify`` share the *target* fit (a plain pass is a verification
with no drafts), a round's ``first_draft`` and later ``draft`` passes the *draft* fit, a draft
model's ``catch_up`` its own. Each fit is ``seconds = θ0 + θ1 · rows / 16 + θ2 · sequences / 16 +
θ3 · context / 16384 + θ4 · extra`` (``extra``: 1 for a verification or a first draft pass),
exponentially weighted ridge least squares, every coefficient but θ0 at least 0; an observation
above the last solved fit's prediction weighs ``SLOW_WEIGHT`` and counts as at most ``SPIKE``
times it (interference only adds time). Whole steps are then compared with what the fits predict
for their passes now (``PassCosts.step_factor``). Invariant: every prediction is the current fit's,
and positive; a fit read before any pass predicts nothing. The model in full: docs/speculation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import mul

KINDS = ("plain", "verify", "first_draft", "draft", "catch_up")
FIT_OF = {"plain": "target", "verify": "target", "first_draft": "draft", "draft": "draft",
          "catch_up": "catch_up"}
FITS = tuple(dict.fromkeys(FIT_OF.values()))  # target, draft, catch_up: a step's features, a row each
EXTRA = {"verify", "first_draft"}  # kinds that pay their fit's extra fixed cost
ROW_SCALE, CONTEXT_SCALE = 16.0, 16384.0
SPIKE = 2.0  # observations above SPIKE x the prediction count as SPIKE x the prediction
SLOW_WEIGHT = 0.25  # the weight of an observation above the prediction
STEP_DECAY = 0.7  # the past's weight in a kind of step's sums of seconds and of its passes' features
STEP_SPIKE = 4.0  # a step counts as at most this many times what its passes' fits predicted
NUM_FEATURES = 5
NO_FEATURES = (0.0,) * (NUM_FEATURES * len(FITS))  # a step's features: each fit's passes', summed


def _features(rows: float, context: float, sequences: float, extra: bool) -> tuple[float, ...]:
    return 1.0, rows / ROW_SCALE, sequences / ROW_SCALE, context / CONTEXT_SCALE, float(extra)


def _dot(a, b) -> float:
    return sum(map(mul, a, b))


@dataclass(slots=True)
class LinearFit:
    """Exponentially weighted ridge regression of seconds on ``(1, rows, sequences, context,
    extra)``, every coefficient but the intercept at least 0 (``theta``). Each observation is
    folded in as it comes, weighed against the last solved fit; the fit is solved when next read.
    Plain Python throughout: on five features numpy's per-call cost outweighs the arithmetic."""

    decay: float = 0.97
    ridge: float = 1e-3
    gram: list[list[float]] = field(default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    moment: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _theta: tuple[float, ...] | None = None  # None: observed since last solved
    _solved: tuple[float, ...] | None = None  # the last fit solved from passes

    def observe(self, rows: float, context: float, seconds: float,
                sequences: float | None = None, extra: bool = False) -> float | None:
        """A pass over ``rows`` query tokens of ``sequences`` sequences (default: one row each)
        attending ``context`` tokens took ``seconds``; ``extra``: it pays the extra fixed cost.
        Returns what the last solved fit predicted for it (None: none solved yet)."""
        x = _features(rows, context, rows if sequences is None else sequences, extra)
        expected, weight = None, 1.0
        if self._solved is not None:
            expected = max(_dot(self._solved, x), 1e-7)
            if seconds > expected:
                seconds, weight = min(seconds, SPIKE * expected), SLOW_WEIGHT
        decay, weighted = self.decay, [weight * f for f in x]
        self.gram = [[decay * g + w * f for g, f in zip(row, x)] for row, w in zip(self.gram, weighted)]
        self.moment = [decay * m + w * seconds for m, w in zip(self.moment, weighted)]
        self._theta = None
        return expected

    @property
    def theta(self) -> tuple[float, ...]:
        """The ridge fit whose slopes are at least 0 (a pass never costs less for more rows,
        sequences or context)."""
        if self._theta is None:
            start = [0] if self._solved is None else [i for i, t in enumerate(self._solved) if i == 0 or t > 0.0]
            ridged = [[g + self.ridge * (i == j) for j, g in enumerate(row)] for i, row in enumerate(self.gram)]
            self._theta = _nonnegative_slopes(ridged, self.moment, start)
            if self.gram[0][0] > 0.0:  # solved from passes: later ones are weighed against it
                self._solved = self._theta
        return self._theta

    def predict(self, rows: float, context: float, sequences: float | None = None,
                extra: bool = False) -> float:
        return max(_dot(self.theta, _features(rows, context, rows if sequences is None else sequences, extra)),
                   1e-7)


def _solve(a: list[list[float]], b: list[float], free: list[int]) -> list[float]:
    """``t`` with ``a[free, free] t[free] = b[free]`` and 0 elsewhere, by Gaussian elimination
    (``a`` is positive definite, so every pivot is positive)."""
    m = [[a[i][j] for j in free] + [b[i]] for i in free]
    n = len(free)
    for k, pivot in enumerate(m):
        for row in m[k + 1:]:
            f = row[k] / pivot[k]
            row[k:] = [r - f * p for r, p in zip(row[k:], pivot[k:])]
    x = [0.0] * n
    for k in range(n - 1, -1, -1):
        x[k] = (m[k][n] - _dot(m[k][k + 1:n], x[k + 1:])) / m[k][k]
    t = [0.0] * len(b)
    for i, value in zip(free, x):
        t[i] = value
    return t


def _nonnegative_slopes(a: list[list[float]], b: list[float], free: list[int]) -> tuple[float, ...]:
    """``t`` minimising ``t' a t - 2 t' b`` with ``t[1:] >= 0``, for a positive definite ``a``, by
    Lawson and Hanson's active set, from the last solve's ``free`` coefficients where their solution
    is feasible (mostly it is the optimum), else from the intercept alone: every iterate is feasible,
    and the loop ends at the optimality conditions (or, in a numerical tie, after its bound)."""
    n, theta = len(b), _solve(a, b, free)
    if min((theta[i] for i in free[1:]), default=1.0) <= 0.0:
        theta, free = _solve(a, b, [0]), [0]
    for _ in range(3 * n):
        gradient = [_dot(row, theta) - target for row, target in zip(a, b)]
        growing = [i for i in range(1, n) if i not in free and gradient[i] < -1e-15]
        if not growing:
            break
        free = sorted([*free, min(growing, key=gradient.__getitem__)])
        while True:
            solution = _solve(a, b, free)
            negative = [i for i in free[1:] if solution[i] <= 0.0]
            if not negative:
                theta = solution
                break
            step = min(theta[i] / max(theta[i] - solution[i], 1e-300) for i in negative)
            theta = [t + step * (s - t) for t, s in zip(theta, solution)]
            free = [i for i in free if i == 0 or theta[i] > 0.0]
    return tuple(theta)


class PassCosts:
    """The learned cost of each kind of pass: ``observe`` what a pass took, ``predict`` what one
    will take (from nothing observed, nothing), ``counts`` those of each kind observed. Beside the
    fits, per size class of the batch (1, 2-3, 4-7, ...), decayed sums of what whole steps took
    (a plain pass; a round's from its first draft through its verification) and of their passes'
    features, priced by the fits as they are now: the fits lean on fast passes and are linear, so
    a round of many passes and rows, or a plain step at some batch size, can take more than they
    say (``step_factor``)."""

    def __init__(self) -> None:
        self.fits = {name: LinearFit() for name in FITS}
        self.counts = dict.fromkeys(KINDS, 0)
        # (a round?, size class) -> decayed sums of its steps' passes' features (fit after fit) and seconds
        self.steps: dict[tuple[bool, int], tuple[list[float], float]] = {}
        self._round = (NO_FEATURES, 0.0, 0.0)  # the step under way: its passes' features, seconds, predictions

    def fit(self, kind: str) -> LinearFit:
        return self.fits[FIT_OF[kind]]

    def observe(self, kind: str, rows: int, context: int, seconds: float, sequences: int | None = None) -> None:
        """A pass of ``kind`` took ``seconds``; a plain pass, or a verification (which ends a
        round), also teaches its kind of step's factor."""
        fit, extra, sequences = self.fit(kind), kind in EXTRA, rows if sequences is None else sequences
        expected = fit.observe(rows, context, seconds, sequences, extra)
        self.counts[kind] += 1
        features, past_seconds, predicted = (NO_FEATURES, 0.0, 0.0) if kind in ("plain", "first_draft") else self._round
        features, at = list(features), FITS.index(FIT_OF[kind]) * NUM_FEATURES  # its fit's five
        for i, f in enumerate(_features(rows, context, sequences, extra), at):
            features[i] += f
        self._round = (features, past_seconds + seconds, predicted + (expected or math.inf))
        if kind in ("plain", "verify") and not math.isinf(self._round[2]):  # else a fit was unsolved
            old = self.steps.get(key := (kind == "verify", int(sequences).bit_length()), (NO_FEATURES, 0.0))
            self.steps[key] = ([STEP_DECAY * o + f for o, f in zip(old[0], features)],
                               STEP_DECAY * old[1] + min(self._round[1], STEP_SPIKE * self._round[2]))

    def step_factor(self, round_: bool, sequences: int) -> float:
        """What a plain step (or a round) of a batch of ``sequences`` has taken lately over what
        the fits predict for its passes now (1 where none of its size class was timed)."""
        features, seconds = self.steps.get((round_, int(sequences).bit_length()), (None, 1.0))
        if features is None:
            return 1.0
        return seconds / max(sum(_dot(self.fits[name].theta, features[NUM_FEATURES * i:])
                                 for i, name in enumerate(FITS)), 1e-9)

    def predict(self, kind: str, rows: float, context: float, sequences: float | None = None) -> float:
        return self.fit(kind).predict(rows, context, sequences, kind in EXTRA)

    def fixed(self, kind: str) -> float:
        """The seconds of a pass of this kind that do not grow with its rows, sequences or context
        (the intercept and, for a kind that pays it, the extra fixed cost), at least 0."""
        return max((theta := self.fit(kind).theta)[0] + theta[4] * (kind in EXTRA), 0.0)

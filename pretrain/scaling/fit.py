"""Fit L(N, D) = E + A / N^alpha + B / D^beta to final losses (Hoffmann et al. 2022, "Training
Compute-Optimal Large Language Models", arXiv:2203.15556, Sec. 3.3 and App. D.2).

The procedure of App. D.2, as implemented here:
* parametrisation A = exp(a), B = exp(b), E = exp(e), so the prediction is
  log L_pred = LSE(a - alpha log N, b - beta log D, e) (log-sum-exp);
* objective: sum over runs of Huber_delta(log L_pred - log L), delta = 1e-3;
* optimiser: L-BFGS (scipy.optimize.minimize, method L-BFGS-B, with the bound alpha, beta >= 0 so that loss
  cannot grow with N or D) and the analytic gradient;
* initialisations: the grid of App. D.2, alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
  a, b in {0, 5, ..., 25} (4,500 points). The objective is evaluated at every grid point and L-BFGS starts
  from the `starts` best of them (Hoffmann et al. start from all; `starts=0` does that here too); the fit
  with the lowest objective wins.

Uncertainty: a bootstrap over runs (resample the runs with replacement, refit, percentile interval).
Compute-optimal allocation under C = 6 N D (Hoffmann et al. Eq. 4): N_opt = G (C/6)^(beta/(alpha+beta)),
D_opt = (C/6)^(alpha/(alpha+beta)) / G with G = (alpha A / (beta B))^(1/(alpha+beta)).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3
GRID = {"a": np.arange(0.0, 25.1, 5.0), "b": np.arange(0.0, 25.1, 5.0), "e": np.arange(-1.0, 1.01, 0.5),
        "alpha": np.arange(0.0, 2.01, 0.5), "beta": np.arange(0.0, 2.01, 0.5)}
NAMES = ("a", "b", "e", "alpha", "beta")
# log A, log B, log E kept where exp() is a float: a resample without the spread to pin A or B can
# otherwise run them to overflow (measured on the demo ladder's bootstrap).
BOUNDS = [(-50.0, 700.0), (-50.0, 700.0), (-50.0, 50.0), (0.0, None), (0.0, None)]
CONSTANTS = ("E", "A", "B", "alpha", "beta")


@dataclass(frozen=True)
class LawFit:
    """Fitted constants of L(N, D) = E + A / N^alpha + B / D^beta, and the objective they reached."""
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float = float("nan")

    def loss(self, n, d):
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal(self, flops: float) -> dict:
        """Compute-optimal N, D (and the predicted loss) for a budget of C = 6 N D FLOPs."""
        if not (flops > 0 and math.isfinite(flops)):
            raise ValueError(f"FLOP budget {flops!r}: must be a positive number")
        if self.alpha <= 0 or self.beta <= 0:
            return {"flops": flops, "n": float("nan"), "d": float("nan"), "loss": float("nan")}
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        n = g * (flops / 6.0) ** (self.beta / s)
        d = (flops / 6.0) ** (self.alpha / s) / g
        return {"flops": flops, "n": float(n), "d": float(d), "loss": float(self.loss(n, d))}

    def as_dict(self) -> dict:
        return asdict(self)


def _check(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, loss = (np.asarray(x, dtype=float).ravel() for x in (n, d, loss))
    if not (len(n) == len(d) == len(loss)):
        raise ValueError(f"N, D and loss must have one value per run: got {len(n)}, {len(d)}, {len(loss)}")
    for name, x in (("N", n), ("D", d), ("loss", loss)):
        bad = [float(v) for v in x if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"{name}: every value must be finite and > 0; got {bad[:5]}")
    return n, d, loss


def logsumexp(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """log(sum(exp(x))) along `axis` (scipy.special.logsumexp is ~30x slower on these tiny arrays)."""
    m = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
              delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient in (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    lse = logsumexp(terms, axis=0)
    r = lse - log_l
    small = np.abs(r) <= delta
    value = float(np.sum(np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))))
    dr = np.clip(r, -delta, delta)            # Huber'(r)
    w = np.exp(terms - lse)                   # d LSE / d term (softmax weights)
    grad = np.array([np.sum(dr * w[0]), np.sum(dr * w[1]), np.sum(dr * w[2]),
                     -np.sum(dr * w[0] * log_n), -np.sum(dr * w[1] * log_d)])
    return value, grad


def grid_points() -> np.ndarray:
    """The App. D.2 initialisation grid as rows (a, b, e, alpha, beta)."""
    return np.array(list(itertools.product(*(GRID[k] for k in NAMES))))


def _grid_objective(grid: np.ndarray, log_n, log_d, log_l, delta: float) -> np.ndarray:
    a, b, e, alpha, beta = (grid[:, i:i + 1] for i in range(5))
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(grid), len(log_n)))])
    r = np.abs(logsumexp(terms, axis=0) - log_l)
    return np.sum(np.where(r <= delta, 0.5 * r * r, delta * (r - 0.5 * delta)), axis=1)


def _minimise(start: np.ndarray, log_n, log_d, log_l, delta: float):
    # The objective is divided by delta (same minimiser) so that L-BFGS-B's absolute tolerances fit its scale.
    def scaled(theta):
        v, g = objective(theta, log_n, log_d, log_l, delta)
        return v / delta, g / delta
    return minimize(scaled, start, jac=True, method="L-BFGS-B", bounds=BOUNDS,
                    options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-9})


def fit_law(n, d, loss, *, starts: int = 64, delta: float = HUBER_DELTA, extra_starts=()) -> LawFit:
    """Hoffmann et al. App. D.2 fit (see the module doc) of runs with non-embedding params N, tokens D and
    final loss. `starts`: L-BFGS runs from that many best grid points (0: from every grid point);
    `extra_starts`: further (a, b, e, alpha, beta) starting points (the bootstrap passes the full-data fit)."""
    n, d, loss = _check(n, d, loss)
    if len(n) < 6:
        raise ValueError(f"{len(n)} runs: the law has 5 constants, a fit needs at least 6 runs "
                         "(e.g. 3 sizes x 2 token budgets)")
    if len(set(n)) < 2 or len(set(d)) < 2:
        raise ValueError(f"the runs span {len(set(n))} model size(s) and {len(set(d))} token budget(s): "
                         "alpha and beta need at least 2 of each")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    grid = grid_points()
    if starts:
        values = _grid_objective(grid, log_n, log_d, log_l, delta)
        grid = grid[np.argsort(values, kind="stable")[:starts]]
    best = None
    for start in [*grid, *(np.asarray(s, dtype=float) for s in extra_starts)]:
        res = _minimise(start, log_n, log_d, log_l, delta)
        value = objective(res.x, log_n, log_d, log_l, delta)[0]
        if np.all(np.isfinite(res.x)) and (best is None or value < best[0]):
            best = (value, res.x)
    a, b, e, alpha, beta = best[1]
    return LawFit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta),
                  objective=float(best[0]))


def theta_of(law: LawFit) -> np.ndarray:
    return np.array([math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta])


@dataclass
class Bootstrap:
    """Percentile intervals of the constants (and of compute-optimal N, D per budget) over resampled fits."""
    samples: list[LawFit]
    level: float

    def interval(self, values) -> tuple[float, float]:
        values = np.asarray([v for v in values if math.isfinite(v)])
        if not len(values):
            return float("nan"), float("nan")
        tail = 50.0 * (1.0 - self.level)
        return float(np.percentile(values, tail)), float(np.percentile(values, 100.0 - tail))

    def constants(self) -> dict[str, tuple[float, float]]:
        return {k: self.interval([getattr(s, k) for s in self.samples]) for k in CONSTANTS}

    def optimal(self, flops: float) -> dict[str, tuple[float, float]]:
        opts = [s.optimal(flops) for s in self.samples]
        return {k: self.interval([o[k] for o in opts]) for k in ("n", "d", "loss")}


def bootstrap(n, d, loss, law: LawFit, *, resamples: int = 200, seed: int = 0, level: float = 0.95,
              starts: int = 4) -> Bootstrap:
    """Resample the runs with replacement `resamples` times and refit each (from the `starts` best grid points
    and the full-data fit). A resample with fewer than 2 distinct sizes or budgets is drawn again."""
    n, d, loss = _check(n, d, loss)
    if not 0 < level < 1:
        raise ValueError(f"bootstrap level {level}: must be in (0, 1)")
    rng = np.random.default_rng(seed)
    samples = []
    while len(samples) < resamples:
        idx = rng.integers(0, len(n), len(n))
        if len(set(n[idx])) < 2 or len(set(d[idx])) < 2:
            continue
        samples.append(fit_law(n[idx], d[idx], loss[idx], starts=starts, extra_starts=[theta_of(law)]))
    return Bootstrap(samples, level)

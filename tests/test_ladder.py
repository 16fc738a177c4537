"""make ladder: the L(N, D) fit recovers known constants from synthetic losses (fast), the ladder files compose,
bad ladder files are refused naming the field. The CPU demo ladder itself is a bench (docs/ladder.md)."""
import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from common.config import ConfigError
from pretrain.scaling.fit import LawFit, bootstrap, fit_law
from pretrain.scaling.ladder import load_ladder, plan

# Hoffmann et al. 2022 (arXiv:2203.15556) Eq. 10: E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28.
CHINCHILLA = LawFit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def synthetic(law: LawFit, sigma: float, seed: int = 1):
    """5 sizes (30M-3B) x 5 budgets (5-80 tokens per parameter), loss x lognormal(0, sigma) noise."""
    sizes, mult = np.array([3e7, 1e8, 3e8, 1e9, 3e9]), np.array([5, 10, 20, 40, 80])
    n = np.repeat(sizes, len(mult))
    d = (sizes[:, None] * mult[None, :]).ravel()
    loss = law.loss(n, d) * np.exp(np.random.default_rng(seed).normal(0.0, sigma, len(n)))
    return n, d, loss


def test_fit_recovers_the_constants_exactly_without_noise():
    fit = fit_law(*synthetic(CHINCHILLA, 0.0), starts=16)
    for k in ("E", "A", "B", "alpha", "beta"):
        assert getattr(fit, k) == pytest.approx(getattr(CHINCHILLA, k), rel=1e-3), k


def test_fit_recovers_the_constants_from_noisy_losses_within_its_bootstrap_intervals():
    n, d, loss = synthetic(CHINCHILLA, 0.005)            # 0.5% noise on every loss
    fit = fit_law(n, d, loss, starts=16)
    assert fit.alpha == pytest.approx(0.34, abs=0.04) and fit.beta == pytest.approx(0.28, abs=0.04)
    assert fit.E == pytest.approx(1.69, rel=0.05)
    assert 1 / 1.6 < fit.A / 406.4 < 1.6 and 1 / 1.6 < fit.B / 410.7 < 1.6   # A, B trade off with the exponents
    # the compute-optimal exponent N_opt ~ C^(beta/(alpha+beta)): 0.452 for the true constants
    assert fit.beta / (fit.alpha + fit.beta) == pytest.approx(0.28 / 0.62, abs=0.03)
    boot = bootstrap(n, d, loss, fit, resamples=30, seed=0)
    for k, (lo, hi) in boot.constants().items():
        assert lo <= getattr(CHINCHILLA, k) <= hi, (k, lo, hi)
        assert lo < hi


def test_compute_optimal_allocation_is_the_minimum_on_the_budget():
    for c in (1e19, 5.76e23):
        opt = CHINCHILLA.optimal(c)
        assert 6 * opt["n"] * opt["d"] == pytest.approx(c, rel=1e-9)
        numeric = minimize_scalar(lambda log_n, c=c: float(CHINCHILLA.loss(math.exp(log_n), c / 6 / math.exp(log_n))),
                                  bounds=(math.log(1e6), math.log(1e13)), method="bounded",
                                  options={"xatol": 1e-9})
        assert opt["n"] == pytest.approx(math.exp(numeric.x), rel=1e-3)
        assert opt["loss"] == pytest.approx(numeric.fun, rel=1e-9)
    # Chinchilla's own budget (5.76e23 FLOPs) with these constants: ~30-40B parameters (Hoffmann et al. Table 3)
    assert 2e10 < CHINCHILLA.optimal(5.76e23)["n"] < 6e10


def test_fit_refuses_too_few_runs_or_one_size():
    n, d, loss = synthetic(CHINCHILLA, 0.0)
    with pytest.raises(ValueError, match="at least 6 runs"):
        fit_law(n[:5], d[:5], loss[:5])
    with pytest.raises(ValueError, match="1 model size"):
        fit_law(n[:5].tolist() * 2, d[:5].tolist() * 2, loss[:5].tolist() * 2)
    with pytest.raises(ValueError, match="loss: every value must be finite"):
        fit_law(n, d, np.where(np.arange(len(n)) == 3, np.nan, loss))


def test_demo_ladder_composes_with_the_shapes_it_names():
    groups = plan(load_ladder("demo"))
    assert [g.name for g in groups] == ["l2-h64", "l3-h96", "l4-h128"]
    for g in groups:
        layers, hidden = (int(x[1:]) for x in g.name.split("-"))
        job = g.jobs[0]
        assert (job.model.num_layers, job.model.hidden_size) == (layers, hidden)
        # N: layers only (12 h^2 + 13 h per layer with biases and norms) + the final norm
        assert g.n == layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden
        assert [j.derived.train_tokens for j in g.jobs] == g.tokens == [131072, 262144, 524288]


def test_bad_ladder_files_are_refused_naming_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("shapes:\n  a: {model: {num_layers: 2}}\ntokens: [1000]\ntokens_per_param: [5]\n")
    with pytest.raises(ConfigError) as err:
        load_ladder(str(path))
    text = str(err.value)
    assert "shapes: 1 given" in text and "set exactly one of them" in text
    path.write_text("shapes:\n  a: {model: {num_layers: 2}}\n  b: {model: {num_layerz: 3}}\ntokens: [131072, 262144]\n")
    with pytest.raises(ConfigError, match="shape b: .*num_layerz"):
        plan(load_ladder(str(path)))
    path.write_text("shapez: {}\n")
    with pytest.raises(ConfigError, match="shapez"):
        load_ladder(str(path))
    with pytest.raises(ConfigError, match="no ladder 'nope'"):
        load_ladder("nope")

"""Issue 38, finding 6: fit's Poisson q never comes from private data unless the size is
declared public.

Relation (fit_sampling's module docstring): add or remove one example, the neighbour sampled
at the SAME q. With `fit(..., population_size=N)` (a public N), q = B / N and the steps
round(N / B) depend on public values only, so the run on D and the run on D' = D minus one
example use the same q whatever their sizes. Without it, q = B / len(x) and the dataset's
size is treated as public (the log line and the statement say so).

The issue's tiny setting: n = 8, B = 6, z = 1, 10 steps (10 epochs of round(8 / 6) = 1 step),
delta = 1e-5. The ledger's claim is 15.57 (RDP) / 14.39 (PLD), dp-accounting called by hand.
The exact epsilon of a concrete pair is computed here independently (numpy/scipy: the privacy
loss distribution of the one-dimensional noised clipped sum on a fine grid, composed by FFT):
D holds 7 examples whose clipped gradient is +C u and a target whose clipped gradient is -C u
(a linear loss +-<w, u>); D' is D without the target. When D' is sampled at its own
q' = 6 / 7 (the old behaviour: q from len(x)) that pair's exact epsilon is 21.11 > 15.57.
"""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
from scipy import stats

import tf_dpiter as dp
from tf_dpiter import accounting

N, B, Z, EPOCHS, DELTA = 8, 6, 1.0, 10, 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ---- the exact epsilon of a concrete pair, independent of the library ----------------------

def _step_laws(num_others, g_other, g_target, q_with, q_without):
  """Atoms and weights of the clipped sum (in units of C along u) under D and under D'."""
  with_t, without_t = {}, {}
  for j, w in enumerate(stats.binom.pmf(np.arange(num_others + 1), num_others, q_with)):
    for b, wb in ((0, 1 - q_with), (1, q_with)):
      at = j * g_other + b * g_target
      with_t[at] = with_t.get(at, 0.0) + w * wb
  for j, w in enumerate(stats.binom.pmf(np.arange(num_others + 1), num_others, q_without)):
    without_t[j * g_other] = without_t.get(j * g_other, 0.0) + w
  return with_t, without_t


def exact_epsilon(law_p, law_q, sigma, steps, delta, grid=2e-3):
  """epsilon(delta) of `steps` independent releases of (law * N(0, sigma^2)), both orders."""
  x = np.linspace(-40 * sigma - 20, 40 * sigma + 20, 400001)
  dx = x[1] - x[0]
  dens = lambda law: sum(w * stats.norm.pdf(x, m, sigma) for m, w in law.items())
  p, q = dens(law_p), dens(law_q)
  best = 0.0
  for a, b in ((p, q), (q, p)):
    keep = a > 1e-300
    loss = np.log(a[keep]) - np.log(np.maximum(b[keep], 1e-300))
    w = a[keep] * dx
    w /= w.sum()
    lo = np.floor(loss.min() / grid) * grid
    pmf = np.bincount(np.round((loss - lo) / grid).astype(int), weights=w)
    size = 1 << int(np.ceil(np.log2(len(pmf) * steps)))
    tot = np.maximum(np.fft.irfft(np.fft.rfft(pmf, size) ** steps, size)[
        :(len(pmf) - 1) * steps + 1], 0.0)
    losses = lo * steps + grid * np.arange(len(tot))

    def hockey(eps):
      m = losses > eps
      return float(np.sum(tot[m] * -np.expm1(eps - losses[m])))
    if hockey(0.0) <= delta:
      continue
    lo_e, hi_e = 0.0, float(losses.max())
    for _ in range(80):
      mid = (lo_e + hi_e) / 2
      lo_e, hi_e = (mid, hi_e) if hockey(mid) > delta else (lo_e, mid)
    best = max(best, hi_e)
  return best


def _pair_epsilon(q_d, q_d_prime, g_other=1, g_target=-1):
  return exact_epsilon(*_step_laws(N - 1, g_other, g_target, q_d, q_d_prime), Z, EPOCHS, DELTA)


def _by_hand(q, steps, accountant):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(Z)), steps)
  acc = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
  acc.compose(event)
  return acc.get_epsilon(DELTA)


# ---- the real fit on D and on D' -----------------------------------------------------------

def _data(drop_target):
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 3).astype("float32"), rng.randint(0, 2, N)
  return (x[:-1], y[:-1]) if drop_target else (x, y)


def _fit(drop_target, **fit_kwargs):
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1), loss=LOSS)
  model.fit(*_data(drop_target), batch_size=B, epochs=EPOCHS, **fit_kwargs)
  (run,) = model.ledger.to_dict()["runs"]
  return model, run


def test_declared_population_keeps_q_public_and_the_claim_above_the_exact_pair(capsys):
  runs = {}
  for drop in (False, True):
    model, run = _fit(drop, population_size=N, verbose=2)
    runs[drop] = (model, run)
    assert run["population_size"] == N and run["count"] == EPOCHS
    assert run["selection_probability"] == pytest.approx(B / N, rel=1e-12)
  line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("tf_dpiter DP-SGD")]
  assert "declared population_size" in line[0] and "stays private" in line[0]
  # D (8 records) and D' (7) are sampled at one q: the neighbouring relation of the claim
  q_d, q_d_prime = (runs[d][1]["selection_probability"] for d in (False, True))
  assert q_d == q_d_prime
  model = runs[False][0]
  claim_rdp = accounting.epsilon(model.ledger, DELTA)
  claim_pld = accounting.epsilon(model.ledger, DELTA, accountant="pld")
  assert claim_rdp == pytest.approx(_by_hand(B / N, EPOCHS, "rdp"), rel=1e-9)
  assert claim_pld == pytest.approx(_by_hand(B / N, EPOCHS, "pld"), rel=1e-9)
  assert claim_rdp == pytest.approx(15.57, abs=0.01) and claim_pld == pytest.approx(14.39, abs=0.01)
  concrete = _pair_epsilon(q_d, q_d_prime)                  # others +C u, target -C u
  worst = _pair_epsilon(q_d, q_d_prime, g_other=0, g_target=1)   # the dominating pair
  assert concrete == pytest.approx(7.53, abs=0.02)
  assert concrete <= claim_pld <= claim_rdp
  assert worst <= claim_pld + 1e-3 and worst == pytest.approx(claim_pld, abs=0.01)
  statement = str(model.privacy_statement(DELTA))
  assert "declared, public population_size" in statement


def test_default_takes_n_from_the_data_and_states_that_it_is_treated_as_public(capsys):
  (model, run), (_, run_prime) = _fit(False, verbose=2), _fit(True, verbose=0)
  line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("tf_dpiter DP-SGD")]
  assert "taken from the data and treated as PUBLIC" in line[0]
  assert "population_size=N" in line[0]
  q_d, q_d_prime = run["selection_probability"], run_prime["selection_probability"]
  assert (q_d, q_d_prime) == (pytest.approx(6 / 8), pytest.approx(6 / 7))
  claim = accounting.epsilon(model.ledger, DELTA)
  assert claim == pytest.approx(15.57, abs=0.01)
  # the size is private: the neighbour sampled at its own q breaks the claim (the finding)
  assert _pair_epsilon(q_d, q_d_prime) == pytest.approx(21.11, abs=0.02)
  assert _pair_epsilon(q_d, q_d_prime) > claim
  # the documented relation (the size public: the neighbour sampled at the same q) holds
  assert _pair_epsilon(q_d, q_d) <= claim
  statement = str(model.privacy_statement(DELTA))
  assert "treated as public" in statement and "population_size=N" in statement
  report = accounting.privacy_report(model.ledger, delta=DELTA)
  assert any("the dataset's size is treated as public" in a for a in report.assumptions)


def test_population_size_larger_than_the_data_is_a_public_bound():
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1), loss=LOSS)
  x, y = _data(False)
  model.fit(x, y, batch_size=4, epochs=1, population_size=16, verbose=0)
  (run,) = model.ledger.to_dict()["runs"]
  # q = B / N and the steps round(N / B) come from the public N, not from len(x) = 8
  assert run["population_size"] == 16 and run["count"] == 4
  assert run["selection_probability"] == pytest.approx(0.25, rel=1e-12)


def test_population_size_is_refused_where_it_cannot_be_honoured():
  x, y = _data(False)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1), loss=LOSS)
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"`population_size` must be None with sampling='shuffle'.*"
                           r"Received: population_size=8"):
    model.fit(x, y, batch_size=4, sampling="shuffle", population_size=8, verbose=0)
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"`population_size` must be >= batch_size=6.*Received: "
                           r"population_size=5"):
    model.fit(x, y, batch_size=6, population_size=5, verbose=0)
  for bad in (0, float("nan"), True, "8"):
    with pytest.raises(dp.errors.PrivacyConfigError, match="`population_size` must be a finite"):
      model.fit(x, y, batch_size=4, population_size=bad, verbose=0)
  ds = dp.data.poisson_batches(x, y, expected_batch_size=4)
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"`population_size` must be None when fit is given a dataset"):
    model.fit(ds, population_size=8, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 0

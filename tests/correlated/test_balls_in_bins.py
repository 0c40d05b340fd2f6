"""Balls-in-bins sampling: the law it claims, its ledger policy, and its epsilon.

Relation: add or remove one example; unit: the example. Each epoch puts every example in one
of k steps uniformly at random; the ledger records policy balls_in_bins (sample_size k,
q = 1/k) and the epochs started as passes; epsilon is one un-amplified step mechanism per
epoch, compared here with dp-accounting called by hand, and checked against the exact
privacy profile of the k = 2 mixture computed by quadrature (an independent path).
"""

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter.accounting import accountant
from tf_dpiter.data import balls_in_bins as bib
from tf_dpiter.data import sampling
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec

# Nightly (`-m slow`): z = 0.5. test_recorded_bound_covers_the_exact_mixture_and_poisson_would_
# not[0.3333333333333333-1.0] stays by default: the same branch (z < 1), the same two
# assertions (the ledger's PLD bound >= the exact two-step delta; per-step Poisson below 0.95
# of it), at less noise, where the gap Poisson misses is the larger; [2.0-1.0] keeps z >= 1.
SLOW_CASES = {"test_recorded_bound_covers_the_exact_mixture_and_poisson_would_not[0.5-1.0]"}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("n,k", [(100, 4), (37, 5), (10, 10)])
def test_every_example_is_in_exactly_one_step_per_epoch(n, k):
  sampler = bib.BallsInBinsSampler(n, k, seed=n)
  for epoch in range(3):
    steps = sampler.next_epoch()
    assert len(steps) == k
    joined = np.sort(np.concatenate(steps))
    np.testing.assert_array_equal(joined, np.arange(n))
  assert sampler.take_new_passes() == 3   # epochs drawn since the sampler was made
  assert sampler.take_new_passes() == 0


def test_steps_are_uniform_and_independent_of_the_index():
  n, k, epochs = 400, 4, 300
  sampler = bib.BallsInBinsSampler(n, k, seed=0)
  counts = np.zeros([n, k])
  for _ in range(epochs):
    for j, idx in enumerate(sampler.next_epoch()):
      counts[idx, j] += 1
  # Each cell ~ Binomial(epochs, 1/k): sd sqrt(epochs p (1-p)) = 7.5; pooled over all records
  # the per-step mean is within 5 sd / sqrt(n) of epochs / k.
  sd = np.sqrt(epochs * (1 / k) * (1 - 1 / k))
  assert np.all(np.abs(counts.mean(0) - epochs / k) <= 5 * sd / np.sqrt(n))
  chi2 = ((counts - epochs / k) ** 2 / (epochs / k)).sum(1)      # ~ chi2(k - 1) per record
  assert abs(chi2.mean() - (k - 1)) <= 5 * np.sqrt(2 * (k - 1) / n)


def test_dataset_pads_to_one_size_and_carries_its_spec():
  x = np.arange(60, dtype="float32").reshape(60, 1)
  ds = bib.balls_in_bins_batches(x, x[:, 0], expected_batch_size=12, epochs=2, seed=1)
  spec = sampling.get_sampling_spec(ds)
  assert spec[:4] == (rec.BALLS_IN_BINS, 60, 1 / 5, 5.0)
  seen = []
  for bx, by, mask in ds:
    m = int(mask.numpy().sum())
    assert bx.shape[0] == spec.sampler.max_batch_size() and np.all(mask.numpy()[m:] == 0)
    np.testing.assert_array_equal(bx.numpy()[:m, 0], by.numpy()[:m])
    seen.append(bx.numpy()[:m, 0])
  assert len(seen) == 10
  for epoch in (seen[:5], seen[5:]):
    np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), np.arange(60))
  assert spec.sampler.take_new_passes() == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"steps_per_epoch": 0}, "steps_per_epoch"), ({"steps_per_epoch": 11}, "steps_per_epoch"),
    ({}, "expected_batch_size"), ({"steps_per_epoch": 2, "epochs": 0}, "epochs"),
    ({"steps_per_epoch": 2, "max_batch_size": 0}, "max_batch_size")])
def test_bad_arguments_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    bib.balls_in_bins_batches(np.zeros([10, 1]), **kwargs)


def _ledger(steps, z, k=10, n=1000, passes=None):
  samples = np.array([[n, 1 / k, k, rec.policy_code(rec.BALLS_IN_BINS), 1, 1]] * steps, float)
  queries = np.array([[i, rec.GAUSSIAN, 1.0, z, 1.0] for i in range(steps)], float)
  return ledger_file.arrays_to_dict(samples, queries, passes=passes or -(-steps // k))


@pytest.mark.parametrize("acc_name", ["rdp", "pld"])
@pytest.mark.parametrize("steps,z,k", [(30, 2.0, 10), (25, 2.5, 5)])
def test_epsilon_equals_dp_accounting_by_hand(acc_name, steps, z, k):
  d = _ledger(steps, z, k)
  report = accountant.privacy_report(d, delta=1e-5, accountant=acc_name)
  acc = (dpa.rdp.RdpAccountant() if acc_name == "rdp" else dpa.pld.PLDAccountant())
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), -(-steps // k)))
  assert report.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  assert any("balls-in-bins" in a and "add or remove one example" in a and
             "NO amplification" in a for a in report.assumptions)


def test_too_few_epochs_are_refused_and_none_charges_every_step():
  with pytest.raises(ValueError, match="at least 3"):
    accountant.privacy_report(_ledger(30, 1.0, passes=2), delta=1e-5)
  samples = np.array([[1000, 0.1, 10, rec.policy_code(rec.BALLS_IN_BINS), 1, 1]] * 5, float)
  queries = np.array([[i, rec.GAUSSIAN, 1.0, 3.0, 1.0] for i in range(5)], float)
  report = accountant.privacy_report((samples, queries, 0), delta=1e-5)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(3.0), 5))
  assert report.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_q_must_be_one_over_k():
  samples = np.array([[1000, 0.2, 10, rec.policy_code(rec.BALLS_IN_BINS), 1, 0]], float)
  with pytest.raises(ValueError, match="1 / sample_size"):
    rec.validate_arrays(samples, np.zeros([0, 5]))


def _exact_two_step_delta(mu, eps, nodes=160):
  """delta(eps) of the k = 2 balls-in-bins epoch of two Gaussian steps (sensitivity mu in noise
  units), both directions, by Gauss-Hermite quadrature over the two outputs."""
  g, w = np.polynomial.hermite_e.hermegauss(nodes)
  w = w / w.sum()
  x1, x2 = np.meshgrid(g, g, indexing="ij")
  weights = np.outer(w, w)

  def loss(a, b):   # log of the with/without likelihood ratio
    return np.logaddexp(mu * a - mu ** 2 / 2, mu * b - mu ** 2 / 2) - np.log(2)

  remove = np.sum(weights * np.maximum(0, 1 - np.exp(eps - loss(x1 + mu, x2))))
  add = np.sum(weights * np.maximum(0, 1 - np.exp(eps + loss(x1, x2))))
  return max(remove, add)


@pytest.mark.parametrize("z,eps", [(1 / 3, 1.0), (0.5, 1.0), (2.0, 1.0)])
def test_recorded_bound_covers_the_exact_mixture_and_poisson_would_not(z, eps):
  exact = _exact_two_step_delta(1 / z, eps)
  acc = dpa.pld.PLDAccountant()
  acc.compose(accountant.ledger_to_dp_event(_ledger(2, z, k=2, n=100), accountant="pld"))
  assert acc.get_delta(eps) >= exact
  if z < 1:
    # Low noise: per-step Poisson at rate 1/k (dp-accounting's mixture of Gaussians
    # [0, 1] with probabilities [1/2, 1/2] per step) understates delta, even computed
    # pessimistically (a coarse discretization only raises it).
    poisson = dpa.pld.PLDAccountant(value_discretization_interval=1e-2)
    poisson.compose(dpa.SelfComposedDpEvent(
        dpa.dp_event.MixtureOfGaussiansDpEvent(z, [0.0, 1.0], [0.5, 0.5]), 2))
    assert poisson.get_delta(eps) < 0.95 * exact


def test_fit_records_the_policy_and_one_pass_per_epoch():
  import keras  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  x = np.random.RandomState(0).randn(64, 4).astype("float32")
  y = (x[:, 0] > 0).astype("int64")
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.2, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(dp.data.balls_in_bins_batches(x, y, steps_per_epoch=4, seed=0), epochs=3, verbose=0)
  d = model.ledger.to_dict()
  assert d["num_samples"] == 12 and d["passes"] >= 3
  (run,) = d["runs"]
  assert (run["policy"], run["sample_size"], run["selection_probability"]) == (
      rec.BALLS_IN_BINS, 4.0, 0.25)
  report = accountant.privacy_report(model.ledger, delta=1e-5)
  acc = dpa.rdp.RdpAccountant()
  z = run["queries"][0]["stddev"] / run["queries"][0]["sensitivity"]    # 1.2 in float32
  assert z == pytest.approx(1.2, rel=1e-6)
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), min(d["passes"], 12)))
  assert report.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)

"""Shuffled passes and balls-in-bins epochs across fits: participations vs the ledger's claim.

The real pipeline, noise 0, a one-hot linear model (the trained weights show which examples
each step used; see test_cyclic_schedule). Over several fits with steps_per_epoch (every fit
drops what its iterator prefetched) and a new dataset per fit, each example joins at most once
per pass (epoch) the ledger charges, and the ledger charges exactly the passes that were used.
"""

import warnings

import pytest

import tf_dpiter as dp
from tf_dpiter.data import balls_in_bins
from tf_dpiter.data import shuffling

from tests.privacy import privacy_joins  # noqa: E402

# Nightly tier (-m slow): one case per policy and per dataset mode stays, [False-balls_in_bins]
# and [True-shuffle]; shuffle's same-dataset fits are also test_policy_matrix.py's
# [shuffle-fits_steps], a new dataset per fit its [cyclic_poisson-new_dataset].
SLOW_CASES = {
    "test_each_example_joins_at_most_once_per_charged_pass[False-shuffle]",
    "test_each_example_joins_at_most_once_per_charged_pass[True-balls_in_bins]"}

N = 24


_Recorder = privacy_joins.JoinRecorder


def _model():
  return privacy_joins.one_hot_model(N)


def _data():
  return privacy_joins.one_hot_data(N)


@pytest.mark.parametrize("policy", ["shuffle", "balls_in_bins"])
@pytest.mark.parametrize("new_dataset", [False, True])
def test_each_example_joins_at_most_once_per_charged_pass(policy, new_dataset):
  x, y = _data()
  make = {"shuffle": lambda: shuffling.shuffled_batches(x, y, batch_size=6, passes=None),
          "balls_in_bins": lambda: balls_in_bins.balls_in_bins_batches(
              x, y, steps_per_epoch=4, epochs=16)}[policy]
  model, joined, ds = _model(), [], make()
  for _ in range(6):
    if new_dataset:
      ds = make()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      model.fit(ds, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[_Recorder(joined)])
  passes = int(model.ledger.passes)
  assert len(joined) == int(model.ledger.sample_count) == 18
  joins = [sum(i in s for s in joined) for i in range(N)]
  assert max(joins) <= passes
  # the passes charged are the passes used: a shuffled fit of 3 steps (4 per pass) is one
  # new pass; balls in bins continues its allocation (same dataset) or starts one (new).
  if policy == "shuffle":
    assert passes == 6
  elif new_dataset:
    assert passes == 6
  else:
    assert passes <= 6 and passes >= -(-18 // 4)
  # the ledger is accountable: it records at least the passes its samples need
  assert dp.accounting.epsilon(model.ledger, 1e-5) == float("inf")   # noise 0

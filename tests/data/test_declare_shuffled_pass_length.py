"""dp.data.declare_shuffled checks the pass length it declares (review R2-finding-6).

Relation: replace one example (n public), shuffled passes, no amplification; unit: one
example; a DP-FTRL leaf has sensitivity 2S. The ledger charges one mechanism per pass (under
noise="tree" one SingleEpochTreeAggregationDpEvent per pass), sound only if every tree lies
inside one pass. A pipeline that `.filter`s 12 of n = 48 records has 6 batches of B = 6 a
pass, not the declared ceil(48 / 6) = 8: with restart_every R = 4 the second tree (steps 4-7)
would hold the end of pass 1 and the start of pass 2 (the review measured epsilon 18.39
charged against 20.31 by dp-accounting for what ran). The sampler now refuses the pass that
would start after a pass of another length, before any step takes its first batch: nothing
drawn, charged or applied for it. A correct declaration (steps_per_pass=6, R = 2) trains and
its epsilon equals dp-accounting called by hand; a new fit continues the pass count.
"""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import shuffling
from tf_dpiter.errors import PrivacyConfigError

N, B, DELTA, CLIP, Z = 48, 6, 1e-5, 1.0, 1.3
KEPT = 36   # records the pipeline keeps: 6 batches a pass
# fit raises the sampler's PrivacyConfigError when it unwraps it; a loop over the dataset
# sees tf.data's InvalidArgumentError carrying the same message
REFUSED = (PrivacyConfigError, tf.errors.InvalidArgumentError)


def _filtered(steps_per_pass=None, repeat=1):
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)
  keep = np.arange(N) >= N - KEPT   # 12 malformed records filtered out
  ds = (tf.data.Dataset.from_tensor_slices((x, y, keep))
        .shuffle(N, reshuffle_each_iteration=True)
        .filter(lambda a, b, k: k).map(lambda a, b, k: (a, b)).batch(B).repeat(repeat))
  return dp.data.declare_shuffled(ds, population_size=N, batch_size=B,
                                  steps_per_pass=steps_per_pass)


def _model(restart_every, jit_compile=False):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      CLIP, Z, noise="tree", restart_every=restart_every, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile)
  return model


def _tree_epsilon(model, restart_every, per_pass, passes):
  """dp-accounting by hand: per pass, per_pass / R trees of R leaves, one leaf per example
  (replace one: 2S per node); the node stddev as the ledger recorded it."""
  [run] = model.ledger.to_dict()["runs"]
  [row] = run["queries"]
  assert (run["policy"], row["type"]) == ("shuffle", "tree_gaussian")
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
  acc.compose(dpa.SingleEpochTreeAggregationDpEvent(
      row["stddev"] / (2 * CLIP), [restart_every] * (per_pass // restart_every)), passes)
  return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_pass_shorter_than_declared_is_refused_before_its_first_step(jit_compile):
  warnings.simplefilter("ignore")
  model = _model(4, jit_compile)
  with pytest.raises(REFUSED, match=r"a pass of the declared pipeline had 6 batches, not the "
                     r"declared 8: pass steps_per_pass=6 to declare_shuffled .*Received: "
                     r"steps_per_pass=8"):
    model.fit(_filtered(), epochs=4, verbose=0)
  # the first pass's 6 steps ran and were charged; the refused pass took no step, drew no
  # noise and left the tree where the sixth step put it
  d = model.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (6, 1)
  assert int(model.optimizer.iterations.numpy()) == 6
  assert int(model.optimizer.noise_state().step) == 6
  eps = dp.accounting.epsilon(model.ledger, DELTA)
  assert eps == pytest.approx(_tree_epsilon(model, 4, 8, 1), rel=1e-9)


def test_the_declared_pass_length_trains_and_is_charged_as_by_hand():
  warnings.simplefilter("ignore")
  model = _model(2)
  model.fit(_filtered(steps_per_pass=6), epochs=4, verbose=0)
  d = model.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (24, 4)
  # the filtered pipeline's cardinality is unknown: each epoch ends with a call of the train
  # function whose batch never comes; it draws no noise and leaves the tree unmoved
  assert int(model.optimizer.noise_state().step) == 24
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(
      _tree_epsilon(model, 2, 6, 4), rel=1e-9)
  # a new fit on the same pipeline continues the pass count (never restarts it)
  model.fit(_filtered(steps_per_pass=6), epochs=1, verbose=0)
  d = model.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (30, 5)
  assert int(model.optimizer.noise_state().step) == 30
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(
      _tree_epsilon(model, 2, 6, 5), rel=1e-9)


def test_a_new_fit_after_a_short_pass_is_refused_inside_the_tree():
  """One epoch of the mis-declared pipeline puts no tree across passes (6 steps); a new fit
  would start a pass inside tree 2 (steps 4-7): the mechanism's boundary check refuses it
  before any step."""
  warnings.simplefilter("ignore")
  model = _model(4)
  model.fit(_filtered(), epochs=1, verbose=0)
  with pytest.raises(PrivacyConfigError, match=r"restart_every=4: the mechanism is at step "
                     r"\d+, inside a tree"):
    model.fit(_filtered(), epochs=1, verbose=0)
  d = model.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (6, 1)


def _loop(ds, iterations):
  """A custom loop's view: batches per iteration, and the passes the sampler counted."""
  sampler = dp.data.get_sampling_spec(ds).sampler
  sizes = [sum(1 for _ in ds) for _ in range(iterations)]
  return sizes, sampler.take_new_passes()


def test_a_loop_over_a_declared_pipeline_is_refused_at_the_pass_after_a_short_one():
  ds = _filtered()
  it = iter(ds)
  assert sum(1 for _ in it) == 6
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"had 6 batches, not the declared "
                     r"8: pass steps_per_pass=6"):
    next(iter(ds))
  assert dp.data.get_sampling_spec(ds).sampler.take_new_passes() == 1   # not the refused one
  assert _loop(_filtered(steps_per_pass=6), 3) == ([6, 6, 6], 3)


def test_an_iteration_of_whole_passes_is_accepted_and_a_longer_odd_one_refused():
  # two whole passes an iteration (12 batches, steps_per_pass 6): 2 passes counted each
  assert _loop(_filtered(steps_per_pass=6, repeat=2), 2) == ([12, 12], 4)
  ds = _filtered(steps_per_pass=8, repeat=2)   # 12 batches: not a multiple of 8
  assert sum(1 for _ in ds) == 12
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"yielded 12 batches, not a "
                     r"multiple of the declared steps_per_pass \(its last pass had 4 batches"):
    next(iter(ds))


def test_the_sampler_judges_only_iterations_of_the_current_fit():
  sampler = shuffling.ShuffleSampler(8)
  sampler.start_iteration()
  for _ in range(5):   # a fit's iterator dropped after 5 prefetched batches
    sampler.step_drawn()
  sampler.begin_fit()
  sampler.start_iteration()   # a new fit's iteration: the dropped one is not judged
  for _ in range(3):
    sampler.step_drawn()
  with pytest.raises(PrivacyConfigError, match=r"had 3 batches, not the declared 8") as err:
    sampler.start_iteration()
  assert sampler.refusal is err.value


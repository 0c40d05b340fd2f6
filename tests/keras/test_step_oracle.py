"""The step oracle: one real DP step (noise 0) against an independent per-record loop.

With noise 0 and SGD(learning_rate=1) the weights move by the DP gradient
sum_r clip_C(g_r) / D, where a record r is one example (or, with `num_microbatches` = m < B,
the mean gradient of the examples i = r mod m), clip_C(g) = g min(1, C / ||g||) (Abadi et al.
2016, "Deep Learning with Differential Privacy", Algorithm 1; McMahan et al. 2018, "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Section
5.1 for microbatches), and D the policy's public denominator: the expected number of records
E / (examples per record) for Poisson sampling (add/remove one example), the number of
records in the batch for shuffled passes (replace-one). Rows of sample weight 0 are padding
and contribute nothing.

The reference (`dp_keras_helpers.reference_gradient`) runs each record alone through the
model under its own tape, clips it in float64 and sums: no code of the library's step. The
cases cover every pair of values of the axes {model} x {clipping path} x {jit_compile} x
{microbatches} x {physical chunk} x {padding rows} x {policy} x {entry point} at least once
(all-pairs, generated below), so each axis is checked against every other one.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B, CLIP, N = 8, 0.05, 64
PAD = 3   # padding rows (sample weight 0) appended to a padded batch

AXES = {
    "model": ["dense", "conv", "embedding", "lstm", "gru", "multi_input", "regularized"],
    "clipping": ["fast", "vectorized"],
    "jit": [False, True],
    # None and B: one example per record; 2: 4 per record; 3 does not divide B (example i
    # goes to record i mod 3)
    "micro": [None, B, 2, 3],
    "physical": [None, 4],          # max_physical_batch_size
    "padding": [False, True],
    "policy": ["poisson", "shuffle"],
    "entry": ["train_on_batch", "fit"],
}


def _allowed(case):
  """The library refuses microbatches of several examples under Poisson sampling (removing
  one example re-deals the others) and the fast path on a model with regularization losses
  (its penalty is not per example); a shuffled pass has no padding rows."""
  if case["model"] == "regularized" and case["clipping"] == "fast":
    return False
  if case["micro"] in (2, 3) and case["policy"] == "poisson":
    return False
  if case["padding"] and case["policy"] != "poisson":
    return False
  return True


def _cost(case):
  """A rough relative CPU cost of a case (measured: the XLA compilation of a recurrent model,
  more so over physical chunks, dominates; a plain step is about 1)."""
  rnn = case["model"] in ("lstm", "gru")
  cost = 1.0 + (0.4 if rnn else 0.0) + (0.3 if case["entry"] == "fit" else 0.0)
  if case["jit"]:
    cost += 0.6 + (2.5 if rnn else 0.0) + (0.8 if case["physical"] else 0.0) * (3 if rnn else 1)
  return cost


def _all_pairs():
  """A greedy all-pairs cover of AXES among the allowed combinations (deterministic): each
  pick covers the most uncovered pairs, the cheapest (`_cost`) among equals."""
  names = list(AXES)
  combos = [dict(zip(names, values)) for values in itertools.product(*AXES.values())]
  combos = [c for c in combos if _allowed(c)]

  def pairs(c):
    return {((a, repr(c[a])), (b, repr(c[b]))) for a, b in itertools.combinations(names, 2)}

  combo_pairs = [pairs(c) for c in combos]   # each combination's pairs, formed once
  uncovered = set().union(*combo_pairs)
  cases = []
  while uncovered:
    best = max(range(len(combos)),
               key=lambda i: (len(combo_pairs[i] & uncovered), -_cost(combos[i]), -i))
    uncovered -= combo_pairs[best]
    cases.append(combos[best])
  return cases


CASES = _all_pairs()


def _data(kind, rng, rows):
  if kind in ("dense", "regularized"):
    return rng.randn(rows, 6).astype("float32"), rng.randint(0, 3, rows)
  if kind == "conv":
    return rng.randn(rows, 8, 8, 2).astype("float32"), rng.randint(0, 3, rows)
  if kind in ("embedding", "lstm", "gru"):
    return rng.randint(0, 20, (rows, 5)).astype("int32"), rng.randint(0, 3, rows)
  return ({"a": rng.randn(rows, 4).astype("float32"), "b": rng.randn(rows, 3).astype("float32")},
          rng.randint(0, 3, rows))


def _model(kind):
  keras.utils.set_random_seed(1)
  if kind == "dense":
    layers = [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
  elif kind == "conv":
    layers = [keras.Input((8, 8, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
              keras.layers.MaxPooling2D(2), keras.layers.Flatten(), keras.layers.Dense(3)]
  elif kind == "embedding":
    layers = [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]
  elif kind in ("lstm", "gru"):
    # LSTM: Keras' while_loop (the sequential fallback); GRU: unroll=True (vectorized)
    rnn = keras.layers.LSTM(4) if kind == "lstm" else keras.layers.GRU(4, unroll=True)
    layers = [keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4), rnn,
              keras.layers.Dense(3)]
  elif kind == "regularized":
    # the penalty is part of each record's loss, clipped with it
    layers = [keras.Input((6,)),
              keras.layers.Dense(5, kernel_regularizer=keras.regularizers.L2(0.5)),
              keras.layers.Dense(3)]
  else:
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4, activation="relu")(a),
                                    keras.layers.Dense(2)(b)])
    return dp.keras.make_private(keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h)))
  return dp.keras.DPSequential(layers)


def _one_step(model, case, x, y, w):
  """The weight change of one step through the case's entry point."""
  if case["entry"] == "train_on_batch":
    return helpers.one_step_update(model, x, y, sample_weight=w)
  # fit on a dataset whose batch axis is unknown to the trace (as fit's padded samples)
  ds = tf.data.Dataset.from_tensors((x, y, w))
  ds = ds.map(lambda a, b, c: (a, b, c))
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def _case_id(case):
  return "-".join(f"{k}={v}" for k, v in case.items())


def test_the_cases_cover_every_pair():
  names = list(AXES)
  for a, b in itertools.combinations(names, 2):
    seen = {(c[a], c[b]) for c in CASES}
    wanted = {(u, v) for u in AXES[a] for v in AXES[b]
              if any(_allowed(dict(zip(names, vals))) for vals in itertools.product(
                  *[[u] if n == a else [v] if n == b else AXES[n] for n in names]))}
    assert seen == wanted, (a, b, wanted - seen)
  assert len(CASES) <= 30


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_equals_the_per_record_oracle(case):
  rng = np.random.RandomState(len(_case_id(case)))
  rows = B + PAD if case["padding"] else B
  x, y = _data(case["model"], rng, rows)
  w = np.ones(rows, "float32")
  w[B:] = 0.0
  model = _model(case["model"])
  assert isinstance(model, dp.keras.DPModelMixin)   # make_private's, for multi_input
  opt = dp.keras.DPKerasSGDOptimizer(
      CLIP, 0.0, case["micro"], learning_rate=1.0, clipping=case["clipping"],
      max_physical_batch_size=case["physical"])
  model.compile(optimizer=opt, loss=LOSS, jit_compile=case["jit"])
  real_x = tf.nest.map_structure(lambda a: a[:B], x)
  model(real_x)
  # Poisson: the public denominator is the expected sample size E = B declared here
  # (q = B / N); shuffled passes: the batch's B examples.
  model.optimizer.set_sampling(N, B / N, case["policy"], B)
  ref = helpers.reference_gradient(model, LOSS, real_x, y[:B], clip=CLIP,
                                   num_microbatches=case["micro"])
  got = _one_step(model, case, x, y, w)
  # reference: sum over records / records, times the pinned sum's clip shrink
  helpers.assert_close_up_to_the_shrink(got, ref, rtol=2e-4, atol=2e-6)
  assert max(float(np.abs(r).max()) for r in ref) > 0
  assert int(model.optimizer.ledger.sample_count.numpy()) == 1

"""Every input structure Keras' `fit` accepts trains under DP `fit`, exactly.

For each structure (a list of inputs, a tuple, a dict of named inputs, a nest of both, a
list of targets for several outputs, sample weights, a tf.data dataset, shuffled passes),
each clipping path (fast ghost norms, vectorized per-example gradients) and with or without
XLA, two steps of DP `fit` with noise 0 and SGD(lr=1) move the weights by the mean of the
per-example gradients, each clipped to C, computed by an independent Python loop
(`dp_keras_helpers.reference_gradient`) at the weights of each step; the ledger counts the
two steps. Poisson sampling on arrays uses batch_size = n (q = 1: every example is in both
samples, so the reference knows the batch); under XLA the n = 6 examples are padded to 8
rows of which 2 have weight 0. The cases are pairwise (every structure on both paths, every
structure and every path with and without XLA), and `clipping="auto"` is checked to route
every structure's model to the fast path.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.errors import PrivacyConfigError

N, CLIP, STEPS = 6, 0.05, 2
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MSE = keras.losses.MeanSquaredError()


def _arrays(seed=0):
  rng = np.random.RandomState(seed)
  return {"a": rng.randn(N, 4).astype("float32"), "b": rng.randn(N, 3).astype("float32"),
          "c": rng.randn(N, 2).astype("float32"), "b4": rng.randn(N, 4).astype("float32"),
          "y": rng.randint(0, 3, N),
          "r": rng.randn(N, 1).astype("float32"),
          "w": np.array([1.0, 0.5, 2.0, 0.0, 1.0, 1.5], "float32")}


def _inputs():
  return keras.Input((4,), name="a"), keras.Input((3,), name="b"), keras.Input((2,), name="c")


def _two_input_head(ia, ib):
  h = keras.layers.Concatenate()([keras.layers.Dense(4, activation="tanh")(ia),
                                  keras.layers.Dense(2)(ib)])
  return keras.layers.Dense(3)(h)


def _case(structure):
  """(model, fit's data keyword arguments, the reference's (x, y, sample_weight), loss)."""
  keras.utils.set_random_seed(1)
  d = _arrays()
  ia, ib, ic = _inputs()
  a, b, y = d["a"], d["b"], d["y"]
  if structure == "list":   # inputs of one shape: a stacked list was ONE input of [2, B, 4]
    ib4 = keras.Input((4,), name="b")
    model = keras.Model([ia, ib4], _two_input_head(ia, ib4))
    x = [a, d["b4"]]
  elif structure in ("list_sample_weight", "shuffle_list"):
    model = keras.Model([ia, ib], _two_input_head(ia, ib))
    x = [a, b]
  elif structure == "tuple":   # the DP functional class itself, not make_private
    model = dp.keras.DPModel([ia, ib], _two_input_head(ia, ib))
    x = (a, b)
  elif structure == "dict":
    model = keras.Model({"a": ia, "b": ib}, _two_input_head(ia, ib))
    x = {"a": a, "b": b}
  elif structure == "nested":   # a dict holding a list
    h = keras.layers.Concatenate()([keras.layers.Dense(4, activation="tanh")(ia), ib,
                                    keras.layers.Dense(2)(ic)])
    model = keras.Model({"a": ia, "pair": [ib, ic]}, keras.layers.Dense(3)(h))
    x = {"a": a, "pair": [b, d["c"]]}
  elif structure == "multi_output":   # a list of targets, one per output
    h = keras.layers.Dense(4, activation="tanh")(ia)
    model = keras.Model(ia, [keras.layers.Dense(3)(h), keras.layers.Dense(1)(h)])
    x, y = a, [y, d["r"]]
  elif structure == "dataset":   # tf.data, its sampling declared with set_sampling
    model = keras.Model([ia, ib], _two_input_head(ia, ib))
    x = (a, b)
  else:
    raise ValueError(structure)
  model = dp.keras.make_private(model)
  w = d["w"] if structure == "list_sample_weight" else None
  kwargs = {"x": x, "y": y, "batch_size": N}
  if w is not None:
    kwargs["sample_weight"] = w
  if structure == "shuffle_list":
    kwargs["sampling"] = "shuffle"
  if structure == "dataset":
    kwargs = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(N)}
  loss = [SCCE, MSE] if structure == "multi_output" else SCCE
  return model, kwargs, (x, y, w), loss


def _reference_loss(structure):
  if structure != "multi_output":
    return SCCE
  return lambda y, pred, sample_weight=None: SCCE(y[0], pred[0]) + MSE(y[1], pred[1])


STRUCTURES = ("list", "tuple", "dict", "nested", "multi_output", "list_sample_weight",
              "dataset", "shuffle_list")
# Pairwise: every structure on both clipping paths, each path with and without XLA, and
# every structure with and without XLA (structure i: fast under XLA iff i is even). By
# default each structure once, each (path, XLA) pair twice; the rest with -m slow.
CASES = [(s, clipping, (i % 2 == 0) == (clipping == "fast"))
         for i, s in enumerate(STRUCTURES) for clipping in ("fast", "vectorized")]
_DEFAULT = {(s, ("fast", "fast", "vectorized", "vectorized")[i % 4])
            for i, s in enumerate(STRUCTURES)}


def _case_id(case):
  structure, clipping, jit = case
  return f"{structure}-{clipping}-{'xla' if jit else 'graph'}"


@pytest.mark.parametrize("structure,clipping,jit", [
    pytest.param(*c, id=_case_id(c), marks=() if c[:2] in _DEFAULT else pytest.mark.slow)
    for c in CASES])
def test_fit_update_is_the_mean_of_clipped_per_example_gradients(structure, clipping, jit):
  model, kwargs, (x, y, w), loss = _case(structure)
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, clipping=clipping)
  model.compile(optimizer=opt, loss=loss, jit_compile=jit)
  x, y = keras.tree.lists_to_tuples(x), keras.tree.lists_to_tuples(y)
  start = [v.numpy().copy() for v in model.trainable_variables]
  ref_loss = _reference_loss(structure)
  unclipped = helpers.reference_gradient(model, ref_loss, x, y, 1e9, sample_weight=w)
  # the reference: STEPS steps of -lr * (mean of clipped per-example gradients), from start
  for step in range(STEPS):
    ref = helpers.reference_gradient(model, ref_loss, x, y, CLIP, sample_weight=w)
    if step == 0:   # the clip is active: the clipped mean is not the plain mean
      assert max(float(np.abs(r - u).max()) for r, u in zip(ref, unclipped)) > 1e-4
    for v, r in zip(model.trainable_variables, ref):
      v.assign(v.numpy() - r)
  expected = [s - v.numpy() for s, v in zip(start, model.trainable_variables)]
  for v, s in zip(model.trainable_variables, start):
    v.assign(s)
  if structure == "dataset":
    model.optimizer.set_sampling(N, 1.0, "poisson", N)
  model.fit(epochs=STEPS, verbose=0, **kwargs)
  got = [s - v.numpy() for s, v in zip(start, model.trainable_variables)]
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-6)
  assert int(model.ledger.sample_count.numpy()) == STEPS


@pytest.mark.parametrize("structure", STRUCTURES)
def test_auto_clipping_takes_the_fast_path(structure):
  # clipping="auto" (the default) routes every structure's model to the fast path: the
  # batch-independence probe reads the model's inputs in their own structure
  model, _, _, loss = _case(structure)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0),
                loss=loss)
  assert model.optimizer.resolve_clipping(model) == "fast"


RAGGED_ROWS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 1], [2], [3, 3]]


def _ragged_model(clipping, jit=False):
  keras.utils.set_random_seed(1)
  model = dp.keras.make_private(keras.Sequential([
      keras.Input((None,), ragged=True, dtype="int32"), keras.layers.Embedding(10, 4),
      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0,
                                                       clipping=clipping),
                loss=SCCE, jit_compile=jit)
  return model


@pytest.mark.parametrize("data,clipping", [("arrays", "auto"), ("dp_data_padded", "vectorized")])
def test_ragged_fit_is_exact(data, clipping):
  # Keras' fit takes a tf.RaggedTensor (Input(ragged=True)); DP fit samples its rows by
  # Poisson and clips them record by record (the vectorized path, looping over records:
  # "auto" takes it, the fast path's probe cannot shape ragged inputs). The dp.data sampler
  # pads the 6 rows to 8 with rows of one zero (weight 0), which must add nothing.
  x = tf.ragged.constant(RAGGED_ROWS, dtype=tf.int32)
  y = np.arange(N) % 3
  model = _ragged_model(clipping)
  start = [v.numpy().copy() for v in model.trainable_variables]
  ref = helpers.reference_gradient(model, SCCE, x, y, CLIP)
  if data == "arrays":
    model.fit(x, y, batch_size=N, epochs=1, verbose=0)
  else:
    model.fit(dp.data.poisson_batches(x, y, expected_batch_size=N, max_batch_size=8),
              epochs=1, verbose=0)
  got = [s - v.numpy() for s, v in zip(start, model.trainable_variables)]
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
  assert max(float(np.abs(r).max()) for r in ref) > 1e-4
  assert int(model.ledger.sample_count.numpy()) == 1


@pytest.mark.parametrize("case", ["ragged_xla", "ragged_shuffle", "sparse"])
def test_unsupported_arrays_are_refused_before_any_step(case):
  # ragged rows have no static shape (XLA, replica shards) and shuffled passes slice numpy
  # arrays; sparse arrays are not sampled: each is refused at once, naming what to do
  y = np.arange(N) % 3
  if case == "sparse":
    model = dp.keras.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]))
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0),
                  loss=SCCE)
    x, kwargs, match = tf.sparse.from_dense(np.eye(N, 4, dtype="float32")), {}, "tf.sparse.to_dense"
  else:
    model = _ragged_model("vectorized", jit=case == "ragged_xla")
    x = tf.ragged.constant(RAGGED_ROWS, dtype=tf.int32)
    kwargs = {"sampling": "shuffle"} if case == "ragged_shuffle" else {}
    match = "Received: sampling='shuffle'" if kwargs else "`jit_compile` must be False"
  with pytest.raises(PrivacyConfigError, match=match):
    model.fit(x, y, batch_size=N, verbose=0, **kwargs)
  assert int(model.optimizer.iterations.numpy()) == 0


def test_ragged_fit_refuses_the_fast_path_by_name():
  # the fast path's per-example pass reshapes dense rows: clipping="fast" on ragged inputs is
  # refused naming them (session 48: before, its pass failed inside the trace with
  # "ValueError: All relevant dimensions must be uniform" once the route was decided
  # without a probe before the pass)
  model = _ragged_model("fast")
  with pytest.raises(dp.PrivacyConfigError, match="ragged or sparse"):
    model.fit(tf.ragged.constant(RAGGED_ROWS, dtype=tf.int32), np.arange(N) % 3,
              batch_size=N, epochs=1, verbose=0)

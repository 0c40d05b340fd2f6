"""Add/remove-one neighbours through the real `fit` step under XLA for a model whose clipped
sum shares ops (algebra.once_per_graph: Gram matrices, [x, 1], reshapes, weightings) and takes
EinsumDense projections as Dense layers (rules/dense.py `_as_dense`).

Relation: add or remove one example (Poisson sampling); sensitivity C. The model reads one
input through three projections (one shared Gram, exact) and through a fourth projection of a
different tensor of the same shape (x * 2: it must never get x's Gram), then an output
projection "abcd,cde->abe". The padded Poisson batch reaches the compiled step with a batch
size the trace does not know, so the first E records run in one chunk and the tail in a loop
of chunks (the shared ops are built again in the loop body's graph). With noise 0 and
SGD(lr=1) the step moves the weights by sum_i clip(g_i) / E: it must equal the clipped
per-example sum of an independent loop, and every neighbour tried must move it by at most C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source
from tests.keras import dp_keras_helpers as helpers
from tests.privacy import neighbours
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import dense as dense_rule

# Nightly tier (-m slow): the gram form under XLA; by default the ordinary fast
# form in graph and under XLA (one neighbouring case per jit).
SLOW_CASES = {
    "test_fit_shared_ops_move_the_sum_by_at_most_c[gram-True]"}

CLIP, N, E, REAL, ROWS, T, K, H, D = 0.4, 1000, 8, 13, 32, 4, 6, 2, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(jit=True):
  keras.utils.set_random_seed(4)
  x = keras.Input((T, K))
  proj = lambda: keras.layers.EinsumDense("abc,cde->abde", output_shape=(T, H, D),  # noqa: E731
                                          bias_axes="de")
  q, k, v = proj()(x), proj()(x), proj()(x)
  w = proj()(keras.layers.Rescaling(2.0)(x))
  out = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(T, K), bias_axes="e")(
      q * k + v * w)
  h = keras.layers.Flatten()(keras.layers.LayerNormalization()(x + out))
  model = dp.keras.DPModel(x, keras.layers.Dense(3)(h))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0,
                                                       clipping="fast"),
                loss=LOSS, jit_compile=jit)
  model.optimizer.set_sampling(N, E / N, "poisson", E)
  return model


@pytest.mark.parametrize("form, jit", [("gram", True), (None, True), (None, False)])
def test_fit_shared_ops_move_the_sum_by_at_most_c(form, jit, monkeypatch):
  """jit=False: the batch size unknown to the trace, the kept-or-book-keeping choice a
  run-time tf.cond (the shared ops built in each branch's graph)."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  views, shared = [], []
  as_dense, once = dense_rule._as_dense, algebra.once_per_graph  # pylint: disable=protected-access
  monkeypatch.setattr(dense_rule, "_as_dense",
                      lambda *a, **kw: views.append(1) or as_dense(*a, **kw))
  monkeypatch.setattr(algebra, "once_per_graph",
                      lambda kind, *a, **kw: shared.append(kind) or once(kind, *a, **kw))
  model = _model(jit)
  rng = np.random.RandomState(0)
  x = (rng.randn(REAL, T, K) * rng.choice([0.3, 1.0, 4.0], (REAL, 1, 1))).astype("float32")
  y = rng.randint(0, 3, REAL).astype("int64")
  xp, yp, mask = neighbours.padded(x, y, ROWS - REAL)
  spec = (tf.TensorSpec((None, T, K), tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))
  w0 = [np.array(w) for w in model.get_weights()]

  def clipped_sum(xb, yb, wb):
    model.set_weights(w0)
    ds = python_source.python_dataset(lambda: iter([(xb, yb, wb)]), spec)
    model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
    return E * np.concatenate([(a - b).ravel() for a, b in zip(w0, model.get_weights())]
                              ).astype(np.float64)

  base = clipped_sum(xp, yp, mask)
  assert views and "gram" in shared or form is None, (views, set(map(str, shared)))
  model.set_weights(w0)
  ref = helpers.reference_gradient(model, LOSS, tf.constant(x), tf.constant(y), clip=CLIP)
  np.testing.assert_allclose(base, REAL * np.concatenate([r.ravel() for r in ref]),
                             rtol=2e-4, atol=2e-5)
  changes = neighbours.add_remove_changes(clipped_sum, xp, yp, mask, REAL, rng, candidates=4)
  assert max(changes) <= CLIP * (1 + 1e-4), max(changes)
  assert max(changes) > 0.5 * CLIP
  run = model.ledger.to_dict()["runs"][-1]
  assert max(q["sensitivity"] for q in run["queries"]) == pytest.approx(CLIP)


@pytest.mark.slow   # ~13 s on the loaded 2-core machine (two XLA programs)
def test_steps_per_execution_two_equals_one_step_at_a_time(monkeypatch):
  """steps_per_execution=2 traces the step inside Keras's loop over steps (the shared ops
  built in that loop body's graph, and again in the padded tail's): four padded Poisson
  batches give the weights of four single-step executions, which match the independent
  per-example loop step by step."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  rng = np.random.RandomState(2)
  batches = []
  for real in (13, 9, 20, 11):
    x = (rng.randn(real, T, K) * rng.choice([0.3, 1.0, 4.0], (real, 1, 1))).astype("float32")
    y = rng.randint(0, 3, real).astype("int64")
    batches.append(neighbours.padded(x, y, ROWS - real))
  spec = (tf.TensorSpec((None, T, K), tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))

  def trained(steps_per_execution):
    model = _model()
    model.compile(optimizer=model.optimizer, loss=LOSS, jit_compile=True,
                  steps_per_execution=steps_per_execution)
    ds = python_source.python_dataset(lambda: iter(batches), spec)
    model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    return model

  two = trained(2)
  one = _model()
  for xp, yp, mask in batches:   # the independent loop, one step at a time
    real = int(mask.sum())
    ref = helpers.reference_gradient(one, LOSS, tf.constant(xp[:real]), tf.constant(yp[:real]),
                                     clip=CLIP)
    for v, r in zip(one.trainable_variables, ref):
      v.assign_sub(r * real / E)
  for a, b in zip(two.trainable_variables, one.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=5e-4, atol=5e-5)
  assert int(two.optimizer.ledger.sample_count.numpy()) == 4

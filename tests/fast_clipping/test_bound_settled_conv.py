"""A public bound on the batch (runtime.examples_at_most inside a summation.public_plan, as
fit's add/remove step traces its clipped sum, one physical chunk) settles the convolution and Dense rules'
run-time choices at trace time when every batch within it takes the same branch
(rules/budget.batch_most): the keep choice, one call against chunks, and the pinned trees'
widths (summation.pairwise_sum's `most`). Checked: the bounded trace holds no while loop;
its norms equal the unbounded trace's bit for bit at every batch size within the bound (the
same branch, the same additions in the same order), and its clipped sums equal them up to
the norms' rounding margin (algebra.norm_margin): the unbounded trace also noted the depths
of the branch no batch within the bound takes (the book-keeping form's), so it shrank every
clip factor a little more (one ratio for every entry, within 1e-5 of 1); a batch past the
bound fails the step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.internals import runtime

BOUND = 12
C = 0.5


def _model():
  keras.utils.set_random_seed(5)
  return keras.Sequential([keras.Input((12, 12, 1)),
                           keras.layers.Conv2D(4, 5, strides=2, padding="same",
                                               activation="relu"),
                           keras.layers.Conv2D(6, 3, strides=2, padding="valid"),
                           keras.layers.Flatten(), keras.layers.Dense(5, activation="tanh"),
                           keras.layers.Dense(3)])


def _loss(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _fn(model, bounded, bound=BOUND):
  def step(x, y):
    with summation.public_plan(bound, bound):
      with runtime.examples_at_most(bound if bounded else None):
        grads, norms = clipping.clipped_grad_sum(model, x, y, _loss, C, physical_chunks=False)
    return grads, norms
  sig = [tf.TensorSpec([None, 12, 12, 1]), tf.TensorSpec([None], tf.int32)]
  return tf.function(step, input_signature=sig)


def _ops(fn):
  graph = fn.get_concrete_function().graph
  types = [op.type for op in graph.get_operations()]
  for f in graph.as_graph_def().library.function:
    types += [n.op for n in f.node_def]
  return types


@pytest.fixture(scope="module")
def fns():
  model = _model()
  return _fn(model, True), _fn(model, False)


def test_bounded_trace_has_no_loop(fns):
  bounded, unbounded = fns
  loops = lambda fn: sum(t in ("While", "StatelessWhile") for t in _ops(fn))
  assert loops(unbounded) > 0
  assert loops(bounded) == 0
  conds = lambda fn: sum(t in ("If", "StatelessIf") for t in _ops(fn))
  assert conds(bounded) < conds(unbounded)


def test_bounded_trace_equals_unbounded_bit_for_bit(fns):
  bounded, unbounded = fns
  rng = np.random.default_rng(0)
  for b in (1, 2, 5, 8, BOUND):
    x = (rng.normal(size=(b, 12, 12, 1)) * rng.choice([0.1, 30.0], size=(b, 1, 1, 1)))
    x = x.astype("float32")
    y = rng.integers(0, 3, b).astype("int32")
    (g1, n1), (g2, n2) = bounded(x, y), unbounded(x, y)
    np.testing.assert_array_equal(n1.numpy(), n2.numpy())
    ratios = []
    for a, c in zip(g1, g2):
      a, c = a.numpy().astype(np.float64), c.numpy().astype(np.float64)
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5 * np.max(np.abs(c)))
      ratios.append(np.sum(a * c) / np.sum(c * c))
    # one margin: the same ratio for every variable, at least 1 (less shrink, never more)
    assert 1.0 <= min(ratios) and max(ratios) - min(ratios) < 1e-6
    assert max(ratios) < 1.0 + 1e-5


def test_batch_past_the_bound_fails(fns):
  bounded, _ = fns
  with pytest.raises(tf.errors.InvalidArgumentError):
    bounded(np.ones((BOUND + 9, 12, 12, 1), "float32"), np.zeros(BOUND + 9, "int32"))


def test_bound_within_factor_settles_chunks(monkeypatch):
  """A public bound above the rules' chunks but within budget.BOUND_FACTOR of them (chunks of
  8 examples, bound 3 x 8: fit's Poisson bound is 2.5 times its expected batch) settles one
  call on the batch at trace time: no while loop and fewer conds than the unbounded trace,
  which chunks a batch of more than 8 at run time; the norms and the clipped sums agree at
  sizes 0, 1, a chunk -1, +0, +1 and the bound (float32 round-off of the other form: relative
  1e-5 on norms; sums as test_bounded_trace_equals_unbounded_bit_for_bit, one margin ratio
  within 1e-5 of 1)."""
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1)   # chunks of 8 examples (chunk_size's least)
  bound = 3 * 8
  assert bound <= budget.BOUND_FACTOR * 8
  model = _model()
  bounded, unbounded = _fn(model, True, bound), _fn(model, False, bound)
  loops = lambda fn: sum(t in ("While", "StatelessWhile") for t in _ops(fn))
  conds = lambda fn: sum(t in ("If", "StatelessIf") for t in _ops(fn))
  assert loops(unbounded) > 0 and loops(bounded) == 0
  assert conds(bounded) < conds(unbounded)
  rng = np.random.default_rng(1)
  for b in (0, 1, 7, 8, 9, bound):
    x = (rng.normal(size=(b, 12, 12, 1)) * rng.choice([0.1, 30.0], size=(b, 1, 1, 1)))
    x = x.astype("float32")
    y = rng.integers(0, 3, b).astype("int32")
    if b == 0:   # oneDNN's forward convolution refuses an empty batch: both traces alike
      outs = []
      for fn in (bounded, unbounded):
        try:
          outs.append(fn(x, y))
        except tf.errors.InvalidArgumentError as e:
          outs.append(type(e))
      assert (outs[0] is outs[1]) if isinstance(outs[0], type) else all(
          np.all(a.numpy() == 0) for a in outs[0][0])
      continue
    (g1, n1), (g2, n2) = bounded(x, y), unbounded(x, y)
    np.testing.assert_allclose(n1.numpy(), n2.numpy(), rtol=1e-5)
    ratios = []
    for a, c in zip(g1, g2):
      a, c = a.numpy().astype(np.float64), c.numpy().astype(np.float64)
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5 * np.max(np.abs(c)))
      ratios.append(np.sum(a * c) / np.sum(c * c))
    assert max(ratios) - min(ratios) < 1e-5 and abs(max(ratios) - 1.0) < 1e-5, (b, ratios)

"""Trace-time bounds on a batch the trace does not know (rules/budget.py): the run-time keep
choice bounds the batch in each of by_keep's branches, and a caller's public bound
(runtime.examples_at_most) bounds every batch; over_chunks and sum_over_chunks then build only
the form that can run (no chunk loop a bounded batch cannot reach). Asserted: the keep choice
equals floor(B / k) record_bytes <= KEEP_BYTES in exact integers (no int32 overflow) and
carries the largest batch it keeps; the bounded trace has fewer loops; the clipped sum and
norms of the bounded trace match the per-record float64 loop (conftest.per_record_clipped_sum)
in graph mode and under jit_compile=True, at batch sizes on both sides of the bounds.
Tolerances: float32 round-off (relative 1e-4 on norms, 1e-4 of the largest entry on sums)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.internals import runtime

from .test_sequence_budget import T
from .test_sequence_budget import _class_loss as _loss
from .test_sequence_budget import _model

_MEMOS = {}   # b -> the reference loop's per-record gradients on _data(b, seed=1) (conftest memo)


def _shared_model():
  """test_sequence_budget's attention model (Dense, self-attention's EinsumDense, LayerNorm,
  Dense per token with and without bias, on [B, 6, d]), built once per module."""
  return _model("attention")


def _data(b, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, T, 5)).astype("float32"), rng.integers(0, 3, b).astype("int32"))


def _fn(model, clip, bound, jit):
  def step(x, y):
    with runtime.examples_at_most(bound):
      return clipping.clipped_grad_sum(model, x, y, _loss, clip)
  sig = [tf.TensorSpec([None, T, 5]), tf.TensorSpec([None], tf.int32)]
  return tf.function(step, input_signature=sig, jit_compile=jit)


def _loops(fn):
  """While loops and conds of the traced function (its function library included)."""
  graph = fn.get_concrete_function().graph
  types = [op.type for op in graph.get_operations()]
  for f in graph.as_graph_def().library.function:
    types += [n.op for n in f.node_def]
  return sum(t in ("While", "StatelessWhile", "If", "StatelessIf") for t in types)


def _runtime_keep(monkeypatch, keep_bytes):
  """Chunks of 8 examples; the per-record gradients kept by the batch's bytes alone (the
  operand rule of keep_choice off, so that an unknown batch takes the run-time choice)."""
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
  monkeypatch.setattr(budget, "KEEP_BYTES", keep_bytes)
  orig = budget.keep_choice
  monkeypatch.setattr(budget, "keep_choice",
                      lambda bt, rb, allowed, operand_bytes=0: orig(bt, rb, allowed))


def _keep_fn(k, rb, kept_max):
  @tf.function(input_signature=[tf.TensorSpec([None, 2])])
  def keep_of(x):
    with algebra.examples_per_record(k):
      keep = budget.keep_choice(x, rb, True)
    kept_max.append(getattr(keep, budget._KEPT_BATCH_MAX))   # pylint: disable=protected-access
    return keep
  return keep_of


def test_keep_choice_exact_integers_and_largest_kept_batch(monkeypatch):
  """floor(B / k) rb <= KEEP_BYTES at run time, exactly (B rb above 2^31 too), and the
  tensor carries the largest B it keeps: (floor(KEEP_BYTES / rb) + 1) k - 1."""
  rb = 9 << 20   # a 768 x 3072 kernel's float32 gradient is about this
  monkeypatch.setattr(budget, "KEEP_BYTES", 64 << 20)
  for k in (1, 3):
    kept_max = []
    keep_of = _keep_fn(k, rb, kept_max)
    for b in (0, 1, 7 * k - 1, 7 * k, 8 * k - 1, 8 * k, 300 * k):
      assert bool(keep_of(tf.zeros([b, 2]))) == ((b // k) * rb <= (64 << 20)), (k, b)
    assert kept_max[0] == 8 * k - 1


def test_examples_at_most_rejects_bad_bounds():
  for bad in (-1, 2.0, True, "3"):
    with pytest.raises(ParameterValueError, match="`n` must be None or an int >= 0"):
      with runtime.examples_at_most(bad):
        pass
  with runtime.examples_at_most(10):
    with runtime.examples_at_most(None):
      assert runtime.examples_bound() == 10
    with runtime.examples_at_most(20):
      assert runtime.examples_bound() == 10
  assert runtime.examples_bound() is None


def test_over_chunks_bounded_batch_builds_one_form():
  """Under a public bound <= BOUND_FACTOR m the whole-batch form alone (no cond, no loop);
  above it the cond."""
  body = lambda a: (tf.reduce_sum(a, 1),)
  spec = [tf.TensorSpec([2], tf.float32)]

  def traced(bound):
    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def f(a):
      with runtime.examples_at_most(bound):
        return budget.over_chunks(body, (a,), 2, spec)[0]
    return f

  bounded, loose = traced(2 * budget.BOUND_FACTOR), traced(2 * budget.BOUND_FACTOR + 1)
  assert _loops(bounded) == 0 and _loops(loose) > 0
  for b in (0, 1, 2, 3, 2 * budget.BOUND_FACTOR):   # one call, chunks of 2 at run time
    a = np.arange(3 * b, dtype=np.float32).reshape(b, 3)
    np.testing.assert_array_equal(bounded(a), loose(a))


def test_settled_one_call_public_values_only():
  """budget.settled_one_call: the bounds' most M <= limit (and <= fast) settle it; a public
  bound R up to BOUND_FACTOR limit (R / 2 <= fast) too; a by_keep range alone only by M <=
  limit; no bound: never (the run-time choice)."""
  f = budget.BOUND_FACTOR
  assert not budget.settled_one_call(10)
  with runtime.examples_at_most(10 * f):
    assert budget.settled_one_call(10)
    assert not budget.settled_one_call(9)
    assert budget.settled_one_call(10, fast=5 * f)
    assert not budget.settled_one_call(10, fast=5 * f - 1)
  with budget._batch_range(0, 12):   # pylint: disable=protected-access
    assert budget.settled_one_call(12) and not budget.settled_one_call(11)
    assert not budget.settled_one_call(12, fast=11)


@pytest.mark.parametrize("jit", [False, True])
def test_public_bound_exact(jit, clip_reference):
  """A public bound on the batch below every rule's chunk: fewer loops in the trace (no
  chunk loop), the sum and norms of the per-record loop."""
  model = _shared_model()
  b = 5
  x, y = _data(b, seed=1)
  ref, ref_norms = clip_reference(model, x, y, _loss, 0.5, memo=_MEMOS.setdefault(b, {}))
  fn = _fn(model, 0.5, b, jit)   # chunks of thousands of examples here: bound 5 <= m
  if not jit:   # under XLA an unknown batch is one call already
    assert _loops(fn) < _loops(_fn(model, 0.5, None, jit))
  got, norms = fn(x, y)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, np.max(np.abs(r))))


@pytest.mark.parametrize("b", [13, pytest.param(5, marks=pytest.mark.slow)])
def test_keep_branches_exact(b, monkeypatch, clip_reference):
  """The run-time keep choice of each layer (KEEP_BYTES 4 KiB: a layer of 192 to 432 bytes
  per record keeps 9 to 21 records, chunks hold 8): its branch that does not keep builds the
  chunk loop alone; at 5 examples every layer keeps, at 13 some do and some do not. The sum
  and norms are the per-record loop's."""
  _runtime_keep(monkeypatch, 4 << 10)
  model = _shared_model()
  x, y = _data(b, seed=1)
  ref, ref_norms = clip_reference(model, x, y, _loss, 0.5, memo=_MEMOS.setdefault(b, {}))
  fn = _fn(model, 0.5, None, False)
  bounded = _loops(fn)
  monkeypatch.setattr(budget, "_fits_one_chunk", _unbounded_fits_one_chunk)
  assert bounded < _loops(_fn(model, 0.5, None, False))
  got, norms = fn(x, y)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, np.max(np.abs(r))))


def _unbounded_fits_one_chunk(tensors, m):
  """budget._fits_one_chunk without bounds (the trace of the previous revision)."""
  if m is None:
    return True
  static_b = tensors[0].shape[0]
  return None if static_b is None else static_b <= m

"""Review: the float32 rounding of the clipped sum ACROSS records, through the real DP step.

Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it" (CCS 2022), Secs. 3-5: a float sum of
terms each of norm <= C can move by more than C when one term is added or removed, because
the other terms' roundings depend on the partial sums the removed term changed. This file
drives the optimizer's own step (`train_on_batch`, `fit` on padded Poisson batches, physical
chunks, records of k examples, graph and XLA, the vectorized and the fast path) and compares
the move with the sensitivity the ledger records for the step.

Relation and unit: add/remove one example under Poisson sampling (the removed example a
padding row of weight 0 in the same static batch, as `fit`'s Poisson batches pad), replace
one example under "fixed_size" with records of k examples (sensitivity 2C); unit: the
gradient L2 norm. S(D) is read exactly: the model is a bias-free Dense(1) from zero weights
trained with noise 0, SGD lr 1 and normalize=False (or the expected batch size 2^m as the
denominator, exact), so w0 - w1 is the step's float32 sum.

Construction (each example's input x = 1 and loss y * output, so its gradient is y exactly;
|y| <= C: clip factor 1): the sum in the rows' order is built to 2^K - 1/2 from rows of 1
and one of 1/2; the target row (C = 1) takes it to 2^K + 1/2; every later row is -3/4 w,
w = 2^(K - 24) the float32 spacing below 2^K. With the target each later row rounds away
(spacing 2w above 2^K), without it each rounds to -w: the sums differ by C + (later rows) w
in a sequential float32 sum (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
ed., Sec. 4.2), while the float64 sums of the same rows differ by exactly C.

Measured at e70d7a6 (2026-11-30, CPU, noise off; the ledger records C, 2C for records of
two): B = 4096, the fast path (its sum a matrix product over the batch) 1.2498 C in graph
mode, under XLA and through fit; the vectorized path (reduce_sum) 1.00024 C in graph mode and
through fit, 1.0000005 C under XLA; physical chunks of 512 (float64 accumulator across chunks,
float32 within) 1.0039 C fast, 1.0000029 C vectorized; replace-one (one example of a record of two
replaced), vectorized, 2.000059 C in graph mode, 2.0000002 C under XLA. Within the
sensitivity here: the fast path's records of k (their kept sum is not sequential in the
records) and the float64 accumulation across chunks.
A sequential sum's rounding can reach 2 gamma_{B-1} (B - 1) C beyond C (8 C at B = 8192), so
a fix must bound the sum's order, not only widen the sensitivity by a constant.

Fixed in session 29 (dp_query/summation.py): the vectorized path sums its records by a pinned
pairwise tree (summation.pairwise_sum), the chunks' sums one after the other, and clips every
record to C / (1 + eta), eta = summation.rounding_margin of that plan (4096 records in one
chunk: 5.9e-3; 8 chunks of 512: 7.8e-3); the fast path forms a Dense layer's sums on [B, K]
inputs (one term per record) by blocks of 64 rows and a pairwise tree over the blocks
(algebra.pinned_rows_product) and multiplies the sums by 1 / (1 + eta) (3.4e-3 at 4096),
where every sum of the step is so pinned (clipping._with_rounding_margin). The sum then moves
by at most C: those cases pass (the rows' sums checked to within the shrink, rtol 0.2: the fast path's public plan at B = 4096).
Fixed in session 32 (dp_query.global_l2_norm, summation.norm_margin): the norm of a record of
many tiny coordinates was taken low (1.00088 C vectorized under XLA, a reduction adding the
tiny squares one at a time); the record's squares are now summed in blocks of 64 and a
pairwise tree (summation.pinned_square_sum), and the clip is C / (1 + eta_norm), eta_norm
the bound of that order (2.5e-6 for 2^20 coordinates). The fast path's norms are its
rules' (their own bounds).
Fixed in session 34 (keras/fast_clipping/clipping._pinned_rows_sum): the fast path's records
of k examples and sequence records (several terms per record) whose float32 per-record
gradients are kept (registry.PerExampleGrads / PerExampleBlock, vectorized units) are summed
over the records in the pinned order of algebra.pinned_rows_product and charged the plan's
shrink: each record is then one term, the very gradient whose norm the clip took, so the
one-term analysis holds. Replace-one, fast, XLA, B = 4096, k = 2: 2.00006 C before,
1.99847 C after (the ledger's 2 C); graph mode 1.99854 C.
Opt-in since session 35 (keras/fast_clipping/rules/dense._pinned_record_sums, switched on by
rules/dense.PINNED_RECORD_SUMS; off by default for its memory on BERT-base): a Dense (or an
EinsumDense taken as one) on [B, T, K] inputs whose per-record gradients are not kept (beyond
rules/budget.KEEP_BYTES, BERT-base's 768 x 768 kernels) formed its clipped sum as one matrix
product over the batch's B T rows: records whose positions' terms are large and cancel (their
gradients near 0, clip factor 1) carry partial sums that the added record's term rounds
another way, 1.0542 C at B = 256, T = 16 (graph and XLA). Each record's float32 gradient is
now formed first (over its own positions) and the records' gradients summed by a pinned tree,
charged the plan's shrink: 0.9989 C (graph), 0.9986 C (XLA); by default still 1.0542 C (a
strict xfail below). Still open, the other rules'
book-keeping sums: convolutions whose kernels are too large to keep per example, an
EinsumDense that is not a Dense view, embedding tables (BERT-base's three: the only sums of
its step left unpinned), so no shrink is charged for a step that holds one.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source
from tf_dpiter.dp_query import summation

C = 1.0
N = 1 << 20


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _rows(batch, k=1, stride=1, span=None):
  """(y [batch] float32, the target's rows): the module docstring's rows, one per record of
  k examples (example i is in record i mod (span / k), `gradients.to_records`; each carries
  its record's value: the record's gradient is their mean)
  at every `stride`-th record, 0 between (a reduction that is sequential only within lanes
  or blocks is met on its own order), over the first `span` examples (None: all; the rest
  0: one physical chunk holds them all)."""
  span = batch if span is None else span
  records = span // k
  count = len(range(0, records, stride))
  k_exp = int(np.log2(count)) - 1
  m = 2 ** k_exp
  w = 2.0 ** (k_exp - 24)
  values = np.zeros(records)
  values[::stride] = [1.0] * (m - 1) + [0.5, 1.0] + [-0.75 * w] * (count - m - 1)
  y = np.zeros(batch, np.float32)
  y[:span] = np.tile(values, k)
  assert np.array_equal(y[:span].astype(np.float64), np.tile(values, k))
  return y, m * stride + records * np.arange(k)


def _model(batch, jit, clipping, k=None, policy="poisson", phys=None, normalize=False,
           features=1, positions=None):
  """positions T: inputs [B, T, features], the Dense's outputs flattened to [B, T] (a
  sequence record: T terms x_t dz_t^T in each record's kernel gradient)."""
  keras.utils.set_random_seed(0)
  shape = (features,) if positions is None else (positions, features)
  layers = [keras.Input(shape), keras.layers.Dense(1, use_bias=False,
                                                   kernel_initializer="zeros")]
  if positions is not None:
    layers.append(keras.layers.Flatten())
  model = dp.keras.DPSequential(layers)
  micro = None if k is None else batch // k
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, micro, learning_rate=1.0, clipping=clipping,
                                     normalize=normalize, max_physical_batch_size=phys)
  model.compile(optimizer=opt, loss=_loss, jit_compile=jit)
  opt.set_sampling(N, batch / N, policy, batch)
  return model


def _sensitivity(model):
  (query,) = model.ledger.to_dict()["runs"][-1]["queries"]
  return query["sensitivity"]


def _step_sum(model, y, weights, scale=1.0, positions=None):
  """The step's float32 clipped sum (float64 from the float32 weights) on x = 1; with
  `positions` T, x [B, T, 1] of ones and each example's y split into T equal targets y / T
  (exact for T a power of two), so its gradient is still y, a sum of T terms."""
  model.set_weights([np.zeros((1, 1), np.float32)])
  if positions is None:
    x, targets = np.ones((len(y), 1), np.float32), y[:, None]
  else:
    x = np.ones((len(y), positions, 1), np.float32)
    targets = np.repeat(y[:, None] / np.float32(positions), positions, axis=1)
    assert np.array_equal(targets.sum(axis=1, dtype=np.float64), y.astype(np.float64))
  model.train_on_batch(x, targets, sample_weight=weights)
  return -scale * model.get_weights()[0].astype(np.float64).ravel()


def _fit_sum(model, y, weights, scale):
  model.set_weights([np.zeros((1, 1), np.float32)])
  x = np.ones((len(y), 1), np.float32)
  spec = (tf.TensorSpec([None, 1], tf.float32), tf.TensorSpec([None, 1], tf.float32),
          tf.TensorSpec([None], tf.float32))
  ds = python_source.python_dataset(lambda: iter([(x, y[:, None], weights)]), spec)
  model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
  return -scale * model.get_weights()[0].astype(np.float64).ravel()


def _moved_by_adding(path, clipping, jit, batch, stride, span=None):
  """(||S(D) - S(D')|| from the step's float32 sums, the ledger's sensitivity), D' = D
  without the target example (a padding row of weight 0)."""
  y, target = _rows(batch, stride=stride, span=span)
  weights = np.ones(batch, np.float32)
  without = weights.copy()
  without[target] = 0.0
  y64 = y.astype(np.float64)
  assert abs(np.sum(y64) - np.sum(np.delete(y64, target))) == C   # the float64 sums' move
  if path == "fit":   # fit's Poisson batches: divided by the expected size 2^12, exact
    model = _model(batch, jit, clipping, normalize=True)
    s_d, s_d2 = (_fit_sum(model, y, w, batch) for w in (weights, without))
  else:
    model = _model(batch, jit, clipping, phys=512 if path == "chunks" else None)
    s_d, s_d2 = (_step_sum(model, y, w) for w in (weights, without))
  # the step's sums are the rows' sums up to the rounding measured (<= 0.25 C here) and the
  # clip's shrink 1 / (1 + eta) (eta <= 0.0127 up to 8192 records: summation.rounding_margin)
  # rtol: the clip shrink of the step's public row bound (8704 rows), every block's roundings
  # charged (summation.rounding_margin, shifted): fast path eta 0.0197 in a graph (blocks of
  # 8), 0.080 under XLA (the padded tail's 145 chunks combined by a pinned tree: every row
  # through 8 additions of chunk sums; 0.222 when they were added one after the other);
  # vectorized 0.0145, 0.021 under XLA (0.162 before)
  np.testing.assert_allclose(s_d, np.sum(y64), rtol=0.2, atol=0.3 * C)
  np.testing.assert_allclose(s_d2, np.sum(np.delete(y64, target)), rtol=0.2, atol=0.3 * C)
  return float(np.linalg.norm(s_d - s_d2)), _sensitivity(model)


def _moved_by_replacing(clipping, jit, batch, k, stride):
  """(||S(D) - S(D')||, the ledger's sensitivity), D' = D with ONE example of the target
  record replaced by -(2k - 1): the record's gradient (its examples' mean) goes from C to -C."""
  model = _model(batch, jit, clipping, k=k, policy="fixed_size")
  y, target = _rows(batch, k, stride=stride)
  y2 = y.copy()
  y2[target[0]] = -(2 * k - 1)
  assert np.mean(y2[target].astype(np.float64)) == -C
  ones = np.ones(batch, np.float32)
  moved = float(np.linalg.norm(_step_sum(model, y, ones) - _step_sum(model, y2, ones)))
  return moved, _sensitivity(model)


_SLOW = pytest.mark.slow
# (path, clipping, jit, batch, stride, span): the default cases meet every path once in the
# order its reduction sums (the fast path's matrix product and fit sequentially: stride 1;
# the vectorized reduce_sum in lanes: stride 32, under XLA 256; physical chunks inside one
# chunk of 512), the others are slow.
ADDING = [
    pytest.param("step", "fast", False, 4096, 1, None),
    pytest.param("step", "fast", True, 4096, 1, None, marks=_SLOW),
    pytest.param("fit", "fast", False, 4096, 1, None, marks=_SLOW),
    pytest.param("fit", "fast", True, 4096, 1, None),
    pytest.param("step", "vectorized", False, 4096, 32, None),
    pytest.param("step", "vectorized", True, 4096, 256, None, marks=_SLOW),
    pytest.param("fit", "vectorized", False, 4096, 32, None, marks=_SLOW),
    pytest.param("chunks", "fast", False, 4096, 1, 512),
    pytest.param("chunks", "vectorized", False, 4096, 32, 512, marks=_SLOW),
    pytest.param("step", "vectorized", False, 4096, 1, None, marks=_SLOW),
    pytest.param("chunks", "fast", False, 4096, 1, None, marks=_SLOW),
    pytest.param("chunks", "fast", True, 4096, 1, 512, marks=_SLOW),
]
# (clipping, jit, batch, k, stride)
REPLACING = [
    pytest.param("vectorized", False, 4096, 2, 32),
    pytest.param("fast", False, 4096, 2, 1, marks=_SLOW),
    pytest.param("vectorized", False, 4096, 2, 1, marks=_SLOW),
    pytest.param("fast", True, 4096, 2, 1),   # 2.00006 C before session 34's pinned sums
    pytest.param("fast", False, 4096, 4, 1, marks=_SLOW),
    pytest.param("vectorized", True, 4096, 2, 256, marks=_SLOW),
]


@pytest.mark.parametrize("path, clipping, jit, batch, stride, span", ADDING)
def test_adding_one_example_moves_the_sum_by_at_most_the_ledger_sensitivity(
    path, clipping, jit, batch, stride, span):
  moved, sensitivity = _moved_by_adding(path, clipping, jit, batch, stride, span)
  assert sensitivity >= C
  assert moved <= sensitivity, (moved, sensitivity)


@pytest.mark.parametrize("clipping, jit, batch, k, stride", REPLACING)
def test_replacing_one_record_of_k_moves_the_sum_by_at_most_the_ledger_sensitivity(
    clipping, jit, batch, k, stride):
  moved, sensitivity = _moved_by_replacing(clipping, jit, batch, k, stride)
  assert sensitivity >= 2 * C
  assert moved <= sensitivity, (moved, sensitivity)


@pytest.mark.parametrize("jit", [pytest.param(True), pytest.param(False, marks=_SLOW)])
def test_adding_one_sequence_record_moves_the_sum_by_at_most_the_ledger_sensitivity(jit):
  """Sequence records on the fast path (a Dense on [B, T, K] inputs, T = 2 positions: each
  record's kernel gradient a sum of T terms; the module docstring's rows, each split into T
  equal targets), add/remove one record under Poisson sampling: the move must stay within
  the ledger's C. The record's float32 gradient is formed first (kept per record) and the
  records' gradients are summed in a pinned order (clipping._pinned_rows_sum), so the
  shrink of summation.rounding_margin applies as to records of one term."""
  batch, positions = 4096, 2
  y, target = _rows(batch)
  weights = np.ones(batch, np.float32)
  without = weights.copy()
  without[target] = 0.0
  y64 = y.astype(np.float64)
  model = _model(batch, jit, "fast", positions=positions)
  s_d, s_d2 = (_step_sum(model, y, w, positions=positions) for w in (weights, without))
  np.testing.assert_allclose(s_d, np.sum(y64), rtol=0.2, atol=0.3 * C)
  np.testing.assert_allclose(s_d2, np.sum(np.delete(y64, target)), rtol=0.2, atol=0.3 * C)
  # the step's sum is charged the plan's margin (every sum pinned: the shrink 1 / (1 + eta),
  # eta ~ 2e-2 here, is applied), beyond the rows' float32 rounding (<= 0.25 C of 2^11 C)
  assert s_d[0] < np.sum(y64) * (1 - 1e-3), (s_d, np.sum(y64))
  moved = float(np.linalg.norm(s_d - s_d2))
  assert _sensitivity(model) >= C
  assert moved <= _sensitivity(model), (moved, _sensitivity(model))


def _rounded_once_rows(batch):
  """(y, target): rows whose exact sum is 2^11 + 1/2 - 3 v (v = 2^-15) with the target and
  2^11 - 1/2 - 3 v without, the rows' partial sums exact in float32 at every order (chunks
  of 512 too). Rounded once to float32 (spacing 8 v above 2^11, 4 v below) the first goes
  to 2^11 + 1/2 and the second to 2^11 - 1/2 - 4 v: they differ by C + 2^-13 C, so a sum
  accumulated exactly (float64) must not be rounded to float32 before its noise."""
  y = np.zeros(batch, np.float32)
  y[:2047], y[2047] = 1.0, 0.5
  y[2048], y[2049] = 1.0, -0.75 * 2.0 ** -13
  return y, np.array([2048])


@pytest.mark.parametrize("path, clipping, jit", [
    pytest.param("chunks", "vectorized", True),
    pytest.param("fit", "fast", False, marks=_SLOW),
    pytest.param("chunks", "fast", False, marks=_SLOW),
])
def test_a_sum_rounded_once_moves_by_at_most_the_ledger_sensitivity(path, clipping, jit):
  batch = 4096
  y, target = _rounded_once_rows(batch)
  weights = np.ones(batch, np.float32)
  without = weights.copy()
  without[target] = 0.0
  if path == "fit":
    model = _model(batch, jit, clipping, normalize=True)
    s_d, s_d2 = (_fit_sum(model, y, w, batch) for w in (weights, without))
  else:
    model = _model(batch, jit, clipping, phys=512)
    s_d, s_d2 = (_step_sum(model, y, w) for w in (weights, without))
  moved = float(np.linalg.norm(s_d - s_d2))
  assert moved <= _sensitivity(model), (moved, _sensitivity(model))


@pytest.mark.parametrize("clipping, jit", [
    pytest.param("vectorized", False, marks=_SLOW),
    pytest.param("fast", True, marks=_SLOW),
])
def test_one_clipped_record_has_norm_at_most_the_ledger_sensitivity(clipping, jit):
  """Within one record: pi_C(x) = fl(c x), c = fl(min(1, C / ||x||)), in float32 (one real
  example, 7 padding rows, so there is no other term to round against). The ledger's C must
  bound ||fl(c x)|| (float64 of the float32 sum); 20 random x of norm 3 to 3e4 in 8
  features. Measured at e70d7a6: 1.03e-7 C above C (vectorized, graph), 9.6e-8 C (fast,
  XLA) over 40 such x: the clip factor's, the norm's and the product's roundings are not
  covered."""
  features, batch = 8, 8
  model = _model(batch, jit, clipping, features=features)
  rng = np.random.RandomState(1)
  weights = np.zeros(batch, np.float32)
  weights[0] = 1.0
  y = np.ones((batch, 1), np.float32)
  largest = 0.0
  for _ in range(20):
    x = np.zeros((batch, features), np.float32)
    x[0] = rng.randn(features) * rng.choice([3.0, 30.0, 3e4])
    model.set_weights([np.zeros((features, 1), np.float32)])
    model.train_on_batch(x, y, sample_weight=weights)
    largest = max(largest, np.linalg.norm(model.get_weights()[0].astype(np.float64)))
  assert largest > C * (1 - 1e-4)   # every record clipped (to C / (1 + eta), eta 3e-6 here)
  assert largest <= _sensitivity(model), (largest, _sensitivity(model))


def _largest_tiny_coordinates_update(model, batch, features):
  """The largest ||update|| (float64) over the tiny-coordinates records of m = 1, 32, 64, 128
  big coordinates (the test below), each the one real example of a batch, from zero weights."""
  weights = np.zeros(batch, np.float32)
  weights[0] = 1.0
  largest = 0.0
  for m in (1, 32, 64, 128):
    x = np.zeros((batch, features), np.float32)
    x[0] = np.sqrt(0.9 * 2.0 ** -24 / m)
    x[0, :m] = 1.0 / np.sqrt(m)
    model.set_weights([np.zeros((features, 1), np.float32)])
    model.train_on_batch(x, np.ones((batch, 1), np.float32), sample_weight=weights)
    largest = max(largest, np.linalg.norm(model.get_weights()[0].astype(np.float64)))
  return largest


@pytest.mark.parametrize("clipping, jit", [
    pytest.param("vectorized", True),
    # the vectorized path by the norm's own margin (dp_query.global_l2_norm); the fast path
    # by its rules' norms and the shrink (1.000047 C under XLA with one plan of 8 rows before)
    pytest.param("fast", True, marks=_SLOW),
    pytest.param("vectorized", False, marks=_SLOW),
    pytest.param("fast", False, marks=_SLOW),
])
def test_a_record_of_many_tiny_coordinates_has_norm_at_most_the_ledger_sensitivity(
    clipping, jit):
  """The record's float32 norm taken low: m coordinates of 1 / sqrt(m) and 2^20 - m of
  sqrt(0.9 u) / sqrt(m) (u = 2^-24), each tiny square just below half a unit in the last
  place of a partial sum that holds a big one, so a reduction that adds them to it one at a
  time drops them (Higham, Sec. 4.2): exact norm sqrt(1 + 0.05625 / m) (1.0277 at m = 1),
  computed lower, so the clip factor C / norm is too large. One real example (gradient x
  exactly: x = the record, loss y * output, y = 1) in a batch of 8, Dense(1) on 2^20
  features. Measured at e70d7a6, the worst of m = 1, 32, 64, 128: vectorized under XLA
  ||fl(c x)|| = 1.00088 C, fast under XLA 1.000055 C, graph mode 1.0000067 C (vectorized)
  and 1.0000069 C (fast); with the pinned norm (session 32) below C by derivation."""
  features, batch = 1 << 20, 8
  model = _model(batch, jit, clipping, features=features)
  largest = _largest_tiny_coordinates_update(model, batch, features)
  # clipped, not vanishing (exact norms above C; the fast path's graph plan shrinks by 2.8e-4)
  assert largest > C * (1 - 1e-3)
  assert largest <= _sensitivity(model), (largest, _sensitivity(model))


@pytest.mark.parametrize("jit", [True, False])
def test_a_record_of_many_tiny_coordinates_on_the_fast_path_without_the_shrink(
    monkeypatch, jit):
  """The tiny-coordinates record above on the fast path with the clip shrink made 1
  (summation.public_shrink): the norm's own margin alone (its squares summed in a pinned
  order, algebra.record_sqr_sums, and the margin applied in clipping._clip_factors) keeps
  ||fl(c x)|| <= C, in graph mode and under XLA. Measured 2026-11-30 without the shrink:
  before the pinned order 1.0000549 C under XLA, 1.0000069 C in graph mode; with it
  0.9999979 C and 0.9999972 C."""
  real = summation.public_shrink

  def no_shrink(*args, **kwargs):
    real(*args, **kwargs)   # the rows' check kept
    return 1.0

  monkeypatch.setattr(summation, "public_shrink", no_shrink)
  features, batch = 1 << 20, 8
  model = _model(batch, jit, "fast", features=features)
  largest = _largest_tiny_coordinates_update(model, batch, features)
  assert largest > C * (1 - 1e-4)   # clipped (exact norms above C)
  assert largest <= C, (largest, C)


def _cancelling_rows(batch, positions, e):
  """y [batch, T] (the target record 0 first, then the others), each record's T terms of a
  Dense(1) on x = 1 (dz_t = y_t): record 0 is [C, 0, ...]; every other record j is
  [a, -3/4 w, ..., -3/4 w, -a], a = 2^e - 1/2, w = 2^(e - 24), whose gradient is about 0
  (clip factor 1: its norm's bound, about sqrt((2T + 1) u) 2 a + gamma_L 2 a, stays below C
  for e = 8, T = 16, B = 256 with L over the batch's rows; over the public plan's rows,
  algebra.sum_examples, for e = 7) while its terms are large and cancel. Summed in the rows' order,
  with the target the partial sum is 1, a takes it to 2^e + 1/2 (spacing 2 w) where each
  -3/4 w rounds away; without it to 2^e - 1/2 (spacing w) where each rounds to -w: every
  record j moves the sum by (T - 2) w more, (B - 1)(T - 2) w in all (0.0545 C here), while
  the float64 sums differ by exactly C."""
  a, w = 2.0 ** e - 0.5, 2.0 ** (e - 24)
  y = np.zeros((batch, positions), np.float64)
  y[0, 0] = C
  y[1:, 0], y[1:, -1], y[1:, 1:-1] = a, -a, -0.75 * w
  assert np.array_equal(y.astype(np.float32).astype(np.float64), y)
  return y


def _moved_by_a_cancelling_record(monkeypatch, jit, pinned=None, batch=256, positions=16, e=8):
  """(||S(D) - S(D')||, the ledger's sensitivity, S(D)) for `_cancelling_rows` through the
  fast step (Dense(1) on [B, T, 1], add/remove record 0 under Poisson sampling: a padding
  row of weight 0), the per-record gradients not kept (the Gram norm form, as BERT-base's
  768 x 768 kernels beyond rules/budget.KEEP_BYTES: registry's form hook); `pinned`:
  rules/dense.PINNED_RECORD_SUMS set (None: the library's default)."""
  from tf_dpiter.keras.fast_clipping import registry   # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping.rules import dense   # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  if pinned is not None:
    monkeypatch.setattr(dense, "PINNED_RECORD_SUMS", pinned)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((positions, 1)),
      keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
      keras.layers.Flatten()])
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, None, learning_rate=1.0, clipping="fast",
                                     normalize=False)
  model.compile(optimizer=opt, loss=_loss, jit_compile=jit)
  opt.set_sampling(N, batch / N, "poisson", batch)
  y = _cancelling_rows(batch, positions, e)
  x = np.ones((batch, positions, 1), np.float32)
  sums = []
  for drop in (False, True):
    weights = np.ones(batch, np.float32)
    weights[0] = 0.0 if drop else 1.0
    model.set_weights([np.zeros((1, 1), np.float32)])
    model.train_on_batch(x, y.astype(np.float32), sample_weight=weights)
    sums.append(-model.get_weights()[0].astype(np.float64).ravel())
  return float(np.linalg.norm(sums[0] - sums[1])), _sensitivity(model), sums[0]


@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=_SLOW)])
def test_adding_one_record_among_cancelling_unkept_records_moves_by_at_most_c(
    monkeypatch, jit):
  """Sequence records whose per-record gradients are not kept (`_cancelling_rows`): the
  clipped sum formed record by record (rules/dense._pinned_record_sums, opted in by
  rules/dense.PINNED_RECORD_SUMS: each record's float32 gradient first, the records by a
  pinned tree) and charged the plan's shrink keeps the move within the ledger's C. Measured
  2026-11-30 (B = 256, T = 16): the book-keeping product over the B T rows moved it by
  1.0542 C in graph mode and under XLA; the record-by-record sum 0.9989 C (graph) and
  0.9986 C (XLA)."""
  moved, sensitivity, _ = _moved_by_a_cancelling_record(monkeypatch, jit, pinned=True)
  assert sensitivity >= C
  assert moved <= sensitivity, (moved, sensitivity)
  # the sums are the records' (C and the others' own roundings, -(T - 2) w each) times the
  # shrink; charged (every sum of the step pinned), not vanishing
  assert 0.9 < moved < C * (1 - 1e-4), moved


@pytest.mark.xfail(strict=True, reason=(
    "open by default: rules/dense.PINNED_RECORD_SUMS is False (its memory cost on "
    "BERT-base), the book-keeping product over the batch's rows moves the sum by 1.0266 C"))
def test_the_default_book_keeping_product_over_cancelling_records_moves_by_at_most_c(
    monkeypatch):
  """The same records with the library's default form of the sum (the book-keeping product
  over the batch's B T rows, no shrink charged): the move must stay within the ledger's C.
  Measured 2026-11-30: 1.0542 C (graph mode, e = 8). Since review R22 (session 48) the norm
  bounds count the public plan's rows (algebra.sum_examples), which lifts e = 8's bounds
  above C (the records clipped: 0.9994 C); at e = 7 (unclipped) 1.0266 C (2026-12-02)."""
  moved, sensitivity, _ = _moved_by_a_cancelling_record(monkeypatch, False, e=7)
  assert moved <= sensitivity, (moved, sensitivity)

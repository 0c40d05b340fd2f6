"""Review R22 (session 48): a record's norm bound on the fast path must not depend on how
many other records the batch holds.

Where a layer's clipped sum is not formed from kept per-record gradients, each record's
norm is an upper bound raised to cover the float32 rounding of the record's terms in the
clipped sum's product over R rows (algebra.with_sum_rounding: (||g|| + gamma_L S)^2,
L = T + R + 1, S = sum_t ||a_t|| ||b_t||; Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., Secs. 3.1 and 4.2). R was the batch's own rows (B T). Under add/remove
one example with an unpadded batch, D' = D + r has one more example than D, so every clipped
record's factor C / bound moves with r's arrival, and the sum moves by r's term plus
sum_i (c_i(B + 1) - c_i(B)) g_i: the same phenomenon as a clip shrink taken from the
batch's rows (dp_query/summation.public_plan; Casacuberta et al., "Widespread
underestimation of sensitivity in differentially private libraries and how to fix it",
CCS 2022). Now R is the public plan's rows (algebra.sum_examples).

Relation: add/remove one example under Poisson sampling (declared, population 1,000); unit:
the L2 norm of a record's clipped gradient, C = 1. Real step (train_on_batch on unpadded
batches of B and B + 1 rows, the added example last: no row shifts), noise 0, SGD lr 1,
normalize=False: w0 - w1 is the step's float32 clipped sum.

Records of D: two output positions with equal input patches (the input constant along the
width) and output gradients s and -s (1 - eps) on one channel, so that g = 3 s eps e e^T
(||g|| = 2 C) while S ~ 6 s; eps is chosen so that gamma_L S ~ ||g|| for L over the batch's
rows (before the fix): the bound ~ 2 ||g||,
each record adds about C / 2, and one more example in the batch raises L by T, lowering
every factor by about T / (2 L). The added record: no cancellation, clipped to C, opposite
sign. Layers: a 3x3 convolution of 48 -> 48 channels (20,736 kernel entries, over
registry.MAX_PER_EXAMPLE_ENTRIES: gradients never kept, the unfolded per-example pass's
norms raised by rules/conv.py `_per_example_pass`) at 48 output positions, where the direct
form is cheaper than the Gram; and a Dense of 257 -> 257 units on sequences of 130 (66,049
entries, over registry.MAX_DIRECT_PER_EXAMPLE_ENTRIES; the norms raised over the
book-keeping product's chunk rows, budget.chunk_rows).

Second case, same relation and unit: a layer's per-record gradients kept (the norms their own,
exact) while the batch's take at most the keep budget and not kept above it (the not-kept
forms' upper bounds): a batch at the budget and one example more gave every record another
norm. Now, under an add/remove plan, the choice is the plan's (budget.planned_keep).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

C = 1.0
U = 2.0 ** -24


def _conv_case(batch):
  """(a function making the layers, loss, x, y, L, ||a_t||) of the convolution case: x, y
  hold batch + 1 examples, the added one last."""
  ch, positions = 48, 48
  length = positions + batch * positions + 1
  layers = lambda: [keras.Input((3, positions + 2, ch)),
                    keras.layers.Conv2D(ch, 3, padding="valid", use_bias=False,
                                        kernel_initializer="zeros")]
  x = np.zeros((batch + 1, 3, positions + 2, ch), np.float32)
  x[..., 0] = 1.0   # every patch of a record the same: 9 ones on channel 0 (||a_t|| = 3)
  y = np.zeros((batch + 1, 1, positions, ch), np.float32)
  return layers, (lambda t, p: tf.reduce_sum(t * p, axis=[1, 2, 3])), x, y, length, 3.0


def _dense_case(batch):
  """The Dense-on-sequences case (as `_conv_case`)."""
  units, positions = 257, 130
  length = positions + batch * positions + 1   # batch below the chunk's examples
  layers = lambda: [keras.Input((positions, units)),
                    keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros")]
  x = np.zeros((batch + 1, positions, units), np.float32)
  x[:, :2, 0] = 1.0   # two positions of the same input (||a_t|| = 1), the others zero
  y = np.zeros((batch + 1, positions, units), np.float32)
  return layers, (lambda t, p: tf.reduce_sum(t * p, axis=[1, 2])), x, y, length, 1.0


def _targets(y, batch, length, a_norm):
  """Writes the output gradients (the loss is y . output): records 0..batch-1 nearly cancel
  (||g|| = 2 C, gamma_L S about ||g||), record `batch` does not (clipped to C, opposite)."""
  eps = np.float32(2.0 * length * U)
  s = np.float32(2.0 * C / (a_norm * eps))   # ||g|| = a_norm s eps = 2 C, S ~ 2 a_norm s
  flat = y.reshape(batch + 1, -1, y.shape[-1])
  flat[:batch, 0, 0] = s
  flat[:batch, 1, 0] = -s * (1.0 - eps)
  flat[batch, :2, 0] = -10.0
  return flat.reshape(y.shape)


def _step_sum(layers, loss, x, y, jit, expected):
  """The real step's float32 clipped sum of (x, y) (noise 0, lr 1) under the sampling of
  `expected` records of 1,000 (the same on both datasets: public): flat float64."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential(layers())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: the no-noise warning
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping="fast",
                                       normalize=False)
  model.compile(optimizer=opt, loss=loss, jit_compile=jit)
  model.optimizer.set_sampling(1000, expected / 1000, "poisson", expected)
  model.train_on_batch(x, y)
  return -np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64)


# the Dense case below its chunk's 8 examples (budget.examples_per_chunk): the rows then follow B
CASES = [("conv", 16, False), ("dense", 4, False),
         pytest.param("conv", 16, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, batch, jit", CASES)
def test_one_added_example_moves_the_fast_sum_by_at_most_c(kind, batch, jit):
  """Measured (2026-12-02, load ~2.5): before the fix (norm bounds over the batch's own rows)
  conv B = 16 moved 1.2285 C in a graph (1.2458 C at B = 64) and Dense B = 4 1.1816 C; with
  the public plan's rows (algebra.sum_examples) 0.99981 C and 0.99993 C. Under XLA the
  batch is padded to the layout's first chunk (the same rows on both): 0.99997 C before,
  0.99995 C after (slow). The vectorized path (norms of the per-record gradients
  themselves): 0.9998 C (conv, B = 64)."""
  layers, loss, x, y, length, a_norm = (_conv_case if kind == "conv" else _dense_case)(batch)
  y = _targets(y, batch, length, a_norm)
  s_d = _step_sum(layers, loss, x[:batch], y[:batch], jit, batch)
  s_d1 = _step_sum(layers, loss, x, y, jit, batch)
  # the construction exercises the bound: each record of D is clipped by its raised norm,
  # adding well under C (C / 2 with the batch's rows, less with the public plan's)
  assert 0.1 * batch * C < np.linalg.norm(s_d) <= 0.6 * batch * C
  moved = float(np.linalg.norm(s_d1 - s_d))
  assert moved <= C, moved


def _kept_case(kind, batch, eps):
  """Records of `_targets`' kind at `eps` (two positions of one input, output gradients s and
  -s (1 - eps): ||g|| = 2 C) for a layer whose per-record gradients are kept while the batch's
  take at most its budget: "dense", a Dense of 128 -> 128 units on 2 positions (16,384
  entries: rules/budget.keep_choice keeps 128 examples); "conv", a 3x3 convolution of
  32 -> 32 channels at 2 output positions (9,216 entries, pinned: rules/conv.py keeps 455).
  Returns (a function making the layers, loss, x, y)."""
  units, positions = (128, 2) if kind == "dense" else (32, 2)
  if kind == "dense":
    shape, out, a_norm = (positions, units), (positions, units), 1.0
    layers = lambda: [keras.Input(shape), keras.layers.Dense(units, use_bias=False,
                                                             kernel_initializer="zeros")]
  else:
    shape, out, a_norm = (3, positions + 2, units), (1, positions, units), 3.0
    layers = lambda: [keras.Input(shape), keras.layers.Conv2D(units, 3, use_bias=False,
                                                              kernel_initializer="zeros")]
  x = np.zeros((batch + 1,) + shape, np.float32)
  x[..., 0] = 1.0
  y = np.zeros((batch + 1, positions, units), np.float32)
  s = np.float32(2.0 * C / (a_norm * eps))   # ||g|| = a_norm s eps = 2 C
  y[:batch, 0, 0], y[:batch, 1, 0] = s, -s * np.float32(1.0 - eps)
  y[batch, :, 0] = -10.0
  axes = list(range(1, len(out) + 1))
  return layers, (lambda t, p: tf.reduce_sum(t * p, axis=axes)), x, y.reshape((-1,) + out)


@pytest.mark.parametrize("kind, batch", [("dense", 128), ("conv", 455)])
def test_one_added_example_at_the_keep_budget_moves_the_fast_sum_by_at_most_c(kind, batch):
  """Add/remove one example to a batch of the most examples whose per-record gradients are
  kept (rules/budget.keep_choice, rules/conv.py `_per_example_result`): D's norms were the
  kept gradients' own (exact), D''s the not-kept forms' upper bounds, which for records whose
  positions nearly cancel (eps = 1e-3) exceed the exact norm about tenfold, so every
  record's factor changed with the added example. Now the choice is the public plan's
  (budget.planned_keep). Measured 2026-12-02 (load ~7): Dense 114.54 C at 338372d (D's
  records add C each, D''s about C / 10; 0.8876 C without cancellation, eps = 1/2), 0.99891 C
  with the plan's choice; conv 45.345 C before, 0.99152 C after."""
  layers, loss, x, y = _kept_case(kind, batch, 1e-3)
  s_d = _step_sum(layers, loss, x[:batch], y[:batch], False, batch)
  s_d1 = _step_sum(layers, loss, x, y, False, batch)
  moved = float(np.linalg.norm(s_d1 - s_d))
  assert moved <= C, moved

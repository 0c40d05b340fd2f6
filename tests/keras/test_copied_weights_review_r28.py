"""Review R28 (session 51): copies of a DP run's weights cast to another dtype or transposed
(`keras.optimizer.weight_fingerprints`: a run starting from values another DP run released
adopts that run's ledger; the exact digest h names the bits in their order).

Relation and unit: add/remove one example, Poisson sampling q = 10/100 (fit on N = 100 arrays
at batch_size 10), C = 1, z = 1 (noise from OS entropy: a released state names its run); a
sample is one noised step. Epsilon is compared with dp-accounting's RDP accountant called by
hand at delta = 1e-5 (`custom_loop_setup.rdp_epsilon`). Rule (McMahan et al. 2018, "A General
Approach to Adding Differential Privacy to Iterative Training Procedures", Section 6): a model
whose weights are a function of a run's noised steps (a cast, a transpose: post-processing) is
charged for them; a run is charged for no other run's steps its weights never saw.

Finding (under-charge): a DP fit's Dense [4, 6] kernel and bias given by value to a new DP
model transposed (tied weights), or cast to float16, bfloat16 or float64 by set_weights into a
layer of that dtype (or cast to float16 and back to float32), named no released state: the new
run charged its own 1 step for 4. Fixed: released states are also kept under order- and
dtype-invariant keys (`_digests_and_keys`: a sum over the elements of a mixed hash of their
bfloat16 rounding, and of their float16-then-bfloat16 rounding), looked up when the exact
digest names no run.

Negative results (must stay): unrelated runs of one seed adopt nothing of each other, also
through the invariant keys: a source whose weights barely moved (learning rate 1e-7: every
rounding equal to the start's) and a same-seed float32 or float16 model (zero biases, the
same initial values) charges its own 1 step.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import weight_fingerprints as wf
from tests.keras import custom_loop_setup as loop
from tests.keras import test_copied_weights_review_r24 as r24

DELTA = 1e-5

# Nightly tier (-m slow): the other casts; the default tier keeps the float16 cast, the
# transpose, a copy between fits and the same-seed negatives.
SLOW_CASES = {
    "test_a_cast_or_transposed_copy_keeps_its_run[bfloat16]",
    "test_a_cast_or_transposed_copy_keeps_its_run[float64]",
    "test_a_cast_or_transposed_copy_keeps_its_run[float16_and_back]",
}


def _model(seed=0, hidden=6, dtype=None, learning_rate=loop.LR):
  """A DP model Input(D) -> Dense(hidden, dtype) -> Dense(1) at keras seed `seed`, built."""
  keras.utils.set_random_seed(seed)
  model = dp.keras.DPSequential([keras.Input((loop.D,)),
                                 keras.layers.Dense(hidden, dtype=dtype),
                                 keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=learning_rate), "mse")
  model.build((None, loop.D))
  return model


def _fit(model, steps):
  """`steps` Poisson steps (q = 0.1) on the fixed regression data."""
  model.fit(*loop.data(), batch_size=10, epochs=1, steps_per_epoch=steps, verbose=0)
  return model


def _charged(model):
  return int(model.optimizer.ledger.sample_count)


def _cast(dtype, back=False):
  """A new DP model (seed 11) whose Dense(6) of `dtype` is given the kernel and bias (set_weights
  casts them; with `back`, cast to `dtype` and then to float32 in a float32 layer)."""

  def make(kernel, bias):
    copy = _model(seed=11, dtype=None if back else dtype)
    if back:
      kernel, bias = (np.asarray(w).astype(dtype).astype(np.float32) for w in (kernel, bias))
    copy.layers[0].set_weights([kernel, bias])
    return copy

  return make


_transposed = r24._transposed_copy   # a Dense(4) given the kernel transposed (tied weights)


@pytest.mark.parametrize("make", [
    pytest.param(_cast("float16"), id="float16"),
    pytest.param(_cast(ml_dtypes.bfloat16), id="bfloat16"),
    pytest.param(_cast("float64"), id="float64"),
    pytest.param(_cast(np.float16, back=True), id="float16_and_back"),
    pytest.param(_transposed, id="transposed")])
def test_a_cast_or_transposed_copy_keeps_its_run(make):
  """A DP fit of 3 steps; its hidden Dense [4, 6] kernel (and bias) given by value to a new
  DP model cast or transposed, which fits 1 step: 3 + 1 = 4 samples, epsilon = 4 Poisson
  steps (q = 0.1, z = 1) by hand. Measured before the fix: 1 each."""
  source = _fit(_model(), 3)
  kernel, bias = source.layers[0].get_weights()
  copy = _fit(make(kernel, bias), 1)
  assert _charged(copy) == 4, copy.optimizer.ledger.run_table()
  assert dp.accounting.epsilon(copy.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(loop.rdp_epsilon(4), rel=1e-6))
  assert _charged(source) == 3


def test_a_cast_copy_between_fits_keeps_the_steps_it_saw():
  """A DP fit of 2 steps, its hidden layer's weights (from the DP model's get_weights) copied
  into a float16 Dense(6) of a new DP model, then 2 more steps of the source: the copy's 1 step
  charges 2 + 1 = 3 samples (the source's steps after the copy did
  not touch it: `run_ids.earlier`), epsilon = 3 steps by hand. Measured before the fix: 1."""
  source = _fit(_model(), 2)
  copy = _model(seed=11, dtype="float16")
  copy.layers[0].set_weights(source.get_weights()[:2])
  _fit(source, 2)
  ledger = _fit(copy, 1).optimizer.ledger
  assert int(ledger.sample_count) == 3, ledger.run_table()
  assert dp.accounting.epsilon(ledger, DELTA, accountant="rdp") == pytest.approx(
      loop.rdp_epsilon(3), rel=1e-6)
  assert _charged(source) == 4


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_a_same_seed_model_adopts_no_barely_moved_run(dtype):
  """Start rule: a DP fit of 3 steps at learning rate 1e-7 (its weights move, so new exact
  digests, but every bfloat16 and float16 rounding stays its start's), then an unrelated DP
  model of the same seed (the same initial values, zero biases; float32, or float16) fit 1
  step at learning rate 0.1: 1 sample, epsilon = 1 step by hand (no adoption of the first
  run's 3). A run that released a rounding equal to its start's would make every same-seed
  model adopt it."""
  first = _fit(_model(learning_rate=1e-7), 3)
  kernel = first.layers[0].get_weights()[0]
  keras.utils.set_random_seed(0)
  start = keras.layers.Dense(6)
  start.build((None, loop.D))
  assert not np.array_equal(kernel, start.kernel.numpy())   # the weights moved
  assert np.array_equal(kernel.astype(ml_dtypes.bfloat16), start.kernel.numpy().astype(
      ml_dtypes.bfloat16))   # their roundings did not
  second = _fit(_model(dtype=dtype), 1)
  assert _charged(second) == 1, second.optimizer.ledger.run_table()
  assert dp.accounting.epsilon(second.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(loop.rdp_epsilon(1), rel=1e-6))
  assert _charged(first) == 3


def _reference_sum(values):
  """s of the module docstring by an independent route: ml_dtypes' bfloat16 rounding of the
  values as float32 (round to nearest even), F by Python integers, summed mod 2^64."""
  bits = np.asarray(values).reshape(-1).astype(np.float32).astype(ml_dtypes.bfloat16).view(
      np.uint16)
  total = 0
  for c in bits.tolist():
    y = (c * 0x9E3779B1) & 0xFFFFFFFF
    y = ((y ^ (y >> 15)) * 0x85EBCA77) & 0xFFFFFFFF
    total += y ^ (y >> 13)
  return total % 2**64


@pytest.mark.parametrize("shape", [(20, 30), (200, 250)], ids=["host", "compiled"])
def test_invariant_keys_of_cast_and_transposed_copies(shape):
  """The keys (`_digests_and_keys`) of a float32 value ([20, 30]: on the host; [200, 250]:
  above HOST_ELEMENTS, compiled) are the reference sums of its bfloat16 and its float16-then-
  bfloat16 roundings, and those of its transpose, float64, bfloat16 and float16 copies (and
  float16 and back) are its first or, for float16, its second; a zero value has none."""
  rng = np.random.default_rng(3)
  x = (rng.normal(size=shape) * 0.05).astype(np.float32)
  x.flat[:4] = [3e-6, -7e-8, 70000.0, 1.5e-5]   # float16 subnormals and overflow
  half = x.astype(np.float16)
  copies = [x, np.ascontiguousarray(x.T), x.astype(np.float64), x.astype(ml_dtypes.bfloat16),
            half, half.astype(np.float32), np.zeros(shape, np.float32)]
  _, keys = wf._digests_and_keys(  # pylint: disable=protected-access
      [tf.constant(c) for c in copies], want=[True] * len(copies))
  n = x.size
  assert keys[0] == ((n, _reference_sum(x)), (n, _reference_sum(half.astype(np.float32))))
  assert keys[0][0] != keys[0][1]   # float16's double rounding moved some elements
  assert [k[0] for k in keys[1:4]] == [keys[0][0]] * 3
  assert [k[0] for k in keys[4:6]] == [keys[0][1]] * 2
  assert keys[6] == (None, None)

"""The weights' fingerprints at a fraction of their cost (weight_fingerprints): the same digest
on the host and compiled, a kept digest reused only while the variable's buffer is the one it
was computed from, and one pass over the weights per DP train_on_batch.

Claim (module docstring): the digest h(X) = sum_i a_i sum_j b_j X_ij mod 2^64 of a variable's
bit patterns is exact integer arithmetic, so the host (NumPy) and the compiled (XLA) forms give
the same value; a kept digest stands for the variable's values only while no write happened
since it was computed (TensorFlow's copy-on-write of a variable whose buffer another tensor
holds): every kind of write between two DP steps is refused as before.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import weight_fingerprints as wf

N, D = 100, 4

# Nightly (tests/conftest.py; benchmarks/SUITE_CUTS.md, session 45): under jit_compile=True the
# set_weights and plain-optimizer changes, whose refusal the default tier asserts without XLA
# (their [False] cases: same models, calls and messages) and under XLA by the smallest change,
# one unit in the last place of one kernel entry ([assign-True]: the compiled digest sees it,
# the next train_on_batch and the statement are refused), and by
# test_weights_changed_outside.py's set_weights_of_other_values_...[True] (set_weights of other
# values after XLA-compiled DP fits refused).
SLOW_CASES = {f"test_train_on_batch_one_pass_and_changes_between_calls_refused[{change}-True]"
              for change in ("set_weights", "plain_optimizer")}

_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "bool"]
_SHAPES = [(), (7,), (5, 3), (4, 3, 2), (300, 7), (8, 4, 64)]


def _reference(values):
  """h by Python integers (no wrapping type): the bit patterns of `values` (a NumPy array)
  as unsigned integers (a 64-bit value as its two 32-bit words), [R, C] in memory order with
  C the largest divisor of their number at most 1024 (1024 in the (8, 4, 64) case), and the
  module's multipliers."""
  width = min(values.dtype.itemsize, 4)   # a 64-bit value as its two 32-bit words
  bits = np.ascontiguousarray(values).reshape(-1).view(np.dtype(f"u{width}"))
  cols = max(c for c in range(1, min(1024, bits.size) + 1) if bits.size % c == 0)
  rows = bits.size // cols
  a, b = wf._multipliers(rows, cols)   # pylint: disable=protected-access
  x = bits.reshape(rows, cols)
  total = 0
  for i in range(rows):
    row = sum(int(b[0, j]) * int(x[i, j]) for j in range(cols))
    total += int(a[i]) * row
  return total % 2**64


def _values(dtype, shape, rng):
  if dtype == "bool":
    return rng.integers(0, 2, size=shape).astype(bool)
  if dtype in ("int32", "int64", "uint8"):
    return rng.integers(-100 if dtype != "uint8" else 0, 100, size=shape).astype(dtype)
  return np.array(tf.cast(rng.normal(size=shape), dtype).numpy())


@pytest.mark.parametrize("dtype", _DTYPES)
def test_host_and_compiled_digests_equal_the_integer_formula(dtype, monkeypatch):
  rng = np.random.default_rng(3)
  for shape in _SHAPES:
    values = _values(dtype, shape, rng)
    tensor = tf.constant(values)
    expected = _reference(values.view(np.uint8) if dtype == "bool" else values)
    monkeypatch.setattr(wf, "HOST_ELEMENTS", 10**9)   # every size on the host
    host = wf._digests([tensor])[0]   # pylint: disable=protected-access
    monkeypatch.setattr(wf, "HOST_ELEMENTS", -1)      # every size compiled
    compiled = wf._digests([tensor])[0]   # pylint: disable=protected-access
    assert host == compiled == expected, (dtype, shape)


def test_small_variables_are_digested_without_a_compiled_program(monkeypatch):
  """Below HOST_ELEMENTS no program runs (BERT-base: 123 of 197 variables, 4 of 10 shapes)."""
  calls = []
  real = wf._fused_digest   # pylint: disable=protected-access
  monkeypatch.setattr(wf, "_fused_digest", lambda *a: calls.append(a) or real(*a))
  small = tf.ones([wf.HOST_ELEMENTS])
  large = tf.ones([wf.HOST_ELEMENTS + 1])
  wf._digests([small, small * 2])   # pylint: disable=protected-access
  assert not calls
  wf._digests([small, large])   # pylint: disable=protected-access
  assert len(calls) == 1


def test_values_of_one_size_share_one_compiled_shape(monkeypatch):
  """N values with 1024 dividing N are read as [N / 1024, 1024] whatever their shape
  (BERT-base: its [768, 12, 64] query kernels and [768, 768] output kernels, its
  [768, 3072] and [3072, 768] feed-forward kernels), so one compiled program serves them."""
  calls = []
  real = wf._fused_digest   # pylint: disable=protected-access
  monkeypatch.setattr(wf, "_fused_digest", lambda *a: calls.append(a) or real(*a))
  monkeypatch.setattr(wf, "HOST_ELEMENTS", -1)   # every size compiled
  values = tf.random.stateless_normal([768, 768], seed=[1, 2])
  shapes = [(768, 768), (768, 12, 64), (9216, 64)]
  digests = wf._digests([tf.reshape(values, s) for s in shapes])   # pylint: disable=protected-access
  assert len(set(digests)) == 1
  assert {tuple(c[0].shape) for c in calls} == {(576, 1024)}
  monkeypatch.setattr(wf, "HOST_ELEMENTS", 10**9)   # the host's form: the same h
  assert wf._digests([values]) == digests[:1]   # pylint: disable=protected-access


class _Opt:
  """A stand-in DP optimizer: only `iterations` is read by the fingerprints."""

  def __init__(self):
    self.iterations = tf.Variable(0, dtype=tf.int64)


def _count_digests(monkeypatch):
  """Counts the values digested (`_digests_and_keys`: every pass goes through it)."""
  counted = []
  real = wf._digests_and_keys   # pylint: disable=protected-access

  def counting(values, arrays=None, want=None):
    counted.append(len(values))
    return real(values, arrays, want)

  monkeypatch.setattr(wf, "_digests_and_keys", counting)
  return counted


def _writes():
  """Every kind of write to a variable between two DP steps (the module's copy-on-write
  claim): eager, traced, XLA-compiled, sparse, through a plain Keras optimizer, the raw ops."""
  graph_sub = tf.function(lambda v: v.assign_sub(tf.ones_like(v) * 0.5))
  jit_sub = tf.function(lambda v: v.assign_sub(tf.ones_like(v) * 0.5), jit_compile=True)

  def keras_opt(kv):
    opt = keras.optimizers.Adam(0.1)
    opt.apply([tf.ones(kv.shape)], [kv])

  def keras_opt_traced(kv):
    opt = keras.optimizers.SGD(0.1)
    opt.build([kv])
    tf.function(lambda: opt.apply([tf.ones(kv.shape)], [kv]), jit_compile=True)()

  return {
      "assign": lambda kv: kv.assign(np.full(kv.shape, 2.0, np.float32)),
      "assign_add": lambda kv: kv.assign_add(tf.ones(kv.shape)),
      "tf_assign_sub": lambda kv: kv.value.assign_sub(tf.ones(kv.shape)),
      "graph_assign_sub": lambda kv: graph_sub(kv.value),
      "jit_assign_sub": lambda kv: jit_sub(kv.value),
      "scatter": lambda kv: kv.value.scatter_add(
          tf.IndexedSlices(tf.ones([1] + list(kv.shape[1:])), tf.constant([1]))),
      "keras_adam": keras_opt,
      "keras_sgd_jit": keras_opt_traced,
      "raw_assign": lambda kv: tf.raw_ops.AssignVariableOp(
          resource=kv.value.handle, value=tf.zeros(kv.shape)),
      "raw_apply": lambda kv: tf.raw_ops.ResourceApplyGradientDescent(
          var=kv.value.handle, alpha=tf.constant(0.1), delta=tf.ones(kv.shape)),
  }


@pytest.mark.parametrize("size", [(6, 4), (wf.HOST_ELEMENTS + 5, 2)], ids=["host", "compiled"])
@pytest.mark.parametrize("write", sorted(_writes()))
def test_a_kept_digest_is_not_used_after_any_write(write, size, monkeypatch):
  """After a record, a check reads the kept digest (no digest computed) while nothing wrote
  the variable; after each kind of write the digest is computed and the change refused."""
  kv = keras.Variable(np.random.default_rng(0).normal(size=size).astype(np.float32))
  other = keras.Variable(np.ones([3], np.float32))
  opt = _Opt()
  wf.record(opt, [kv, other])
  counted = _count_digests(monkeypatch)
  assert wf.changed([kv, other]) == []
  assert sum(counted) == 0   # both kept digests read: nothing computed
  _writes()[write](kv)
  bad = wf.changed([kv, other])
  assert [v for v, _ in bad] == [kv]
  assert sum(counted) == 1   # the written variable's digest computed, the other's kept


def test_writing_back_the_recorded_values_is_accepted(monkeypatch):
  """A write of the recorded values (a new buffer, the same values) is accepted: the kept
  digest only saves work, the decision is the digest's."""
  kv = keras.Variable(np.arange(12, dtype=np.float32).reshape(3, 4))
  opt = _Opt()
  wf.record(opt, [kv])
  saved = np.array(kv)
  kv.assign(saved + 1)
  kv.assign(saved)
  counted = _count_digests(monkeypatch)
  assert wf.changed([kv]) == []
  assert sum(counted) == 1


def test_a_dp_update_lets_the_kept_tensors_go():
  """check(record_with=...) precedes a DP update: no tensor is kept, so the update writes the
  variable in place."""
  kv = keras.Variable(np.ones([4, 4], np.float32))
  opt = _Opt()
  wf.record(opt, [kv])
  rec = wf._record_of(kv)   # pylint: disable=protected-access
  assert rec.held is not None
  wf.check([kv], "train_on_batch", record_with=opt)
  assert rec.held is None


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, D)).astype(np.float32),
          rng.normal(size=(N, 1)).astype(np.float32))


def _shared(jit_compile):
  keras.utils.set_random_seed(0)
  encoder = keras.layers.Dense(8, name="encoder")
  inp = keras.Input((D,))
  h = encoder(inp)
  dp_model = dp.keras.DPModel(inp, keras.layers.Dense(1, name="head")(h))
  dp_model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse",
                   jit_compile=jit_compile)
  dp_model.optimizer.set_sampling(N, 10 / N, "poisson", 10)   # the user's batches
  plain = keras.Model(inp, keras.layers.Dense(D)(h))
  plain.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
  return dp_model, plain


def _train_on_batch(model, x, y):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return model.train_on_batch(x, y)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("change", ["set_weights", "plain_optimizer", "assign", "none"])
def test_train_on_batch_one_pass_and_changes_between_calls_refused(jit_compile, change,
                                                                    monkeypatch):
  """train_on_batch computes each trainable variable's digest once a call (the record after
  its update; the next call's check reads the kept digests), and a change between two calls
  (set_weights, a plain optimizer on the shared layer, assign) is refused by the next call."""
  x, y = _data()
  dp_model, plain = _shared(jit_compile)
  _train_on_batch(dp_model, x[:10], y[:10])
  _train_on_batch(dp_model, x[10:20], y[10:20])
  counted = _count_digests(monkeypatch)
  _train_on_batch(dp_model, x[20:30], y[20:30])
  assert sum(counted) == len(dp_model.trainable_variables)   # one pass, not two
  if change == "set_weights":
    dp_model.set_weights([w + np.float32(1e-3) for w in dp_model.get_weights()])
  elif change == "plain_optimizer":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      plain.train_on_batch(x[:10], x[:10])
  elif change == "assign":
    kernel = np.array(dp_model.get_layer("head").kernel)
    kernel[0, 0] = np.nextafter(kernel[0, 0], np.float32(np.inf))
    dp_model.get_layer("head").kernel.assign(kernel)
  steps = int(dp_model.optimizer.iterations.numpy())
  if change == "none":
    _train_on_batch(dp_model, x[30:40], y[30:40])
    assert int(dp_model.optimizer.iterations.numpy()) == steps + 1
    dp_model.privacy_statement(1e-5)
    return
  with pytest.raises(dp.errors.PrivacyConfigError, match="train_on_batch refused"):
    _train_on_batch(dp_model, x[30:40], y[30:40])
  assert int(dp_model.optimizer.iterations.numpy()) == steps   # no step taken
  with pytest.raises(dp.errors.PrivacyConfigError, match="privacy_statement refused"):
    dp_model.privacy_statement(1e-5)


@pytest.mark.parametrize("change", ["assign", "none"])
def test_train_on_batch_does_not_digest_frozen_layers_again(change, monkeypatch):
  """A frozen layer (LoRA's backbone) keeps its kept digest through the DP update: a
  train_on_batch digests only the variables the update writes, and a write to the frozen
  layer between two calls is still refused by the next."""
  x, y = _data()
  dp_model, _ = _shared(False)
  dp_model.get_layer("encoder").trainable = False
  dp_model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  dp_model.optimizer.set_sampling(N, 10 / N, "poisson", 10)
  _train_on_batch(dp_model, x[:10], y[:10])
  _train_on_batch(dp_model, x[10:20], y[10:20])
  frozen = dp_model.get_layer("encoder").kernel
  assert any(v is frozen for v in wf.checked_variables(dp_model))   # checked, not trainable
  counted = _count_digests(monkeypatch)
  _train_on_batch(dp_model, x[20:30], y[20:30])
  assert sum(counted) == len(dp_model.trainable_variables) == 2   # the head's only
  if change == "none":
    _train_on_batch(dp_model, x[30:40], y[30:40])
    return
  frozen.assign(np.array(frozen) + np.float32(1e-3))
  with pytest.raises(dp.errors.PrivacyConfigError, match="train_on_batch refused"):
    _train_on_batch(dp_model, x[30:40], y[30:40])


def mirrored_fingerprints_check(strategy):
  """A DP model built under `strategy`: DP fits accepted one after the other, set_weights of
  other values between two fits refused, the run's earlier state accepted; prints "OK
  <replicas>"."""
  x, y = _data()
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = dp.keras.DPSequential([keras.Input((D,)), keras.layers.Dense(8),
                                   keras.layers.Dense(1)])
    model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    w1 = model.get_weights()
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, steps_per_epoch=2)
    model.set_weights([w + np.float32(1e-3) for w in w1])
    try:
      model.fit(x, y, batch_size=10, epochs=1, verbose=0, steps_per_epoch=2)
    except dp.errors.PrivacyConfigError as err:
      assert "fit refused" in str(err), err
    else:
      raise AssertionError("set_weights of other values between two fits was accepted")
    model.set_weights(w1)   # an earlier state of the run
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, steps_per_epoch=2)
  model.privacy_statement(1e-5)
  print("OK", strategy.num_replicas_in_sync, flush=True)


_MIRRORED = """
import tensorflow as tf
physical = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(physical[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from tests.keras import test_weight_fingerprints_cost as t
t.mirrored_fingerprints_check(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
"""


@pytest.mark.slow
def test_dp_fits_under_two_replicas_refuse_a_change_between_them():
  """Two logical CPUs under MirroredStrategy (a subprocess: the devices are set before
  TensorFlow starts): the kept digests of the mirrored variables (their primary's reads) are
  used only while unchanged; set_weights between two DP fits is refused."""
  import os   # pylint: disable=import-outside-toplevel
  import subprocess   # pylint: disable=import-outside-toplevel
  import sys   # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True,
                        timeout=600, env=env, cwd=root, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "OK 2" in proc.stdout.splitlines(), proc.stdout[-2000:]

"""Keras idioms under a real 2-replica tf.distribute.MirroredStrategy (nightly:
tests/keras/test_mirrored_idioms.py runs this module in a fresh process and checks each job):

  checkpoint_restore  a tf.train.Checkpoint of model and optimizer restored after more steps:
                      iterations go back, the ledger does not (a restore never uncharges a
                      step), and no update after the restore repeats an earlier one's noise;
                      without and with XLA
  save_load           model.save / keras.models.load_model, then fit: the loaded model's
                      ledger continues the saved one's
  per_step_charges    keras.callbacks.BackupAndRestore (run through, and interrupted then
                      resumed), BandMF noise (noise="band_mf" on cyclic Poisson batches) and
                      physical chunks (max_physical_batch_size): one ledger sample per step
  spe_refused         a steps_per_execution that does not divide the epoch is refused before
                      any step; a divisor fares as on a plain Keras model (Keras 3.15's
                      multi-step execution fails under the strategy: nothing charged)

Every fit is `fit(x, y, batch_size=B)` on N = 96 records with B = 24 (the default Poisson
sampling, expected batch B) unless the job says otherwise: ceil(N / B) = 4 steps an epoch. The
numbers the checks expect are computed by hand from the steps each job takes (see each
check). Each job prints its RESULT json lines after a line "JOB <name>".

Usage: python -m tests.keras.mirrored_idioms_job [JOB ...]   (default: every job of JOBS)
"""

import json
import os
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras.optimizer import chunking  # noqa: E402

N, B, REPLICAS = 96, 24, 2
STEPS = N // B        # steps an epoch: 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
JOBS = ("checkpoint_restore", "save_load", "per_step_charges", "spe_refused")


def _data(features=6):
  rng = np.random.default_rng(0)
  return (rng.standard_normal((N, features)).astype("float32"),
          rng.integers(0, 3, N).astype("int64"))


def _classifier(strategy, jit=False, spe=1, **opt_kwargs):
  with strategy.scope():
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, **opt_kwargs)
    model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                   keras.layers.Dense(3)])
    model.compile(optimizer=opt, loss=LOSS, jit_compile=jit, steps_per_execution=spe)
  return model


def _counts(model):
  """[optimizer iterations, ledger samples]."""
  opt = model.optimizer
  return [int(opt.iterations.numpy()), int(opt.ledger.sample_count.numpy())]


def _counter(opt):
  """The noise generator's Philox counter (the state's first word, uint64 held as int64)."""
  return int(np.uint64(opt.noise_generator.state.numpy()[0].astype(np.int64).view(np.uint64)))


def _result(out):
  print("RESULT " + json.dumps(out), flush=True)


def _results(lines):
  return [json.loads(l[len("RESULT "):]) for l in lines if l.startswith("RESULT ")]


class _Updates(keras.callbacks.Callback):
  """Each step's update of the first kernel (steps_per_execution=1: one call a step)."""

  def __init__(self, updates):
    super().__init__()
    self.updates = updates
    self.last = None

  def on_train_begin(self, logs=None):
    self.last = self.model.get_weights()[0].copy()

  def on_train_batch_end(self, batch, logs=None):
    now = self.model.get_weights()[0].copy()
    self.updates.append(now - self.last)
    self.last = now


def checkpoint_restore(strategy):
  """Zero gradients (the loss 0 * y_pred: each update is the noise alone, noise multiplier 1):
  fit an epoch (4 steps), save a tf.train.Checkpoint of model and optimizer, fit an epoch,
  restore it, fit an epoch; without and with XLA. One RESULT line per run: [iterations,
  ledger samples] at each point, whether the restore brought back the saved weights, the
  noise counter around the restore, and every step's update (compared pairwise)."""
  x, _ = _data(3)
  y = np.zeros((N, 1), np.float32)
  for jit in (False, True):
    with strategy.scope():
      opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0)
      model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(
          4, kernel_initializer="zeros")])
      model.compile(optimizer=opt, jit_compile=jit,
                    loss=lambda yt, yp: 0.0 * tf.reduce_sum(yp, axis=-1))
    updates = []
    fit = lambda: model.fit(x, y, batch_size=B, epochs=1, verbose=0,  # noqa: E731
                            callbacks=[_Updates(updates)])
    out = {"jit": jit, "counts": {}}
    fit()
    out["counts"]["saved"] = _counts(model)
    saved_weights = model.get_weights()[0].copy()
    directory = tempfile.mkdtemp()
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    fit()
    out["counts"]["before_restore"] = _counts(model)
    counter_before = _counter(opt)
    ckpt.restore(path).assert_existing_objects_matched()
    out["counts"]["restored"] = _counts(model)
    out["restored_saved_weights"] = bool(np.array_equal(model.get_weights()[0], saved_weights))
    out["counter_restore"] = [counter_before, _counter(opt)]
    fit()
    out["counts"]["after"] = _counts(model)
    out["counter_after"] = _counter(opt)
    out["steps"] = len(updates)
    out["norms"] = [float(np.linalg.norm(u)) for u in updates]
    # pairs (i, j), i < j, of steps whose updates are equal (np.allclose): none expected
    out["equal_pairs"] = [[i, j] for i in range(len(updates)) for j in range(i + 1, len(updates))
                          if np.allclose(updates[i], updates[j])]
    _result(out)


def check_checkpoint_restore(lines):
  """Each run: 4 steps saved [4, 4]; 4 more [8, 8]; the restore sets iterations back to 4 and
  leaves the ledger at 8 (the 4 undone steps were taken and stay charged); 4 more steps
  [8, 12] = 4 + 4 + 4 samples for 12 steps taken. The restore brings back the saved weights
  and leaves the noise counter where it was (the generator is not in the checkpoint); the
  12 updates (noise alone) all moved and no two are equal, in particular steps 9-12 (the
  restored iterations 4-7) repeat none of steps 5-8 (the same iterations before)."""
  results = _results(lines)
  assert [r["jit"] for r in results] == [False, True], lines
  for r in results:
    c = r["counts"]
    assert c["saved"] == [STEPS, STEPS], r
    assert c["before_restore"] == [2 * STEPS, 2 * STEPS], r
    assert c["restored"] == [STEPS, 2 * STEPS], r       # a restore never uncharges steps
    assert c["after"] == [2 * STEPS, 3 * STEPS], r      # 12 steps taken, 12 samples
    assert r["restored_saved_weights"], r
    assert r["counter_restore"][1] == r["counter_restore"][0], r
    assert r["counter_after"] > r["counter_restore"][1], r
    assert r["steps"] == 3 * STEPS, r
    assert all(n > 1e-3 for n in r["norms"]), r          # noise on: every update moved
    assert r["equal_pairs"] == [], r                     # never the same noise twice


def save_load(strategy):
  """Fit an epoch, model.save, keras.models.load_model in the strategy's scope, fit an epoch
  with the loaded model. One RESULT line: the counts of the saved model, of the loaded one
  before and after its fit, and whether the load brought back the saved weights."""
  x, y = _data()
  model = _classifier(strategy)
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  out = {"saved": _counts(model)}
  path = os.path.join(tempfile.mkdtemp(), "model.keras")
  model.save(path)
  with strategy.scope():
    loaded = keras.models.load_model(path)
  out["loaded_class"] = type(loaded.optimizer).__name__
  out["same_weights"] = bool(all(np.array_equal(a, b) for a, b in
                                 zip(model.get_weights(), loaded.get_weights())))
  out["loaded"] = _counts(loaded)
  loaded.fit(x, y, batch_size=B, epochs=1, verbose=0)
  out["after"] = _counts(loaded)
  out["original_after"] = _counts(model)
  _result(out)


def check_save_load(lines):
  """Saved after 4 steps [4, 4]; loaded [4, 4] (the ledger travels in the file); 4 more steps
  [8, 8]; the saved model's own counts unchanged [4, 4]."""
  results = _results(lines)
  assert len(results) == 1, lines
  r = results[0]
  assert r["saved"] == [STEPS, STEPS], r
  assert r["loaded_class"] == "DPKerasSGDOptimizer", r
  assert r["same_weights"], r
  assert r["loaded"] == [STEPS, STEPS], r
  assert r["after"] == [2 * STEPS, 2 * STEPS], r
  assert r["original_after"] == [STEPS, STEPS], r


class _Interrupt(keras.callbacks.Callback):
  """Raises after batch `batch` of epoch `epoch` (0-based) ends."""

  def __init__(self, epoch, batch):
    super().__init__()
    self.at, self.epoch = (epoch, batch), None

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if (self.epoch, batch) == self.at:
      raise RuntimeError("interrupted by the test")


def per_step_charges(strategy):
  """One RESULT line per case ("case": name)."""
  x, y = _data()
  # BackupAndRestore, run through: 2 epochs
  model = _classifier(strategy)
  model.fit(x, y, batch_size=B, epochs=2, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(tempfile.mkdtemp())])
  _result({"case": "backup", "counts": _counts(model)})
  # BackupAndRestore, interrupted after the 3rd step of epoch 2 (backup at the end of epoch
  # 1), then the same fit again: it restores the epoch-1 backup and runs epoch 2
  model = _classifier(strategy)
  backup = tempfile.mkdtemp()
  out = {"case": "backup_interrupted"}
  try:
    model.fit(x, y, batch_size=B, epochs=2, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(1, 2)])
    out["interrupted"] = False
  except RuntimeError as e:
    out["interrupted"] = "interrupted by the test" in str(e)
  out["at_interrupt"] = _counts(model)
  epochs = []
  model.fit(x, y, batch_size=B, epochs=2, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: epochs.append(epoch))])
  out["resumed_epochs"] = epochs
  out["counts"] = _counts(model)
  _result(out)
  # BandMF noise on cyclic Poisson batches: 2 groups, 4 steps an epoch, 2 epochs
  with strategy.scope():
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, noise="band_mf",
                                       num_bands=2, num_steps=2 * STEPS)
    model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=opt, loss=LOSS)
  data = dp.data.cyclic_poisson_batches(x, y, expected_batch_size=B, num_groups=2,
                                        steps_per_epoch=STEPS, seed=2)
  model.fit(data, epochs=2, verbose=0)
  _result({"case": "band_mf", "counts": _counts(model),
           "noise_params": {k: str(v) for k, v in opt.private_step.noise_params.items()}})
  # physical chunks of 8 examples: the chunk sizes sum_over_chunks was traced with
  layouts, real = [], chunking.sum_over_chunks

  def spy(chunk_fn, acc, records, record_mask, per_chunk, template=None):
    layouts.append(per_chunk)
    return real(chunk_fn, acc, records, record_mask, per_chunk, template=template)

  chunking.sum_over_chunks = spy
  try:
    model = _classifier(strategy, max_physical_batch_size=8)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  finally:
    chunking.sum_over_chunks = real
  _result({"case": "physical", "counts": _counts(model), "layouts": sorted(set(
      -1 if p is None else int(p) for p in layouts)),
           "finite": bool(all(np.isfinite(w).all() for w in model.get_weights()))})


def check_per_step_charges(lines):
  """backup: 2 epochs of 4 steps [8, 8]. backup_interrupted: 4 + 3 = 7 steps taken when
  interrupted [7, 7]; the resumed fit restores the end-of-epoch-1 backup (iterations 4) and
  runs epoch 2 only (4 steps): iterations 8, ledger 7 + 4 = 11, every step taken charged
  once. band_mf: 2 epochs of 4 steps [8, 8]. physical: 4 steps [4, 4], summed in chunks of 8
  examples, finite weights."""
  results = {r["case"]: r for r in _results(lines)}
  assert list(results) == ["backup", "backup_interrupted", "band_mf", "physical"], lines
  assert results["backup"]["counts"] == [2 * STEPS, 2 * STEPS], results
  r = results["backup_interrupted"]
  assert r["interrupted"], r
  assert r["at_interrupt"] == [STEPS + 3, STEPS + 3], r
  assert r["resumed_epochs"] == [1], r
  assert r["counts"] == [2 * STEPS, STEPS + 3 + STEPS], r
  assert results["band_mf"]["counts"] == [2 * STEPS, 2 * STEPS], results
  r = results["physical"]
  assert r["counts"] == [STEPS, STEPS], r
  assert r["layouts"] == [8], r
  assert r["finite"], r


def _fit_outcome(model, x, y):
  """None if one epoch's fit ran, else "<error class>: <message>" (a graph error's message
  without its traceback lines)."""
  try:
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    return None
  except (dp.errors.PrivacyConfigError, tf.errors.InvalidArgumentError) as e:
    lines = [l for l in str(e).splitlines() if l.strip() and not l.startswith("  File ")
             and not l.startswith("Detected at node")]
    return f"{type(e).__name__}: " + "\n".join(lines)


def spe_refused(strategy):
  """steps_per_execution=3 on a 4-step epoch (refused), then 2 (a divisor), and 2 on a plain
  Keras model (keras.Sequential, keras.optimizers.SGD) of the same layers: Keras' own
  multi-step execution under the strategy, which the DP model's divisor run is compared with.
  One RESULT line per run: the error (None: it ran) and, for the DP runs, the counts."""
  x, y = _data()
  for spe in (3, 2):
    model = _classifier(strategy, spe=spe)
    before = [w.copy() for w in model.get_weights()]
    out = {"spe": spe, "model": "dp", "error": _fit_outcome(model, x, y)}
    out["counts"] = _counts(model)
    out["weights_same"] = bool(all(np.array_equal(a, b)
                                   for a, b in zip(before, model.get_weights())))
    _result(out)
  with strategy.scope():
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(3)])
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, steps_per_execution=2)
  before = [w.copy() for w in plain.get_weights()]
  error = _fit_outcome(plain, x, y)
  _result({"spe": 2, "model": "plain", "error": error,
           "iterations": int(plain.optimizer.iterations.numpy()),
           "weights_same": bool(all(np.array_equal(a, b)
                                    for a, b in zip(before, plain.get_weights())))})


# Keras 3.15's multi-step execution (steps_per_execution > 1) under a MirroredStrategy of 2
# replicas fails on plain Keras models too (measured, session 55; likely keras-team/keras#19246)
KERAS_MULTI_STEP_FAILURE = "You must feed a value for placeholder tensor"


def check_spe_refused(lines):
  """3 does not divide 4: refused by the library's own check with its message (whole
  executions would take ceil(4 / 3) * 3 = 6 steps), nothing taken or charged [0, 0].
  2 divides 4: the DP model's fit fares as the plain Keras model's: where Keras' multi-step
  execution runs under the strategy, 4 steps [4, 4]; where it fails (Keras 3.15: the
  placeholder error of KERAS_MULTI_STEP_FAILURE, on the plain model too), the DP fit fails
  with the same error and nothing is taken, applied or charged: [0, 0], weights unchanged."""
  results = _results(lines)
  assert [(r["spe"], r["model"]) for r in results] == [(3, "dp"), (2, "dp"), (2, "plain")], lines
  refused, divisor, plain = results
  message = refused["error"]
  assert message is not None and message.startswith("PrivacyConfigError: "), refused
  assert "`steps_per_execution` must divide the epoch's 4 steps under DP training" in message
  assert "6 steps an epoch instead of 4" in message and "[1, 2, 4]" in message, message
  assert "Received: steps_per_execution=3, steps_per_epoch=4" in message, message
  assert refused["counts"] == [0, 0], refused
  assert refused["weights_same"], refused
  if plain["error"] is None:
    assert plain["iterations"] == STEPS, plain
    assert divisor["error"] is None, (divisor, plain)
    assert divisor["counts"] == [STEPS, STEPS], divisor
  else:
    assert plain["error"].startswith("InvalidArgumentError: "), plain
    assert KERAS_MULTI_STEP_FAILURE in plain["error"], plain
    # (the plain model's own iterations are not asserted: measured 1, weights unchanged)
    assert divisor["error"] is not None, (divisor, plain)
    assert divisor["error"].startswith("InvalidArgumentError: "), divisor
    assert KERAS_MULTI_STEP_FAILURE in divisor["error"], divisor
    assert divisor["counts"] == [0, 0], divisor
    assert divisor["weights_same"], divisor               # nothing applied either


CHECKS = {"checkpoint_restore": check_checkpoint_restore, "save_load": check_save_load,
          "per_step_charges": check_per_step_charges, "spe_refused": check_spe_refused}


def _two_cpus():
  """Splits the CPU into 2 logical devices (before TensorFlow's runtime starts: in `main`,
  not at import, since test_mirrored_idioms.py imports this module for its checks)."""
  cpus = tf.config.list_physical_devices("CPU")
  if tf.config.get_logical_device_configuration(cpus[0]) is None:   # once per process
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


def main(argv):
  """Runs the jobs named in argv (default: all, in JOBS order) in one MirroredStrategy."""
  _two_cpus()
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  assert strategy.num_replicas_in_sync == REPLICAS
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name in argv or JOBS:
      print("JOB " + name, flush=True)
      globals()[name](strategy)


if __name__ == "__main__":
  main(sys.argv[1:])

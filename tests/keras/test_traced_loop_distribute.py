"""A custom loop's private steps traced under tf.distribute.MirroredStrategy keep the weights
checked (weight_fingerprints.traced_update under a strategy).

Claim (weight_fingerprints; the privacy statement): the ledger's epsilon is stated only for
weights that are a function of its noised steps. Relation/unit: add/remove one example,
Poisson q = 10 / 100, z = 1, C = 1; unit = example. A custom loop (`strategy.run` of
`compute_private_gradients` and `apply_private_gradients` in a tf.function) on 1 logical CPU
(in this process) and on 2 (a subprocess: the devices are set before TensorFlow starts):
  * an unchanged loop is stated, its epsilon the RDP accountant's of dp-accounting for the
    same Poisson subsampled Gaussian steps, composed by hand;
  * `model.set_weights(w + 0.5)` after a traced step, or between two traced steps, is refused
    at the next statement, and a step from the changed weights leaves weights refused too;
  * putting back a state the run recorded (the weights at a statement) goes on from it;
  * under 2 replicas, a write to one replica's copy of a mirrored variable only (the primary
    unchanged, so the host's read sees nothing) is refused after the next traced step.
The 2-replica checks run, in the default suite, in test_distribute.py's MirroredStrategy
process (tests/keras/mirrored_jobs_worker.py, one process for the suite's 2-device jobs).
"""

import os
import subprocess
import sys

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib
from tf_dpiter.keras.optimizer import weight_fingerprints

N, D, B, Q, Z, DELTA = 100, 4, 10, 0.1, 1.0, 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _epsilon(steps):
  """epsilon at DELTA of `steps` Poisson subsampled Gaussian steps (q = Q, z = Z), by the RDP
  accountant of dp-accounting."""
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(Z)),
                                      steps))
  return acc.get_epsilon(DELTA)


def _loop(strategy):
  """(model, DP optimizer, the traced step) of a custom loop under `strategy`: the model and
  optimizer built in its scope, the sampling declared outside it, the step a tf.function of
  `strategy.run`; each call takes one private step on a fixed batch of B records split over
  the replicas."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, D)).astype(np.float32)
  y = rng.normal(size=(B, 1)).astype(np.float32)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    opt = dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1)
    opt.build(model.trainable_variables)
  opt.set_sampling(N, Q, "poisson", B)
  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(B))))

  def replica_step(xb, yb):
    grads = opt.compute_private_gradients(
        lambda rec: tf.reduce_mean(tf.square(model(rec[0]) - rec[1])),
        model.trainable_variables, data=(xb, yb), model=model)
    opt.apply_private_gradients(grads, model.trainable_variables)

  @tf.function
  def step():
    strategy.run(replica_step, args=batch)

  return model, opt, step


def _stated(opt):
  return statement_lib.run_statement(opt, DELTA)


def _refused(opt):
  try:
    _stated(opt)
  except dp.errors.PrivacyConfigError as err:
    assert "privacy_statement refused" in str(err), err
  else:
    raise AssertionError("weights changed outside the DP optimizer were stated")


def accepted_check(strategy):
  """An unchanged traced loop under `strategy` is stated, with the hand-composed epsilon;
  raises AssertionError otherwise."""
  model, opt, step = _loop(strategy)
  for _ in range(3):
    step()
  stated = _stated(opt)
  assert stated.steps == 3, stated
  assert stated.epsilon == pytest.approx(_epsilon(3), rel=1e-9), (stated.epsilon, _epsilon(3))
  for _ in range(2):
    step()
  stated = _stated(opt)
  assert stated.steps == 5, stated
  assert stated.epsilon == pytest.approx(_epsilon(5), rel=1e-9), (stated.epsilon, _epsilon(5))
  assert all(np.isfinite(w).all() for w in model.get_weights())


def refused_check(strategy):
  """Weights changed after or between traced steps under `strategy` are refused at the next
  statement; a recorded state put back is stated again; under several replicas a write to a
  replica's copy only is refused after the next step. Raises AssertionError otherwise."""
  model, opt, step = _loop(strategy)
  step()
  step()
  w = model.get_weights()
  assert _stated(opt).steps == 2   # the statement records these weights: a recorded state
  model.set_weights([v + np.float32(0.5) for v in w])   # after a traced step
  _refused(opt)
  step()   # a step that starts from the changed weights: its output is refused too
  _refused(opt)
  model.set_weights(w)   # the recorded state put back: the run goes on from it
  step()
  step()
  stated = _stated(opt)
  assert stated.steps == 5, stated   # every noised step is charged, the refused one too
  assert stated.epsilon == pytest.approx(_epsilon(5), rel=1e-9)
  w = model.get_weights()
  step()
  model.set_weights([v + np.float32(0.5) for v in model.get_weights()])   # between two steps
  step()
  _refused(opt)
  model.set_weights(w)
  step()
  assert _stated(opt).steps == 8
  if strategy.num_replicas_in_sync > 1:
    kernel = model.layers[0].kernel.value   # a MirroredVariable: one copy per replica
    copies = kernel.values
    copies[-1].assign(copies[-1] + 0.5)   # one replica's copy: the host reads the primary
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), copies[0].numpy())
    step()
    _refused(opt)


# With -m slow: the default suite runs the same two checks on 2 replicas (test_distribute.py's
# process, job traced_loop), where each asserts what it asserts on 1 and refused_check also the
# write to one replica's copy; test_a_traced_state_past_the_window_is_refused_naming_the_fix
# runs a traced loop on 1 replica by default.
@pytest.mark.slow
def test_one_replica_unchanged_loop_is_stated():
  accepted_check(tf.distribute.MirroredStrategy(["/cpu:0"]))


@pytest.mark.slow
def test_one_replica_changes_around_traced_steps_are_refused():
  refused_check(tf.distribute.MirroredStrategy(["/cpu:0"]))


def two_replica_checks(strategy):
  """Runs accepted_check and refused_check under `strategy` (2 replicas), printing "OK
  <check> <replicas>" or "FAILED <check> <replicas> <error>" for each (`check_two_replicas`
  reads them). The default suite runs this in tests/keras/mirrored_jobs_worker.py's process
  (test_distribute.py checks its lines with `check_two_replicas`); `-m slow` in a process of
  its own (the `two_replicas` fixture)."""
  for name, check in (("accepted", accepted_check), ("refused", refused_check)):
    try:
      check(strategy)
    except AssertionError as err:
      print("FAILED", name, strategy.num_replicas_in_sync, repr(err)[:600], flush=True)
    else:
      print("OK", name, strategy.num_replicas_in_sync, flush=True)


def check_two_replicas(lines):
  """Asserts both checks passed on 2 replicas in `lines` (two_replica_checks' output)."""
  assert "OK accepted 2" in lines, lines
  assert "OK refused 2" in lines, lines


_TWO_REPLICAS = """
import tensorflow as tf
physical = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(physical[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from tests.keras import test_traced_loop_distribute as t
t.two_replica_checks(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
"""


@pytest.fixture(scope="module")
def two_replicas():
  """The stdout lines of both checks run under MirroredStrategy on 2 logical CPUs (one
  process: two strategies in a process draw the same collective keys)."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _TWO_REPLICAS], capture_output=True, text=True,
                        timeout=600, env=env, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout.splitlines()


# The default suite runs both checks on 2 replicas in test_distribute.py's MirroredStrategy
# process (its job "traced_loop"); these run them in a process of their own, with -m slow.
@pytest.mark.slow
def test_two_replicas_unchanged_loop_is_stated(two_replicas):
  assert "OK accepted 2" in two_replicas, two_replicas


@pytest.mark.slow
def test_two_replicas_changes_around_traced_steps_are_refused(two_replicas):
  assert "OK refused 2" in two_replicas, two_replicas


def test_a_traced_state_past_the_window_is_refused_naming_the_fix(tmp_path):
  """The traced steps keep the last TRACED_KEPT states they left (per variable): a
  tf.train.Checkpoint of a state no check saw, put back within them, is stated; put back
  after more traced steps it is refused, and the refusal says so and names the fix (a check
  when saving records the state: then the same restore is stated). A loop of many traced
  steps with no check in between is stated (its weights are the last state)."""
  kept = weight_fingerprints.TRACED_KEPT
  model, opt, step = _loop(tf.distribute.MirroredStrategy(["/cpu:0"]))
  checkpoint = tf.train.Checkpoint(model=model)
  for _ in range(kept + 6):
    step()
  assert _stated(opt).steps == kept + 6
  step()   # past the state the statement recorded
  within = checkpoint.save(str(tmp_path / "within"))
  for _ in range(kept - 1):
    step()
  checkpoint.restore(within)
  assert _stated(opt).steps == 2 * kept + 6
  step()
  past = checkpoint.save(str(tmp_path / "past"))
  for _ in range(kept):
    step()
  checkpoint.restore(past)
  with pytest.raises(dp.errors.PrivacyConfigError, match="privacy_statement refused") as err:
    _stated(opt)
  message = str(err.value)
  assert f"the last {kept} states" in message, message
  assert "model.privacy_statement(delta)" in message and "save_weights" in message, message
  checkpoint.restore(within)   # a state a check saw (the statement above): the run goes on
  step()
  # the fix: a check when the checkpoint is saved records its state
  assert _stated(opt).steps == 3 * kept + 8
  recorded = checkpoint.save(str(tmp_path / "recorded"))
  for _ in range(kept + 1):
    step()
  checkpoint.restore(recorded)
  assert _stated(opt).steps == 4 * kept + 9

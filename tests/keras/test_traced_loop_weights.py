"""A custom loop's private steps traced in a tf.function keep the weights checked
(weight_fingerprints.traced_update; review R5, finding 3 B).

Claim (weight_fingerprints; privacy statement, eager private step, DP fit): the ledger's
epsilon is stated only for weights that are a function of its noised steps. Relation/unit:
add/remove one example, Poisson q = 10 / 100, z = 1, C = 1; unit = example. Before the in-graph
digests, weights written by set_weights after a traced step (no private step produced them)
were stated (epsilon 2.413, 2 steps). Now each traced update writes, in the graph, the digest
of the values it left (and flags a start from values no private step produced); the next check
compares the weights with them.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib
from tf_dpiter.keras.optimizer import weight_fingerprints
from tests.keras import custom_loop_setup as loop


def _loop():
  """(model Dense(8)-Dense(1), DP optimizer, traced step of all variables, traced step of the
  head's only, eager step, the batch of 10)."""
  x, y = loop.data()
  model = loop.regression_model(hidden=(8,))
  opt = loop.dp_sgd(model.trainable_variables)
  loss = loop.record_loss(model)
  full = loop.private_step(opt, loss, model.trainable_variables)
  head = loop.private_step(opt, loss, model.trainable_variables[2:])
  return model, opt, tf.function(full), tf.function(head), full, (x[:10], y[:10])


def _stated(opt):
  return statement_lib.run_statement(opt, 1e-5).steps


def _refused(opt):
  with pytest.raises(dp.errors.PrivacyConfigError, match="privacy_statement refused"):
    statement_lib.run_statement(opt, 1e-5)


def test_traced_steps_are_stated_and_changes_around_them_refused(tmp_path):
  model, opt, full, head, eager, batch = _loop()
  checkpoint = tf.train.Checkpoint(model=model)
  full(*batch)   # a run that starts traced: its start is recorded at the trace
  recorded = checkpoint.save(str(tmp_path / "recorded"))   # stated below: a recorded state
  assert _stated(opt) == 1
  for _ in range(3):
    full(*batch)
  head(*batch)   # a subset: the kernel of Dense(8) keeps the values of the last full step
  head(*batch)
  assert _stated(opt) == 6
  full(*batch)
  traced = checkpoint.save(str(tmp_path / "traced"))   # a state no host check saw
  full(*batch)
  checkpoint.restore(recorded)   # an earlier recorded state: stated
  assert _stated(opt) == 8
  checkpoint.restore(traced)   # a state a traced update left (its ring): stated
  assert _stated(opt) == 8
  # the digests live outside every checkpoint: no restore can set them
  names = [name for name, _ in tf.train.list_variables(traced)]
  assert names and not [n for n in names if "dp_traced" in n or "dp_recorded" in n]

  kernel = model.layers[0].kernel
  kernel.assign(kernel + 0.5)   # after a traced step
  _refused(opt)
  head(*batch)   # a step of the other variables sees nothing of it
  _refused(opt)
  full(*batch)   # a step that starts from the changed kernel: its output is refused too
  _refused(opt)
  with pytest.raises(dp.errors.PrivacyConfigError, match="apply_private_gradients refused"):
    eager(*batch)   # and at the next record (an eager private step)
  checkpoint.restore(recorded)   # put back: stated, and the run goes on from it
  full(*batch)
  full(*batch)
  assert _stated(opt) >= 12
  eager(*batch)   # an eager step records the traced output
  model.set_weights([w + np.float32(0.5) for w in model.get_weights()])
  full(*batch)
  _refused(opt)


def test_traced_digests_are_the_host_digests_under_xla_and_the_step_is_refused_there():
  """The in-graph digest (plain graph and XLA) equals the host's and the fused program's bit
  for bit; a private step traced with jit_compile=True is refused (its ledger write cannot
  compile), so no traced update goes unrecorded there."""
  rng = np.random.default_rng(1)
  values = [tf.constant(rng.normal(size=(300, 129)), tf.float32),   # above HOST_ELEMENTS
            tf.constant(rng.normal(size=(7, 5)), tf.float16),
            tf.constant(rng.normal(size=(6,)), tf.bfloat16),
            tf.constant(rng.integers(-9, 9, size=(3, 4)), tf.int32),
            tf.constant(rng.normal(size=(2, 3)), tf.float64),
            tf.constant(2.5, tf.float32)]
  assert values[0].shape.num_elements() > weight_fingerprints.HOST_ELEMENTS
  host = [weight_fingerprints.digest(v) for v in values]
  for jit in (False, True):
    graph = tf.function(weight_fingerprints._graph_digests, jit_compile=jit)  # pylint: disable=protected-access
    assert [int(h) for h in graph(values).numpy()] == host
  assert len(set(host)) == len(host)
  _, opt, _, _, eager, batch = _loop()
  with pytest.raises(dp.errors.PrivacyConfigError, match="jit_compile=True"):
    tf.function(eager, jit_compile=True)(*batch)
  assert int(opt.iterations.numpy()) == 0   # nothing was applied

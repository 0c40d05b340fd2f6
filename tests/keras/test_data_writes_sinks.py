"""Ops that carry the data out of the private step without a resource (review R5, finding 6):
tf.io.write_file, tf.print to a file or to stderr, given the training call's inputs, are
refused before any step, on both clipping paths (`keras/internals/data_writes._is_release`).

Pair (replace one example, fit's "shuffle"; unit = example): D with x[0, 0] = 10 (every
other |x| < 5) and D' with it replaced by 0: before the fix, D's file held max 10.0 (the
record, exactly) and D''s 4.63, with the same epsilon stated for both. A random draw shaped by
the data and an assert pass (`_QUIET`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.internals import data_writes


class _Out(keras.layers.Layer):
  """Identity; in training, sends max(x) out of the step (`how`) or does a quiet op."""

  def __init__(self, path, how, **kwargs):
    super().__init__(**kwargs)
    self.file, self.how = path, how

  def call(self, inputs, training=None):
    if training:
      top = tf.reduce_max(inputs)
      if self.how == "write_file":
        tf.io.write_file(self.file, tf.strings.as_string(top))
      elif self.how == "print_to_file":
        tf.print(top, output_stream="file://" + self.file)
      elif self.how == "print_to_stderr":
        tf.print(top)
      elif self.how == "debug_dump":   # the v1 debugger: not stateful, writes to a URL
        inputs = tf.raw_ops.DebugIdentity(input=inputs, tensor_name="x:0",
                                          debug_urls=["file://" + self.file])
      elif self.how == "quiet":
        inputs = inputs + 0.0 * tf.random.uniform(tf.shape(inputs))
        tf.debugging.assert_less(top, 1e9)
    return inputs


def _fit(how, path, clipping):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  y = rng.normal(size=(40, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  model = dp.keras.DPModel(inp, keras.layers.Dense(1)(_Out(path, how)(inp)))
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, clipping=clipping),
                "mse")
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  return model


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
@pytest.mark.parametrize("how", ["write_file", "print_to_file", "print_to_stderr"])
def test_data_sent_out_of_the_step_is_refused_before_any_step(how, clipping, tmp_path):
  path = str(tmp_path / "out.txt")
  with pytest.raises(dp.errors.PrivacyConfigError, match=r"writes its input out of the step"):
    _fit(how, path, clipping)
  assert not (tmp_path / "out.txt").exists()   # nothing written: refused before any step


def test_a_debug_dump_of_the_inputs_is_refused_before_any_step(tmp_path):
  """Review R6, finding 2: DebugIdentity (not a stateful op) with a file:// URL, given the
  training call's inputs: before the fix D's dump held the record's row (max 10.0 exactly)
  and epsilon 10.726 was stated; now refused, and nothing is dumped."""
  with pytest.raises(dp.errors.PrivacyConfigError, match=r"writes its input out of the step"):
    _fit("debug_dump", str(tmp_path / "dump"), "auto")
  assert not (tmp_path / "dump").exists()


def test_random_draws_and_asserts_given_the_data_pass(tmp_path):
  model = _fit("quiet", str(tmp_path / "unused.txt"), "auto")
  assert int(model.optimizer.iterations.numpy()) == 4


def test_every_stateful_resourceless_op_is_quiet_or_a_release():
  """The allow-list names registered stateful ops without a resource input; the file and log
  writers are releases."""
  for op in ("WriteFile", "PrintV2", "Print", "SaveV2", "Save", "DebugIdentityV2",
             "DebugIdentity", "DebugNanCount", "DebugNumericSummary", "Copy", "CopyHost"):
    assert data_writes._is_release(op), op
  for op in data_writes._QUIET:
    assert not data_writes._is_release(op), op
  for op in ("AssignVariableOp", "RandomUniform", "Assert", "StatefulPartitionedCall",
             "While", "LogUniformCandidateSampler", "Identity", "DebugGradientIdentity",
             "ScalarSummary"):
    assert not data_writes._is_release(op), op

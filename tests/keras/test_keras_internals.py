"""The upgrade test: every private Keras API tf_dpiter.keras uses (keras_internals) exists and
behaves as the DP train step expects in the installed Keras. A failure names the attribute and
the Keras version: adapt tf_dpiter/keras/internals/keras_internals.py to the new Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.internals import keras_internals as ki

VERSION = keras.__version__


def _model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3,))
  hidden = keras.Sequential([keras.layers.Dense(4, name="inner_dense")], name="inner")(inputs)
  model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
  model.compile(optimizer="sgd", loss="mse")
  return model


def _missing_internals():
  """The private Keras names keras_internals uses that the installed Keras lacks, as
  "Where.attribute", looked for on a tiny compiled functional model and a StatelessScope."""
  inputs = keras.Input((2,))
  model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
  model.compile(optimizer="sgd", loss="mse")
  needed = [(model, "Model", name) for name in (
      "_flatten_layers", "_compute_loss", "_call_has_training_arg", "_symbolic_build",
      "_loss_tracker", "_jit_compile", "_compile_metrics", "_nodes_by_depth",
      "_compile_loss", "_compile_config")]
  needed.append((keras.src.backend, "keras.src.backend", "rnn"))
  needed.append((model._compile_loss, "CompileLoss", "_metrics"))  # pylint: disable=protected-access
  needed.append((model._compile_config, "SerializableDict", "config"))  # pylint: disable=protected-access
  needed.append((keras.src.losses.loss, "keras.src.losses.loss",
                 "unscale_loss_for_distribution"))
  needed.append((keras.src.models.functional, "keras.src.models.functional", "Functional"))
  with keras.StatelessScope() as scope:
    needed.append((scope, "StatelessScope", "state_mapping"))
  return [f"{where}.{name}" for obj, where, name in needed if not hasattr(obj, name)]


def test_no_internal_is_missing():
  missing = _missing_internals()
  assert not missing, f"Keras {VERSION} lacks the private attributes {missing}"


def test_tensorflow_constant_impl_has_the_wrapped_signature():
  """keras_internals.shared_constants wraps TensorFlow's private constant_op._constant_impl
  with its parameters passed positionally: they must still be these six."""
  import inspect  # pylint: disable=g-import-not-at-top
  from tensorflow.python.framework import constant_op  # pylint: disable=g-import-not-at-top
  params = list(inspect.signature(constant_op._constant_impl).parameters)  # pylint: disable=protected-access
  assert params == ["value", "dtype", "shape", "name", "verify_shape", "allow_broadcast"], (
      f"TensorFlow {tf.__version__} changed constant_op._constant_impl: {params}")


def test_flatten_layers_reaches_nested_layers():
  names = [layer.name for layer in ki.flatten_layers(_model(), include_self=False)]
  assert {"inner", "inner_dense", "head"} <= set(names), (
      f"Layer._flatten_layers in Keras {VERSION} no longer lists nested layers: {names}")


def test_compiled_loss_is_the_compiled_mse():
  model = _model()
  x, y = np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32)
  y_pred = model(x)
  got = ki.compiled_loss_fn(model)(x=x, y=y, y_pred=y_pred, sample_weight=None, training=True)
  np.testing.assert_allclose(got, np.mean(np.square(y_pred)), rtol=1e-6,
                             err_msg=f"Model._compute_loss changed in Keras {VERSION}")


def test_training_arg_loss_tracker_and_metrics():
  model = _model()
  assert ki.call_has_training_arg(model) in (True, False)
  tracker = ki.loss_tracker(model)
  tracker.update_state(3.0)
  assert float(tracker.result()) == 3.0, f"Model._loss_tracker changed in Keras {VERSION}"
  metrics = ki.compile_metrics(model)
  ki.set_compile_metrics(model, None)
  assert ki.compile_metrics(model) is None
  ki.set_compile_metrics(model, metrics)
  assert ki.compile_metrics(model) is metrics


def test_jit_compile_off_is_restored():
  model = _model()
  model.jit_compile = True
  with ki.jit_compile_off(model):
    assert not model.jit_compile, f"Model._jit_compile no longer drives jit_compile in {VERSION}"
  assert model.jit_compile


def test_functional_graph_and_symbolic_build():
  model = _model()
  assert isinstance(model, ki.functional_class())
  graph, depths = ki.functional_graph(model)
  assert graph is model and depths and all(isinstance(d, int) for d in depths), (
      f"Functional._nodes_by_depth changed in Keras {VERSION}")
  sub = keras.Sequential([keras.layers.Dense(2)])
  sub.compile(optimizer="sgd", loss="mse")
  ki.symbolic_build(sub, (tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None, 2], tf.float32)))
  assert sub.built, f"Model._symbolic_build no longer builds in Keras {VERSION}"


def test_keras_mask_round_trip():
  t = tf.ones([2, 3])
  assert ki.keras_mask(t) is None
  ki.set_keras_mask(t, tf.constant([True, False]))
  np.testing.assert_array_equal(ki.keras_mask(t), [True, False])


def test_map_variables_substitutes_a_float32_value():
  v = keras.Variable(np.ones(2), dtype="float16")
  with keras.StatelessScope() as scope:
    ki.map_variables(scope, [v], [tf.constant([2.0, 3.0], tf.float32)])
    read = tf.convert_to_tensor(v)
  assert read.dtype == tf.float32, f"StatelessScope.state_mapping changed in Keras {VERSION}"
  np.testing.assert_array_equal(read, [2.0, 3.0])


def test_swap_call_and_restore():
  layer = keras.layers.Dense(1, kernel_initializer="ones")
  x = tf.ones([1, 2])
  want = layer(x)
  token = ki.swap_call(layer, lambda inputs: inputs * 0.0 - 5.0)
  np.testing.assert_array_equal(layer(x), [[-5.0, -5.0]])
  ki.restore_call(token)
  np.testing.assert_array_equal(layer(x), want)
  assert "call" not in vars(layer)


def test_backend_rnn_loop():
  def step(x, states):
    return x + states[0], [x + states[0]]
  last, outputs, _ = ki.rnn(step, tf.ones([2, 4, 3]), [tf.zeros([2, 3])])
  np.testing.assert_allclose(last, np.full((2, 3), 4.0))
  assert tuple(outputs.shape) == (2, 4, 3), f"keras.src.backend.rnn changed in Keras {VERSION}"


def test_a_missing_internal_names_attribute_and_version():
  with pytest.raises(AttributeError, match=rf"_flatten_layers.*Keras {VERSION}"):
    ki.flatten_layers(object())


def test_functional_inputs_struct_is_the_built_structure():
  """total_records reads a functional model's input structure (a dict batch given to a model
  built on a list of inputs is matched by the inputs' names)."""
  a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
  out = keras.layers.Concatenate()([a, b])
  as_list = ki.functional_inputs_struct(keras.Model([a, b], out))
  as_dict = ki.functional_inputs_struct(keras.Model({"a": a, "b": b}, out))
  assert isinstance(as_list, (list, tuple)) and [t.name for t in as_list] == ["a", "b"], (
      f"Functional._inputs_struct changed in Keras {VERSION}: {as_list}")
  assert isinstance(as_dict, dict) and sorted(as_dict) == ["a", "b"], as_dict
  with pytest.raises(AttributeError, match=rf"Functional._inputs_struct.*Keras {VERSION}"):
    ki.functional_inputs_struct(object())


def test_plain_resource_variable_on_every_trace_and_under_a_strategy():
  """weight_fingerprints' in-graph records: made while a tf.function is traced a second time
  (tf.Variable's creator scope refuses that) and under a strategy's scope (not mirrored)."""
  made = []

  @tf.function
  def trace(x):
    made.append(ki.plain_resource_variable(np.zeros([3], np.int64), "dp_probe"))
    return x + 1

  trace(tf.constant(1))
  trace(tf.constant(1.0))   # a second trace
  assert len(made) == 2 and made[0] is not made[1]
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    under = ki.plain_resource_variable(np.arange(3, dtype=np.int64), "dp_probe")
  for v in made + [under]:
    assert isinstance(v, tf.Variable) and not v.trainable
    assert not isinstance(v, tf.distribute.DistributedValues), type(v)
  np.testing.assert_array_equal(under.numpy(), [0, 1, 2])
  with pytest.raises(ValueError):   # what the plain variable avoids
    @tf.function
    def refused(x):
      tf.Variable(0.0)
      return x
    refused(tf.constant(1))
    refused(tf.constant(1.0))


_GLOBAL_DROPOUT = keras.layers.Dropout(0.5)


def test_closure_layers_finds_the_layers_a_loss_reaches():
  """ki.closure_layers: a closure's cells, a global the code names, a default,
  a bound method's object, a functools.partial and a nested function (the custom loop keys
  their random layers); a layer held by a plain object's attribute is not reached."""
  import functools  # pylint: disable=g-import-not-at-top
  cell, default, bound, part, nested, deep = (keras.layers.Dropout(0.5) for _ in range(6))

  class Holder:
    layer = deep

  holder = Holder()

  def inner():
    return nested

  def loss(d=default):
    return cell, _GLOBAL_DROPOUT, d, bound.call, inner(), holder

  found = ki.closure_layers(functools.partial(lambda f, p: (f(), p), loss, part))
  ids = {id(layer) for layer in found}
  assert ids == {id(x) for x in (cell, _GLOBAL_DROPOUT, default, bound, part, nested)}
  assert id(deep) not in ids


def test_closure_layers_sees_through_decorators_at_the_same_level():
  """A decorator's wrapper (functools.wraps; AutoGraph's tf_convert of a partial, as a custom
  loop's traced call hands loss_fn on) and a tf.function are not a level of nesting: a
  layer three functions deep is found through each (review R15, session 45)."""
  import functools  # pylint: disable=g-import-not-at-top
  layer = keras.layers.Dropout(0.5)

  def third():
    return layer

  def second():
    return third()

  def loss():
    return second()

  @functools.wraps(loss)
  def wrapped():
    return loss()

  assert ki.closure_layers(loss) == [layer]
  assert ki.closure_layers(wrapped) == [layer]
  assert ki.closure_layers(tf.function(loss)) == [layer]

  @tf.function
  def traced():
    ctx = tf.__internal__.autograph.control_status_ctx()
    converted = tf.__internal__.autograph.tf_convert(functools.partial(loss), ctx)
    assert ki.closure_layers(converted) == [layer]
    return tf.constant(0)

  traced()

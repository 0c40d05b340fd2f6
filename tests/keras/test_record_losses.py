"""clipping="auto" is exact for any loss shape (issue 14): per-token losses with masks and
sample weights, multi-output and dict losses, add_loss losses.

Each case runs one real train step with noise 0, learning rate 1 and no normalization, so the
weights move by minus the clipped sum, and compares it with a per-record loop: for each example
alone, the gradient of the compiled loss (keras' compute_loss on a batch of one), clipped to C,
summed. The per-record loss is defined as what the compiled, mean-reduced loss gives for that
record (tf_dpiter.keras.optimizer.record_losses)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

CLIP = 0.05
B, T, V = 6, 5, 7


def _reference_sum(model, x, y, sample_weight):
  """sum_i clip_C(grad of compute_loss on example i alone), flattened."""
  variables = model.trainable_variables
  total = [np.zeros(v.shape, np.float64) for v in variables]
  take = lambda t, i: tf.nest.map_structure(lambda a: a[i:i + 1], t)
  for i in range(B):
    xi, yi = take(x, i), take(y, i)
    wi = None if sample_weight is None else take(sample_weight, i)
    with tf.GradientTape() as tape:
      y_pred = model(xi, training=True)
      loss = model.compute_loss(x=xi, y=yi, y_pred=y_pred, sample_weight=wi)
    grads = [np.asarray(tf.convert_to_tensor(g), np.float64) for g in tape.gradient(loss, variables)]
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    factor = min(1.0, CLIP / max(norm, 1e-30))
    total = [t + factor * g for t, g in zip(total, grads)]
  return np.concatenate([t.ravel() for t in total])


def _step_sum(model, x, y, sample_weight):
  """Minus the weight change of one real private step (noise 0, lr 1, normalize False)."""
  w0 = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
  model.train_on_batch(x, y, sample_weight=sample_weight)
  w1 = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
  for v, w in zip(model.trainable_variables, w0):
    v.assign(w.astype(v.dtype))
  return np.concatenate([(a - b).ravel() for a, b in zip(w0, w1)])


def _compile(model, clipping, loss, **kwargs):
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, normalize=False,
                                     clipping=clipping)
  model.compile(optimizer=opt, loss=loss, **kwargs)
  opt.set_sampling(100, B / 100, "poisson")
  return opt


def _check(model, x, y, sample_weight, clipping, expected_path):
  opt = model.optimizer
  ref = _reference_sum(model, x, y, sample_weight)
  got = _step_sum(model, x, y, sample_weight)
  assert opt.resolve_clipping(model) == expected_path
  assert np.linalg.norm(ref) > CLIP  # several records, not all zero
  np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-6)


def _token_model():
  inp = keras.Input((T,), dtype="int32")
  h = keras.layers.Embedding(V, 4, mask_zero=True)(inp)
  out = keras.layers.Dense(V)(h)
  return dp.keras.DPModel(inp, out)


def _token_data(rng):
  x = rng.randint(1, V, size=(B, T)).astype("int32")
  x[0, 3:] = 0   # padding tokens: masked out of example 0's loss
  x[2, 1:] = 0
  y = rng.randint(0, V, size=(B, T)).astype("int32")
  return x, y


@pytest.mark.parametrize("clipping,path,weights", [
    pytest.param("auto", "fast", None, marks=pytest.mark.slow),
    pytest.param("auto", "fast", "example", marks=pytest.mark.slow), ("auto", "fast", "token"),
    pytest.param("vectorized", "vectorized", "token", marks=pytest.mark.slow)])
def test_per_token_loss_with_mask_and_sample_weights(clipping, path, weights):
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  model = _token_model()
  _compile(model, clipping, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = _token_data(rng)
  sw = {None: None, "example": rng.uniform(0.5, 2.0, B).astype("float32"),
        "token": rng.uniform(0.5, 2.0, (B, T)).astype("float32")}[weights]
  if sw is not None:
    sw[1] = 0.0   # example 1 removed by its weight
  _check(model, x, y, sw, clipping, path)


def _two_output_model(as_dict):
  inp = keras.Input((4,))
  h = keras.layers.Dense(5, activation="tanh")(inp)
  a = keras.layers.Dense(3, name="cls")(h)
  b = keras.layers.Dense(2, name="reg")(h)
  return dp.keras.DPModel(inp, {"cls": a, "reg": b} if as_dict else [a, b])


@pytest.mark.parametrize("clipping,path,as_dict", [
    pytest.param("auto", "fast", False, marks=pytest.mark.slow), ("auto", "fast", True),
    pytest.param("vectorized", "vectorized", True, marks=pytest.mark.slow)])
def test_multi_output_and_dict_losses(clipping, path, as_dict):
  keras.utils.set_random_seed(1)
  rng = np.random.RandomState(1)
  model = _two_output_model(as_dict)
  ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if as_dict:
    _compile(model, clipping, {"cls": ce, "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5})
    y = {"cls": rng.randint(0, 3, B), "reg": rng.randn(B, 2).astype("float32")}
  else:
    _compile(model, clipping, [ce, "mse"], loss_weights=[1.0, 0.5])
    y = [rng.randint(0, 3, B), rng.randn(B, 2).astype("float32")]
  x = rng.randn(B, 4).astype("float32") * 3
  _check(model, x, y, None, clipping, path)


class _ActivityPenalty(keras.layers.Layer):
  """Adds a loss on its own activations (add_loss) and passes them through."""

  def call(self, h):
    self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
    return h


def test_add_loss_losses_are_part_of_each_record():
  """Layer losses (add_loss, activity regularizers) come from each record's own forward pass:
  "auto" takes the vectorized path, which runs each record alone."""
  clipping = "auto"
  keras.utils.set_random_seed(2)
  rng = np.random.RandomState(2)
  model = dp.keras.DPSequential([
      keras.Input((4,)), keras.layers.Dense(5, activity_regularizer="l2"), _ActivityPenalty(),
      keras.layers.Dense(3)])
  _compile(model, clipping, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = rng.randn(B, 4).astype("float32") * 3, rng.randint(0, 3, B)
  _check(model, x, y, None, clipping, "vectorized")


def test_per_token_loss_error_names_no_internal_function():
  """A loss the compiled loss cannot reduce per record is reported in user terms."""
  keras.utils.set_random_seed(0)
  model = _token_model()
  _compile(model, "auto", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = _token_data(np.random.RandomState(0))
  with pytest.raises(Exception) as info:
    model.train_on_batch(x, y[:, :2])   # labels of the wrong length
  assert "per_example_loss_fn" not in str(info.value)


def test_the_record_map_traces_no_gradient_of_its_own_under_xla():
  """Under jit_compile, tf.vectorized_map is a nested tf.function; traced under the fast
  path's two tapes it must stay an inference call (its gradient is the custom one), not a
  `__forward_*` function whose symbolic gradient TensorFlow traces too (tracing cost only);
  each record's loss is still its own weighted cross-entropy."""
  from tf_dpiter.keras.optimizer import record_losses
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(3)
  logits = rng.randn(4, 2).astype("float32")
  y, w = np.array([0, 1, 1, 0], np.int32), np.array([1.0, 1.0, 0.5, 0.0], np.float32)

  @tf.function(jit_compile=True)
  def losses(logits, y, w):
    with tf.GradientTape(watch_accessed_variables=False) as first, \
        tf.GradientTape(persistent=True) as tape:
      y_pred = tf.identity(logits)
      first.watch(y_pred)
      tape.watch(y_pred)
      return record_losses.compiled_record_losses(model, y, y_pred, w)

  graph = losses.get_concrete_function(logits, y, w).graph
  names = [f.signature.name for f in graph.as_graph_def().library.function]
  assert names and not [n for n in names if n.startswith(("__forward", "__backward"))], names
  expected = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) * w
  np.testing.assert_allclose(losses(logits, y, w), expected, rtol=1e-5, atol=1e-7)

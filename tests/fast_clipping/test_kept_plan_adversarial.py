"""The fast-clipping plan kept per train function, under changes it must not miss.

The Keras step keeps its fast-clipping plan (plan.one_plan_per_step with the train function's
_TraceFacts.plans) and rebuilds it when the model's trainable variables or the registered
rules change. Each test changes the model between steps in a way a kept plan could miss and
checks, step by step, that the step's update is the per-example clipped sum computed here
independently (one example at a time, the model's own forward, clipped and summed in float64
over the variables the step moved), or that the step refuses (an error of the library).
Noise 0, no normalization and learning rate 1, so an update is the clipped sum itself.
run_eagerly=True re-runs the step's Python at every step, where a kept plan is reused as is.
"""

import signal
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.errors import DPiterError
from tf_dpiter.keras.fast_clipping import registry
from tests.keras import dp_keras_helpers as helpers

# Nightly tier (-m slow, besides the marks below): one mode (eager or graph) per
# check by default, both modes present.
SLOW_CASES = {
    "test_class_forward_changed_after_the_first_step[False]",
    "test_rule_registered_after_the_first_step[True]"}

CLIP = 1.0


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _data(n=6, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=(n, 4)).astype("float32") * 0.4,
          rng.normal(size=(n, 3)).astype("float32"))


def _compile(model, eager):
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, normalize=False,
                                     clipping="fast")
  model.compile(optimizer=opt, loss=_loss, run_eagerly=eager)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt.set_sampling(100, 0.06, "poisson", 6)
  return model


def _per_example_grads(model, x, y, variables):
  """[example][variable] float64 gradients of each example's loss alone (zeros if None)."""
  out = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      tape.watch([v.value for v in variables])
      loss = tf.reduce_sum(_loss(tf.constant(y[i:i + 1]), model(x[i:i + 1], training=True)))
    out.append([np.zeros(v.shape) if g is None else np.asarray(g, np.float64)
                for g, v in zip(tape.gradient(loss, variables), variables)])
  return out


def _clipped_sum(per_example, keep):
  """sum_i min(1, C / ||g_i||) g_i over the variables at positions `keep` (float64)."""
  total = [np.zeros(per_example[0][j].shape) for j in keep]
  for grads in per_example:
    part = [grads[j] for j in keep]
    norm = np.sqrt(sum(float((g ** 2).sum()) for g in part))
    factor = min(1.0, CLIP / norm) if norm > 0 else 1.0
    total = [t + factor * g for t, g in zip(total, part)]
  return total


def _checked_step(model, x, y):
  """One train_on_batch; asserts its update is the independent clipped sum over the variables
  it moved (each example's norm over all of them), and that it moved at least one. Returns
  the paths of the moved variables."""
  variables = list(model.variables)
  before = [v.numpy().astype(np.float64) for v in variables]
  per_example = _per_example_grads(model, x, y, variables)   # before the step
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.train_on_batch(x, y)
  keep = [j for j, v in enumerate(variables) if not np.array_equal(before[j], v.numpy())]
  assert keep, "the step moved no variable"
  expected = _clipped_sum(per_example, keep)
  got = [before[j] - variables[j].numpy().astype(np.float64) for j in keep]
  # one clip shrink 1 / (1 + eta) for the whole step (its public row bound's plan)
  helpers.assert_close_up_to_the_shrink(got, expected, rtol=2e-5, atol=2e-6, max_eta=6e-3)
  return sorted(variables[j].path for j in keep)


def _refused_or_checked(model, x, y):
  """A step on a batch of a new shape (5 rows, after steps of 6: the graph step retraces, so
  both eager and graph steps run the step's Python on the changed model) refuses with an
  error of the library or is the clipped sum of the changed model."""
  try:
    _checked_step(model, x[:5], y[:5])
  except DPiterError:
    return                                         # refusing is sound


def _two_dense():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((4,))
  h = keras.layers.Dense(5, activation="tanh", name="first")(inputs)
  return dp.keras.DPModel(inputs, keras.layers.Dense(3, name="second")(h))


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("recompile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_freeze_and_unfreeze_between_steps(eager, recompile):
  model = _compile(_two_dense(), eager)
  x, y = _data()
  assert len(_checked_step(model, x, y)) == 4
  model.get_layer("first").trainable = False
  if recompile:
    _compile(model, eager)
  moved = _checked_step(model, x, y)
  if recompile or eager:
    assert all("second" in p for p in moved)       # the frozen layer is not trained
  model.get_layer("first").trainable = True
  if recompile:
    _compile(model, eager)
  assert len(_checked_step(model, x, y)) == 4


class _MyDense(keras.layers.Dense):
  """A Dense subclass with Dense's forward: it inherits Dense's rule until given its own."""


def _spied_dense_rule(calls):
  dense_rule = registry.lookup(keras.layers.Dense(1))

  def rule(*args, **kwargs):
    calls.append(1)
    return dense_rule(*args, **kwargs)

  for attr in ("supports_records", "float32_watched", "float32_sums", "lora_variants"):
    if hasattr(dense_rule, attr):
      setattr(rule, attr, getattr(dense_rule, attr))
  return rule


@pytest.mark.parametrize("eager", [True, False])
def test_rule_registered_after_the_first_step(eager):
  """A rule registered between steps (RULES_VERSION changes): the eager step plans again and
  uses it; every step is the clipped sum."""
  keras.utils.set_random_seed(2)
  inputs = keras.Input((4,))
  layer = _MyDense(3)
  model = dp.keras.DPModel(inputs, layer(inputs))
  dp.keras.declare_per_example(layer, "a Dense: each row alone")
  _compile(model, eager)
  x, y = _data()
  _checked_step(model, x, y)
  calls = []
  registry.register_layer(_MyDense, _spied_dense_rule(calls))
  try:
    _checked_step(model, x, y)
    _checked_step(model, x[:5], y[:5])            # a new shape: the graph step retraces
    assert calls                                  # the new rule is the one planned
  finally:
    with registry._LOCK:                           # pylint: disable=protected-access
      registry._REGISTRY.pop(_MyDense, None)       # pylint: disable=protected-access
    registry.RULES_VERSION += 1


@pytest.mark.parametrize("eager", [True, False])
def test_class_forward_changed_after_the_first_step(eager):
  """A subclass's forward replaced between steps (no rule registered, no variable changed):
  it no longer inherits Dense's rule, so the step must clip the new forward exactly."""

  class Patched(keras.layers.Dense):
    pass

  keras.utils.set_random_seed(3)
  inputs = keras.Input((4,))
  layer = Patched(3)
  model = dp.keras.DPModel(inputs, layer(inputs))
  dp.keras.declare_per_example(layer, "a Dense of 3 x: each row alone")
  _compile(model, eager)
  x, y = _data()
  _checked_step(model, x, y)

  def tripled(self, inputs, training=None):
    return keras.layers.Dense.call(self, inputs * 3.0, training=training)

  Patched.call = tripled
  _refused_or_checked(model, x, y)


class _Wrap(keras.layers.Layer):
  """Calls its sublayer `inner` (swapped by the test)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(3, use_bias=False)

  def build(self, input_shape):
    self.inner.build(input_shape)

  def call(self, inputs):
    return self.inner(inputs)


class _Tripled(keras.layers.Layer):
  """3 x K with the kernel K of another layer (the same variable object)."""

  def __init__(self, kernel, **kwargs):
    super().__init__(**kwargs)
    self.kernel_of_other = kernel
    self.built = True

  def call(self, inputs):
    return tf.matmul(inputs, self.kernel_of_other) * 3.0


def test_sublayer_replaced_by_one_with_the_same_variables():
  """After a step, `inner` is replaced by a layer that uses the same kernel object: the
  trainable variables (their ids) and the rules are unchanged, the layers are not. The step
  must clip the new forward, or refuse as a freshly planned step does (PrivacyConfigError:
  shared variables). Eager (the kept plan reused as is); the graph step's retrace is
  test_graph_step_with_a_planned_layer_never_called_finishes (it does not return)."""
  eager = True
  keras.utils.set_random_seed(4)
  inputs = keras.Input((4,))
  wrap = _Wrap()
  model = dp.keras.DPModel(inputs, wrap(inputs))
  dp.keras.declare_per_example(wrap, "a linear map of each row alone")
  _compile(model, eager)
  x, y = _data()
  _checked_step(model, x, y)
  ids = [id(v) for v in model.trainable_variables]
  wrap._tracker.unlock()                           # pylint: disable=protected-access
  wrap.inner = _Tripled(wrap.inner.kernel)
  wrap._tracker.lock()                             # pylint: disable=protected-access
  assert [id(v) for v in model.trainable_variables] == ids
  _refused_or_checked(model, x, y)


@pytest.mark.parametrize("eager", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_model_reused_in_a_second_model(eager):
  """Layers trained in one DP model, then in a second one that contains it: each step is the
  clipped sum over its own model's variables. While the first model's DP optimizer updates
  the shared layers, the second's is refused (one DP optimizer per variable: each ledger
  would charge only its own steps); compiled again, the second model takes the first's
  ledger and variables over."""
  keras.utils.set_random_seed(5)
  inputs = keras.Input((4,))
  body = keras.layers.Dense(5, activation="tanh")
  first = _compile(dp.keras.DPModel(inputs, keras.layers.Dense(3)(body(inputs))), eager)
  outer_in = keras.Input((4,))
  second = _compile(dp.keras.DPModel(outer_in, keras.layers.Dense(3)(
      keras.layers.Dense(3)(first(outer_in)))), eager)
  x, y = _data()
  assert len(_checked_step(first, x, y)) == 4
  with pytest.raises(dp.errors.PrivacyConfigError, match="already updated by another DP"):
    _checked_step(second, x, y)
  _compile(second, eager)   # takes the nested model's ledger and variables over
  assert len(_checked_step(second, x, y)) == 8
  first.get_layer(index=1).trainable = False       # frozen through the first model
  moved = _checked_step(second, x, y)
  if eager:
    assert len(moved) == 6


def _alarm(signum, frame):
  raise TimeoutError("the step did not return within 60 s (budget.kept_chunk(0, k) loops)")


def test_graph_step_with_a_planned_layer_never_called_is_refused_or_routed():
  """A declared layer that uses its Dense sublayer's kernel without calling the sublayer:
  the plan has a ghost unit that records nothing, and the fast path's update of that kernel
  was silently zero. clipping="fast" now refuses at trace time naming the variable;
  clipping="auto" takes the vectorized path, whose update moves the kernel, also after a
  retrace with an unknown batch size (under a 60 s alarm: the physical-chunk probe once
  looped on 0 kept bytes)."""
  # its planned Dense sublayer is never called (the layer reads the sublayer's kernel)
  from tests.privacy.test_unrecorded_variable_use import _NeverCalled  # pylint: disable=g-import-not-at-top
  inp = keras.Input((4,))
  w = _NeverCalled(name="wrap")
  model = dp.keras.DPModel(inp, w(inp))
  dp.keras.declare_per_example(w, "rows alone")
  rng = np.random.RandomState(0)
  x, y = rng.normal(size=(6, 4)).astype("float32"), rng.normal(size=(6, 3)).astype("float32")
  refused, moved = [], []
  previous = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(60)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for clipping in ("fast", "auto"):
        opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, normalize=False,
                                           clipping=clipping)
        model.compile(optimizer=opt, loss=_loss)
        opt.set_sampling(100, 0.06, "poisson", 6)
        for rows in (6, 5):   # 5: a retrace with an unknown batch size (the chunk probe)
          before = np.array(w.inner.kernel)
          try:
            model.train_on_batch(x[:rows], y[:rows])
          except DPiterError as e:
            refused.append((clipping, type(e).__name__, str(e)))
            break
          moved.append((clipping, rows,
                        float(np.max(np.abs(np.array(w.inner.kernel) - before))) > 0))
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
  assert len(refused) == 1 and refused[0][:2] == ("fast", "PrivacyConfigError"), refused
  # the variable named by its path (wrap/dense/kernel in a fresh process)
  assert f"'{w.inner.kernel.path}'" in refused[0][2], (w.inner.kernel.path, refused)
  assert w.inner.kernel.path.startswith("wrap/dense") and "clipping='vectorized'" in refused[0][2]
  assert moved == [("auto", 6, True), ("auto", 5, True)], moved

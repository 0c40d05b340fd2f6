"""Attacks on the unrecorded-use check that the traced DP step runs in its own fast forward pass.

The fast path forms each unit's per-example norm from the layer's recorded calls (Li et al.,
"Large language models can be strong differentially private learners", Section 4); a
trainable variable read elsewhere escapes the norm. The traced step finds such reads in its
own recorded forward pass and, under clipping="auto", takes the vectorized path instead.

Two properties are attacked here:

* the state a forward pass changes (a counter, a moving statistic, a dropout seed) changes
  exactly as much per step as on the vectorized path: the abandoned fast pass's updates must
  not run besides the vectorized pass's (before the fix a rerouted step applied them twice);
* uses hidden in control flow (tf.cond, tf.while_loop, keras.ops.fori_loop / scan, a nested
  tf.function) inside another
  layer's call, a subclassed model reading a kernel in its own call, a read only under
  training=True, and mixed precision are found (routed to vectorized, exact), and where the
  step stays fast, its update is the independent per-example loop's.

Relation: add or remove one example (unit = example). Each bound check runs the real step
with noise 0, normalize=False and learning rate 1 (the update is the clipped sum), removes an
adversarial example (targets 1000 times larger) and requires ||update(D) - update(D')|| <= C,
with both updates equal to an independent loop (tf.GradientTape per example, clipped to C,
summed in float64).
"""

# pylint: disable=protected-access
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tf_dpiter as dp
from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tests.keras.test_probe_state_restore import _Counter
from tests.privacy import test_unrecorded_variable_use as base

STEPS, VOCAB, WIDTH = base.STEPS, base.VOCAB, base.WIDTH


def _with_and_without_last(model, x, y):
  """The update on (x, y) with every example, and with the last example's weight 0 (the
  neighbouring dataset without it), warnings silenced (auto routes with one)."""
  ones = np.ones(len(x), np.float32)
  without = ones.copy()
  without[-1] = 0.0
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return [base._update(model, x, y, w) for w in (ones, without)]


class _HiddenTied(keras.layers.Layer):
  """logits = h E^T, E read inside control flow of this layer's call (not E's layer's)."""

  def __init__(self, embedding, flow, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding
    self.flow = flow

  def call(self, h, training=None):
    table = lambda: ops.transpose(self.embedding.embeddings)  # noqa: E731
    if self.flow == "cond":
      e_t = tf.cond(tf.reduce_sum(h) > -1e30, table, lambda: tf.zeros([WIDTH, VOCAB]))
    elif self.flow == "while":
      e_t = tf.while_loop(lambda i, t: i < 1, lambda i, t: (i + 1, t + table()),
                          (0, tf.zeros([WIDTH, VOCAB])))[1]
    elif self.flow == "fori":
      e_t = ops.fori_loop(0, 1, lambda i, t: t + table(), tf.zeros([WIDTH, VOCAB]))
    elif self.flow == "scan":
      e_t = ops.scan(lambda t, _: (t + table(), None), tf.zeros([WIDTH, VOCAB]),
                     tf.zeros([1]))[0]
    elif self.flow == "nested_function":
      e_t = tf.function(table, autograph=False)()
    elif self.flow == "training_only":
      e_t = table() if training else tf.zeros([WIDTH, VOCAB])
    else:
      raise ValueError(self.flow)
    return ops.matmul(h, e_t)


class _SubclassedTied(keras.Model):
  """A subclassed model whose own call reads its embedding's matrix (no layer call)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.emb = keras.layers.Embedding(VOCAB, WIDTH)
    self.hidden = keras.layers.Dense(WIDTH, activation="tanh")

  def call(self, x):
    return ops.matmul(self.hidden(self.emb(x)), ops.transpose(self.emb.embeddings))


def _tied(head, counter=False, dropout=False):
  keras.utils.set_random_seed(1)
  inp = keras.Input((STEPS,), dtype="int32")
  emb = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")
  h = emb(inp)
  if counter:
    count = _Counter(name="counter")
    dp.keras.declare_per_example(count, "each row alone")
    h = count(h)
  if dropout:
    h = keras.layers.Dropout(0.5, seed=3)(h)
  h = keras.layers.Dense(WIDTH, activation="tanh")(h)
  out = head(emb)
  model = dp.keras.DPModel(inp, out(h))
  dp.keras.declare_per_example(out, "each row alone")
  return model


def _run_steps(model, clipping, mode, x, y, steps=2, seed=None):
  """`steps` DP steps by train_on_batch or fit; returns every variable's value after.
  seed: the DP optimizer's (tests only): the step's keys of the random layers repeat."""
  base._compile(model, clipping, jit=mode == "xla", eager=mode == "eager", seed=seed)
  if mode == "fit_spe2":
    model.compile(optimizer=model.optimizer, loss=base._loss, steps_per_execution=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if mode.startswith("fit"):
      model.fit(x, y, batch_size=len(x) // steps, epochs=1, shuffle=False, verbose=0)
    else:
      for _ in range(steps):
        model.train_on_batch(x, y)
  return [np.asarray(v) for v in model.variables]


@pytest.fixture(scope="module")
def vectorized_counter_steps():
  """(x, y, the vectorized path's count and variables after two graph steps on them): the
  reference of every mode (one model and trace for the module, not one per mode)."""
  x, y = base._data(_tied(lambda e: base._TiedProjection(e), counter=True), "tokens", n=6)
  want = _tied(lambda e: base._TiedProjection(e), counter=True)
  want_values = _run_steps(want, "vectorized", "graph", x, y)
  return x, y, float(want.get_layer("counter").count.numpy()), want_values


@pytest.mark.parametrize("mode", ["graph", "xla", pytest.param("fit", marks=pytest.mark.slow),
                                  pytest.param("eager", marks=pytest.mark.slow)])
def test_auto_routed_step_changes_layer_state_once(mode, vectorized_counter_steps):
  """A counter's assign in the forward pass: the auto-routed step counts as the vectorized
  step does (before the fix, graph and XLA counted 2 per step: the abandoned fast pass's
  assign ran too); its variables equal the vectorized step's (graph; under XLA the vectorized
  XLA step's, whose clip shrink is that of its own padded plan)."""
  x, y, want_count, want_values = vectorized_counter_steps
  got = _tied(lambda e: base._TiedProjection(e), counter=True)
  got_values = _run_steps(got, "auto", mode, x, y)
  assert got._dp_traced_clipping == "vectorized"
  assert float(got.get_layer("counter").count.numpy()) == want_count > 0
  if mode == "fit":   # fit's Poisson batches differ between two runs: the count only
    return
  if mode == "xla":   # the XLA step's clip shrink is its own plan's (padded layout)
    want_values = _run_steps(_tied(lambda e: base._TiedProjection(e), counter=True),
                             "vectorized", "xla", x, y)
  for a, b in zip(got_values, want_values):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_auto_routed_step_advances_the_dropout_seed_once(mode):
  """A Dropout's SeedGenerator and a counter: every variable (seed state included) after two
  auto-routed steps equals the vectorized path's. The step keys the Dropout from its own
  generator (PrivateStep.keyed_layer_draws), seeded here (tests only) so that both runs draw
  the same masks."""
  x, y = base._data(_tied(lambda e: base._TiedProjection(e)), "tokens", n=6)
  got = _run_steps(_tied(lambda e: base._TiedProjection(e), counter=True, dropout=True), "auto",
                   mode, x, y, seed=7)
  want = _run_steps(_tied(lambda e: base._TiedProjection(e), counter=True, dropout=True),
                    "vectorized", mode, x, y, seed=7)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_step_traced_outside_the_train_function_refuses_a_state_changing_abandoned_pass():
  """model.train_step in the user's own tf.function cannot be traced again by the library:
  with a counter in the abandoned fast pass it refuses instead of counting twice."""
  model = _tied(lambda e: base._TiedProjection(e), counter=True)
  x, y = base._data(model, "tokens")
  base._compile(model, "auto")
  model.optimizer.build(model.trainable_variables)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(PrivacyConfigError, match="stateful operations") as err:
      tf.function(model.train_step)((tf.constant(x), tf.constant(y)))
  assert "clipping='vectorized'" in str(err.value)
  assert float(model.get_layer("counter").count.numpy()) == 0.0


@pytest.mark.parametrize("flow", ["cond", pytest.param("fori", marks=pytest.mark.slow),
                                  pytest.param("training_only", marks=pytest.mark.slow),
                                  pytest.param("while", marks=pytest.mark.slow),
                                  pytest.param("nested_function", marks=pytest.mark.slow)])
def test_reads_inside_control_flow_of_another_layer_are_found(flow):
  model = _tied(lambda e: _HiddenTied(e, flow))
  x, y = base._data(model, "tokens")
  opt = base._compile(model, "auto")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    base._check_exact_and_bounded(model, x, y)
  assert model._dp_traced_clipping == "vectorized"
  assert base._route(opt, model, x) == "vectorized"


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_read_inside_ops_scan_of_another_layer_is_refused_under_fast(jit):
  """keras.ops.scan carrying the tied matrix: clipping='fast' refuses before any step
  (under 'auto' the vectorized path loops over the records: test_derived_tensor_uses)."""
  model = _tied(lambda e: _HiddenTied(e, "scan"))
  x, y = base._data(model, "tokens")
  base._compile(model, "fast", jit=jit)
  before = [np.asarray(v) for v in model.trainable_variables]
  with pytest.raises(PrivacyConfigError, match="clipping='fast' cannot clip") as err:
    model.train_on_batch(x, y)
  assert model.get_layer("tokens").embeddings.path in str(err.value)
  for v, w in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(np.asarray(v), w)


def test_subclassed_model_reading_a_kernel_in_its_call_is_routed_and_bounded():
  keras.utils.set_random_seed(1)
  model = dp.keras.make_private(_SubclassedTied())
  rng = np.random.RandomState(0)
  x = rng.randint(0, VOCAB, size=(5, STEPS)).astype("int32")
  model(x)
  y = rng.normal(size=(5, STEPS, VOCAB)).astype("float32")
  y[-1] *= 1e3
  base._compile(model, "auto")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    base._check_exact_and_bounded(model, x, y)
  assert model._dp_traced_clipping == "vectorized"


def test_mixed_precision_tied_read_is_refused_under_fast():
  """AutoCastVariable reads (mixed_float16) of a tied matrix: clipping='fast' refuses."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _tied(lambda e: base._TiedProjection(e))
    x, y = base._data(model, "tokens")
    base._compile(model, "fast")
    with pytest.raises(PrivacyConfigError, match="clipping='fast' cannot clip"):
      model.train_on_batch(x, y)
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _counted_steps(clipping, mode, x, y):
  """The counter after two steps by fit with steps_per_execution=2, or by train_on_batch
  under a one-replica MirroredStrategy."""
  if mode == "fit_spe2":
    model = _tied(lambda e: base._TiedProjection(e), counter=True)
    _run_steps(model, clipping, mode, x, y)
    return model
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    model = _tied(lambda e: base._TiedProjection(e), counter=True)
    opt = dp.keras.DPKerasSGDOptimizer(base.CLIP, 0.0, learning_rate=1.0, normalize=False,
                                       clipping=clipping)
    model.compile(optimizer=opt, loss=base._loss)
  opt.set_sampling(100, 0.05, "poisson", 5)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
  return model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fit_spe2", "mirrored"])
def test_auto_routed_step_counts_once_in_a_loop_and_under_a_strategy(mode):
  x, y = base._data(_tied(lambda e: base._TiedProjection(e)), "tokens", n=6)
  got = _counted_steps("auto", mode, x, y)
  want = _counted_steps("vectorized", mode, x, y)
  assert got._dp_traced_clipping == "vectorized"
  assert float(got.get_layer("counter").count.numpy()) == float(
      want.get_layer("counter").count.numpy()) == 2.0


@pytest.mark.parametrize("clipping", ["auto", pytest.param("fast", marks=pytest.mark.slow)])
def test_a_tied_matrix_made_trainable_between_two_fits_is_checked_again(clipping):
  """Frozen, the tied matrix is no trainable use (fast); made trainable and recompiled, the
  new train function checks again: 'auto' routes (exact, bounded), 'fast' refuses."""
  model, kind, path = base._model("tied_matmul")
  emb = model.get_layer("tokens")
  emb.trainable = False
  x, y = base._data(model, kind)
  base._compile(model, clipping)
  model.train_on_batch(x, y)
  assert model._dp_traced_clipping == "fast"
  emb.trainable = True
  base._compile(model, clipping)
  if clipping == "fast":
    with pytest.raises(PrivacyConfigError, match="clipping='fast' cannot clip") as err:
      model.train_on_batch(x, y)
    assert path in str(err.value)
    return
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    base._check_exact_and_bounded(model, x, y)
  assert model._dp_traced_clipping == "vectorized"


class _OtherKernelLoss(keras.layers.Layer):
  """add_loss of a per-example term through another layer's kernel (a use in a loss)."""

  def __init__(self, other, **kwargs):
    super().__init__(**kwargs)
    self.other = other

  def call(self, x):
    self.add_loss(ops.sum(ops.matmul(x, self.other.kernel)) * 5.0)
    return x


def test_a_kernel_used_in_a_layer_loss_is_routed_exactly_and_bounded():
  keras.utils.set_random_seed(1)
  inp = keras.Input((4,))
  dense = keras.layers.Dense(4, name="read")
  reader = _OtherKernelLoss(dense)
  dp.keras.declare_per_example(reader, "each row alone")
  model = dp.keras.DPModel(inp, keras.layers.Dense(3)(reader(dense(inp))))
  x, y = base._data(model, "float")
  base._compile(model, "auto")
  got, got_without = _with_and_without_last(model, x, y)
  variables = model.trainable_variables

  def loop(n):   # the independent loop with the layer loss in each example's loss
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(n):
      with tf.GradientTape() as tape:
        loss = base._loss(y[i:i + 1], model(x[i:i + 1], training=True))[0] + tf.add_n(
            model.losses)
      g = [np.asarray(t, np.float64) for t in tape.gradient(loss, variables)]
      norm = np.sqrt(sum(np.sum(t * t) for t in g))
      total = [a + min(1.0, base.CLIP / norm) * t for a, t in zip(total, g)]
    return total

  for a, b in zip(got, loop(len(x))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(got_without, loop(len(x) - 1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert base._distance(got, got_without) <= base.CLIP * (1 + 1e-5)
  assert model._dp_traced_clipping == "vectorized"


def test_a_second_output_head_reading_the_tied_matrix_is_routed_exactly_and_bounded():
  """Two outputs, the second the tied projection (its loss built inside the first trace):
  'auto' routes, and the new train function runs the step (a tf.function whose first trace
  raised ran nothing when called again)."""
  keras.utils.set_random_seed(1)
  inp = keras.Input((STEPS,), dtype="int32")
  emb = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")
  h = keras.layers.Dense(WIDTH, activation="tanh")(emb(inp))
  tied = base._TiedProjection(emb)
  dp.keras.declare_per_example(tied, "each row alone")
  model = dp.keras.DPModel(inp, [keras.layers.Dense(2)(h), tied(h)])
  rng = np.random.RandomState(0)
  x = rng.randint(0, VOCAB, size=(5, STEPS)).astype("int32")
  ys = [rng.normal(size=(5, STEPS, 2)).astype("float32"),
        rng.normal(size=(5, STEPS, VOCAB)).astype("float32")]
  for t in ys:
    t[-1] *= 1e3
  opt = dp.keras.DPKerasSGDOptimizer(base.CLIP, 0.0, learning_rate=1.0, normalize=False,
                                     clipping="auto")
  model.compile(optimizer=opt, loss=[base._loss, base._loss])
  opt.set_sampling(100, 0.05, "poisson", 5)
  got, got_without = _with_and_without_last(model, x, ys)
  variables = model.trainable_variables

  def loop(n):
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(n):
      with tf.GradientTape() as tape:
        outs = model(x[i:i + 1], training=True)
        loss = sum(base._loss(t[i:i + 1], o)[0] for t, o in zip(ys, outs))
      g = [np.asarray(t, np.float64) for t in tape.gradient(loss, variables)]
      norm = np.sqrt(sum(np.sum(t * t) for t in g))
      total = [a + min(1.0, base.CLIP / norm) * t for a, t in zip(total, g)]
    return total

  for a, b in zip(got, loop(5)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(got_without, loop(4)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert base._distance(got, got_without) <= base.CLIP * (1 + 1e-5)
  assert model._dp_traced_clipping == "vectorized" and int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("clipping", ["auto", pytest.param("fast", marks=pytest.mark.slow)])
def test_a_fast_step_and_its_batch_independence_probe_change_layer_state_once(clipping):
  """A counter in a model the fast path clips (ReversibleEmbedding's recorded reverse call):
  the probe's runs are undone (it compares only what its runs wrote) and each step counts
  once, as on the vectorized path; the weights equal the vectorized path's."""
  def model_with_counter():
    keras.utils.set_random_seed(1)
    inp = keras.Input((STEPS,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(VOCAB, WIDTH)
    count = _Counter(name="counter")
    dp.keras.declare_per_example(count, "each row alone")
    h = keras.layers.Dense(WIDTH, activation="tanh")(count(emb(inp)))
    return dp.keras.DPModel(inp, emb(h, reverse=True))

  x, y = base._data(model_with_counter(), "tokens", n=6)
  got = model_with_counter()
  got_values = _run_steps(got, clipping, "graph", x, y)
  want_values = _run_steps(model_with_counter(), "vectorized", "graph", x, y)
  assert got._dp_traced_clipping == "fast"
  assert float(got.get_layer("counter").count.numpy()) == 2.0
  # the vectorized sum adds each clipped record times 1 / (1 + eta) (summation.shrink, eta
  # the float32 rounding margin of the public plan's R rows under add/remove: the sampling's
  # public row bound, 40 for n = 100, q = 0.05); this model's fast sums are not pinned
  # (unshrunk): the two paths may differ by eta times the two updates (each at most 6 C)
  rows = got.optimizer.private_step.sampling.public_row_bound
  shrink_gap = float(summation.rounding_margin(rows)) * 2 * len(x) * base.CLIP
  for a, b in zip(got_values, want_values):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 + shrink_gap)


@pytest.mark.slow
def test_mixed_precision_tied_read_is_routed_and_bounded_under_auto():
  """mixed_float16 (AutoCastVariable reads): 'auto' routes the tied model; its updates equal
  the vectorized path's and removing the (moderately) adversarial example moves the sum by
  at most C (a record whose float16 gradient overflows adds zero by design)."""
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    updates = {}
    for clipping in ("auto", "vectorized"):
      model, kind, _ = base._model("tied_matmul")
      x, y = base._data(model, kind)
      y = y / 1e3 * 10.0
      y[-1] *= 3.0
      base._compile(model, clipping)
      updates[clipping] = _with_and_without_last(model, x, y)
      assert model._dp_traced_clipping == "vectorized"
  finally:
    keras.mixed_precision.set_global_policy("float32")
  got, got_without = updates["auto"]
  assert 0.5 < base._distance(got, got_without) <= base.CLIP * (1 + 1e-3)
  for a, b in zip(got + got_without, updates["vectorized"][0] + updates["vectorized"][1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

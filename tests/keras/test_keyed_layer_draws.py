"""The random layers of a DP model draw from the step's own secret keys
(tf_dpiter.keras.optimizer.private_step.PrivateStep.keyed_layer_draws, called by fit's train
step, tf_dpiter.keras.model.train_step, and by the custom loop's compute_private_gradients,
tf_dpiter.keras.optimizer.custom_loops, when it runs the model).

Relation and unit: add/remove one example under Poisson sampling declared with
`optimizer.set_sampling(N, q, "poisson")`, one step by `train_on_batch` (the real train step),
C = 1, lr 1, SGD, noise off (z = 0) unless said. The harness reads each record's dropout mask
off the update: record i is the one-hot row 10 e_i, the model Dropout(0.5) -> Dense(1, no
bias, zero kernel), the label 1e4, so record i's gradient is a multiple of e_i whose norm is
far above C when its mask keeps feature i and 0 when it drops it; clipped, it adds C e_i or
nothing, and the kernel's entry i after the step is lr C / (q N) (kept) or 0 (dropped).

Before the fix a seeded Dropout (`seed=`, or `keras.utils.set_random_seed`) drew the mask of
row j from its SeedGenerator's state, a known function of the seed and of j: removing record 0
moved every later record to another row and another draw. Measured at BASE f355a8f (N = 16,
seed 1, D = records 0..15, D' = records 1..15): ||w(D) - w(D')|| = 0.354 on the fast path and
0.306 on the fast path under jit_compile=True, against the lr C / (q N) = 0.125 one record
may move it (2.8 and 2.4 times); 0.125 on the vectorized path, whose tf.vectorized_map gives
every record the same mask. The keys are now fresh secret draws at every step, so the masks
do not follow the user's seed, two runs of one seed differ, and no rollback brings a step's
keys back. (After the fix one pair of runs still differs by more than 0.125: D's and D''s
masks are independent draws; the bound holds for the distributions, which no single pair
shows.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

N = 16          # records; record i is the one-hot row 10 e_i
Q = 0.5         # the declared Poisson rate: the sum is divided by q N = 8
C = 1.0
STEP = C / (Q * N)   # a kept record's entry of the kernel after one step (lr 1)
RATE = 0.5


def _model(seed=1, jit=False, clipping=None, z=0.0, microbatches=None, physical=None):
  """A DP model Dropout(RATE, seed) -> Dense(1, no bias, zeros) on N features, compiled with
  SGD (lr 1, C, z), the user's Poisson sampling declared (q of N; with microbatches fixed
  batches of N, replace-one)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((N,)), keras.layers.Dropout(RATE, seed=seed),
      keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  kwargs = {} if clipping is None else {"clipping": clipping}
  if physical is not None:
    kwargs["max_physical_batch_size"] = physical
  opt = dp.keras.DPKerasSGDOptimizer(C, z, num_microbatches=microbatches, learning_rate=1.0,
                                     **kwargs)
  model.compile(opt, "mse", jit_compile=jit)
  if microbatches is None:
    opt.set_sampling(N, Q, "poisson")
  else:   # microbatches are refused under add/remove: replace-one, fixed batches of N
    opt.set_sampling(N, 1.0, "fixed_size", N)
  return model


def _batch(records):
  x = 10.0 * np.eye(N, dtype="float32")[list(records)]
  return x, np.full((len(records), 1), 1e4, "float32")


def _step(model, records):
  """The kernel after one train_on_batch of `records` from a zero kernel."""
  kernel = model.layers[-1].kernel
  kernel.assign(tf.zeros_like(kernel))
  model.train_on_batch(*_batch(records))
  return kernel.numpy()[:, 0].copy()


def _kept(kernel):
  """Record i's mask kept its feature: kernel entry i near lr C / (q N) (the noise, if any,
  far smaller)."""
  return np.abs(kernel) > STEP / 2


def _assert_c_or_nothing(kernel, kept):
  """Each record added C e_i (kept) or nothing: the kernel's entries are lr C / (q N) or 0
  (the step clips to a hair under C: its float32 norm margin)."""
  assert np.all(np.abs(kernel) <= STEP)
  np.testing.assert_allclose(np.abs(kernel), np.where(kept, STEP, 0.0), rtol=1e-4, atol=1e-7)


def _seeded_masks(model, rows):
  """The masks a seeded Dropout of `model` would draw now on a batch of `rows` rows (its
  SeedGenerator's state, as Keras' TensorFlow backend draws them): bool [rows, N]."""
  state = model.layers[0].seed_generator.state.value
  seed = tf.cast(tf.math.floormod(state, tf.int32.max - 1), tf.int32)
  out = tf.nn.experimental.stateless_dropout(tf.ones([rows, N]), RATE, seed=seed)
  return out.numpy() != 0


@pytest.mark.slow   # Keras' own behaviour, the premise (2 s)
def test_a_seeded_layers_positional_masks_shift_under_add_remove():
  """The defect's premise, Keras' own draws: a seeded Dropout's mask of a record depends on
  its row, so removing record 0 gives records 1.. other draws (the masks the step drew before
  the fix; the next test shows it no longer uses them)."""
  model = _model()
  full, less = _seeded_masks(model, N), _seeded_masks(model, N - 1)
  in_d = full[np.arange(1, N), np.arange(1, N)]        # record i at row i
  in_d_prime = less[np.arange(N - 1), np.arange(1, N)]  # record i at row i - 1
  assert (in_d != in_d_prime).sum() >= 2


def test_the_steps_masks_do_not_follow_the_users_seed():
  """(a) One step of D = records 0..N-1: the masks the step used (read off the update) are
  not the seeded layer's (probability 2^-N of a false failure per comparison), each record's
  contribution is C or 0, and two runs with the same user seed draw different masks."""
  runs = []
  for _ in range(2):
    model = _model()
    predicted = np.diag(_seeded_masks(model, N))
    kernel = _step(model, range(N))
    kept = _kept(kernel)
    _assert_c_or_nothing(kernel, kept)
    assert not np.array_equal(kept, predicted)
    runs.append(kept)
  assert not np.array_equal(runs[0], runs[1])


def test_the_users_seed_state_is_kept():
  """The layer's SeedGenerator state after a step is the user's (the step's keys are put
  back: no saved model holds a key a step used)."""
  model = _model()
  before = model.layers[0].seed_generator.state.numpy().copy()
  _step(model, range(N))
  np.testing.assert_array_equal(model.layers[0].seed_generator.state.numpy(), before)


def test_a_rollback_draws_new_keys(tmp_path):
  """(b) Never repeats: noise on (z = 1e-3: the masks stay readable), one step; then the
  model and optimizer restored from a checkpoint written before it, iterations.assign(1) and
  the layer's seed state put back to its value before the step (Keras 3.15's checkpoints and
  weight files do not carry it: a user's own rollback, or a new process with the same seed),
  and the step run again on the same batch: the masks differ (probability 2^-N of a false
  failure). Before the fix (BASE f355a8f) the second step redrew the first's masks."""
  model = _model(z=1e-3)
  model.train_on_batch(*_batch([0]))   # built, then saved
  ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  path = ckpt.write(str(tmp_path / "ckpt"))
  state = model.layers[0].seed_generator.state
  before = state.numpy().copy()
  first = _kept(_step(model, range(N)))
  ckpt.read(path)
  model.optimizer.iterations.assign(1)
  state.assign(before)
  second = _kept(_step(model, range(N)))
  assert not np.array_equal(first, second)


CASES = [
    pytest.param("fast", False, None, None, id="fast"),
    pytest.param("vectorized", False, None, None, id="vectorized"),
    pytest.param("fast", True, None, None, id="fast-jit"),
    pytest.param("vectorized", True, None, None, id="vectorized-jit",
                 marks=pytest.mark.slow),
    pytest.param("fast", False, None, 4, id="fast-physical4", marks=pytest.mark.slow),
    pytest.param("vectorized", False, 8, None, id="vectorized-microbatches8",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("clipping,jit,microbatches,physical", CASES)
def test_each_record_is_clipped_with_the_draws_it_is_summed_with(clipping, jit, microbatches,
                                                                 physical):
  """(c) Noise off, dropout on: every record adds at most C to the clipped sum (the kernel's
  entry i is lr C / (q N) or 0 with no microbatches; a microbatch of two examples adds C or
  nothing to its two entries), so the norm the step clipped is the norm of
  the gradient it summed, whatever the path (fast: norms and sum of one forward; vectorized:
  one per record), jit, physical chunks or microbatches."""
  model = _model(seed=None, jit=jit, clipping=clipping, microbatches=microbatches,
                 physical=physical)
  kernel = _step(model, range(N))
  if microbatches is None:
    kept = _kept(kernel)
    _assert_c_or_nothing(kernel, kept)
    assert 0 < kept.sum() < N
  else:   # record j: examples j, j + M, ... (gradients.to_records), clipped to C as one
    # record and divided by the M records: lr C / M or 0 each
    per_record = np.linalg.norm(kernel.reshape(-1, microbatches), axis=0) * microbatches
    assert np.all(per_record <= C), per_record
    np.testing.assert_allclose(per_record, np.where(per_record > C / 2, C, 0.0), rtol=1e-4)
    assert np.any(per_record > C / 2)


def _loop(seed=1):
  """A plain Keras model Dropout(RATE, seed) -> Dense(1, no bias, zeros) and a DP optimizer
  (C, z = 0, the user's Poisson sampling, q of N) for a custom loop."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((N,)), keras.layers.Dropout(RATE, seed=seed),
                            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0)
  opt.set_sampling(N, Q, "poisson")
  return model, opt


def _per_example_losses(model, x, y):
  return tf.reduce_mean(tf.square(y - model(x, training=True)), axis=-1)


@pytest.mark.parametrize("form", ["data", "callable"])
def test_a_custom_loops_model_draws_from_the_steps_keys(form):
  """The custom loop's compute_private_gradients with model=: the model's random layers draw
  from the step's keys when the library runs the model (form (a), data=...; form (b), a
  callable loss): each record adds C or nothing, and two runs with one user seed draw
  different masks (probability 2^-N of a false failure)."""
  runs = []
  for _ in range(2):
    model, opt = _loop()
    x, y = (tf.constant(t) for t in _batch(range(N)))
    if form == "data":
      grads = opt.compute_private_gradients(
          lambda d: _per_example_losses(model, d[0], d[1]), model.trainable_variables,
          data=(x, y), model=model)
    else:
      grads = opt.compute_private_gradients(lambda: _per_example_losses(model, x, y),
                                            model.trainable_variables, model=model)
    kernel = -np.asarray(grads[0])[:, 0]
    kept = _kept(kernel)
    _assert_c_or_nothing(kernel, kept)
    runs.append(kept)
  assert not np.array_equal(runs[0], runs[1])


def test_a_custom_loops_taped_losses_of_a_random_layer_are_refused_under_poisson():
  """Form (b) with a tape: the losses were computed before the call, by the layers' own seed
  states (positional draws), so under Poisson sampling the call is refused, naming the
  layer and the forms the library keys."""
  model, opt = _loop()
  x, y = (tf.constant(t) for t in _batch(range(N)))
  with tf.GradientTape(persistent=True) as tape:
    losses = _per_example_losses(model, x, y)
  with pytest.raises(dp.errors.PrivacyConfigError, match=r"random layers \['dropout"):
    opt.compute_private_gradients(losses, model.trainable_variables, tape=tape, model=model)


@pytest.mark.parametrize("jit", [False, True])
def test_the_keyed_step_is_traced_once(jit, monkeypatch):
  """The keys' generator is made with the DP state, before any trace: a variable first made
  inside a tf.function's trace makes TensorFlow trace the function twice (BERT-base LoRA's
  first DP step took 8.7 CPU s instead of 5.6 with the generator made at the first trace)."""
  from tf_dpiter.keras.optimizer import chunking  # pylint: disable=g-import-not-at-top
  traces = []
  layout_fn = chunking.chunk_layout
  monkeypatch.setattr(chunking, "chunk_layout", lambda *a, **k: traces.append(1) or layout_fn(
      *a, **k))
  model = _model(jit=jit)
  _step(model, range(N))
  _step(model, range(N))
  assert len(traces) == 1

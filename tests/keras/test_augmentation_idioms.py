"""Image augmentations in a `train_step` override: each row a function of one record.

The walk from the rows a `train_step` override hands the private step back to the batch
(tf_dpiter.keras.internals.row_provenance) accepts the augmentations a Keras user writes
there, and keeps refusing the ones that let one record move another's row (McMahan et al.,
"A General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 2: the clipped sum bounds one record's influence only when row i is a function of
record i).

Accepted: per-image ops whose reductions run over axes >= 1 only (contrast, hue, saturation,
per-image standardization, projective transforms by each image's own row), slices, pads and
tiles that keep axis 0 whole (random and central crops, resize_with_crop_or_pad,
grayscale_to_rgb), branches and nested tf.functions walked through (rot90), random draws from
no data (cutout masks, random flips by keras.ops), and a Keras augmentation layer held
outside the model, whose SeedGenerator state the override writes only as a counter.

Under Poisson sampling a draw of the batch's size from a seed (a stateless seed, a
SeedGenerator's state, tf.random.set_seed) gives row i the i-th draws: a function of its
position, which one added or removed record shifts for every later row (review R12, session
43). Such draws are refused under Poisson (`_POSITIONAL`; `_SEEDED_ONLY` when a seed is set)
and trained under fixed-size shuffled batches, where positions are not data.

Relations and units: fit with Poisson sampling (add/remove one example, q 0.1 of n 100,
z 1, C 1, 10 steps), stated at dp_accounting's RDP epsilon for the steps that ran
(tests/keras/custom_loop_setup.rdp_epsilon); fit with shuffled batches of 10 (replace-one),
stated at the epsilon of the same fit without the override; graph and jit_compile=True.
Refused: before any step, with the library's PrivacyConfigError.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import custom_loop_setup as setup
from tf_dpiter.keras.internals import row_provenance

_SEED = 1
_LAYERS = {   # Keras augmentation layers held outside the model (module level)
    "keras_random_flip": keras.layers.RandomFlip("horizontal", seed=_SEED),
    "keras_random_translation": keras.layers.RandomTranslation(0.2, 0.2, seed=_SEED),
    "keras_random_rotation": keras.layers.RandomRotation(0.1, seed=_SEED),
    "keras_random_zoom": keras.layers.RandomZoom(0.2, seed=_SEED),
    "keras_random_crop": keras.layers.RandomCrop(4, 4, seed=_SEED),
    "keras_random_brightness": keras.layers.RandomBrightness(0.2, seed=_SEED),
    "keras_random_contrast": keras.layers.RandomContrast(0.2, seed=_SEED),
}


def _cutout(x):
  """A 3 x 3 square of each image zeroed at its own random centre."""
  centre = tf.random.uniform(tf.stack([tf.shape(x)[0], 2, 1, 1]), 0, 6, dtype=tf.int32)
  rows, cols = tf.range(6)[None, :, None, None], tf.range(6)[None, None, :, None]
  hole = (tf.abs(rows - centre[:, :1]) < 2) & (tf.abs(cols - centre[:, 1:]) < 2)
  return tf.where(hole, tf.zeros_like(x), x)


def _ops_flip(x):
  """keras.ops: each image flipped left-right with probability 1/2."""
  coin = tf.random.uniform(tf.stack([tf.shape(x)[0], 1, 1, 1]))
  return keras.ops.where(coin < 0.5, keras.ops.flip(x, axis=2), x)


_IDIOMS = {name: (lambda layer: lambda x: layer(x, training=True))(layer)
           for name, layer in _LAYERS.items()}
_IDIOMS.update({
    "rot90": lambda x: tf.image.rot90(x, 1),
    "adjust_contrast": lambda x: tf.image.adjust_contrast(x, 1.5),
    "random_contrast": lambda x: tf.image.random_contrast(x, 0.8, 1.2),
    "stateless_random_contrast": lambda x: tf.image.stateless_random_contrast(
        x, 0.8, 1.2, seed=[1, 2]),
    "grayscale_to_rgb": lambda x: tf.image.grayscale_to_rgb(x[..., :1]),
    "resize_with_crop_or_pad": lambda x: tf.image.resize_with_crop_or_pad(x, 8, 4),
    "random_crop": lambda x: tf.image.random_crop(x, tf.stack([tf.shape(x)[0], 4, 4, 3])),
    "central_crop": lambda x: tf.image.central_crop(x, 0.7),
    "random_brightness": lambda x: tf.image.random_brightness(x, 0.2),
    "random_hue": lambda x: tf.image.random_hue(x, 0.1),
    "random_saturation": lambda x: tf.image.random_saturation(x, 0.8, 1.2),
    "cutout": _cutout,
    "per_image_standardization": tf.image.per_image_standardization,
    "keras_ops_flip": _ops_flip,
    "stateless_random_flip": lambda x: tf.image.stateless_random_flip_left_right(x, [1, 2]),
    "nested_tf_function": tf.function(lambda x: tf.image.flip_up_down(x) * 2.0),
})


# draws of the batch's size from a seed: a row's position under Poisson sampling
_POSITIONAL = frozenset(["keras_random_brightness", "keras_random_contrast",
                         "keras_random_flip", "keras_random_rotation",
                         "keras_random_translation", "keras_random_zoom",
                         "stateless_random_flip"])
_SEEDED_ONLY = frozenset(["cutout", "keras_ops_flip"])   # stateful: positional once seeded


def _chain(names):
  """The idioms `names` in turn (the shapes they change restored by the ones after)."""
  def transform(x):
    for name in names:
      x = _IDIOMS[name](x)
      x = tf.image.resize_with_crop_or_pad(x, 6, 6)
    return x
  return transform


def _walk(transform, exempt_writes=(), private_size=True):
  """Traces `transform` of a batch [None, 6, 6, 3] and walks its rows back (Poisson: the
  batch size private), as an override's check does; raises as refuse_row_mixing."""
  @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 3])], autograph=False)
  def trace(x):
    rows = transform(x)
    row_provenance.refuse_row_mixing(rows, "the test's transform", private_size=private_size,
                                     exempt_writes=exempt_writes)
    return rows

  trace.get_concrete_function()


@pytest.mark.parametrize("idiom", sorted(_IDIOMS))
def test_an_augmentation_keeps_rows_apart(idiom):
  """Each idiom, traced as an override's check walks it: under fixed-size batches all of
  them; under Poisson sampling (the batch size private), with no seed set, all but the
  draws of the batch's size from a seed, refused for their position."""
  tf.random.set_seed(None)
  _walk(_IDIOMS[idiom], private_size=False)
  if idiom in _POSITIONAL:
    with pytest.raises(dp.errors.PrivacyConfigError, match="function of its position"):
      _walk(_IDIOMS[idiom])
  else:
    _walk(_IDIOMS[idiom])


@pytest.mark.parametrize("idiom", sorted(_SEEDED_ONLY))
def test_a_seeded_draw_of_a_poisson_batch_size_is_refused(idiom):
  """tf.random.set_seed (as keras.utils.set_random_seed) makes a stateful draw of the
  batch's size the same numbers at every run: under Poisson sampling a row's position,
  refused; under fixed-size batches accepted."""
  tf.random.set_seed(0)
  try:
    _walk(_IDIOMS[idiom], private_size=False)
    with pytest.raises(dp.errors.PrivacyConfigError, match="function of its position"):
      _walk(_IDIOMS[idiom])
  finally:
    tf.random.set_seed(None)


def _overriding(transform):
  """A DPSequential class whose train_step override hands the step transform(x)."""
  class Override(dp.keras.DPSequential):

    def train_step(self, data):
      return super().train_step((transform(data[0]),) + tuple(data[1:]))

  return Override


def _model(cls, n, noise, learning_rate, jit=False):
  """(model, x [n, 6, 6, 3], y [n, 1]): a `cls` GlobalAveragePooling2D -> zero Dense(1),
  compiled with DP-SGD (C 1), and its data (numpy's default_rng(0))."""
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(n, 6, 6, 3)).astype("float32")
  y = rng.normal(size=(n, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  model = cls([keras.Input((None, None, 3)), keras.layers.GlobalAveragePooling2D(),
               keras.layers.Dense(1, kernel_initializer="zeros")])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, noise, learning_rate=learning_rate), "mse",
                jit_compile=jit)
  return model, x, y


def _fit(transform, jit, override=None, sampling="poisson"):
  """A model whose train_step override hands the step transform(x) (or `override`'s; none:
  a plain DPSequential), fit with `sampling` (batches of 10, q 0.1 of n 100 under Poisson;
  z 1, C 1): the model. Under Poisson no seed is set (a seeded draw of the batch's size is
  refused there)."""
  cls = override or (_overriding(transform) if transform is not None
                     else dp.keras.DPSequential)
  model, x, y = _model(cls, 100, 1.0, 0.1, jit)
  if sampling == "poisson":
    tf.random.set_seed(None)
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling=sampling)
  return model


def _assert_stated(model, sampling="poisson"):
  """Ten steps, stated at dp_accounting's RDP epsilon for them (Poisson), or at the
  epsilon of the same fit without the override (shuffled batches)."""
  steps = int(model.optimizer.iterations.numpy())
  assert steps == 10
  expected = (setup.rdp_epsilon(steps) if sampling == "poisson"
              else _fit(None, False, sampling=sampling).privacy_statement(1e-5).epsilon)
  assert model.privacy_statement(1e-5).epsilon == pytest.approx(expected, rel=1e-9)


def _sampled(idiom):
  """Poisson where the idiom's draws are no row's position, else shuffled batches."""
  return "shuffle" if idiom in _POSITIONAL | _SEEDED_ONLY else "poisson"


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_augmentations_chained_in_an_override_train(jit, sampling):
  """The idioms in one override (graph and XLA): under Poisson those whose draws are no
  row's position, under shuffled batches the others: trained, stated at the epsilon."""
  names = [k for k in _IDIOMS if _sampled(k) == sampling]
  _assert_stated(_fit(_chain(names), jit, sampling=sampling), sampling)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("idiom", sorted(_IDIOMS))
def test_an_augmentation_in_an_override_trains(idiom, jit):
  """Each idiom alone in an override (graph and XLA): trained, stated at the epsilon."""
  _assert_stated(_fit(_IDIOMS[idiom], jit, sampling=_sampled(idiom)), _sampled(idiom))


def test_a_keras_augmentation_layer_under_poisson_is_refused_before_any_step():
  """A RandomFlip held outside the model, fit with Poisson sampling: its draws of the
  batch's size come from its SeedGenerator's state, a row's position: refused before any
  step."""
  model = None

  class Kept(dp.keras.DPSequential):
    def __init__(self, *args, **kwargs):
      nonlocal model
      super().__init__(*args, **kwargs)
      model = self

    def train_step(self, data):
      return super().train_step((_IDIOMS["keras_random_flip"](data[0]),) + tuple(data[1:]))

  with pytest.raises(dp.errors.PrivacyConfigError, match="function of its position"):
    _fit(None, False, override=Kept)
  assert int(model.optimizer.iterations.numpy()) == 0


def _replaced_weights(label):
  """The weights after one fit step of the chained override on n = B = 10 (shuffled with
  one seed, z = 0, C = 1, lr 1, a zero Dense(1)), record 0 at x = 5 with `label`, the
  seed states of the layers outside the model reset first (the same draws for D and D')."""
  for layer in _LAYERS.values():
    for generator in layer._seed_generators:   # pylint: disable=protected-access
      generator.state.assign([_SEED, 0])

  model, x, y = _model(_overriding(_chain(list(_IDIOMS))), 10, 0.0, 1.0)
  x[0], y[0] = 5.0, label
  model.fit(dp.data.shuffled_batches(x, y, batch_size=10, seed=7), epochs=1, verbose=0)
  return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


@pytest.mark.slow   # two fits of the chain
def test_the_chained_augmentations_move_the_weights_by_one_clipped_record():
  """Replace-one example (record 0's label 1000 vs -1000), shuffling with one seed, n = B =
  10, one step, C = 1, lr 1, z = 0: the chained augmentations keep each row a function of
  its record, so ||w(D) - w(D')|| is at most lr 2C / B = 0.2 (the clipped sum alone moves
  the weights)."""
  moved = np.linalg.norm(_replaced_weights(1000.0) - _replaced_weights(-1000.0))
  assert 0.0 < moved <= 0.2 * (1 + 1e-4)


_STATE = tf.Variable([0, 0], dtype=tf.int64)   # a seed state held outside the model


def _seeded_flip(x, seed):
  coin = tf.random.stateless_uniform(tf.stack([tf.shape(x)[0], 1, 1, 1]), seed=seed)
  return tf.where(coin < 0.5, x, -x)


class SeedFromBatchSize(dp.keras.DPSequential):
  """A flip seeded from a state that the override advances, after its step, by the batch's
  size: under Poisson sampling the next step's flips depend on which records were sampled
  in this one."""

  def train_step(self, data):
    logs = super().train_step((_seeded_flip(data[0], _STATE * 1),) + tuple(data[1:]))
    _STATE.assign_add(tf.stack([tf.constant(0, tf.int64),
                                tf.cast(tf.shape(data[0])[0], tf.int64)]))
    return logs


class SeedFromBatch(dp.keras.DPSequential):
  """A flip seeded from a state that the override writes, after its step, from the batch's
  values."""

  def train_step(self, data):
    logs = super().train_step((_seeded_flip(data[0], _STATE * 1),) + tuple(data[1:]))
    _STATE.assign_add(tf.cast(tf.stack([0.0, tf.reduce_sum(data[0])]), tf.int64))
    return logs


@pytest.mark.parametrize("override", [SeedFromBatchSize, SeedFromBatch])
def test_a_seed_state_written_from_the_batch_after_the_step_is_refused(override):
  """A seed variable outside the model is no data only when the whole override writes it
  as a counter: written after the step from the batch's size (a Poisson batch's, private;
  the check of the override's writes takes shapes as public) or from its values, it stays
  other records and the flips it seeds are refused (the walk runs once the override's
  trace is whole), before any step."""
  model = None

  class Kept(override):
    def __init__(self, *args, **kwargs):
      nonlocal model
      super().__init__(*args, **kwargs)
      model = self

  with pytest.raises(dp.errors.PrivacyConfigError, match="can combine rows"):
    _fit(None, False, override=Kept)
  assert int(model.optimizer.iterations.numpy()) == 0


def _counter_then_flip(advance):
  def transform(x):
    seed = _STATE * 1
    _STATE.assign(advance(x))
    return _seeded_flip(x, seed)
  return transform


def _mean_transform(x):   # transforms [B, 8] from the batch mean (a row of every record)
  flat = tf.reshape(x, [-1, 108])[:, :8]
  return tf.tile(tf.reduce_mean(flat, 0, keepdims=True), tf.stack([tf.shape(x)[0], 1]))


_LEAKS = {   # each row then depends on other records
    "seed_from_the_batch": _counter_then_flip(
        lambda x: _STATE + tf.cast(tf.reduce_sum(x) > 0, tf.int64)),
    "seed_from_the_batch_size": _counter_then_flip(
        lambda x: _STATE + tf.cast(tf.shape(x)[0], tf.int64)),
    "seed_read_in_a_branch": lambda x: _seeded_flip(x, tf.cond(
        tf.constant(True), _STATE.read_value, lambda: _STATE.assign_add([0, 1]))),
    "slice_of_all_rows_but_one": lambda x: tf.slice(
        x, [0, 0, 0, 0], tf.stack([tf.shape(x)[0] - 1, 4, 4, 3])),
    "slice_from_row_one": lambda x: tf.slice(x, tf.stack([1, 0, 0, 0]), [-1, 4, 4, 3]),
    "pad_of_the_batch_axis": lambda x: tf.pad(x, tf.reshape(
        tf.stack([1, 0, tf.shape(x)[1] - 6, 0, 0, 0, 0, 0]), [4, 2])),
    "tile_of_the_batch_axis": lambda x: tf.tile(x, tf.concat([[2], tf.ones([3], tf.int32)], 0)),
    "contrast_of_a_batch_of_rank_3": lambda x: tf.image.adjust_contrast(x[..., 0], 1.5),
    "contrast_by_the_batch_mean": lambda x: tf.image.adjust_contrast(x, tf.reduce_mean(x)),
    "transform_from_the_batch": lambda x: keras.ops.image.affine_transform(
        x, _mean_transform(x)),
    "centred_in_a_branch": lambda x: tf.cond(
        tf.constant(True), lambda: x - tf.reduce_mean(x, 0), lambda: x),
    "rot90_by_the_batch": lambda x: tf.image.rot90(
        x, tf.cast(tf.reduce_sum(x) > 0, tf.int32)),
    "centred_in_a_nested_function": tf.function(lambda x: x - tf.reduce_mean(x, 0)),
}


@pytest.mark.parametrize("leak", sorted(_LEAKS))
def test_an_augmentation_that_mixes_rows_is_refused(leak):
  """Refused with the library's message: a seed from the batch (its values, a Poisson
  batch's size) or read where the walk does not follow it, a slice, pad or tile of the
  batch's axis, a per-image op on a batch whose images are not the rows or by a factor
  from the batch, a branch or nested function that centres the batch, a rotation chosen by
  the batch."""
  with pytest.raises(dp.errors.PrivacyConfigError, match="the batch"):
    _walk(_LEAKS[leak])

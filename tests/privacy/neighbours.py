"""Add/remove-one neighbours of a padded batch, for tests of a clipped sum's sensitivity: the
small models they train, the padded batch and the real step's pre-noise sum."""

import keras
import numpy as np

from tests.fast_clipping import covers

# The exactness grid of a step's update on small_layers models: clipping path x (model kind,
# jit_compile). The default suite runs an all-pairs cover of its three axes (every clipping
# path in a graph and under XLA, on each kind); the rest runs with -m slow.
UPDATE_GRID = [(clipping, kind, jit) for clipping in ("vectorized", "fast")
               for kind, jit in (("dense", False), ("conv", False), ("dense", True))]
UPDATE_DEFAULT = covers.all_pairs(UPDATE_GRID)


def update_cases():
  """pytest.params (clipping, kind, jit) of UPDATE_GRID, those outside UPDATE_DEFAULT slow;
  ids "dense-fast", "conv-vectorized", "dense_xla-fast" as before the cover."""
  return covers.slow_outside(UPDATE_GRID, UPDATE_DEFAULT,
                             ids=lambda c: f"{c[1]}{'_xla' if c[2] else ''}-{c[0]}")


def small_layers(kind="dense", features=6, classes=3):
  """The layers of the small test model: "dense" (Dense tanh + Dense) or "conv" (Conv1D)."""
  if kind == "dense":
    return [keras.Input((features,)), keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(classes)]
  return [keras.Input((features,)), keras.layers.Reshape((features, 1)),
          keras.layers.Conv1D(3, 3, activation="relu"), keras.layers.Flatten(),
          keras.layers.Dense(classes)]


def padded(x, y, pad):
  """(xp, yp, mask): the batch followed by `pad` zero rows, mask 1 on the real rows."""
  xp = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
  yp = np.concatenate([y, np.zeros([pad], y.dtype)])
  mask = np.concatenate([np.ones(len(x)), np.zeros(pad)]).astype("float32")
  return xp, yp, mask


def update_sum(model, w0, x, y, weights):
  """The pre-noise clipped sum of one real train step from weights w0: w0 - w1 (noise 0,
  lr 1 and no division where the caller compiled it so), flat, float64."""
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=weights)
  return np.concatenate([(a - b).ravel() for a, b in zip(w0, model.get_weights())]).astype(
      np.float64)


def add_remove_changes(clipped_sum, xp, yp, mask, real, rng, candidates, num_classes=3):
  """Norms of the change of `clipped_sum(x, y, mask)` for every add/remove-one neighbour tried.

  Removes each of the `real` examples in turn (mask 0), then adds `candidates` random
  examples of varied scale in the first padding row (index `real`).

  Args:
    clipped_sum: (x, y, mask) -> the flat pre-noise sum (float64 vector).
    xp, yp, mask: the padded batch and its 0/1 mask (the first `real` rows real).
    real: the number of real examples.
    rng: a numpy RandomState.
    candidates: how many added examples to try.
    num_classes: labels of the added examples are drawn from range(num_classes).
  Returns:
    the list of L2 norms of the changes.
  """
  base = clipped_sum(xp, yp, mask)
  changes = []
  for j in range(real):
    m2 = mask.copy()
    m2[j] = 0.0
    changes.append(np.linalg.norm(clipped_sum(xp, yp, m2) - base))
  for _ in range(candidates):
    xc = (rng.randn(*xp.shape[1:]) * rng.choice([0.3, 3.0, 30.0])).astype("float32")
    x2, y2, m2 = xp.copy(), yp.copy(), mask.copy()
    x2[real], y2[real], m2[real] = xc, rng.randint(0, num_classes), 1.0
    changes.append(np.linalg.norm(clipped_sum(x2, y2, m2) - base))
  return changes


def zero_dense1(clip, jit, clipping, loss):
  """A DP model of one bias-free Dense(1) from zero weights, compiled with SGD (learning rate
  1, noise 0, normalize=False): w0 - w1 after one step is the step's clipped sum."""
  import warnings   # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp   # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: the no-noise warning
    opt = dp.keras.DPKerasSGDOptimizer(clip, 0.0, learning_rate=1.0, clipping=clipping,
                                       normalize=False)
  model.compile(optimizer=opt, loss=loss, jit_compile=jit)
  return model

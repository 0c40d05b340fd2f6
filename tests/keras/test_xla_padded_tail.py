"""Padded Poisson samples under XLA: the padding tail is skipped, the step stays exact.

Under jit_compile=True a Poisson sample is padded to a static size; chunking.chunk_layout
splits it into a first chunk of about E + sqrt(E) records (E = q n, the expected sample
size) and a tail that runs only when it holds a real record. With noise 0 the update must be
-lr * sum_i clip(g_i) / E over the real examples (add/remove one example, Poisson: the
denominator is the public E) whether the tail ran or not; the chunk count is checked on a
counting chunk function.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.keras.optimizer import chunking

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP, N, E, M = 0.05, 1000, 16, 48     # first chunk: ceil((16 + 4) / 8) * 8 = 24 records


def _model(clipping, physical=None):
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      CLIP, 0.0, learning_rate=1.0, clipping=clipping, max_physical_batch_size=physical),
                loss=LOSS, jit_compile=True)
  model.optimizer.set_sampling(N, E / N, "poisson", E)
  return model


def _one_step(model, x, y, w, dynamic):
  """One private step on (x, y, w): train_on_batch (static batch size) or, dynamic, fit on a
  dataset whose batch size is unknown to the trace (as fit's padded Poisson samples)."""
  if not dynamic:
    return helpers.one_step_update(model, x, y, sample_weight=w)
  spec = (tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))
  ds = tf.data.Dataset.from_generator(lambda: iter([(x, y, w)]), output_signature=spec)
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


@pytest.mark.parametrize("clipping,physical,dynamic,layout", [
    ("fast", None, False, (24, None)), ("vectorized", None, False, (24, None)),
    ("fast", 16, False, (16, 16, 16)), ("fast", None, True, (24, None)),
    ("vectorized", None, True, (24, None))])
@pytest.mark.parametrize("real", [10, 40])   # 10: the tail is all padding; 40: it runs
def test_padded_poisson_step_under_xla_is_exact(clipping, physical, dynamic, layout, real,
                                                 monkeypatch):
  layouts = []
  layout_fn = chunking.chunk_layout
  monkeypatch.setattr(chunking, "chunk_layout", lambda *a, **k: layouts.append(
      layout_fn(*a, **k)) or layouts[-1])
  rng = np.random.RandomState(real)
  x = np.zeros((M, 6), "float32")
  y = np.zeros(M, "int64")
  x[:real], y[:real] = rng.randn(real, 6), rng.randint(0, 3, real)
  w = np.zeros(M, "float32")
  w[:real] = 1.0
  model = _model(clipping, physical)
  ref = helpers.reference_gradient(model, LOSS, x[:real], y[:real], clip=CLIP)
  got = _one_step(model, x, y, w, dynamic)
  for g, r in zip(got, ref):   # reference: the mean over the real rows; update: sum / E
    np.testing.assert_allclose(g, r * real / E, rtol=2e-4, atol=2e-6)
  assert int(model.optimizer.ledger.sample_count.numpy()) == 1
  assert [tuple(t) for t in layouts] == [layout]   # traced once, with the skippable tail


def test_tail_chunk_runs_only_when_it_holds_a_real_record():
  step = _model("fast").optimizer.private_step
  runs = tf.Variable(0)
  layouts = []

  def chunk_fn(acc, chunk, mask):
    runs.assign_add(1)
    return [acc[0] + tf.reduce_sum(chunk * mask[:, None])], tf.reduce_sum(mask), chunk

  @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2]),
                                                 tf.TensorSpec([None])])
  def total_dynamic(x, mask):
    return chunking.sum_over_chunks(chunk_fn, [tf.constant(0.0)], x, mask,
                                    chunking.chunk_layout(step, 1, None))

  @tf.function(jit_compile=True)
  def total(x, mask):
    layout = chunking.chunk_layout(step, 1, x.shape[0])
    layouts.append(layout)
    return chunking.sum_over_chunks(chunk_fn, [tf.constant(0.0)], x, mask, layout)

  x = tf.ones((M, 2))
  for fn in (total, total_dynamic):
    for real, chunks in ((10, 1), (24, 1), (25, 2), (48, 2)):
      runs.assign(0)
      mask = tf.constant([1.0] * real + [0.0] * (M - real))
      acc, loss, aux = fn(x, mask)
      assert float(acc[0]) == 2.0 * real and float(loss) == real and aux.shape == (M, 2)
      assert int(runs.numpy()) == chunks, (fn, real, int(runs.numpy()))
  assert tuple(layouts[0]) == (24, None) and isinstance(layouts[0], chunking.TailChunks)

"""The private step's per-variable pipelining (keras/optimizer/pipelining.py): each clipped sum
is formed once the leaf before it is noised; the values are unchanged."""

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import pipelining


def test_each_sum_waits_for_the_previous_noised_leaf():
  a = tf.constant(np.arange(12.0, dtype="float32").reshape(3, 4))
  edges = {}

  @tf.function
  def step():
    sums = [tf.reshape(tf.matmul(a, a, transpose_a=True), [-1]) * float(i + 1)
            for i in range(3)]
    noised, previous = [], []
    for s in sums:   # a chain as the Gaussian query's: each leaf after the previous one
      with tf.control_dependencies(previous):
        n = s + 1.0
      noised.append(n)
      previous = [n]
    edges["added"] = pipelining.gate_sums_on_noise(sums, noised)
    edges["gates"] = [[c.name for c in pipelining._producer(s).control_inputs]  # pylint: disable=protected-access
                      for s in sums]
    edges["noised"] = [n.op.name for n in noised]
    return noised

  out = step()
  assert edges["added"] == 2
  assert edges["gates"][0] == []
  assert edges["noised"][0] in edges["gates"][1]
  assert edges["noised"][1] in edges["gates"][2]
  gram = a.numpy().T @ a.numpy()
  for i, n in enumerate(out):   # values unchanged by the added order
    np.testing.assert_allclose(n.numpy(), gram.reshape(-1) * (i + 1) + 1.0, rtol=1e-6)


def test_no_edge_that_would_close_a_cycle():
  # Both sums are views of one tensor: its producer is an ancestor of the first noised leaf,
  # so gating it on that leaf would close a cycle; nothing is added and the step runs.
  @tf.function
  def step():
    both = tf.range(8.0) * 2.0
    sums = [tf.identity(both), tf.reshape(both, [8])]
    noised = [s + 1.0 for s in sums]
    return pipelining.gate_sums_on_noise(sums, noised), noised

  added, noised = step()
  assert int(added) == 0
  np.testing.assert_allclose(noised[1].numpy(), np.arange(8.0) * 2.0 + 1.0)


def test_eager_and_mismatched_structures_add_nothing():
  sums = [tf.ones([2]), tf.ones([3])]
  assert pipelining.gate_sums_on_noise(sums, [s + 1.0 for s in sums]) == 0

  @tf.function
  def step():
    s = [tf.ones([2]) * 2.0, tf.ones([3]) * 2.0]
    return pipelining.gate_sums_on_noise(s, [s[0] + 1.0])

  assert int(step()) == 0


def _fit_weights(monkeypatch, gate):
  counts = []
  real = pipelining.gate_sums_on_noise

  def counting(sums, noised):
    counts.append(real(sums, noised) if gate else 0)
    return counts[-1]

  monkeypatch.setattr(pipelining, "gate_sums_on_noise", counting)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(5), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, seed=3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 6).astype("float32"), rng.randint(0, 3, 32)
  model.optimizer.set_sampling(32, 0.25, "shuffle", 8)
  for i in range(3):
    model.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
  return [w.numpy() for w in model.trainable_variables], counts


def test_dp_step_gated_equals_ungated(monkeypatch):
  gated, counts = _fit_weights(monkeypatch, True)
  ungated, _ = _fit_weights(monkeypatch, False)
  # 6 variables: every sum after the first waits for the leaf before it (fast path, one chunk)
  assert counts and counts[0] == 5
  for g, u in zip(gated, ungated):   # same noise from the same seed, same order: same update
    np.testing.assert_array_equal(g, u)

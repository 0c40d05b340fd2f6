"""The private step's per-variable pipelining (private_step.gate_sums_on_noise): each clipped sum
is formed once the leaf before it is noised; the values are unchanged."""

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.optimizer import private_step


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
    edges["added"] = private_step.gate_sums_on_noise(sums, noised)
    edges["gates"] = [[c.name for c in private_step._producer(s).control_inputs]  # pylint: disable=protected-access
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
    return private_step.gate_sums_on_noise(sums, noised), noised

  added, noised = step()
  assert int(added) == 0
  np.testing.assert_allclose(noised[1].numpy(), np.arange(8.0) * 2.0 + 1.0)


def test_eager_and_mismatched_structures_add_nothing():
  sums = [tf.ones([2]), tf.ones([3])]
  assert private_step.gate_sums_on_noise(sums, [s + 1.0 for s in sums]) == 0

  @tf.function
  def step():
    s = [tf.ones([2]) * 2.0, tf.ones([3]) * 2.0]
    return private_step.gate_sums_on_noise(s, [s[0] + 1.0])

  assert int(step()) == 0


def _through_identities(tensor):
  """The first op that is not an Identity on the way back from `tensor`."""
  op = tensor.op
  while op.type == "Identity":
    op = op.inputs[0].op
  return op


def _fit_weights(monkeypatch, gate, sequence=False, split_sums=None):
  counts = []
  real = private_step.gate_sums_on_noise

  def counting(sums, noised):
    counts.append(real(sums, noised) if gate else 0)
    if split_sums is not None:   # (sums that are parts of a split product, products gated)
      splits = [_through_identities(t) for t in tf.nest.flatten(sums)]
      splits = [op for op in splits if op.type == "SplitV"]
      split_sums.append((len(splits), len({op.inputs[0].op.name for op in splits
                                            if op.inputs[0].op.control_inputs})))
    return counts[-1]

  monkeypatch.setattr(private_step, "gate_sums_on_noise", counting)
  keras.utils.set_random_seed(0)
  if sequence:   # Dense on [B, T, d]: the rule's [W; b] clipped sum, split into W and b
    model = dp.keras.DPSequential([
        keras.Input((2, 16)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
  else:
    model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                   keras.layers.Dense(5), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, seed=3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x = rng.randn(*((32, 2, 16) if sequence else (32, 6))).astype("float32")
  y = rng.randint(0, 3, 32)
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


def test_a_split_sum_is_gated_at_the_product_that_allocates_it():
  """Sums that are parts of one product (tf.split of [W; b]'s clipped sum) are gated at the
  product, not at the split that views it: the product of the second layer waits for the first
  layer's last noised leaf."""
  a = tf.constant(np.arange(12.0, dtype="float32").reshape(4, 3))
  seen = {}

  @tf.function
  def step():
    products = [tf.matmul(a, a, transpose_a=True) * float(i + 1) for i in range(2)]   # [3, 3]
    sums = [part for p in products for part in tf.split(p, [2, 1])]
    noised, previous = [], []
    for s in sums:
      with tf.control_dependencies(previous):
        n = s + 1.0
      noised.append(n)
      previous = [n]
    seen["added"] = private_step.gate_sums_on_noise(sums, noised)
    seen["producers"] = [private_step._producer(s).type for s in sums]  # pylint: disable=protected-access
    seen["gate"] = [c.name for c in private_step._producer(sums[2]).control_inputs]  # pylint: disable=protected-access
    seen["noised"] = noised[1].op.name
    return noised

  out = step()
  assert seen["producers"] == ["Mul"] * 4
  assert seen["added"] == 1 and seen["gate"] == [seen["noised"]]
  np.testing.assert_array_equal(out[2].numpy(), 2.0 * (a.numpy().T @ a.numpy())[:2] + 1.0)


def test_dp_step_with_split_sums_gated_equals_ungated(monkeypatch):
  """Dense layers on sequences, where a record's gradient is larger than the operands it
  replaces and the budget keeps none: the kernel's sum is one product and the bias's a
  reduction (rules/dense.py; no [W; b] product split in two, whose gate once had to walk
  through the split), the sums are gated and the update is the ungated one, bit for bit."""
  monkeypatch.setattr(budget, "KEEP_BYTES", 0)   # book-keeping's product, not kept gradients
  split_sums = []
  gated, counts = _fit_weights(monkeypatch, True, sequence=True, split_sums=split_sums)
  ungated, _ = _fit_weights(monkeypatch, False, sequence=True)
  # no sum is a part of a split product (each is gated on its own producer), and gates are set
  assert split_sums[0][0] == 0 and counts[0] >= 1, (split_sums, counts)
  for g, u in zip(gated, ungated):
    np.testing.assert_array_equal(g, u)

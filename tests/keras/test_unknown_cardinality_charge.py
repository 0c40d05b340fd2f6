"""fit on a dataset of unknown cardinality charges exactly its steps.

Relation and unit: add or remove one example (declared Poisson sampling); the unit is the
example. Keras ends such an epoch when the iterator's get_next raises OutOfRange inside the
step function; the step's stateful ops that did not wait for the batch (the ledger write,
Keras' `iterations` increment) had already run, so each epoch charged one sample more than
its steps. The write and the increment now wait for the noised result: the ledger charges
every released update, and only those. Checked with noise off against the same run on the
same batches with a known cardinality (same updates, same charge)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

N, B, EPOCHS = 64, 8, 2

# Nightly (`-m slow`): the jit_compile=True case. The defect (the ledger write and the
# `iterations` increment running before the iterator's OutOfRange) was a graph-mode one and
# [False] reproduces it by default; under jit_compile Keras takes the batch with get_next
# outside the compiled step (keras/src/backend/tensorflow/trainer.py), so the step's writes
# wait for it. What [True] asserts under XLA on an unknown-cardinality pipeline the default
# tier asserts too: tests/correlated/test_tree_pass_length_fit.py::
# test_the_tree_moves_only_with_released_steps[True] (a filtered pipeline under jit_compile,
# 3 epochs: ledger samples == released steps == 24) and
# tests/data/test_declare_shuffled_pass_length.py::
# test_a_pass_shorter_than_declared_is_refused_before_its_first_step[True] (filtered pipeline
# under jit_compile: ledger samples == iterations == 6); the XLA step's update on the same
# batches is test_step_oracle.py's (jit=True cases).
SLOW_CASES = {"test_unknown_cardinality_charges_its_steps[True]"}


def _run(known_cardinality, jit_compile):
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x = rng.randn(N, 5).astype("float32")
  y = rng.randint(0, 3, N).astype("int64")
  ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
  if known_cardinality:
    ds = ds.apply(tf.data.experimental.assert_cardinality(N))
  ds = ds.batch(B)
  assert (int(ds.cardinality()) == N // B) == known_cardinality
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.5),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile)
  model.optimizer.set_sampling(N, B / N, policy="poisson", sample_size=B)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(ds, epochs=EPOCHS, verbose=0)
  return (int(model.optimizer.ledger.sample_count.numpy()),
          int(model.optimizer.iterations.numpy()), model.get_weights())


@pytest.mark.parametrize("jit_compile", [False, True])
def test_unknown_cardinality_charges_its_steps(jit_compile):
  count, iterations, weights = _run(False, jit_compile)
  ref_count, ref_iterations, ref_weights = _run(True, jit_compile)
  assert (ref_count, ref_iterations) == (EPOCHS * N // B,) * 2
  assert (count, iterations) == (ref_count, ref_iterations)
  for w, r in zip(weights, ref_weights):   # the same updates were released
    np.testing.assert_allclose(w, r, rtol=1e-6, atol=1e-7)

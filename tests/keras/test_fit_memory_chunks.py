"""The Keras train step's default physical chunks: without `max_physical_batch_size`, a batch
whose book-keeping would keep more than rules/budget.KEPT_BYTES is clipped in chunks of whole
records (fast_clipping.clipping.physical_chunk_examples), and the update is the one-call
update. The budget is made small here so that a 32-example batch of a small sequence model
exceeds it."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import data_writes
from tf_dpiter.keras.optimizer import chunking

# Nightly (`-m slow`): the jit_compile=True case. The chunk size (8 examples for a 4 KiB
# budget; None at 1 GiB) is chosen by the same trace-time Python in both modes, asserted by
# [False]; that a step clipped over chunks of whole records (sum_over_chunks with an integer
# chunk) under XLA equals the per-record reference, a stronger check than equal to the
# one-call step, is tests/keras/test_step_oracle.py's jit=True physical=4 cases (e.g.
# [model=conv-clipping=vectorized-jit=True-micro=8-physical=4-padding=False-policy=shuffle-
# entry=fit], [model=regularized-clipping=vectorized-jit=True-micro=None-physical=4-...]).
SLOW_CASES = {"test_fit_chunks_a_batch_over_the_kept_budget_and_updates_as_one_call[True]"}


def _recorded_layouts(monkeypatch):
  """The list that each later chunking.sum_over_chunks call appends its chunk layout to, once
  it formed its sum (a pass in one call that finds it keeps too much is abandoned before
  any sum, and the step traced again in chunks)."""
  layouts = []
  real = chunking.sum_over_chunks

  def spy(chunk_fn, acc, records, record_mask, per_chunk, template=None):
    out = real(chunk_fn, acc, records, record_mask, per_chunk, template=template)
    layouts.append(per_chunk)
    return out

  monkeypatch.setattr(chunking, "sum_over_chunks", spy)
  return layouts


def _one_step(monkeypatch, kept_bytes, jit):
  """(weights after one DP train_on_batch of noise 0, the chunk layouts sum_over_chunks got)."""
  monkeypatch.setattr(budget, "KEPT_BYTES", kept_bytes)
  layouts = _recorded_layouts(monkeypatch)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
      keras.layers.Dense(16, activation="tanh"), keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(0.5, 0.0, learning_rate=0.5)
  model.compile(optimizer=opt, jit_compile=jit,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randint(0, 50, (32, 12)).astype("int32"), rng.randint(0, 3, 32)
  x[5] = 49   # one record far from the others: clipped hard
  model.optimizer.set_sampling(64, 32 / 64, "poisson", 32)
  model.train_on_batch(x, y)
  return [np.asarray(w) for w in model.trainable_weights], layouts


@pytest.mark.parametrize("jit", [False, True])
def test_fit_chunks_a_batch_over_the_kept_budget_and_updates_as_one_call(monkeypatch, jit):
  chunked, layouts = _one_step(monkeypatch, 4096, jit)   # 4 KiB: chunks of 8 examples
  assert layouts and all(isinstance(p, int) and p == 8 for p in layouts), layouts
  whole, layouts = _one_step(monkeypatch, 1 << 30, jit)
  assert layouts and all(p is None for p in layouts), layouts
  for a, b in zip(chunked, whole):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_declared_physical_batch_is_kept(monkeypatch):
  monkeypatch.setattr(budget, "KEPT_BYTES", 4096)
  layouts = _recorded_layouts(monkeypatch)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(0.5, 0.0, learning_rate=0.5, max_physical_batch_size=16)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(1)
  model.optimizer.set_sampling(64, 32 / 64, "poisson", 32)
  model.train_on_batch(rng.randint(0, 50, (32, 12)).astype("int32"), rng.randint(0, 3, 32))
  assert layouts and all(p == 16 for p in layouts), layouts



def test_fit_measures_its_chunks_on_its_own_pass_and_probes_its_rows_after(monkeypatch):
  """fit's traced step finds its chunk size on its own pass (no traced probe of the model:
  clipping._probe_pass), abandons that trace before any sum and traces the step again in
  chunks; the batch-independence probe (random inputs, then fit's kept rows) runs only after
  the chunked pass checked the call (data_writes), and the call has no trace of its own."""
  monkeypatch.setattr(budget, "KEPT_BYTES", 4096)   # 4 KiB: chunks of 8 examples
  rng = np.random.RandomState(0)
  x, y = rng.randint(0, 50, (32, 12)).astype("int32"), rng.randint(0, 3, 32)
  order, probe, sums = [], batch_independence.batch_mixing_layers, chunking.sum_over_chunks

  def counted_probe(model, rows, *args, **kwargs):
    order.append("rows" if np.array_equal(np.asarray(rows)[:2], x[:2]) else "random")
    return probe(model, rows, *args, **kwargs)

  def counted_sum(chunk_fn, acc, records, record_mask, per_chunk, template=None):
    out = sums(chunk_fn, acc, records, record_mask, per_chunk, template=template)
    order.append(f"sum in chunks of {per_chunk}")   # once it formed its sum
    return out

  monkeypatch.setattr(batch_independence, "batch_mixing_layers", counted_probe)
  monkeypatch.setattr(chunking, "sum_over_chunks", counted_sum)
  monkeypatch.setattr(clipping, "_probe_pass", lambda *a: order.append("chunk probe"))
  monkeypatch.setattr(data_writes, "refuse_model_writes", lambda *a: order.append("trace"))
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(0.5, 1.0, learning_rate=0.5),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert order == ["sum in chunks of 8", "random", "rows"], order
  assert int(model.ledger.sample_count.numpy()) == 2

"""Review: records of two examples whose gradients cancel across the examples, for the rules
the earlier reviews checked only within one example. Both examples of a record are the same
input (ordinary values, or one vector repeated over the positions), their labels L above and
L (1 + 2^-23) below the output (L 1e5 .. 1e8): the two output gradients are opposite to
within float32 rounding, so the record's gradient (the sum of its examples') is tiny next to
its parts. Each record alone must move the noise-off clipped sum by at most C (1 + 1e-3),
with the per-record gradients kept and not kept (the sum then formed by another float32
reduction), graph and XLA.
"""

import keras
import numpy as np
import pytest

from tf_dpiter.keras.fast_clipping import registry

from .covers import assert_covers
from .covers import cover
from .covers import slow_outside
from .test_gram_cancellation_review import _contributions
from .test_layer_cancellation_review import _assert_within_c
from .test_layer_cancellation_review import _no_kept

# Nightly tier (-m slow): by default every value of each parameter, graph and XLA, at least
# once (a diagonal of the product); the comment of each id group names the cases that stay.
SLOW_CASES = {
    # test_dense_forced_forms_records_of_two: [direct-True], [gram-False] stay by default
    "test_dense_forced_forms_records_of_two[direct-False]",
    "test_dense_forced_forms_records_of_two[gram-True]",
}

L = keras.layers


def _layer(name):
  """(input shape, layer, integer ids?)"""
  return {
      "layer_norm": ((4, 16), L.LayerNormalization(), False),
      "simple_rnn": ((4, 8), L.SimpleRNN(8, return_sequences=True), False),
      "lstm": ((4, 8), L.LSTM(8, return_sequences=True), False),
      "gru": ((4, 8), L.GRU(8, return_sequences=True), False),
      "conv2d": ((6, 6, 3), L.Conv2D(8, 3), False),
      "conv1d": ((8, 4), L.Conv1D(6, 3, padding="causal"), False),
      "dense_seq": ((3, 16), L.Dense(16), False),
      "einsum_heads": ((3, 16), L.EinsumDense("abc,cde->abde", (3, 2, 4), bias_axes="de"),
                       False),
      "embedding": ((4,), L.Embedding(20, 16), True),
  }[name]


def _mirrored(model, shape, ids, count=10, seed=3):
  rng = np.random.RandomState(seed)
  xs, ys = [], []
  for _ in range(count):
    if ids:
      x = rng.randint(0, 20, shape).astype("int32")
    else:
      x = np.broadcast_to(rng.normal(size=shape[-1]) * 10.0 ** rng.uniform(0, 3),
                          shape).astype("float32")
    out = float(model(x[None])[0, 0])
    big = np.float32(10.0 ** rng.uniform(5, 8))
    xs += [x, x]
    ys += [[out + big], [out - np.nextafter(big, 2 * big)]]
  return np.stack(xs), np.array(ys, np.float32)


# (layer, keep, jit): by default each layer once and each (kept, mode) pair once (one case per
# rule and path), the rest marked slow (-m slow: the whole grid)
GRID = [(name, keep, jit) for name in ["layer_norm", "simple_rnn", "lstm", "gru", "conv2d",
                                       "conv1d", "dense_seq", "einsum_heads", "embedding"]
        for keep in (True, False) for jit in (False, True)]
GROUPS = [(0,), (1, 2)]
DEFAULT = cover(GRID, GROUPS)


def test_default_cases_cover_every_layer_and_mode():
  assert_covers(DEFAULT, GRID, GROUPS)
  assert len(DEFAULT) <= len(GRID) / 3


@pytest.mark.parametrize("name,keep,jit", slow_outside(GRID, DEFAULT))
def test_records_of_two_cancelling_across_examples(name, keep, jit, monkeypatch):
  if not keep:
    _no_kept(monkeypatch)
  keras.utils.set_random_seed(0)
  shape, layer, ids = _layer(name)
  inp = keras.Input(shape, dtype="int32" if ids else "float32")
  z = layer(inp)
  head = L.Dense(1, use_bias=False, trainable=False)
  model = keras.Model(inp, head(L.Flatten()(z) if len(z.shape) > 2 else z))
  x, y = _mirrored(model, shape, ids)
  _assert_within_c(_contributions(model, x, y, jit, k=2))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("form", ["gram", "direct"])
def test_dense_forced_forms_records_of_two(form, jit, monkeypatch):
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  _no_kept(monkeypatch)
  keras.utils.set_random_seed(0)
  shape, layer, _ = _layer("dense_seq")
  inp = keras.Input(shape)
  model = keras.Model(inp, L.Dense(1, use_bias=False, trainable=False)(
      L.Flatten()(layer(inp))))
  x, y = _mirrored(model, shape, False)
  _assert_within_c(_contributions(model, x, y, jit, k=2))

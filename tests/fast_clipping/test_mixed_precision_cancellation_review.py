"""Review: per-record norms under 16-bit dtype policies (mixed_float16, mixed_bfloat16) on
cancelling records. The layers compute in 16 bits; the norms, clip factors and the clipped
sum must be float32 (the rules' float32 recomputation of the watched tensor,
registry.float32_watched): a norm taken of a 16-bit product, or a sum formed in 16 bits,
would let a record whose positions' gradients nearly cancel move the clipped sum by far more
than C (a 16-bit rounding is 2^-11 / 2^-8 relative).

Constructions of test_layer_cancellation_review (one input vector at every position, one
entry moved by delta; a frozen head w at position 0 and -w at position 1; |a| and the labels
kept inside float16's range): Dense (the cost-chosen form, the Gram and direct forms forced,
per-record gradients not kept), Conv2D, LayerNormalization, an Embedding read twice at one
id. Each record alone moves the noise-off clipped sum by at most C (1 + 1e-3), graph and XLA.
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
from .test_layer_cancellation_review import _frozen_head
from .test_layer_cancellation_review import _no_kept

# Nightly tier (-m slow): by default every value of each parameter, graph and XLA, at least
# once (a diagonal of the product); the comment of each id group names the cases that stay.
SLOW_CASES = {
    # test_embedding_one_id_twice: [False-mixed_float16], [True-mixed_bfloat16] stay by default
    "test_embedding_one_id_twice[False-mixed_bfloat16]",
    "test_embedding_one_id_twice[True-mixed_float16]",
}

L = keras.layers


@pytest.fixture
def policy(request):
  keras.config.set_dtype_policy(request.param)
  yield request.param
  keras.config.set_dtype_policy("float32")


def _records(shape, count=12, seed=2, top=3):
  """One vector a (|a| 1 .. 10^top) at every position, the first entry moved by delta
  (1e-2 .. 1); labels 1e2 .. 1e4 (float16's range holds the outputs)."""
  rng = np.random.RandomState(seed)
  xs = []
  for _ in range(count):
    x = np.broadcast_to(rng.normal(size=shape[-1]) * 10.0 ** rng.uniform(0, top), shape).copy()
    x.reshape(-1)[0] += 10.0 ** rng.uniform(-2, 0)
    xs.append(x)
  return (np.stack(xs).astype("float32"),
          (10.0 ** rng.uniform(2, 4, (count, 1))).astype(np.float32))


POLICIES = ["mixed_float16", "mixed_bfloat16"]
# (policy, form, jit) for Dense and (policy, layer, keep, jit) for Conv2D and LayerNormalization:
# by default each form or layer once, each policy in graph and under XLA, each layer kept and
# not (one case per rule and path), the rest marked slow (-m slow: the whole grids)
DENSE = [(p, form, jit) for p in POLICIES for form in [None, "gram", "direct", "not_kept"]
         for jit in (False, True)]
LAYERS = [(p, layer, keep, jit) for p in POLICIES for layer in ("conv2d", "layer_norm")
          for keep in (True, False) for jit in (False, True)]
DENSE_GROUPS, LAYERS_GROUPS = [(0, 2), (1,)], [(0, 3), (1, 2)]
DENSE_DEFAULT = cover(DENSE, DENSE_GROUPS)
LAYERS_DEFAULT = cover(LAYERS, LAYERS_GROUPS)


def test_default_cases_cover_every_form_policy_and_mode():
  assert_covers(DENSE_DEFAULT, DENSE, DENSE_GROUPS)
  assert_covers(LAYERS_DEFAULT, LAYERS, LAYERS_GROUPS)
  assert len(DENSE_DEFAULT) <= len(DENSE) / 2 and len(LAYERS_DEFAULT) <= len(LAYERS) / 2


@pytest.mark.parametrize("policy,form,jit", slow_outside(DENSE, DENSE_DEFAULT),
                         indirect=["policy"])
def test_dense(policy, form, jit, monkeypatch):
  del policy
  if form == "not_kept":
    _no_kept(monkeypatch)
  else:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  keras.utils.set_random_seed(0)
  inp = keras.Input((2, 16))
  model, _ = _frozen_head(inp, L.Dense(16)(inp), 16, nearly=False)
  x, y = _records((2, 16))
  _assert_within_c(_contributions(model, x, y, jit))


_LAYERS = {"conv2d": ((6, 6, 3), lambda: L.Conv2D(8, 3), 8),
           "layer_norm": ((4, 16), L.LayerNormalization, 16)}


@pytest.mark.parametrize("policy,layer,keep,jit", slow_outside(LAYERS, LAYERS_DEFAULT),
                         indirect=["policy"])
def test_conv2d_and_layer_norm(policy, layer, keep, jit, monkeypatch):
  del policy
  if not keep:
    _no_kept(monkeypatch)
  shape, make, units = _LAYERS[layer]
  keras.utils.set_random_seed(0)
  inp = keras.Input(shape)
  model, _ = _frozen_head(inp, make()(inp), units, nearly=False)
  x, y = _records(shape)
  _assert_within_c(_contributions(model, x, y, jit))


@pytest.mark.parametrize("policy", POLICIES, indirect=True)
@pytest.mark.parametrize("jit", [False, True])
def test_embedding_one_id_twice(policy, jit):
  del policy
  keras.utils.set_random_seed(0)
  inp = keras.Input((2,), dtype="int32")
  model, _ = _frozen_head(inp, L.Embedding(10, 16)(inp), 16, nearly=False)
  rng = np.random.RandomState(4)
  x = np.full((10, 2), 3, np.int32)
  y = (10.0 ** rng.uniform(2, 4, (10, 1))).astype(np.float32)
  _assert_within_c(_contributions(model, x, y, jit))
